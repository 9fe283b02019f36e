"""Block files kept mapped, so that a load copies out of memory instead of reading the file.

A load through `preadv` copies from the page cache and then reads the block again for its
checksum; a block file that is already mapped is checked and copied in one pass
(`copy_verified`) at memory speed, after one `stat` to see that the file is still the one
mapped. Blocks get mapped three ways, all within one budget (`MapCache`: bytes and mappings):

- ahead, when a kernel starts: the posix driver's listing maps the blocks it finds while the
  budget has room and fills the page tables (`adopt`; reading from disk the pages that are not
  in the page cache), which is what makes a restarted engine's first loads fast. Reading them
  in matters even just after they were written: a host may drop cold page-cache pages within
  a minute (figures: docs/performance.md, "Mapping stored blocks ahead");
- on a block's first load, when it was not mapped (stored after the start, or past the budget
  then): the file opened for the load is mapped and the block checked and copied from the new
  mapping (`map_opened`), which costs no more than `preadv` and a checksum pass (the copy's page
  faults take the place of the read: docs/performance.md, issue 38, 2026-12-06), and later
  loads of it are copies from memory that the kernel's fast path may take off the trio thread;
- a full budget makes room for a load's mapping by dropping the mappings loaded least
  recently; the listing never drops one (its order says nothing about which blocks are hot).

Published block files are never written in place (a store writes a temp file and renames it
over the old one; a delete unlinks), so a mapping holds one whole block for as long as it
lives. The `stat` before each load from a kept mapping compares device, inode, size, mtime and
ctime: a file replaced, deleted or truncated is dropped from the cache and read again from its
path. A new mapping is made from the descriptor the load opened and fstat'ed, with that
identity, and a block whose header or checksum fails is dropped. (A file truncated by
something other than ucm in the instant between that stat and the copy would fault the
process, as with any mapped file.)
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import threading
from collections import OrderedDict

import numpy as np

from ucm.block import MADV_POPULATE_READ, PAYLOAD_OFFSET, buffer_address, madvise


def populate(view: memoryview) -> bool:
    """Maps the pages of `view` (part of a mapping) into this process: fills the page tables
    (MADV_POPULATE_READ; Linux 5.14+) and reads one byte of each page, so that the first load
    from it runs at memory speed. Used wherever stored blocks are mapped ahead of their loads
    (mapped posix files, the shm arena, the pmem pool). False, and nothing read, where the
    kernel says that an access would fault (`fill_page_tables`).

    Filling the page tables is not enough on a VM that hands free memory back to its host:
    the first CPU access to each such page is slow there, so one byte of each page is read
    now (figures: docs/performance.md, "Mapping stored blocks ahead"). On an older kernel the
    madvise fails and the reads alone fault the pages in."""
    if not fill_page_tables(view):
        return False
    np.frombuffer(view, np.uint8)[::mmap.PAGESIZE].max(initial=0)
    return True


def fill_page_tables(view: memoryview) -> bool:
    """MADV_POPULATE_READ over `view`: reads in what the page cache lacks and maps it. False
    where an access would raise SIGBUS (a file truncated under its mapping, an I/O error: the
    madvise fails with EFAULT or EIO instead); True also on a kernel without it (EINVAL)."""
    return madvise(buffer_address(view), view.nbytes, MADV_POPULATE_READ) in (0, errno.EINVAL)


def identity(st: os.stat_result) -> tuple[int, ...]:
    """What must not change for a mapping to stay the file's (any write changes the times)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class MappedBlock:
    __slots__ = ("identity", "view")

    def __init__(self, view: memoryview, identity: tuple[int, ...]) -> None:
        self.view = view  # read-only; keeps the mapping alive while a load copies from it
        self.identity = identity


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (cgroup v2): no limit


