"""Shared machinery of the built-in drivers: batch validation, the async plumbing that moves
blocking work to worker threads, and the block-file store used by `posix` and by `nfs` in
mount mode.

`ThreadedDriver` is the async face: it validates every call, hands the batch to a synchronous
backend in `trio.to_thread.run_sync` and keeps the counters on the trio thread (no locks
needed). A small batch is one thread hop; a batch of several MiB is split into a few parts that
run in two worker threads at a time (xxh3 and the copies release the GIL, so verifying one part
overlaps reading the next), each part at most CHUNK_BYTES so a cancel lands within milliseconds.

`BlockFiles` keeps each block as one file in the `ucm.block` format:

    <root>/<aa>/<bb>/<hex key>.blk      keys of up to 120 bytes (shards from the key's hex)
    <root>/<aa>/<bb>/<digest>.lblk      longer keys (the name would pass NAME_MAX); the header
                                        holds the key, so listing reads it back from there
    <root>/.tmp/<host>.<pid>.<tid>.<rand>.tmp   blocks being written

A store writes a temp file and `os.replace`s it into place, so a reader opens the old whole
block or the new whole block, never a mix, and a writer killed mid-write leaves only a temp file
that no lookup sees; `BlockFiles.open` removes the temp files of dead processes on this host.
A load reads the header and the payload with one `preadv` straight into the caller's buffer and
verifies the checksum there: no extra copy for codec none.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import random
import socket
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio
import xxhash

from ucm.block import (
    PAYLOAD_OFFSET,
    BlockHeader,
    Codec,
    Scatter,
    as_byte_view,
    check_key,
    decode_header,
    decode_payload_into,
    encode_header,
    encode_payload,
    verify_payload,
)
from ucm.drivers._idle import run_idle
from ucm.drivers._mapped import MapCache
from ucm.drivers._protocol import LoadState
from ucm.drivers._pump import Pump, Spread, chunks, wide
from ucm.errors import (
    BlockCorrupt,
    ConfigError,
    DriverError,
    InvalidRequest,
    NoCapacity,
    StorageUnavailable,
)

ALIGN = 4096
# A thread hop per part of at most this many bytes: big enough that the hop costs nothing
# next to the copy, small enough that a cancelled batch stops within a few milliseconds.
CHUNK_BYTES = 32 * 2**20
# Batches of at least this many bytes are split over PARALLEL worker threads: xxh3 and the
# copies release the GIL, so checksumming one part overlaps the I/O of another.
SPLIT_BYTES = 4 * 2**20
PARALLEL = 2
_LONG_KEY = 120  # longer keys are named by a digest: 2 * 120 hex chars + suffix < NAME_MAX
_TMP_DIR = ".tmp"


# --- validation --------------------------------------------------------------------------


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """The keys as a list, or InvalidRequest naming the first problem."""
    if isinstance(keys, (bytes, bytearray, memoryview, str)):
        raise InvalidRequest("keys must be a sequence of bytes keys, not a single key")
    keys = list(keys)
    if not keys:
        raise InvalidRequest("empty batch: pass at least one key")
    for key in keys:
        check_key(key)
    return keys


def check_batch(
    keys: Sequence[bytes], buffers: Sequence[Any], *, writable: bool
) -> tuple[list[bytes], list[memoryview]]:
    """Validated keys and flat byte views of their buffers (one per key)."""
    keys = check_keys(keys)
    buffers = list(buffers)
    if len(buffers) != len(keys):
        raise InvalidRequest(f"{len(keys)} keys but {len(buffers)} buffers")
    views = []
    for i, buf in enumerate(buffers):
        if writable and type(buf) is Scatter:
            views.append(buf)
            continue
        try:
            view = as_byte_view(buf)
        except TypeError:
            raise InvalidRequest(f"buffer {i} is a {type(buf).__name__}, not a buffer") from None
        if writable and view.readonly:
            raise InvalidRequest(f"buffer {i} is read-only; a load needs a writable buffer")
        views.append(view)
    return keys, views


def size_mismatch(view: memoryview, header: BlockHeader) -> InvalidRequest:
    return InvalidRequest(f"buffer is {view.nbytes} bytes; the block holds {header.raw_len}")


def os_error(exc: OSError, driver: str) -> DriverError:
    """Translates an OSError that failed a whole batch into the ucm tree."""
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        why = f": {exc.strerror}" if exc.strerror != os.strerror(exc.errno) else ""
        return NoCapacity(f"no space left{why}{where}", driver=driver)
    return StorageUnavailable(f"{exc.strerror or exc}{where}", driver=driver)


def parse_codec(codec: str | Codec) -> Codec:
    try:
        return Codec.parse(codec)
    except InvalidRequest as exc:
        raise ConfigError(f"codec: {exc}") from None


# --- async plumbing ----------------------------------------------------------------------


class Backend:
    """What a ThreadedDriver runs in worker threads. Methods are synchronous and batched.

    load returns one (state, bytes read) per key and raises InvalidRequest for a buffer whose
    size differs from the block; store returns the stored bytes per key (0 = not stored) and
    raises OSError only when no key was stored.
    """

    def lookup(self, keys: list[bytes]) -> list[bool]:
        raise NotImplementedError

    def load(self, keys: list[bytes], views: list[memoryview]) -> list[LoadState]:
        raise NotImplementedError

    def store(self, keys: list[bytes], views: list[memoryview]) -> list[int]:
        raise NotImplementedError

    def delete(self, keys: list[bytes]) -> None:
        raise NotImplementedError

    def list_units(self) -> list[Any]:
        """Opaque units of listing work (for example directories), each one thread hop."""
        raise NotImplementedError

    def list_unit(self, unit: Any) -> list[tuple[bytes, int]]:
        raise NotImplementedError

    def in_memory(self, keys: list[bytes]) -> bool:
        """Whether `load_one` would read every one of these blocks from memory (a mapping, an
        arena) rather than from a device: such a load may run outside trio (see
        `ThreadedDriver.in_memory_load`). A backend says True only where it knows."""
        return False

    def close(self) -> None:
        pass


def _partition(views: list[memoryview]) -> list[slice]:
    """Contiguous parts of about equal bytes: one for a small batch, else at least PARALLEL
    (as keys allow) and none much over CHUNK_BYTES."""
    total = sum(v.nbytes for v in views)
    if total < SPLIT_BYTES or len(views) == 1:
        return [slice(0, len(views))]
    count = min(len(views), max(PARALLEL, -(-total // CHUNK_BYTES)))
    target = total / count
    parts, start, acc = [], 0, 0
    for i, view in enumerate(views):
        acc += view.nbytes
        if acc >= target * (len(parts) + 1) and len(parts) < count - 1:
            parts.append(slice(start, i + 1))
            start = i + 1
    parts.append(slice(start, len(views)))
    return [p for p in parts if p.start < p.stop]


def count_loads(stats: dict[str, int], states: Sequence[LoadState],
                views: Sequence[memoryview]) -> None:
    """Adds one load batch's outcomes to a driver's counters."""
    stats["loads"] += len(states)
    for state, view in zip(states, views, strict=True):
        if state is LoadState.OK:
            stats["loaded"] += 1
            stats["bytes_read"] += view.nbytes
        else:
            stats[state.name.lower()] += 1


def count_stores(stats: dict[str, int], sizes: Sequence[int]) -> None:
    """Adds one store batch's outcomes (bytes per block, 0 = not stored) to the counters."""
    stats["stores"] += len(sizes)
    for size in sizes:
        if size:
            stats["stored"] += 1
            stats["bytes_written"] += size
        else:
            stats["store_failed"] += 1


