"""The block-file store of the `posix` driver (and of `nfs` in mount mode): each block one
file in the `ucm.block` format.

    <root>/<aa>/<bb>/<hex key>.blk      keys of up to 120 bytes (shards from the key's hex)
    <root>/<aa>/<bb>/<digest>.lblk      longer keys (the name would pass NAME_MAX); the header
                                        holds the key, so listing reads it back from there
    <root>/.tmp/<host>.<pid>.<tid>.<rand>.tmp   blocks being written

A store writes a temp file and `os.replace`s it into place, so a reader opens the old whole
block or the new whole block, never a mix, and a writer killed mid-write leaves only a temp file
that no lookup sees; `BlockFiles.open` removes the temp files of dead processes on this host.
A load reads the header and the payload with one `preadv` straight into the caller's buffer and
verifies the checksum there: no extra copy for codec none.

Nothing in the store is trusted: block files are opened with O_NOFOLLOW and O_NONBLOCK and
must be regular files (a symlink, FIFO or directory at a block's path is a corrupt block, and
never blocks a load, the listing or close); the header must name this key and namespace and
the caller's size, and the file's length must match the header before anything is allocated
for it. A bad block is CORRUPT for its key (the kernel removes it), never a failed batch.
Files are created 0600 and directories 0700 (a `group` and `mode` share them deliberately).
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import random
import socket
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from ucm.block import (
    PAYLOAD_OFFSET,
    BlockHeader,
    Codec,
    KVLayouts,
    Scatter,
    copy_bytes,
    decode_header,
    decode_payload_into,
    verify_payload,
    zstd_bound,
)
from ucm.drivers._mapped import MapCache, MappedBlock
from ucm.drivers.kit import Backend, LoadState, frame_block, pid_alive, wrong_size
from ucm.errors import BlockCorrupt, ConfigError

ALIGN = 4096
_LONG_KEY = 120  # longer keys are named by a digest: 2 * 120 hex chars + suffix < NAME_MAX
_TMP_DIR = ".tmp"
_HOST = socket.gethostname().replace(os.sep, "_").replace(".", "_") or "host"
FILE_MODE = 0o600  # blocks hold prompt-derived data: private unless shared on purpose
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # never hangs on a FIFO


def dir_mode(file_mode: int) -> int:
    """The directory mode that matches a block file mode: 0600 -> 0700, 0640 -> 0750, 0660 ->
    0770 (search wherever read is granted, and write for whoever may publish blocks)."""
    mode = 0o700
    for shift in (3, 0):  # group, others
        if file_mode & (0o4 << shift):
            mode |= (0o5 << shift) | (file_mode & (0o2 << shift))
    return mode


def open_regular(path: str, flags: int = _OPEN_FLAGS) -> tuple[int, os.stat_result]:
    """An fd on the regular file at `path` and its fstat. Raises BlockCorrupt for a symlink
    (O_NOFOLLOW) or anything else that is not a regular file; OSError as open raises it."""
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BlockCorrupt(f"{path} is a symlink") from None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise BlockCorrupt(f"{path} is not a regular file")
    return fd, st


def tmp_name() -> str:
    """A temp file name unique to this writer thread (see `is_dead_writers_temp`)."""
    return f"{_HOST}.{os.getpid()}.{threading.get_ident()}.{random.getrandbits(40):x}.tmp"


def is_dead_writers_temp(name: str) -> bool:
    """True for a temp file name (see `tmp_name`) of a writer on this host that is no longer
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


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in once, when mapped


class _Scratch(threading.local):
    """Per-thread page-aligned buffers: the header read target, and the stage of a payload
    that is not read into the caller's buffer (O_DIRECT bounce, compressed blocks): reused,
    so a load takes no allocation and no page faults for it."""

    def __init__(self) -> None:
        self.head = memoryview(mmap.mmap(-1, ALIGN))
        self.body: memoryview | None = None

    def bounce(self, size: int) -> memoryview:
        if self.body is None or self.body.nbytes < size:
            self.body = None  # the old mapping goes before the larger one is made
            self.body = memoryview(mmap.mmap(
                -1, max(_round_up(size), 2**20),
                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE))
        return self.body[:size]


