"""Block files kept mapped, so that a load copies out of memory instead of reading the file.

A load through `preadv` copies from the page cache and then reads the block again for its
checksum; a block file that is already mapped is checked and copied in one pass
(`copy_verified`) at memory speed, after one `stat` to see that the file is still the one
mapped. Mapping a file at load time costs more than it saves (page tables for every page), so
files are mapped ahead: the posix driver maps the blocks its listing finds when a kernel
starts, up to a byte budget, and fills the page tables (reading from disk the pages that are
not in the page cache), which is what makes a restarted engine's first loads fast. Reading
them in matters even just after they were written: a host may drop cold page-cache pages
within a minute (figures: docs/performance.md, "Mapping stored blocks ahead").

Published block files are never written in place (a store writes a temp file and renames it
over the old one; a delete unlinks), so a mapping holds one whole block for as long as it
lives. The `stat` before each load compares device, inode, size, mtime and ctime: a file replaced,
deleted or truncated is dropped from the cache and read the usual way. (A file truncated by
something other than ucm in the instant between that stat and the copy would fault the
process, as with any mapped file.)
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from collections import OrderedDict

import numpy as np

from ucm.block import MADV_POPULATE_READ, PAYLOAD_OFFSET, buffer_address, madvise


def populate(view: memoryview) -> None:
    """Maps the pages of `view` (part of a mapping) into this process: fills the page tables
    (MADV_POPULATE_READ; Linux 5.14+) and reads one byte of each page, so that the first load
    from it runs at memory speed. Used wherever stored blocks are mapped ahead of their loads
    (mapped posix files, the shm arena, the pmem pool).

    Filling the page tables is not enough on a VM that hands free memory back to its host:
    the first CPU access to each such page is slow there, so one byte of each page is read
    now (figures: docs/performance.md, "Mapping stored blocks ahead"). On an older kernel the
    madvise fails and the reads alone fault the pages in."""
    madvise(buffer_address(view), view.nbytes, MADV_POPULATE_READ)
    np.frombuffer(view, np.uint8)[::mmap.PAGESIZE].max(initial=0)


def identity(st: os.stat_result) -> tuple[int, ...]:
    """What must not change for a mapping to stay the file's (any write changes the times)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class MappedBlock:
    __slots__ = ("identity", "view")

    def __init__(self, view: memoryview, identity: tuple[int, ...]) -> None:
        self.view = view  # read-only; keeps the mapping alive while a load copies from it
        self.identity = identity


class MapCache:
    """Mapped block files by key, up to `limit_bytes` and `limit_maps` mappings (each one is
    a VMA: the kernel's default vm.max_map_count is 65530). Thread-safe. Mappings are never
    closed explicitly: a dropped one is unmapped when the last load using it lets go."""

    def __init__(self, limit_bytes: int, limit_maps: int = 16384) -> None:
        self.limit_bytes = limit_bytes
        self.limit_maps = limit_maps
        self._maps: OrderedDict[bytes, MappedBlock] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.loads = 0  # blocks loaded from a mapping (counted by the caller; racy is fine)

    def __len__(self) -> int:
        return len(self._maps)

    def __contains__(self, key: bytes) -> bool:
        return key in self._maps

    @property
    def mapped_bytes(self) -> int:
        return self._bytes

    def full(self) -> bool:
        return self._bytes >= self.limit_bytes or len(self._maps) >= self.limit_maps

    def adopt(self, key: bytes, path: str) -> bool:
        """Maps the block file at `path` if the budget allows, and fills this process's page
        tables for it (reading in the pages the page cache has lost). False if it was not
        mapped."""
        if self.full():
            return False
        try:
            # no symlinks followed; O_NONBLOCK: a FIFO planted here never hangs the listing
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if (not stat.S_ISREG(st.st_mode) or st.st_size <= PAYLOAD_OFFSET
                    or self._bytes + st.st_size > self.limit_bytes):
                return False
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError:
            return False
        finally:
            os.close(fd)
        view = memoryview(mm)
        populate(view)
        with self._lock:
            old = self._maps.pop(key, None)
            if old is not None:
                self._bytes -= old.view.nbytes
            self._maps[key] = MappedBlock(view, identity(st))
            self._bytes += st.st_size
        return True

    def get(self, key: bytes, path: str) -> MappedBlock | None:
        """The mapping of `key`'s block if `path` is still the file mapped, else None (and a
        mapping that went stale is dropped)."""
        block = self._maps.get(key)
        if block is None:
            return None
        try:
            now = identity(os.lstat(path))  # a symlink put in its place is another file
        except OSError:
            now = None
        if now != block.identity:
            self.drop(key)
            return None
        return block

    def drop(self, key: bytes) -> None:
        with self._lock:
            block = self._maps.pop(key, None)
            if block is not None:
                self._bytes -= block.view.nbytes

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()
            self._bytes = 0