class ScatterLoading:
    """Mixin of a ThreadedDriver whose backend reads straight into a Scatter's pieces (the
    `ScatterLoads` capability)."""

    async def load_scatter(self, keys: Sequence[bytes],
                           buffers: Sequence[memoryview | Scatter]) -> list[LoadState]:
        return await self.load(keys, buffers)  # type: ignore[attr-defined]


class ThreadedDriver:
    """Validation, thread hops, counters and error translation around a Backend."""

    name: str
    persistent: bool
    # Batches of at most this many bytes run on the trio thread (a memcpy of a few KiB costs
    # less than a thread hop), and so do lookup, delete and listing when `inline_meta` is set.
    # Both stay off for backends that make syscalls.
    inline_bytes = 0
    inline_meta = False
    # Loads handed out block by block to the copy threads of a `_pump.Pump` (the backend has
    # `load_one(key, view)`), instead of one fixed part per thread.
    pump_loads = False

    def __init__(self, backend: Backend, *, name: str) -> None:
        self._backend = backend
        self.name = name
        self._closed = False
        self._pump = Pump(PARALLEL)
        self._stats: dict[str, int] = dict.fromkeys(
            ("lookups", "hits", "loads", "loaded", "missing", "corrupt", "failed",
             "bytes_read", "stores", "stored", "bytes_written", "store_failed", "deletes"), 0)
        # In-memory loads run on the pump's threads and the caller's, outside trio: their
        # counters and the count of those running (close waits for them) take a lock.
        self._in_memory = threading.Condition()
        self._in_memory_running = 0
        self._in_memory_stats: dict[str, int] = dict.fromkeys(self._stats, 0)

    async def _run(self, fn: Callable[..., Any], *args: Any, inline: bool = False,
                   idle: bool = False) -> Any:
        """fn(*args) on the trio thread (`inline`), on an idle-priority thread (`idle`: stores,
        see _idle) or on trio's thread cache."""
        if self._closed:
            raise StorageUnavailable("driver is closed", driver=self.name)
        try:
            if inline:
                await trio.lowlevel.checkpoint()
                return fn(*args)
            if idle:
                return await run_idle(fn, *args)
            # Not abandon_on_cancel: the thread may still be writing into the caller's buffer.
            return await trio.to_thread.run_sync(fn, *args)
        except OSError as exc:
            raise os_error(exc, self.name) from exc

    async def _map(self, fn: Callable[..., list[Any]], keys: list[bytes],
                   views: list[memoryview]) -> list[Any]:
        """Runs `fn` over the batch's parts, PARALLEL at a time, results in key order; stores
        on idle-priority threads, so they never take a core from the inference engine."""
        idle = fn == self._backend.store
        parts = _partition(views)
        if len(parts) == 1:
            inline = sum(v.nbytes for v in views) <= self.inline_bytes
            return await self._run(fn, keys, views, inline=inline, idle=idle)
        results: list[list[Any]] = [[] for _ in parts]
        limiter = trio.CapacityLimiter(PARALLEL)

        async def run_part(i: int, part: slice) -> None:
            async with limiter:
                results[i] = await self._run(fn, keys[part], views[part], idle=idle)

        async with trio.open_nursery() as nursery:
            for i, part in enumerate(parts):
                nursery.start_soon(run_part, i, part)
        return [r for rs in results for r in rs]

    async def _pumped(self, fn: Callable[[bytes, Any], Any], keys: list[bytes],
                      views: list[memoryview]) -> list[Any]:
        """fn(key, view) for every block, on the pump's threads, in parts of at most
        PARALLEL * CHUNK_BYTES (a cancel lands between parts, never while a thread writes
        into a caller's buffer)."""
        results: list[Any] = []
        for part in chunks(views, PARALLEL * CHUNK_BYTES):
            if self._closed:
                raise StorageUnavailable("driver is closed", driver=self.name)
            threads = PARALLEL if wide(views[part], SPLIT_BYTES) else 1
            spread = await Spread(fn, keys[part], views[part]).run(self._pump, threads)
            error = next((e for e in spread.errors if e is not None), None)
            if isinstance(error, OSError):
                raise os_error(error, self.name) from error
            if error is not None:
                raise error
            results.extend(spread.results)
        return results

    async def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        keys = check_keys(keys)
        found = await self._run(self._backend.lookup, keys, inline=self.inline_meta)
        self._stats["lookups"] += len(keys)
        self._stats["hits"] += sum(found)
        return found

    async def load(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[LoadState]:
        keys, views = check_batch(keys, buffers, writable=True)
        if self.pump_loads and sum(v.nbytes for v in views) > self.inline_bytes:
            states: list[LoadState] = await self._pumped(self._backend.load_one, keys, views)
        else:
            states = await self._map(self._backend.load, keys, views)
        count_loads(self._stats, states, views)
        if all(s is LoadState.FAILED for s in states):
            raise StorageUnavailable(f"all {len(keys)} reads failed", driver=self.name)
        return states

    # A load of blocks in memory, outside trio: for the kernel's loads of indexed blocks.
    def in_memory_load(self, keys: list[bytes],
                       buffers: Sequence[memoryview | Scatter]) -> Spread | None:
        """The load of `keys` into `buffers` (a Load event's, already checked) as a Spread to
        run with `start_in_memory_load`, when the backend holds every block in memory and its
        loads go over the pump; else None (load the usual way). Nothing runs yet.

        Such a load needs no trio: the kernel starts it on the submitting thread, the pump's
        threads copy, the one that finishes resolves the caller's handle, and a caller that
        waits helps copy (`help_load`). A 64 MiB batch's two trips through the trio thread
        and its task set-up are what that saves."""
        if not self.pump_loads or self._closed:
            return None
        views = list(buffers)
        if sum(v.nbytes for v in views) <= self.inline_bytes:
            return None
        if not self._backend.in_memory(keys):
            return None
        return Spread(self._backend.load_one, keys, views, then=self._count_in_memory)

    def start_in_memory_load(self, spread: Spread, done: Callable[[Spread], Any]) -> bool:
        """Starts an `in_memory_load` on the pump's threads. `done(spread)` runs on the thread
        that finishes it; `spread.outcome` is then the states (None for blocks skipped after a
        cancel), or `spread.error` what failed. Raises StorageUnavailable once closed.

        True when the caller should help (`help_load`): it is bound to one CPU and a copy
        thread to another, so one copy thread fewer is woken, on another CPU. An unbound
        caller does not help: the scheduler moved it between the cores while it copied, onto
        the copy thread's, and a 64 MiB load took longer than with no help (5.7 ms against
        5.2, after 20 ms of quiet)."""
        with self._in_memory:
            if self._closed:
                raise StorageUnavailable("driver is closed", driver=self.name)
            self._in_memory_running += 1

        def finished() -> None:
            try:
                done(spread)
            finally:
                with self._in_memory:
                    self._in_memory_running -= 1
                    self._in_memory.notify_all()

        spread._wake = finished
        threads = PARALLEL if wide(spread.views, SPLIT_BYTES) else 1
        caller = self._pump.helper_cpu()
        helped = caller >= 0
        if helped:
            self._pump.submit(spread, max(1, threads - 1), avoid_cpu=caller)
        else:
            self._pump.submit(spread, threads)
        return helped

    def help_load(self, spread: Spread) -> None:
        """Copies the runs of a started `in_memory_load` that no thread has taken yet."""
        self._pump.help(spread)

    def _count_in_memory(self, spread: Spread) -> list[LoadState | None]:
        states: list[LoadState | None] = []
        for result, error in zip(spread.results, spread.errors, strict=True):
            states.append(LoadState.FAILED if error is not None else result)
        counted = [(s, v) for s, v in zip(states, spread.views, strict=True) if s is not None]
        with self._in_memory:
            count_loads(self._in_memory_stats, [s for s, _ in counted], [v for _, v in counted])
        return states

    async def store(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        keys, views = check_batch(keys, buffers, writable=False)
        sizes: list[int] = await self._map(self._backend.store, keys, views)
        count_stores(self._stats, sizes)
        return sizes

    async def delete(self, keys: Sequence[bytes]) -> None:
        keys = check_keys(keys)
        await self._run(self._backend.delete, keys, inline=self.inline_meta)
        self._stats["deletes"] += len(keys)

    async def list_blocks(self) -> AsyncIterator[tuple[bytes, int]]:
        units = await self._run(self._backend.list_units, inline=self.inline_meta)
        for unit in units:
            for item in await self._run(self._backend.list_unit, unit, inline=self.inline_meta):
                yield item

    async def aclose(self) -> None:
        if not self._closed:
            with self._in_memory:
                self._closed = True
                running = self._in_memory_running
            if running:  # memory copies: milliseconds
                await trio.to_thread.run_sync(self._wait_in_memory_loads)
            if self._pump.started:
                await trio.to_thread.run_sync(self._pump.close)
            self._backend.close()
        await trio.lowlevel.checkpoint()

    def _wait_in_memory_loads(self) -> None:
        with self._in_memory:
            self._in_memory.wait_for(lambda: not self._in_memory_running)

    def statistics(self) -> dict[str, int | float]:
        stats = dict(self._stats)
        with self._in_memory:
            for name, count in self._in_memory_stats.items():
                stats[name] += count
        return stats


# --- block files -------------------------------------------------------------------------


_HOST = socket.gethostname().replace(os.sep, "_").replace(".", "_") or "host"


def _tmp_name() -> str:
    return f"{_HOST}.{os.getpid()}.{threading.get_ident()}.{random.getrandbits(40):x}.tmp"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def is_dead_writers_temp(name: str) -> bool:
    """True for a temp file name (see `_tmp_name`) of a writer on this host that is no longer
    alive; a live writer's, and other hosts' (whose pids mean nothing here), are False."""
    parts = name.rsplit(".", 4)
    if len(parts) != 5 or parts[4] != "tmp" or parts[0] != _HOST:
        return False
    try:
        pid = int(parts[1])
    except ValueError:
        return False
    return pid != os.getpid() and not pid_alive(pid)


def remove_stale_temp_files(tmp_dir: str) -> int:
    """Removes temp files left by dead processes of this host; returns how many. A live
    writer's files, and files of other hosts (their pids mean nothing here), are kept."""
    removed = 0
    try:
        entries = list(os.scandir(tmp_dir))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if is_dead_writers_temp(entry.name):
            try:
                os.unlink(entry.path)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def safe_dir_name(namespace: str) -> str:
    """A directory name for a namespace: itself when it is plain, else a readable prefix plus
    a digest, so two namespaces never share a directory."""
    plain = "".join(c if c.isalnum() or c in "-_." else "_" for c in namespace)
    if plain == namespace and not namespace.startswith("."):
        return namespace
    digest = hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()
    return f"{plain.lstrip('.')[:64]}-{digest}"


class _Scratch(threading.local):
    """Per-thread page-aligned buffers: the header read target, and the O_DIRECT bounce."""

    def __init__(self) -> None:
        self.head = memoryview(mmap.mmap(-1, ALIGN))
        self.body: memoryview | None = None

    def bounce(self, size: int) -> memoryview:
        if self.body is None or self.body.nbytes < size:
            self.body = memoryview(mmap.mmap(-1, max(_round_up(size), 2**20)))
        return self.body[:size]


_scratch = _Scratch()


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _aligned(view: memoryview | Scatter) -> bool:
    import numpy as np  # only O_DIRECT needs an address; numpy reads it from any buffer

    parts = view.parts if type(view) is Scatter else (view,)
    return all(p.nbytes % ALIGN == 0 and np.frombuffer(p, np.uint8).ctypes.data % ALIGN == 0
               for p in parts)


def _write_all(fd: int, parts: list[memoryview], offset: int) -> None:
    while parts:
        n = os.pwritev(fd, parts, offset)
        offset += n
        while parts and n >= parts[0].nbytes:
            n -= parts[0].nbytes
            parts.pop(0)
        if parts and n:
            parts[0] = parts[0][n:]


def _read_into(fd: int, parts: list[memoryview], offset: int, *, once: bool = False) -> int:
    """Fills `parts` from `offset`; fewer bytes only at end of file. `once` for O_DIRECT,
    where a retry at an unaligned offset would fail with EINVAL."""
    total = 0
    while parts:
        n = os.preadv(fd, parts, offset)
        if n == 0 or once:
            return total + n
        total += n
        offset += n
        while parts and n >= parts[0].nbytes:
            n -= parts[0].nbytes
            parts.pop(0)
        if parts and n:
            parts[0] = parts[0][n:]
    return total


@dataclass(frozen=True, slots=True)
class FileLayout:
    roots: tuple[str, ...]  # each already holds the namespace
    shard_depth: int

    def root_for(self, key: bytes) -> str:
        if len(self.roots) == 1:
            return self.roots[0]
        return self.roots[xxhash.xxh3_64_intdigest(key) % len(self.roots)]

    def path_for(self, key: bytes) -> str:
        if len(key) <= _LONG_KEY:
            stem = key.hex()
            name = stem + ".blk"
        else:
            stem = hashlib.blake2b(key, digest_size=32).hexdigest()
            name = stem + ".lblk"
        stem = stem.ljust(2 * self.shard_depth, "0")
        shards = [stem[2 * i : 2 * i + 2] for i in range(self.shard_depth)]
        return os.path.join(self.root_for(key), *shards, name)


class BlockFiles(Backend):
    """Blocks as files in the ucm block format. See the module docstring for the layout."""

    def __init__(self, layout: FileLayout, *, namespace: str, codec: Codec, fsync: bool,
                 direct: bool, direct_writes: bool = False, map_bytes: int = 0) -> None:
        """`direct`: O_DIRECT reads and writes. `direct_writes`: O_DIRECT writes only, so a
        store takes no page-cache pages (see the posix driver's docstring for when it pays);
        reads stay buffered and listed blocks stay mapped."""
        self.layout = layout
        # Blocks found in the page cache by a listing stay mapped (see _mapped): not with
        # O_DIRECT reads, whose point is to keep blocks out of the page cache.
        self.maps = MapCache(map_bytes) if map_bytes > 0 and not direct else None
        self.namespace = namespace
        self.codec = codec
        self.fsync = fsync
        self.direct = direct
        self.direct_writes = direct or direct_writes
        self._read_flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        self._write_flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                             | (os.O_DIRECT if self.direct_writes else 0))

    @classmethod
    def open(cls, layout: FileLayout, **kwargs: Any) -> BlockFiles:
        """Creates the directories, removes dead writers' temp files, and checks O_DIRECT."""
        files = cls(layout, **kwargs)
        for root in layout.roots:
            tmp = os.path.join(root, _TMP_DIR)
            os.makedirs(tmp, exist_ok=True)
            remove_stale_temp_files(tmp)
            if files.direct_writes:
                _probe_direct(tmp, root, "direct_writes" if not files.direct else "direct")
        return files

    def path_for(self, key: bytes) -> str:
        return self.layout.path_for(key)

    # lookup / delete

    def lookup(self, keys: list[bytes]) -> list[bool]:
        found = []
        for key in keys:
            try:
                os.stat(self.layout.path_for(key))
            except (FileNotFoundError, NotADirectoryError):
                found.append(False)
            else:
                found.append(True)
        return found

    def delete(self, keys: list[bytes]) -> None:
        for key in keys:
            if self.maps is not None:
                self.maps.drop(key)
            try:
                os.unlink(self.layout.path_for(key))
            except FileNotFoundError:
                pass

    # load

    def load(self, keys: list[bytes], views: list[memoryview]) -> list[LoadState]:
        return [self.load_one(key, view) for key, view in zip(keys, views, strict=True)]

    def in_memory(self, keys: list[bytes]) -> bool:
        """Every block mapped (its file is still checked before the copy, in load_one)."""
        maps = self.maps
        return maps is not None and all(key in maps for key in keys)

    def load_one(self, key: bytes, view: memoryview | Scatter) -> LoadState:
        path = self.layout.path_for(key)
        maps = self.maps
        mapped = None if maps is None else maps.get(key, path)
        if mapped is not None:
            maps.loads += 1
            try:
                return self._load_mapped(mapped.view, key, view)
            except BlockCorrupt:
                return LoadState.CORRUPT
        try:
            fd = os.open(path, self._read_flags)
        except (FileNotFoundError, NotADirectoryError):
            return LoadState.MISSING
        except OSError:
            return LoadState.FAILED
        try:
            return self._load_fd(fd, key, view)
        except BlockCorrupt:
            return LoadState.CORRUPT
        except OSError:
            return LoadState.FAILED
        finally:
            os.close(fd)

    @staticmethod
    def _load_mapped(block: memoryview, key: bytes, out: memoryview | Scatter) -> LoadState:
        """A mapped block file: header checked, payload checked and copied in one pass."""
        header = decode_header(block[:PAYLOAD_OFFSET], expect_key=key)
        if header.raw_len != out.nbytes:
            raise size_mismatch(out, header)
        if PAYLOAD_OFFSET + header.payload_len != block.nbytes:
            raise BlockCorrupt("the file's length differs from its header's")
        decode_payload_into(header, block[PAYLOAD_OFFSET:], out)  # NONE: copy_verified
        return LoadState.OK

    def _load_fd(self, fd: int, key: bytes, out: memoryview | Scatter) -> LoadState:
        head = _scratch.head
        if self.codec is Codec.NONE and (not self.direct or _aligned(out)):
            # The expected case: header and payload in one syscall, payload into `out`.
            parts = [head, *out.parts] if type(out) is Scatter else [head, out]
            n = _read_into(fd, parts, 0, once=self.direct)
            header = decode_header(head[: min(n, ALIGN)], expect_key=key)
            if header.raw_len != out.nbytes:
                raise size_mismatch(out, header)
            if header.codec is Codec.NONE:
                if n - PAYLOAD_OFFSET != header.payload_len:
                    raise BlockCorrupt("payload truncated")
                verify_payload(header, out)
                return LoadState.OK
        else:
            n = _read_into(fd, [head], 0, once=self.direct)
            header = decode_header(head[: min(n, ALIGN)], expect_key=key)
            if header.raw_len != out.nbytes:
                raise size_mismatch(out, header)
        # A compressed block, or an O_DIRECT read into an unaligned buffer: stage the payload.
        size = header.payload_len
        stage = _scratch.bounce(_round_up(size)) if self.direct else memoryview(bytearray(size))
        if _read_into(fd, [stage], PAYLOAD_OFFSET, once=self.direct) < size:
            raise BlockCorrupt("payload truncated")
        decode_payload_into(header, stage[:size], out)
        return LoadState.OK

    # store

    def store(self, keys: list[bytes], views: list[memoryview]) -> list[int]:
        sizes = []
        error: OSError | None = None
        for key, view in zip(keys, views, strict=True):
            try:
                sizes.append(self._store_one(key, view))
            except OSError as exc:
                error = error or exc
                sizes.append(0)
        if error is not None and not any(sizes):
            raise error
        return sizes

    def _store_one(self, key: bytes, view: memoryview) -> int:
        payload = as_byte_view(encode_payload(self.codec, view))
        header = encode_header(key, self.namespace, self.codec, payload, view.nbytes)
        final = self.layout.path_for(key)
        root = self.layout.root_for(key)
        tmp = os.path.join(root, _TMP_DIR, _tmp_name())
        fd = os.open(tmp, self._write_flags, 0o644)
        try:
            try:
                self._write_block(fd, header, payload)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.replace(tmp, final)
            except FileNotFoundError:  # first block in this shard directory
                os.makedirs(os.path.dirname(final), exist_ok=True)
                os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if self.maps is not None:
            self.maps.drop(key)  # the old file's mapping, if any: a stat would drop it too
        if self.fsync:
            _fsync_dir(os.path.dirname(final))
        return PAYLOAD_OFFSET + payload.nbytes

    def _write_block(self, fd: int, header: bytes, payload: memoryview) -> None:
        if not self.direct_writes:
            _write_all(fd, [memoryview(header), payload], 0)
            return
        # O_DIRECT wants page-aligned addresses and lengths: write the caller's buffer as it
        # is when it qualifies, else through the bounce buffer, then cut the padding off.
        head = _scratch.head
        head[:] = header
        size = payload.nbytes
        if _aligned(payload):
            _write_all(fd, [head, payload], 0)
            return
        stage = _scratch.bounce(_round_up(size))
        stage[:size] = payload
        stage[size:] = bytes(stage.nbytes - size)
        _write_all(fd, [head, stage], 0)
        os.ftruncate(fd, PAYLOAD_OFFSET + size)

    # listing

    def list_units(self) -> list[str]:
        units = []
        for root in self.layout.roots:
            if self.layout.shard_depth == 0:
                units.append(root)
                continue
            with os.scandir(root) as it:
                units += [e.path for e in it if e.is_dir() and e.name != _TMP_DIR]
        return units

    def list_unit(self, top: str) -> list[tuple[bytes, int]]:
        found = []
        for dirpath, dirnames, filenames in os.walk(top):
            if _TMP_DIR in dirnames:
                dirnames.remove(_TMP_DIR)
            for fname in filenames:
                path = os.path.join(dirpath, fname)
                try:
                    if fname.endswith(".blk"):
                        key = bytes.fromhex(fname[:-4])
                    elif fname.endswith(".lblk"):
                        key = self._key_from_header(path)
                    else:
                        continue
                    found.append((key, os.stat(path).st_size))
                    if self.maps is not None:
                        self.maps.adopt(key, path)  # False once its budget is spent
                except (ValueError, BlockCorrupt, FileNotFoundError):
                    continue  # not a block name, a bad header, or deleted while listing
        return found

    def close(self) -> None:
        if self.maps is not None:
            self.maps.clear()

    def _key_from_header(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return decode_header(f.read(ALIGN)).key


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _probe_direct(tmp_dir: str, root: str, option: str = "direct") -> None:
    probe = os.path.join(tmp_dir, _tmp_name())
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        try:
            os.pwrite(fd, _scratch.head, 0)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise ConfigError(
                f"{option}: the filesystem of {root} does not support O_DIRECT (tmpfs on "
                f"older kernels); set {option}: false") from None
        raise
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
