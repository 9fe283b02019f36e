"""The `nfs` driver: blocks as files on an NFSv4.1 server.

Client mode (the default) talks NFS from user space through nfs-rs, so it needs no kernel
NFS client or mount:

    - driver: nfs
      url: nfs://127.0.0.1:2049/export?version=4.1
      root: ucm                # directory inside the export
      timeout: 10              # seconds one NFS operation may take
      threads: 8               # worker threads for this tier

Mount mode uses a kernel NFS mount (a path) with the posix machinery made safe for NFS:

    - driver: nfs
      mode: mount
      path: /mnt/nfs/ucm
      fsync: true

Both keep the posix layout, `<root>/<namespace>/<aa>/<bb>/<hex key>.blk`, and publish a block
by writing a temp file named `<host>.<pid>.<thread>.<random>.tmp` and renaming it into place:
the name is unique per host, process and thread, so no lock and no O_EXCL create is needed,
and a reader opens the whole old block or the whole new one. Loads never trust cached
attributes: a block's length is what the read returns, checked against its header, and its
payload checksum is verified before the block counts. A writer that dies leaves only a temp
file, which a later kernel's listing of the blocks removes if its process (on this host) is
gone; a live writer's, and other hosts', are kept.

In client mode the temp file is written in the block's own directory, so the rename stays
inside one directory: renames from a shared temp directory into the shard directories stalled
nfs-ganesha now and then under many writers (docs/performance.md, "Remote drivers"). Mount
mode keeps the posix driver's
`<root>/<namespace>/.tmp`.

In client mode an nfs-rs `Client` is shared by the worker threads. A call that fails on the
transport (timeout, refused connection, lost session after a server restart) drops the
client, and the next call connects again: the driver recovers from a server restart without a
process restart. An error that nfs-rs marks safe to retry (seen a few times in 200 rounds on a
busy host) runs the call once more on the same client first. Calls run abandonable (see
`_remote`): a deadline returns at once even when the server is paused, and loads reach the
caller's buffer only after their checksum passed.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any, Literal, Self

import trio
from pydantic import Field, model_validator

from ucm.block import PAYLOAD_OFFSET, Codec, KVLayouts, decode_header
from ucm.drivers._blockfiles import BlockFiles, FileLayout, is_dead_writers_temp, tmp_name
from ucm.drivers.contract import DriverOptions
from ucm.drivers.kit import (
    Backend,
    DriverStatistics,
    LoadState,
    RemoteDriver,
    ThreadedDriver,
    Workers,
    frame_block,
    os_error,
    parse_codec,
    safe_dir_name,
    unframe_into,
)
from ucm.drivers.kit._threaded import with_counters
from ucm.errors import BlockCorrupt, ConfigError, StorageUnavailable


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.buf = bytearray(0)

    def get(self, size: int) -> memoryview:
        if len(self.buf) < size:
            self.buf = bytearray(max(size, 2**20 + PAYLOAD_OFFSET))
        return memoryview(self.buf)[:size]


_scratch = _Scratch()


class Connection:
    """The shared nfs-rs client, connected again after a transport failure."""

    def __init__(self, url: str, *, timeout: float, connect_timeout: float) -> None:
        self.url = url
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._client: Any = None
        self._lock = threading.Lock()
        self.reconnects = 0

    def get(self) -> Any:
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._client is None:
                from nfs_rs import Client

                try:
                    self._client = Client.connect(
                        self.url, operation_timeout=self.timeout,
                        connect_timeout=self.connect_timeout, uid=os.getuid(), gid=os.getgid())
                except Exception as exc:
                    raise ConnectionError(f"cannot connect to NFS server {self.url}: "
                                          f"{exc}") from exc
                self.reconnects += 1
            return self._client

    def broken(self, client: Any) -> None:
        """Drops `client` if it is still the current one (not closed: that can block on
        a dead server; its sockets go with it)."""
        with self._lock:
            if self._client is client:
                self._client = None

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass


class NfsBlocks(Backend):
    """Block files on an NFS export, through nfs-rs (synchronous; runs in worker threads)."""

    def __init__(self, conn: Connection, layout: FileLayout, *, namespace: str,
                 codec: Codec, layouts: KVLayouts | None = None) -> None:
        self.conn = conn
        self.layout = layout
        self.root = layout.roots[0]
        self.namespace = namespace
        self._ns = namespace.encode()  # what a loaded header must name
        self.codec = codec
        self.layouts = layouts
        self.retries = 0  # operations run again after an error nfs-rs marked safe to retry

    def _call(self, fn: Any) -> Any:
        """Runs fn(client); a transport failure drops the client and raises ConnectionError.
        FileNotFoundError and friends pass through: they are answers, not failures. An error
        that nfs-rs marks safe to retry (the operation did not happen, the session is fine)
        runs fn once more first: every fn here may run twice (it rewrites its own temp file,
        reads, or renames, removes or makes a directory that the first try did not)."""
        from nfs_rs import NfsError, OperationOutcome, RecoveryAction

        may_retry = True
        while True:
            client = self.conn.get()
            try:
                return fn(client)
            except (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError):
                raise
            except NfsError as exc:
                if getattr(exc, "errno", None) == errno.ESTALE:
                    # The file went away under an open handle (another host deleted or
                    # replaced it): an answer like ENOENT, not a broken connection.
                    raise FileNotFoundError(errno.ENOENT, f"stale handle: {exc}") from exc
                if (may_retry and exc.outcome is OperationOutcome.SAFE_TO_RETRY
                        and exc.recovery_action is RecoveryAction.RETRY):
                    may_retry = False
                    self.retries += 1
                    continue
                self.conn.broken(client)
                raise ConnectionError(f"NFS server {self.conn.url}: {exc}") from exc

    def prepare(self) -> None:
        """Creates the namespace directory (which also checks that the export is writable)."""
        self._call(lambda c: c.mkdir(self.root, parents=True, exist_ok=True))

    def path_for(self, key: bytes) -> str:
        return self.layout.path_for(key)

    # lookup / delete

    def lookup(self, keys: list[bytes]) -> list[bool]:
        return [self._call(lambda c, k=k: c.exists(self.path_for(k))) for k in keys]

    def delete(self, keys: list[bytes]) -> None:
        for key in keys:
            try:
                self._call(lambda c, k=key: c.remove(self.path_for(k)))
            except (FileNotFoundError, NotADirectoryError):
                pass

    # store

    def store(self, keys: list[bytes], views: list[memoryview]) -> list[int]:
        return [self._store_one(k, v) for k, v in zip(keys, views, strict=True)]

    def _store_one(self, key: bytes, view: memoryview) -> int:
        header, payload = frame_block(key, self.namespace, self.codec, view, self.layouts)
        assert isinstance(payload, memoryview)  # a Scatter only from a Scatter
        total = PAYLOAD_OFFSET + payload.nbytes
        block = _scratch.get(total)
        block[:PAYLOAD_OFFSET] = header
        block[PAYLOAD_OFFSET:] = payload
        final = self.path_for(key)
        parent = final.rsplit("/", 1)[0]
        tmp = f"{parent}/{tmp_name()}"  # next to the block: a rename inside one directory

        def write(client: Any) -> None:
            with client.open(tmp, "wb") as f:  # returns once the bytes are durable
                f.write(block)

        try:
            try:
                self._call(write)
            except (FileNotFoundError, NotADirectoryError):  # first block in this shard
                self._call(lambda c: c.mkdir(parent, parents=True, exist_ok=True))
                self._call(write)
            self._call(lambda c: c.rename(tmp, final))
        except BaseException:
            try:
                self._call(lambda c: c.remove(tmp))
            except Exception:
                pass
            raise
        return total

    # load

    def load(self, keys: list[bytes], views: list[memoryview]) -> list[LoadState]:
        return [self._load_one(k, v) for k, v in zip(keys, views, strict=True)]

    def _load_one(self, key: bytes, out: memoryview) -> LoadState:
        # One byte more than the block should hold, so a longer file shows up as corrupt.
        want = PAYLOAD_OFFSET + (out.nbytes if self.codec is Codec.NONE
                                 else out.nbytes + (out.nbytes >> 7) + 1024) + 1
        stage = _scratch.get(want)

        def read(client: Any) -> int:
            with client.open(self.path_for(key), "rb") as f:
                n: int = f.readinto(stage)  # fills the range or stops at EOF: one call
                return n

        try:
            n = self._call(read)
        except (FileNotFoundError, NotADirectoryError):
            return LoadState.MISSING
        return unframe_into(key, stage[:n], out, namespace=self._ns)

    # listing

    def list_units(self) -> list[str]:
        if self.layout.shard_depth == 0:
            return [self.root]
        entries = self._call(lambda c: c.listdir(self.root))
        return [f"{self.root}/{name}" for name in entries]

    def list_unit(self, top: str) -> list[tuple[bytes, int]]:
        found = []
        pending = [top]
        while pending:
            path = pending.pop()
            try:
                entries = self._call(lambda c, p=path: list(c.scandir(p)))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                child = f"{path}/{entry.name}"
                if entry.info.type.value == "directory":
                    pending.append(child)
                elif entry.name.endswith(".blk"):
                    try:
                        found.append((bytes.fromhex(entry.name[:-4]), entry.info.size))
                    except ValueError:
                        continue
                elif entry.name.endswith(".lblk"):
                    try:
                        head = self._call(lambda c, p=child: _read_head(c, p))
                        found.append((decode_header(head, expect_namespace=self._ns).key,
                                      entry.info.size))
                    except (FileNotFoundError, BlockCorrupt):
                        continue
                elif is_dead_writers_temp(entry.name):  # its writer died mid-store
                    try:
                        self._call(lambda c, p=child: c.remove(p))
                    except FileNotFoundError:
                        pass
        return found

    def close(self) -> None:
        self.conn.close()


def _read_head(client: Any, path: str) -> bytes:
    with client.open(path, "rb") as f:
        head: bytes = f.read_at(0, PAYLOAD_OFFSET)
        return head


class MountBlockFiles(BlockFiles):
    """BlockFiles for a kernel NFS mount: temp files are created without O_EXCL (unique names
    make it unnecessary, and old NFS servers emulate it badly)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._write_flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                             | (os.O_DIRECT if self.direct_writes else 0))


