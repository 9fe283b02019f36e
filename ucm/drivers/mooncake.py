"""The `mooncake` driver: blocks in a Mooncake Store (a distributed DRAM pool), over TCP.

    - driver: mooncake
      master: 127.0.0.1:50051                       # mooncake_master RPC address
      metadata: http://127.0.0.1:8080/metadata      # or P2PHANDSHAKE, etcd://host:port
      local_hostname: 127.0.0.1                     # what this client advertises (not binds)
      segment_bytes: 0                              # RAM this process lends to the pool
      staging_bytes: 128MiB                         # registered staging memory
      threads: 8                                    # worker threads for this tier

Each block is one object named `ucm/<namespace>/<hex key>` holding the ucm block format
(header + payload), so every load verifies its checksum: a damaged or half-replaced object is
a corrupt miss, never data. Transfers are batched and zero-copy on the wire: each batch is
staged in one registered memory pool and moved with `batch_upsert_from` /
`batch_get_into`; the payload is verified in the staging memory and then copied into the
caller's buffer (so a deadline can abandon a call stuck on a dead master without a late write
into the caller's memory; see `_remote`).

Mooncake is a cache tier, and the driver keeps its rules:
- objects can be evicted at any time: a load then reports MISSING (`persistent = False`);
- `put` on an existing key keeps the old value, so stores use upsert (overwrite);
- a missing key reads as nothing: MISSING;
- data moves peer to peer, so a read can fail in the transfer when the client holding the
  replica leaves meanwhile: it is read once more, and a block gone by then is MISSING. A
  load takes only RPC failures for an unreachable master (and drops the client to reconnect);
- a full pool refuses a put: that block is not stored (size 0), counted in `refused_full`;
- a read takes a lease that blocks `remove` for the master's `default_kv_lease_ttl`: delete
  leaves such objects to expire and be evicted (`delete_deferred`) unless `force_delete`.
Objects live in the segments that clients lend (`segment_bytes`, or a standalone
`mooncake_client`); an object vanishes with the process that lent its memory.

The client's transfer engine listens on all interfaces (hardcoded in Mooncake), and it
advertises `MC_TCP_BIND_ADDRESS`, which `open` sets to `local_hostname` unless it is set.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Self

import trio
from pydantic import ByteSize, Field

from ucm.drivers._extents import Extents
from ucm.drivers.contract import DriverOptions
from ucm.drivers.kit import (
    PAYLOAD_OFFSET,
    Backend,
    Codec,
    DriverStatistics,
    KVLayouts,
    LoadState,
    RemoteDriver,
    Workers,
    frame_block,
    parse_codec,
    safe_dir_name,
    unframe_into,
)
from ucm.drivers.kit._threaded import with_counters
from ucm.errors import ConfigError, NoCapacity, StorageUnavailable

# Mooncake's ErrorCode values the driver acts on.
NO_AVAILABLE_HANDLE = -200  # the pool is full
BUFFER_OVERFLOW = -600  # the target buffer is smaller than the object
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800  # this and lower: transfer and RPC failures (the transport, not a key)
RPC_FAIL = -900  # this and lower: the master failed the call
_ERROR_NAMES = {
    -200: "NO_AVAILABLE_HANDLE (pool full)", -600: "BUFFER_OVERFLOW",
    -704: "OBJECT_NOT_FOUND", -706: "OBJECT_HAS_LEASE", -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}
_ALIGN = 4096


def error_name(rc: int) -> str:
    return _ERROR_NAMES.get(rc, f"error {rc}")


def _zstd_bound(n: int) -> int:
    return n + (n >> 7) + 1024


class StagingPool:
    """One registered anonymous mapping, handed out first-fit in page-rounded pieces."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._map = mmap.mmap(-1, size)
        self._array = (ctypes.c_char * size).from_buffer(self._map)
        self.addr = ctypes.addressof(self._array)
        self.view = memoryview(self._map)
        self._free = Extents([(0, size)])
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        with self._lock:
            return self._free.allocate(-(-nbytes // _ALIGN) * _ALIGN)

    def free(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._free.release(offset, -(-nbytes // _ALIGN) * _ALIGN)


class MooncakeBlocks(Backend):
    """The synchronous side: batches of blocks to and from one MooncakeDistributedStore."""

    def __init__(self, client: Any, pool: StagingPool, *, prefix: str, namespace: str,
                 codec: Codec, master: str, force_delete: bool,
                 reopen: Callable[[], Any], layouts: KVLayouts | None = None) -> None:
        self._client = client
        self._reopen = reopen
        self._lock = threading.Lock()
        self.pool = pool
        self.prefix = prefix
        self.namespace = namespace
        self._ns = namespace.encode()  # what a loaded header must name
        self.codec = codec
        self.layouts = layouts
        self.master = master
        self.force_delete = force_delete
        self.counters = {"refused_full": 0, "delete_deferred": 0, "unstaged": 0,
                         "reconnects": 0}

    @property
    def client(self) -> Any:
        """The store client; after an RPC failure, a new one (a restarted master and metadata
        server know nothing of the old client's registered memory)."""
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._client is None:
                self._client = self._reopen()
                self.counters["reconnects"] += 1
            return self._client

    def name_of(self, key: bytes) -> str:
        return self.prefix + key.hex()

    def _unreachable(self, rc: int) -> ConnectionError:
        # Dropped, not closed: close() may wait on the dead master.
        self._client = None
        return ConnectionError(f"Mooncake master {self.master} failed the call: "
                               f"{error_name(rc)}")

    # lookup / delete

    def lookup(self, keys: list[bytes]) -> list[bool]:
        found = self.client.batch_is_exist([self.name_of(k) for k in keys])
        if found and all(f < 0 for f in found):
            raise self._unreachable(found[0])
        return [f == 1 for f in found]

    def delete(self, keys: list[bytes]) -> None:
        names = [self.name_of(k) for k in keys]
        rcs = self.client.batch_remove(names, self.force_delete)
        leased = [n for n, rc in zip(names, rcs, strict=True) if rc == OBJECT_HAS_LEASE]
        self.counters["delete_deferred"] += len(leased)
        failed = [rc for rc in rcs if rc < 0 and rc not in (OBJECT_NOT_FOUND, OBJECT_HAS_LEASE)]
        if failed and len(failed) == len(rcs):
            raise self._unreachable(failed[0])

    # store

    def store(self, keys: list[bytes], views: list[memoryview]) -> list[int]:
        sizes = [0] * len(keys)
        staged: list[tuple[int, int, int]] = []  # (index, offset, nbytes)
        try:
            for i, (key, view) in enumerate(zip(keys, views, strict=True)):
                header, payload = frame_block(key, self.namespace, self.codec, view,
                                              self.layouts)
                assert isinstance(payload, memoryview)  # a Scatter only from a Scatter
                total = PAYLOAD_OFFSET + payload.nbytes
                offset = self.pool.alloc(total)
                if offset is None:  # no staging room now: the byte API, one copy more
                    self.counters["unstaged"] += 1
                    rc = self.client.upsert(self.name_of(key), header + bytes(payload))
                    sizes[i] = self._stored(rc, total)
                    continue
                staged.append((i, offset, total))
                self.pool.view[offset:offset + PAYLOAD_OFFSET] = header
                self.pool.view[offset + PAYLOAD_OFFSET:offset + total] = payload
            if staged:
                rcs = self.client.batch_upsert_from(
                    [self.name_of(keys[i]) for i, _, _ in staged],
                    [self.pool.addr + off for _, off, _ in staged],
                    [n for _, _, n in staged])
                if all(rc <= TRANSFER_FAIL for rc in rcs):
                    raise self._unreachable(rcs[0])  # transfers or RPCs failed, all of them
                for (i, _, total), rc in zip(staged, rcs, strict=True):
                    sizes[i] = self._stored(rc, total)
        finally:
            for _, offset, total in staged:
                self.pool.free(offset, total)
        return sizes

    def _stored(self, rc: int, total: int) -> int:
        if rc == 0:
            return total
        if rc == NO_AVAILABLE_HANDLE:
            self.counters["refused_full"] += 1
            return 0
        if rc <= RPC_FAIL:  # the master is gone
            raise self._unreachable(rc)
        return 0

    # load

    def load(self, keys: list[bytes], views: list[memoryview]) -> list[LoadState]:
        states = [LoadState.FAILED] * len(keys)
        staged: list[tuple[int, int, int]] = []
        try:
            for i, view in enumerate(views):
                cap = PAYLOAD_OFFSET + (view.nbytes if self.codec is Codec.NONE
                                        else _zstd_bound(view.nbytes))
                offset = self.pool.alloc(cap)
                if offset is None:
                    self.counters["unstaged"] += 1
                    states[i] = self._load_bytes(keys[i], view)
                else:
                    staged.append((i, offset, cap))
            if staged:
                results = self.client.batch_get_into(
                    [self.name_of(keys[i]) for i, _, _ in staged],
                    [self.pool.addr + off for _, off, _ in staged],
                    [cap for _, _, cap in staged])
                if all(n <= RPC_FAIL for n in results):
                    raise self._unreachable(results[0])  # the master failed, not the keys
                for (i, offset, _), n in zip(staged, results, strict=True):
                    states[i] = self._finish(keys[i], views[i], offset, n)
        finally:
            for _, offset, cap in staged:
                self.pool.free(offset, cap)
        return states

    def _finish(self, key: bytes, out: memoryview, offset: int, n: int) -> LoadState:
        if n == 0 or -800 < n <= -700:  # not found, or not (yet) whole: being replaced
            return LoadState.MISSING
        if n == BUFFER_OVERFLOW:  # stored block is larger than the caller's buffer
            return self._load_bytes(key, out)
        if RPC_FAIL < n <= TRANSFER_FAIL:
            return self._after_transfer_failed(key, out)
        if n < 0:
            self.counters[f"load_error_{-n}"] = self.counters.get(f"load_error_{-n}", 0) + 1
            return LoadState.FAILED
        state = unframe_into(key, self.pool.view[offset:offset + n], out, namespace=self._ns)
        if state is LoadState.CORRUPT:
            # An upsert by another client can replace the object under a read in progress: a
            # torn read fails its checksum. Read once more before calling the block corrupt.
            self.counters["reread_after_corrupt"] = (
                self.counters.get("reread_after_corrupt", 0) + 1)
            state = self._load_bytes(key, out)
        return state

    def _after_transfer_failed(self, key: bytes, out: memoryview) -> LoadState:
        # The peer whose memory holds the replica failed the transfer: mostly it left under
        # the read (closed, its segment unmounted), and the object went with it: a miss, and
        # the master is fine (no reconnect). An object still listed is read once more.
        self.counters["transfer_failed"] = self.counters.get("transfer_failed", 0) + 1
        name = self.name_of(key)
        found = self.client.is_exist(name)
        if found == 1:
            data = self.client.get(name)
            if data:
                return unframe_into(key, memoryview(data), out, namespace=self._ns)
            found = self.client.is_exist(name)
        if found <= RPC_FAIL:
            raise self._unreachable(found)
        return LoadState.MISSING if found == 0 else LoadState.FAILED

    def _load_bytes(self, key: bytes, out: memoryview) -> LoadState:
        data = self.client.get(self.name_of(key))
        if not data:
            return LoadState.MISSING
        return unframe_into(key, memoryview(data), out, namespace=self._ns)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:
            client.unregister_buffer(self.pool.addr)
        finally:
            client.close()


def _probe_name() -> str:
    return f"ucm-probe/{os.uname().nodename}/{os.getpid()}/{random.getrandbits(32):x}"


class MooncakeDriver(RemoteDriver):
    """A Mooncake Store tier."""

    persistent = False
    # Mooncake cannot enumerate a namespace's objects: this tier is not a `Listing`.
    list_blocks = None  # type: ignore[assignment]

    class Options(DriverOptions):
        master: str = "127.0.0.1:50051"
        metadata: str = "http://127.0.0.1:8080/metadata"
        local_hostname: str = Field(
            default="127.0.0.1", description="the address this client advertises to its "
            "peers (MC_TCP_BIND_ADDRESS unless set). Mooncake's transfer engine listens on "
            "every interface whatever it says (hardcoded in Mooncake, not configurable from "
            "ucm): where other hosts must not reach it, a firewall has to keep them out")
        protocol: str = "tcp"
        device_names: str = ""
        segment_bytes: ByteSize = ByteSize(0)
        local_buffer_bytes: ByteSize = ByteSize(16 * 2**20)
        staging_bytes: ByteSize = Field(default=ByteSize(128 * 2**20), ge=2**20)
        threads: int = Field(default=8, ge=1, le=64)
        force_delete: bool = False

    def __init__(self, backend: MooncakeBlocks, *, name: str, threads: int,
                 workers: Workers | None = None) -> None:
        super().__init__(backend, name=name, threads=threads, workers=workers)
        self.backend = backend

    @classmethod
    async def open(cls, options: Options | dict[str, Any], *, name: str = "mooncake",
                   namespace: str, codec: str = "none", layouts: KVLayouts | None = None,
                   workers: Workers | None = None) -> Self:
        if not isinstance(options, cls.Options):
            options = cls.Options.model_validate(options)
        codec_value = parse_codec(codec)
        backend = await trio.to_thread.run_sync(
            lambda: _connect(options, name=name, namespace=namespace, codec=codec_value,
                             layouts=layouts),
            abandon_on_cancel=True)
        return cls(backend, name=name, threads=options.threads, workers=workers)

    def statistics(self) -> DriverStatistics:
        return with_counters(super().statistics(), self.backend.counters)


def _check_reachable(address: str, what: str, name: str) -> None:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
    except ValueError:
        raise ConfigError(f"{what} address {address!r} must be host:port") from None
    except OSError as exc:
        raise StorageUnavailable(f"cannot reach the Mooncake {what} at {address}: "
                                 f"{exc.strerror or exc}", driver=name) from None


def _connect(options: MooncakeDriver.Options, *, name: str, namespace: str,
             codec: Codec, layouts: KVLayouts | None = None) -> MooncakeBlocks:
    pool = StagingPool(int(options.staging_bytes))

    def reopen() -> Any:
        try:
            return _open_client(options, pool, name=name)
        except (StorageUnavailable, NoCapacity) as exc:
            raise ConnectionError(str(exc)) from exc

    client = _open_client(options, pool, name=name)
    prefix = f"ucm/{safe_dir_name(namespace)}/"
    return MooncakeBlocks(client, pool, prefix=prefix, namespace=namespace, codec=codec,
                          master=options.master, force_delete=options.force_delete,
                          reopen=reopen, layouts=layouts)


def _open_client(options: MooncakeDriver.Options, pool: StagingPool, *, name: str) -> Any:
    """A set-up store client with `pool` registered; errors name the master and the cause."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ConfigError(f"mooncake driver needs the mooncake extra ({exc}); install it "
                          "with: pip install 'ucm[mooncake]'") from exc
    # setup() retries an absent master for about 90 s: check the addresses first.
    _check_reachable(options.master, "master", name)
    if options.metadata.startswith("http://"):
        _check_reachable(options.metadata[7:].split("/", 1)[0], "metadata server", name)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", options.local_hostname)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    store = MooncakeDistributedStore()
    rc = store.setup(options.local_hostname, options.metadata, int(options.segment_bytes),
                     int(options.local_buffer_bytes), options.protocol, options.device_names,
                     options.master)
    if rc != 0:
        raise StorageUnavailable(
            f"cannot reach the Mooncake master at {options.master} with metadata "
            f"{options.metadata} (setup returned {rc}; is mooncake_master running there?)",
            driver=name)
    try:
        rc = store.register_buffer(pool.addr, pool.size)
        if rc != 0:
            raise StorageUnavailable(f"cannot register {pool.size} staging bytes ({rc})",
                                     driver=name)
        probe = _probe_name()
        for _ in range(10):
            rc = store.put(probe, b"ucm")
            # A client that died lately keeps its segment registered until the master's
            # client_ttl: puts placed there fail for a while. Not a reason to refuse. Nor is a
            # pool briefly without segments (a holder re-mounting after missed heartbeats):
            # only a refusal that lasts the ~3 s of tries means no memory. A put whose
            # transfer to such a segment failed can also end as OBJECT_NOT_FOUND (its revoke
            # finds the object already dropped).
            if rc not in (TRANSFER_FAIL, NO_AVAILABLE_HANDLE, OBJECT_NOT_FOUND):
                break
            time.sleep(0.3)
        if rc in (TRANSFER_FAIL, OBJECT_NOT_FOUND):
            return store
        if rc == NO_AVAILABLE_HANDLE:
            raise NoCapacity(
                f"the Mooncake pool at {options.master} refuses puts: it is full or no "
                "client lends it memory (segment_bytes, or a mooncake_client holder)",
                driver=name)
        if rc != 0:
            raise StorageUnavailable(f"probe put to the Mooncake master at {options.master} "
                                     f"failed: {error_name(rc)}", driver=name)
        store.remove(probe, True)
    except BaseException:
        store.close()
        raise
    return store