_scratch = _Scratch()


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _aligned(view: memoryview | Scatter) -> bool:
    import numpy as np  # only O_DIRECT needs an address; numpy reads it from any buffer

    parts = view.parts if type(view) is Scatter else (view,)
    return all(p.nbytes % ALIGN == 0 and np.frombuffer(p, np.uint8).ctypes.data % ALIGN == 0
               for p in parts)


def _advance(parts: list[memoryview], n: int) -> None:
    """Drops the first `n` bytes of `parts` (what a short pwritev/preadv moved)."""
    while parts and n >= parts[0].nbytes:
        n -= parts[0].nbytes
        parts.pop(0)
    if parts and n:
        parts[0] = parts[0][n:]


_IOV_MAX = 1024  # iovecs one pwritev takes (Linux's UIO_MAXIOV): more pieces go in turns


def _write_all(fd: int, parts: list[memoryview], offset: int) -> None:
    while parts:
        n = os.pwritev(fd, parts[:_IOV_MAX], offset)
        offset += n
        _advance(parts, n)


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
        _advance(parts, n)
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
                 direct: bool, direct_writes: bool = False, map_bytes: int = 0,
                 file_mode: int = FILE_MODE, gid: int | None = None,
                 layouts: KVLayouts | None = None) -> None:
        """`direct`: O_DIRECT reads and writes. `direct_writes`: O_DIRECT writes only, so a
        store takes no page-cache pages (see the posix driver's docstring for when it pays);
        reads stay buffered and listed blocks stay mapped. `file_mode` and `gid`: blocks
        shared on purpose (directories get the matching `dir_mode`); the default is private."""
        self.layout = layout
        # Blocks found in the page cache by a listing stay mapped (see _mapped): not with
        # O_DIRECT reads, whose point is to keep blocks out of the page cache.
        self.maps = MapCache(map_bytes) if map_bytes > 0 and not direct else None
        self.namespace = namespace
        self._ns = namespace.encode()  # what a loaded header must name
        self.file_mode = file_mode
        self.dir_mode = dir_mode(file_mode)
        self.gid = gid
        # umask only narrows 0600/0700; a mode chosen for sharing is set explicitly
        self._share = file_mode != FILE_MODE or gid is not None
        self.codec = codec
        self.layouts = layouts
        self.fsync = fsync
        self.direct = direct
        self.direct_writes = direct or direct_writes
        self._read_flags = _OPEN_FLAGS | (os.O_DIRECT if direct else 0)
        self._write_flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                             | (os.O_DIRECT if self.direct_writes else 0))

    @classmethod
    def open(cls, layout: FileLayout, **kwargs: Any) -> BlockFiles:
        """Creates the directories, removes dead writers' temp files, and checks O_DIRECT."""
        files = cls(layout, **kwargs)
        for root in layout.roots:
            tmp = os.path.join(root, _TMP_DIR)
            files.makedirs(tmp)
            remove_stale_temp_files(tmp)
            if files.direct_writes:
                _probe_direct(tmp, root, "direct_writes" if not files.direct else "direct")
        return files

    def path_for(self, key: bytes) -> str:
        return self.layout.path_for(key)

    def makedirs(self, path: str) -> None:
        """Creates `path` and its missing parents with `dir_mode` (existing ones are left as
        they are), and gives the new ones to `gid`."""
        try:
            os.mkdir(path, self.dir_mode)
        except FileExistsError:
            return
        except FileNotFoundError:
            self.makedirs(os.path.dirname(path))
            try:
                os.mkdir(path, self.dir_mode)
            except FileExistsError:
                return
        if self._share:
            if self.gid is not None:
                os.chown(path, -1, self.gid)
            os.chmod(path, self.dir_mode)

    # lookup / delete

    def lookup(self, keys: list[bytes]) -> list[bool]:
        found = []
        for key in keys:
            try:
                os.lstat(self.layout.path_for(key))
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
            except (FileNotFoundError, IsADirectoryError):  # a planted directory stays
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
        if mapped is not None and maps is not None:  # (maps is set whenever mapped is)
            return self._load_mapped(maps, mapped, key, view)
        try:
            fd, st = open_regular(path, self._read_flags)
        except (FileNotFoundError, NotADirectoryError):
            return LoadState.MISSING
        except BlockCorrupt:
            return LoadState.CORRUPT
        except OSError:
            return LoadState.FAILED
        try:
            # Not mapped yet (stored after the start, or past the budget then): mapped now, if
            # its length fits the caller's block (a planted giant never takes the budget), and
            # copied from the new mapping; later loads are copies from memory (see _mapped).
            if maps is not None and st.st_size <= PAYLOAD_OFFSET + view.nbytes:
                mapped = maps.map_opened(key, fd, st)
                if mapped is not None:
                    return self._load_mapped(maps, mapped, key, view)
            return self._load_fd(fd, st.st_size, key, view)
        except BlockCorrupt:
            return LoadState.CORRUPT
        except OSError:
            return LoadState.FAILED
        finally:
            os.close(fd)

    def _check(self, head: memoryview, key: bytes, out: memoryview | Scatter,
               file_size: int) -> BlockHeader:
        """The header of `key`'s block file, checked against this namespace, the caller's
        size and the file's length before anything is read or allocated for its payload."""
        header = decode_header(head, expect_key=key, expect_namespace=self._ns)
        if header.raw_len != out.nbytes:
            raise wrong_size(out, header)
        if PAYLOAD_OFFSET + header.payload_len != file_size:
            raise BlockCorrupt("the file's length differs from its header's")
        return header

    def _load_mapped(self, maps: MapCache, mapped: MappedBlock, key: bytes,
                     out: memoryview | Scatter) -> LoadState:
        """A mapped block file: header checked, payload checked and copied in one pass. A
        block that fails is CORRUPT and its mapping dropped."""
        maps.loads += 1
        block = mapped.view
        try:
            header = self._check(block[:PAYLOAD_OFFSET], key, out, block.nbytes)
            decode_payload_into(header, block[PAYLOAD_OFFSET:], out)  # NONE: copy_verified
        except BlockCorrupt:
            maps.drop(key, mapped)
            return LoadState.CORRUPT
        return LoadState.OK

    def _load_fd(self, fd: int, file_size: int, key: bytes, out: memoryview | Scatter,
                 ) -> LoadState:
        head = _scratch.head
        if self.codec is Codec.NONE and (not self.direct or _aligned(out)):
            # The expected case: header and payload in one syscall, payload into `out`.
            parts = [head, *out.parts] if type(out) is Scatter else [head, out]
            n = _read_into(fd, parts, 0, once=self.direct)
            header = self._check(head[: min(n, ALIGN)], key, out, file_size)
            if header.codec is Codec.NONE:
                if n - PAYLOAD_OFFSET != header.payload_len:
                    raise BlockCorrupt("payload truncated")
                verify_payload(header, out)
                return LoadState.OK
        elif not self.direct and ALIGN < file_size <= ALIGN + zstd_bound(out.nbytes):
            # A compressed block: header and payload in one syscall into this thread's stage
            # (the bound: no payload of a block this size is longer, so a planted file
            # allocates nothing beyond it), then decoded from there into `out`.
            size = file_size - PAYLOAD_OFFSET
            stage = _scratch.bounce(size)
            n = _read_into(fd, [head, stage], 0)
            header = self._check(head[: min(n, ALIGN)], key, out, file_size)
            if n - PAYLOAD_OFFSET < size:  # the file shrank under us
                raise BlockCorrupt("payload truncated")
            decode_payload_into(header, stage, out)
            return LoadState.OK
        else:
            n = _read_into(fd, [head], 0, once=self.direct)
            header = self._check(head[: min(n, ALIGN)], key, out, file_size)
        # An O_DIRECT read into an unaligned buffer, or a compressed block in O_DIRECT mode:
        # stage the payload, whose length `_check` bounded by the file's and (decode_header)
        # by the raw size.
        size = header.payload_len
        stage = _scratch.bounce(_round_up(size) if self.direct else size)
        if _read_into(fd, [stage], PAYLOAD_OFFSET, once=self.direct) < size:
            raise BlockCorrupt("payload truncated")
        decode_payload_into(header, stage[:size], out)
        return LoadState.OK

    # store

    def store(self, keys: list[bytes], views: Sequence[memoryview | Scatter]) -> list[int]:
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

    def _store_one(self, key: bytes, view: memoryview | Scatter) -> int:
        header, payload = frame_block(key, self.namespace, self.codec, view, self.layouts)
        final = self.layout.path_for(key)
        root = self.layout.root_for(key)
        tmp = os.path.join(root, _TMP_DIR, tmp_name())
        fd = os.open(tmp, self._write_flags, self.file_mode)
        try:
            try:
                if self._share:
                    if self.gid is not None:
                        os.fchown(fd, -1, self.gid)
                    os.fchmod(fd, self.file_mode)
                self._write_block(fd, header, payload)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.replace(tmp, final)
            except FileNotFoundError:  # first block in this shard directory
                self.makedirs(os.path.dirname(final))
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

    def _write_block(self, fd: int, header: bytes, payload: memoryview | Scatter) -> None:
        pieces = list(payload.parts) if type(payload) is Scatter else [payload]
        if not self.direct_writes:  # a Scatter's pieces straight from where they lie
            _write_all(fd, [memoryview(header), *pieces], 0)
            return
        # O_DIRECT wants page-aligned addresses and lengths: write the caller's buffer as it
        # is when it qualifies, else through the bounce buffer, then cut the padding off.
        head = _scratch.head
        head[:] = header
        size = payload.nbytes
        if _aligned(payload):
            _write_all(fd, [head, *pieces], 0)
            return
        stage = _scratch.bounce(_round_up(size))
        copy_bytes(stage[:size], payload)
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
                units += [e.path for e in it
                          if e.is_dir(follow_symlinks=False) and e.name != _TMP_DIR]
        return units

    def list_unit(self, top: str) -> list[tuple[bytes, int]]:
        """The blocks under `top`: regular files with a block's name only (symlinks, FIFOs
        and other planted things are passed over without being opened)."""
        found = []
        pending = [top]
        while pending:
            try:
                it = os.scandir(pending.pop())
            except (FileNotFoundError, NotADirectoryError):
                continue
            with it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            if entry.name != _TMP_DIR:
                                pending.append(entry.path)
                            continue
                        name = entry.name
                        if not entry.is_file(follow_symlinks=False):
                            continue
                        if name.endswith(".blk"):
                            key = bytes.fromhex(name[:-4])
                        elif name.endswith(".lblk"):
                            key = self._key_from_header(entry.path)
                        else:
                            continue
                        found.append((key, entry.stat(follow_symlinks=False).st_size))
                        if self.maps is not None:
                            self.maps.adopt(key, entry.path)  # False once its budget is spent
                    except (ValueError, BlockCorrupt, FileNotFoundError):
                        continue  # not a block name, a bad header, or deleted while listing
        return found

    def close(self) -> None:
        if self.maps is not None:
            self.maps.clear()

    def _key_from_header(self, path: str) -> bytes:
        fd, _ = open_regular(path)
        try:
            head = os.pread(fd, ALIGN, 0)
        finally:
            os.close(fd)
        return decode_header(head, expect_namespace=self._ns).key


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _probe_direct(tmp_dir: str, root: str, option: str = "direct") -> None:
    probe = os.path.join(tmp_dir, tmp_name())
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, FILE_MODE)
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