class NfsOptions(DriverOptions):
    mode: Literal["client", "mount"] = "client"
    url: str | None = None
    root: str = "ucm"
    path: str | None = None
    timeout: float = Field(default=10.0, gt=0)
    connect_timeout: float = Field(default=3.0, gt=0)
    threads: int = Field(default=8, ge=1, le=64)
    shard_depth: int = Field(default=2, ge=0, le=4)
    fsync: bool = True

    @model_validator(mode="after")
    def _mode_fields(self) -> NfsOptions:
        if self.mode == "client":
            if not self.url or not self.url.startswith("nfs://"):
                raise ValueError("url: client mode needs url: nfs://host[:port]/export"
                                 "?version=4.1")
            if self.path is not None:
                raise ValueError("path is for mode: mount; client mode takes url and root")
            root = self.root.strip("/")
            if not root or ".." in root.split("/"):
                raise ValueError("root must name a directory inside the export (nfs-rs "
                                 "cannot list the export's top directory)")
        elif not self.path:
            raise ValueError("path: mount mode needs the directory of an NFS mount")
        return self


class NfsDriver(RemoteDriver):
    """NFSv4.1 through nfs-rs (client mode)."""

    persistent = True
    Options = NfsOptions

    def __init__(self, backend: NfsBlocks, *, name: str, threads: int,
                 workers: Workers | None = None) -> None:
        super().__init__(backend, name=name, threads=threads, workers=workers)
        self.backend = backend

    @classmethod
    async def open(cls, options: NfsOptions | dict[str, Any], *, name: str = "nfs",
                   namespace: str, codec: str = "none", layouts: KVLayouts | None = None,
                   workers: Workers | None = None) -> Self | NfsMountDriver:
        if not isinstance(options, NfsOptions):
            options = NfsOptions.model_validate(options)
        codec_value = parse_codec(codec)
        if options.mode == "mount":
            return await NfsMountDriver.open_mount(options, name=name, namespace=namespace,
                                                   codec=codec_value, layouts=layouts,
                                                   workers=workers)
        try:
            import nfs_rs  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"nfs driver needs the nfs extra ({exc}); install it with: "
                              "pip install 'ucm[nfs]'") from exc
        assert options.url is not None  # NfsOptions requires one in client mode
        conn = Connection(options.url, timeout=options.timeout,
                          connect_timeout=options.connect_timeout)
        root = f"{options.root.strip('/')}/{safe_dir_name(namespace)}"
        backend = NfsBlocks(conn, FileLayout((root,), options.shard_depth),
                            namespace=namespace, codec=codec_value, layouts=layouts)
        try:
            await trio.to_thread.run_sync(backend.prepare, abandon_on_cancel=True)
        except OSError as exc:
            raise StorageUnavailable(f"{exc}", driver=name) from exc
        return cls(backend, name=name, threads=options.threads, workers=workers)

    def block_path(self, key: bytes) -> str:
        """`key`'s block path inside the export (tests and tools; it may not exist)."""
        return self.backend.path_for(key)

    def statistics(self) -> DriverStatistics:
        return with_counters(super().statistics(), {"connects": self.backend.conn.reconnects,
                                                    "retries": self.backend.retries})


class NfsMountDriver(ThreadedDriver):
    """Mount mode: the posix machinery on a kernel NFS mount (see the module docstring)."""

    persistent = True

    def __init__(self, files: BlockFiles, *, name: str,
                 workers: Workers | None = None) -> None:
        super().__init__(files, name=name, workers=workers)
        self.files = files

    @classmethod
    async def open_mount(cls, options: NfsOptions, *, name: str, namespace: str,
                         codec: Codec, layouts: KVLayouts | None = None,
                         workers: Workers | None = None) -> NfsMountDriver:
        path = os.path.abspath(os.path.expanduser(options.path or ""))
        layout = FileLayout((os.path.join(path, safe_dir_name(namespace)),),
                            options.shard_depth)
        try:
            files = await trio.to_thread.run_sync(
                lambda: MountBlockFiles.open(layout, namespace=namespace, codec=codec,
                                             layouts=layouts, fsync=options.fsync,
                                             direct=False))
        except OSError as exc:
            raise os_error(exc, name) from exc
        return cls(files, name=name, workers=workers)

    def block_path(self, key: bytes) -> str:
        return self.files.path_for(key)