def usable_memory() -> int:
    """Bytes of memory this process may use: the host's, or its cgroup's limit where lower
    (v2 memory.max, v1 memory.limit_in_bytes), or its address-space limit (RLIMIT_AS)."""
    limits = [os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        limit = _read_int(path)
        if limit:
            limits.append(limit)
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    except (ImportError, ValueError, OSError):  # pragma: no cover - not Linux
        pass
    return min(limits)


def auto_map_bytes() -> int:
    """The posix driver's default `map_bytes`: a quarter of `usable_memory()`. What a mapped
    block costs is 2 MiB of page tables per GiB and one of `MapCache.limit_maps` mappings:
    its pages are the page cache's, which the kernel may still reclaim (a later load then
    faults them back in from the file); the share bounds what a start-up listing reads in."""
    return usable_memory() // 4


def max_maps() -> int:
    """Mappings one MapCache may hold: a quarter of vm.max_map_count (65530 by default: a
    process that passes it fails every mmap, torch's and the allocator's included), at most
    16384."""
    limit = _read_int("/proc/sys/vm/max_map_count") or 65530
    return max(1, min(16384, limit // 4))


class MapCache:
    """Mapped block files by key, least recently loaded first, up to `limit_bytes` and
    `limit_maps` mappings (each one is a VMA; see `max_maps`). Thread-safe. Mappings are never
    closed explicitly: a dropped one is unmapped when the last load using it lets go."""

    def __init__(self, limit_bytes: int, limit_maps: int | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.limit_maps = max_maps() if limit_maps is None else limit_maps
        self._maps: OrderedDict[bytes, MappedBlock] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        # Counted by the callers, racy (a lost increment is fine): blocks loaded from a
        # mapping, mappings made by a load, mappings dropped to make room for one.
        self.loads = 0
        self.mapped_on_load = 0
        self.evicted = 0

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
        """Maps the block file at `path` if the budget has room (nothing is dropped for it),
        and fills this process's page tables for it (reading in the pages the page cache has
        lost). False if it was not mapped."""
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
        if not populate(view):  # truncated since the fstat, or unreadable
            return False
        return self._put(key, MappedBlock(view, identity(st)), make_room=False)

    def map_opened(self, key: bytes, fd: int, st: os.stat_result) -> MappedBlock | None:
        """Maps the block file a load opened (`fd`, a regular file, and its fstat `st`) and
        keeps the mapping, dropping the least recently loaded ones if the budget needs the
        room. Its page tables are filled first (`fill_page_tables`), which reads in what the
        page cache lacks as a read would, and tells a file truncated since the fstat or an
        I/O error from a good block without a fault. None if it was not mapped (larger than
        the whole budget, mmap failed, or the pages would fault): the caller reads it."""
        size = st.st_size
        if size <= PAYLOAD_OFFSET or size > self.limit_bytes or self.limit_maps < 1:
            return None
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError:
            return None
        view = memoryview(mm)
        if not fill_page_tables(view):
            return None
        block = MappedBlock(view, identity(st))
        if not self._put(key, block, make_room=True):
            return None
        self.mapped_on_load += 1
        return block

    def _put(self, key: bytes, block: MappedBlock, *, make_room: bool) -> bool:
        size = block.view.nbytes
        with self._lock:
            old = self._maps.pop(key, None)
            if old is not None:
                self._bytes -= old.view.nbytes
            if make_room:
                while self._maps and (self._bytes + size > self.limit_bytes
                                      or len(self._maps) >= self.limit_maps):
                    _, victim = self._maps.popitem(last=False)
                    self._bytes -= victim.view.nbytes
                    self.evicted += 1
            elif self._bytes + size > self.limit_bytes or len(self._maps) >= self.limit_maps:
                return False
            self._maps[key] = block
            self._bytes += size
        return True

    def get(self, key: bytes, path: str) -> MappedBlock | None:
        """The mapping of `key`'s block if `path` is still the file mapped, else None (and a
        mapping that went stale is dropped). Marks it the most recently loaded."""
        block = self._maps.get(key)
        if block is None:
            return None
        try:
            now = identity(os.lstat(path))  # a symlink put in its place is another file
        except OSError:
            now = None
        if now != block.identity:
            self.drop(key, block)
            return None
        with self._lock:
            if self._maps.get(key) is block:
                self._maps.move_to_end(key)
        return block

    def drop(self, key: bytes, block: MappedBlock | None = None) -> None:
        """Forgets `key`'s mapping (only if it is still `block`, when that is given)."""
        with self._lock:
            current = self._maps.get(key)
            if current is not None and (block is None or current is block):
                del self._maps[key]
                self._bytes -= current.view.nbytes

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()
            self._bytes = 0
