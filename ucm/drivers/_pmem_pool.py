"""The pmem pool: one file mapped through libpmem, holding an index and the blocks.

Pool layout, crash-consistent without a log:

    0       4 KiB superblock: magic, version, sizes, entry count, checksum
    4096    index: one 64-byte entry per slot {magic, seq, offset, length, key digest, crc}
    data    extents of whole 4 KiB pages, each one block in the `ucm.block` format

A store copies header and payload into a free extent and persists it, then writes and
persists the index entry: a block is visible only once its bytes and checksums are durable,
and the entry's own checksum makes a torn entry invisible. Replacing or deleting a block
clears (and persists) the old entry before its extent can be reused, so no entry ever points
at bytes that another block overwrote. Recovery (every open) reads the index: valid entries
whose header names the same key digest are blocks, the highest sequence number wins a
duplicate, everything else is free space. An extent that a load is reading stays allocated
until that load is done, so a delete or overwrite never breaks a load in progress.

The index is a `_slots` table (as the shared-memory arena's): an entry's place is the
extent's byte offset.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import itertools
import os
import struct
import threading
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ucm.block import (
    PAYLOAD_OFFSET,
    Codec,
    KVLayouts,
    as_byte_view,
    buffer_address,
    copy_hashed,
    decode_header,
    decode_payload_into,
    encode_header,
    encode_payload,
    key_digest,
)
from ucm.drivers._extents import Extents
from ucm.drivers._mapped import populate
from ucm.drivers._slots import ENTRY_SIZE, SlotTable, names_block, parse_entry, seal, unseal
from ucm.drivers.kit import Backend, LoadState, wrong_size
from ucm.errors import BlockCorrupt, ConfigError, StorageUnavailable

PAGE = 4096
_SUPER = struct.Struct("<8sIIQQQQ")  # magic, version, entry size, file size, entries, index, data
_SUPER_MAGIC, _VERSION = b"UCMPMEM1", 1
_ENTRY_MAGIC = 0x45504355  # "UCPE"; an entry's word: 0, its place: the extent's offset
_MSYNC_GAP = 1 << 20  # extents closer than this share one msync
PMEM_FILE_CREATE = 1


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


_lib: Any = None


def libpmem() -> Any:
    """libpmem through ctypes, loaded once; ConfigError when it is not installed."""
    global _lib
    if _lib is None:
        name = ctypes.util.find_library("pmem") or "libpmem.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as exc:
            raise ConfigError(f"pmem driver needs libpmem ({exc}); install it with: "
                              "apt-get install libpmem1") from None
        size_p, int_p = ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)
        lib.pmem_map_file.restype = ctypes.c_void_p  # else ctypes cuts the pointer to an int
        lib.pmem_map_file.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_uint, size_p, int_p]
        lib.pmem_unmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.pmem_is_pmem.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.pmem_persist.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.pmem_persist.restype = None
        lib.pmem_flush.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.pmem_flush.restype = None
        lib.pmem_drain.argtypes = []
        lib.pmem_drain.restype = None
        lib.pmem_msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.pmem_memcpy_persist.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.pmem_memcpy_persist.restype = ctypes.c_void_p
        lib.pmem_memcpy_nodrain.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.pmem_memcpy_nodrain.restype = ctypes.c_void_p
        lib.pmem_errormsg.restype = ctypes.c_char_p
        _lib = lib
    return _lib


class _NextFit(Extents):
    """Extents allocated next-fit: from where the last allocation ended, wrapping around.

    Stores then move through the whole pool instead of rewriting its first pages again and
    again: on a file, rewriting a region written back moments ago is the slow part (figures:
    docs/performance.md, "The shm arena and pmem pool"). On pmem it spreads the writes."""

    def __init__(self, free: list[tuple[int, int]] | None = None) -> None:
        super().__init__(free)
        self._cursor = 0

    def allocate(self, length: int) -> int | None:
        free = self._free
        start = bisect_left(free, (self._cursor, 0))
        for i in itertools.chain(range(start, len(free)), range(start)):
            offset, size = free[i]
            if size >= length:
                if size == length:
                    del free[i]
                else:
                    free[i] = (offset + length, size - length)
                self._cursor = offset + length
                return offset
        return None


@dataclass(slots=True)
class _Entry:
    slot: int
    offset: int
    length: int  # header + payload
    extent: int  # whole pages
    seq: int
    readers: int = 0
    cleared: bool = False  # the slot on the media no longer names this extent


class PmemPool(Backend):
    """The mapped pool file: index, allocator and block copies. Thread-safe."""

    def __init__(self, path: str, *, namespace: str, codec: Codec, lock_fd: int,
                 layouts: KVLayouts | None = None) -> None:
        self.path = path
        self.namespace = namespace
        self._ns = namespace.encode()  # what a loaded header must name
        self.codec = codec
        self.layouts = layouts
        self._lock_fd = lock_fd
        self._lock = threading.Lock()
        self.lib = libpmem()
        self.addr = 0
        self.size = 0
        self.is_pmem = False
        self.index: dict[bytes, _Entry] = {}
        self._free: Extents = _NextFit()
        self._free_slots: list[int] = []
        self._seq = 0
        self.recovered_dropped = 0

    # -- mapping and recovery -------------------------------------------------------------

    @classmethod
    def open(cls, path: str, *, size: int, max_blocks: int | None, namespace: str,
             codec: Codec, layouts: KVLayouts | None = None,
             populate: bool = True) -> PmemPool:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock_fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise StorageUnavailable(f"pool {path} is open in another process") from None
        pool = cls(path, namespace=namespace, codec=codec, lock_fd=lock_fd, layouts=layouts)
        try:
            pool._map(size, max_blocks)
            if populate:
                pool._map_blocks(pool.index.values())
        except BaseException:
            pool.close()
            raise
        return pool

    def _map(self, size: int, max_blocks: int | None) -> None:
        lib = self.lib
        mapped, is_pmem = ctypes.c_size_t(), ctypes.c_int()
        exists = os.path.exists(self.path) and os.path.getsize(self.path) > 0
        if exists:
            addr = lib.pmem_map_file(self.path.encode(), 0, 0, 0, ctypes.byref(mapped),
                                     ctypes.byref(is_pmem))
        else:
            addr = lib.pmem_map_file(self.path.encode(), size, PMEM_FILE_CREATE, 0o600,
                                     ctypes.byref(mapped), ctypes.byref(is_pmem))
        if not addr:
            err = ctypes.get_errno()
            message = (lib.pmem_errormsg() or b"").decode(errors="replace")
            raise OSError(err or errno.EIO, f"pmem_map_file: {message}", self.path)
        self.addr, self.size = addr, mapped.value
        self.is_pmem = bool(is_pmem.value) and bool(lib.pmem_is_pmem(addr, self.size))
        self.view = memoryview((ctypes.c_char * self.size).from_address(addr)).cast("B")
        if not exists or not any(self.view[:_SUPER.size]):
            self._format(max_blocks)  # new, or a crash before the superblock was written
        self._recover()

    def _format(self, max_blocks: int | None) -> None:
        entries = max_blocks or max(256, self.size // (64 * 1024))
        data = _round_up(PAGE + entries * ENTRY_SIZE)
        if data + PAGE > self.size:
            raise ConfigError(f"size: {self.size} bytes cannot hold {entries} index entries "
                              "and one block; raise size or lower max_blocks")
        self.view[PAGE:data] = bytes(data - PAGE)
        self.persist(PAGE, data - PAGE)
        head = _SUPER.pack(_SUPER_MAGIC, _VERSION, ENTRY_SIZE, self.size, entries, PAGE, data)
        self.view[: _SUPER.size + 4] = seal(head)
        self.persist(0, PAGE)

    def _recover(self) -> None:
        head = unseal(self.view, _SUPER.size)
        magic, version, entry_size, file_size, entries, index, data = _SUPER.unpack(
            head or bytes(_SUPER.size))
        if head is None or magic != _SUPER_MAGIC:
            raise ConfigError(f"path: {self.path} is not a ucm pmem pool")
        if version != _VERSION or entry_size != ENTRY_SIZE or file_size != self.size:
            raise ConfigError(f"path: {self.path} has pool format {version} for "
                              f"{file_size} bytes; this driver reads format {_VERSION}")
        self.entries, self.index_offset, self.data_offset = entries, index, data
        self._table = SlotTable(self.view, index, _ENTRY_MAGIC)
        found: dict[bytes, _Entry] = {}
        for slot in range(entries):
            entry = self._read_entry(slot)
            if entry is None:
                self._free_slots.append(slot)
                continue
            key, item = entry
            self._seq = max(self._seq, item.seq)
            older = found.get(key)
            if older is not None and older.seq > item.seq:
                item, older = older, item
            if older is not None:  # a replace that crashed before clearing the old entry
                self._clear_slot(older.slot)
                self._free_slots.append(older.slot)
                self.recovered_dropped += 1
            found[key] = item
        self._free_slots.reverse()  # pop() hands out low slots first
        self.index = found
        self._free = _NextFit.gaps([(e.offset, e.extent) for e in found.values()],
                                  self.data_offset, self.size)

    def _map_blocks(self, entries: Iterable[_Entry]) -> None:
        """Maps the blocks the pool holds into this process (`_mapped.populate`), so the first
        load of each after a restart copies at memory speed instead of taking a page fault
        every few pages (figures: docs/performance.md, "The shm arena and pmem pool")."""
        ranges: list[list[int]] = []
        for start, length in sorted((e.offset, e.extent) for e in entries):
            if ranges and start <= ranges[-1][1]:
                ranges[-1][1] = max(ranges[-1][1], start + length)
            else:
                ranges.append([start, start + length])
        for start, end in ranges:
            populate(self.view[start:end])

    def _read_entry(self, slot: int) -> tuple[bytes, _Entry] | None:
        raw = self._table.raw(slot)
        if int.from_bytes(raw[:4], "little") != _ENTRY_MAGIC:
            return None
        entry = parse_entry(raw, _ENTRY_MAGIC)
        if entry is None:
            self.recovered_dropped += 1  # torn: the store never completed
            return None
        offset, length = entry.place, entry.length
        extent = _round_up(length)
        if (offset < self.data_offset or offset % PAGE or length < PAYLOAD_OFFSET
                or offset + extent > self.size):
            self.recovered_dropped += 1
            return None
        key = names_block(self.view, offset, entry.digest, length)
        if key is None:
            self.recovered_dropped += 1
            return None
        return key, _Entry(slot, offset, length, extent, entry.seq)

    # -- media ------------------------------------------------------------------------------

    def persist(self, offset: int, length: int) -> None:
        if self.is_pmem:
            self.lib.pmem_persist(self.addr + offset, length)
        elif self.lib.pmem_msync(self.addr + offset, length) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), self.path)

    def persist_ranges(self, ranges: list[tuple[int, int]]) -> None:
        """Makes every (offset, length) durable, with as few barriers as the media allows.

        On pmem: a cache flush per range and one drain (fence) for all of them. Elsewhere: one
        msync per run of ranges whose gaps are under _MSYNC_GAP (msync costs a writeback and a
        journal round trip per call; the clean pages of a small gap cost next to nothing)."""
        if not ranges:
            return
        if self.is_pmem:
            for offset, length in ranges:
                self.lib.pmem_flush(self.addr + offset, length)
            self.lib.pmem_drain()
            return
        ranges = sorted(ranges)
        start, end = ranges[0][0], ranges[0][0] + ranges[0][1]
        for offset, length in ranges[1:]:
            if offset - end > _MSYNC_GAP:
                self.persist(start, end - start)
                start, end = offset, offset + length
            else:
                end = max(end, offset + length)
        self.persist(start, end - start)

    def _entry_at(self, slot: int) -> int:
        return self._table.at(slot)

    def _put_entry(self, entry: _Entry, key: bytes) -> None:
        """Writes an index entry into the mapping; durable only after a persist."""
        self._table.write(entry.slot, 0, entry.seq, entry.offset, entry.length, key_digest(key))

    def _put_clear(self, slot: int) -> None:
        self._table.clear(slot)

    def _clear_slot(self, slot: int) -> None:
        self._put_clear(slot)
        self.persist(self._entry_at(slot), ENTRY_SIZE)

    # -- allocator (call with the lock held) --------------------------------------------------

    def _allocate(self, length: int) -> int | None:
        return self._free.allocate(length)

    def _release(self, offset: int, length: int) -> None:
        self._free.release(offset, length)

    def _maybe_free(self, entry: _Entry) -> None:
        if entry.cleared and entry.readers == 0:
            self._release(entry.offset, entry.extent)

    def _retire(self, entries: list[_Entry]) -> None:
        """Clears replaced or deleted blocks' slots (one persist for all), then frees what no
        reader holds. Until the clears are durable the extents stay allocated, so no entry on
        the media ever names bytes that another block overwrote."""
        if not entries:
            return
        for entry in entries:
            self._put_clear(entry.slot)
        self.persist_ranges([(self._entry_at(e.slot), ENTRY_SIZE) for e in entries])
        with self._lock:
            for entry in entries:
                entry.cleared = True
                self._free_slots.append(entry.slot)
                self._maybe_free(entry)

    # -- the Backend ------------------------------------------------------------------------

    def lookup(self, keys: list[bytes]) -> list[bool]:
        index = self.index
        return [key in index for key in keys]

    def load(self, keys: list[bytes], views: list[memoryview]) -> list[LoadState]:
        return [self.load_one(key, out) for key, out in zip(keys, views, strict=True)]

    def load_one(self, key: bytes, out: memoryview) -> LoadState:
        with self._lock:
            entry = self.index.get(key)
            if entry is None:
                return LoadState.MISSING
            entry.readers += 1
        try:
            return self._load_one(entry, key, out)
        except BlockCorrupt:
            return LoadState.CORRUPT
        finally:
            with self._lock:
                entry.readers -= 1
                self._maybe_free(entry)

    def _load_one(self, entry: _Entry, key: bytes, out: memoryview) -> LoadState:
        start = entry.offset
        header = decode_header(self.view[start:start + PAYLOAD_OFFSET], expect_key=key,
                               expect_namespace=self._ns)
        if header.raw_len != out.nbytes:
            raise wrong_size(out, header)
        if header.stored_len != entry.length:
            raise BlockCorrupt("header and index disagree on the block's length")
        payload = start + PAYLOAD_OFFSET
        # Codec NONE: checked and copied in one pass (copy_verified): the extent cannot change
        # meanwhile (it stays allocated while this load holds it, and a store never writes
        # into an allocated extent), so the bytes copied are the bytes checked.
        decode_payload_into(header, self.view[payload:payload + header.payload_len], out)
        return LoadState.OK

    def store(self, keys: list[bytes], views: list[memoryview]) -> list[int]:
        placed = []
        try:
            for key, view in zip(keys, views, strict=True):
                placed.append(self.place(key, view))
        except BaseException:
            self.unplace(placed)
            raise
        return self.publish(keys, placed)

    def place(self, key: bytes, view: memoryview) -> _Entry | None:
        """Copies one block (header and payload) into a free extent, not yet durable nor
        named by any entry; None when the pool has no room. `publish` or `unplace` it."""
        payload = as_byte_view(encode_payload(self.codec, view, self.layouts))
        # On pmem libpmem copies and flushes; elsewhere the payload goes in first, hashed
        # on the way (copy_hashed), and the header with its checksum after it.
        header = (encode_header(key, self.namespace, self.codec, payload, view.nbytes)
                  if self.is_pmem else None)
        length = PAYLOAD_OFFSET + payload.nbytes
        extent = _round_up(length)
        with self._lock:
            if not self._free_slots:
                return None
            offset = self._allocate(extent)
            if offset is None:
                return None
            slot = self._free_slots.pop()
            self._seq += 1
            entry = _Entry(slot, offset, length, extent, self._seq)
        dst = self.addr + offset
        if self.is_pmem:  # copied and flushed: publish needs only one drain for the batch
            copy = self.lib.pmem_memcpy_nodrain
            copy(dst, header, PAYLOAD_OFFSET)
            if payload.nbytes:
                copy(dst + PAYLOAD_OFFSET, buffer_address(payload), payload.nbytes)
            return entry
        try:
            digest = copy_hashed(self.view[offset + PAYLOAD_OFFSET:offset + length], payload)
            self.view[offset:offset + PAYLOAD_OFFSET] = encode_header(
                key, self.namespace, self.codec, payload, view.nbytes, digest=digest)
        except BaseException:
            self.unplace([entry])
            raise
        return entry

    def unplace(self, placed: list[_Entry | None]) -> None:
        """Gives back what `place` took, for a batch that will not be published."""
        with self._lock:
            for entry in placed:
                if entry is not None:
                    self._put_clear(entry.slot)  # not durable yet: never let it resurface
                    self._free_slots.append(entry.slot)
                    self._release(entry.offset, entry.extent)

    def publish(self, keys: list[bytes], placed: list[_Entry | None]) -> list[int]:
        """Makes placed blocks durable and visible with three barriers in all, not two per
        block; returns the stored bytes per key (0: no room).

        1. every placed extent (header and payload) is persisted (one msync per run of nearby
           extents);
        2. only then are the index entries naming them written, and persisted together: an
           entry never reaches the media before the bytes it names, and a torn or half-written
           entry fails its own checksum, so a crash at any point shows each block either whole
           or not at all;
        3. only after the new entries are durable are the entries of the blocks they replace
           cleared (persisted together) and their extents freed, so after a crash recovery
           finds the old or the new block of a key (the higher sequence wins), never neither.
        """
        done = [(key, e) for key, e in zip(keys, placed, strict=True) if e is not None]
        try:
            if self.is_pmem:  # 1. the bytes (place flushed them already)
                self.lib.pmem_drain()
            else:
                self.persist_ranges([(e.offset, e.length) for _, e in done])
            for key, entry in done:
                self._put_entry(entry, key)
            self.persist_ranges([(self._entry_at(e.slot), ENTRY_SIZE)  # 2. then the entries
                                 for _, e in done])
        except BaseException:
            self.unplace(placed)
            raise
        retired = []
        with self._lock:
            for key, entry in done:
                old = self.index.get(key)
                if old is not None and old.seq > entry.seq:
                    old, entry = entry, old  # a newer store of this key finished first
                self.index[key] = entry
                if old is not None:
                    retired.append(old)
        self._retire(retired)  # 3. the blocks these replaced
        if keys and not done:
            raise OSError(errno.ENOSPC, f"pool {self.path} is full", self.path)
        return [0 if e is None else e.length for e in placed]

    def delete(self, keys: list[bytes]) -> None:
        with self._lock:
            gone = [e for e in (self.index.pop(key, None) for key in keys) if e is not None]
        self._retire(gone)

    def list_units(self) -> list[list[tuple[bytes, int]]]:
        with self._lock:
            return [[(key, e.length) for key, e in self.index.items()]]

    def list_unit(self, unit: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        return unit

    def capacity(self) -> int:
        return self.size - getattr(self, "data_offset", 0)

    def free_bytes(self) -> int:
        with self._lock:
            return self._free.free_bytes

    def close(self) -> None:
        if self.addr:
            self.view.release()
            self.lib.pmem_unmap(self.addr, self.size)
            self.addr = 0
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = -1
