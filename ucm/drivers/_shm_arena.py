"""The shared-memory arena behind `memory` with `shared: true`: one file on tmpfs that every
process on the host maps, and in which any of them stores, loads and deletes blocks.

A load is a copy out of the mapping (checked as it goes), with no system call: the same
path as the pmem pool's, but the arena has many writers.

Trust: the directory and files must be this user's (or the sharing group's) and writable by
nobody else (`_shm_trust`). A load from a truncated mapping dies with SIGBUS, which Python cannot
catch, and a per-load size check would cost a system call and still race: ownership is the
defence (only those who may write the file can cut it); open refuses a file shorter than its
header says.

Layout of `<shm_dir>/<namespace>.arena` (little-endian):

    0         4 KiB header: geometry (checksummed), then two words changed under the lock:
              the sequence counter and the allocation cursor
    table     buckets of WAYS 64-byte entries {magic, pages, seq, first page, length,
              key digest, crc}; a key lives in the bucket its digest names
    owners    one u32 per data page: 0 free, slot + 1 for a published block's pages,
              IN_FLIGHT | pid for pages a store is still writing
    data      4 KiB pages; a block (ucm.block header + payload) takes consecutive pages

Writers serialize on a lock that is a `flock` on `<arena>.lock` (plus a thread lock in the
process): the kernel drops it when a holder dies, so a killed process never leaves the arena
locked. A live holder can keep it (any member of a sharing group can), so no wait for it is
unbounded: a call waits until its deadline (`until`: the event's), else `lock_wait` seconds,
then fails with TimeoutError (a store then stores nothing; open fails naming the lock file).
Pages a failed store had taken are given back at this process's next turn with the lock.
Under the lock a store takes pages and, after copying outside it, publishes the entry; a
delete clears entries. Pages are taken round the arena like a ring: the cursor moves on
from the last allocation, and the blocks whose pages it reaches are evicted (oldest written
first, as a FIFO cache). A bucket with no free way evicts its oldest entry. So a store never
fails for want of room unless other stores hold the pages in flight.

Readers take no lock. A load finds the entry, checks the block's header (it names the key)
and copies the payload out while checking it against the header's checksum, then reads the
entry's sequence number again: a block whose entry changed meanwhile (deleted, replaced, or
evicted by another process) is a miss, never data, because an entry is always cleared before
its pages can be taken again. A torn entry fails its crc and reads as absent.

Crash safety: a block is visible only once its entry is written, after its bytes. A writer
killed mid-copy leaves pages marked in flight under its pid; allocation takes them back once
that pid is gone, and the first process to open an arena nobody else has open rebuilds the
owners from the valid entries. Processes that share an arena must share a pid namespace (a
publish checks that its pages are still its own, so a mistake costs a store, not data).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np

from ucm.block import (
    MADV_POPULATE_WRITE,
    PAYLOAD_OFFSET,
    Codec,
    KVLayouts,
    Scatter,
    as_buffer_view,
    buffer_address,
    copy_hashed,
    decode_header,
    decode_payload_into,
    encode_header,
    encode_payload,
    key_digest,
    madvise,
)
from ucm.drivers._mapped import populate
from ucm.drivers._shm_trust import PRIVATE, Sharing
from ucm.drivers._slots import (
    DIGEST_OFFSET,
    ENTRY_SIZE,
    Entry,
    SlotTable,
    names_block,
    parse_entry,
    seal,
    unseal,
)
from ucm.drivers.kit import Backend, LoadState, pid_alive, wrong_size
from ucm.errors import BlockCorrupt, ConfigError

log = logging.getLogger(__name__)

PAGE = 4096
WAYS = 8
_HEAD = struct.Struct("<8sIIQQQQQQ")  # magic, version, ways, pages, buckets, table, owners,
_HEAD_MAGIC, _VERSION = b"UCMSHMA1", 1  # data, file size
_SEQ_AT, _CURSOR_AT = 512, 520  # the mutable words (u64 each), outside the checksummed part
_ENTRY_MAGIC = 0x41534355  # "UCSA"; an entry's word: pages, its place: the first page
_U64 = struct.Struct("<Q")
IN_FLIGHT = 0x8000_0000  # owners value: IN_FLIGHT | pid of the writer
DEFAULT_LOCK_WAIT = 10.0  # seconds a call with no deadline waits for the arena's lock
T = TypeVar("T")
def _pages(length: int) -> int:
    return -(-length // PAGE)


def geometry(size: int) -> tuple[int, int, int, int, int]:
    """(data pages, buckets, table offset, owners offset, data offset) for a file of `size`
    bytes: two entries per 64 KiB of the file, rounded to whole buckets."""
    buckets = max(16, size // (64 * 1024) * 2 // WAYS)
    table = PAGE
    owners = table + buckets * WAYS * ENTRY_SIZE
    # owners take 4 bytes per data page; solve for the pages that fit after them
    pages = (size - owners) // (PAGE + 4)
    data = -(-(owners + pages * 4) // PAGE) * PAGE
    pages = (size - data) // PAGE
    return pages, buckets, table, owners, data


class ShmArena(Backend):
    """One arena file mapped into this process. Thread-safe; see the module docstring."""

    def __init__(self, path: str, *, namespace: str, codec: Codec,
                 layouts: KVLayouts | None = None,
                 lock_wait: float = DEFAULT_LOCK_WAIT) -> None:
        if not lock_wait > 0:
            raise ConfigError(f"lock_wait: must be > 0 seconds, not {lock_wait!r}")
        self.path = path
        self.namespace = namespace
        self._ns = namespace.encode()  # what a loaded header must name
        self.codec = codec
        self.layouts = layouts
        self.lock_wait = float(lock_wait)
        self._pid = os.getpid()
        self._thread_lock = threading.Lock()
        self._calls = threading.local()  # the deadline of the call this thread runs
        # Page runs (first, pages) of stores that failed without the lock to give them back.
        self._orphans: list[tuple[int, int]] = []
        self.lock_timeouts = 0  # waits for the lock that reached their deadline
        self._fd = self._lock_fd = -1
        self._mm: mmap.mmap | None = None
        self.recovered_dropped = 0  # torn or stale entries cleared at open
        self.evicted = 0  # blocks this process evicted to make room

    # -- opening ------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str, *, size: int, namespace: str, codec: Codec,
             layouts: KVLayouts | None = None, populate: bool = True,
             sharing: Sharing = PRIVATE, lock_wait: float = DEFAULT_LOCK_WAIT,
             deadline: float | None = None) -> ShmArena:
        """Opens (creating if absent) the arena at `path`. Its locks are waited for until
        `deadline` (time.monotonic()), else for `lock_wait` seconds: TimeoutError past it."""
        arena = cls(path, namespace=namespace, codec=codec, layouts=layouts, lock_wait=lock_wait)
        try:
            arena.until(deadline, arena._open)(size, populate, sharing)
        except BaseException:
            arena.close()
            raise
        return arena

    def until(self, deadline: float | None, fn: Callable[..., T]) -> Callable[..., T]:
        """`fn`, whose waits for the arena's locks end at `deadline` (time.monotonic(); None:
        `lock_wait` seconds after each wait starts)."""
        calls = self._calls

        def call(*args: Any) -> T:
            outer = getattr(calls, "deadline", None)
            calls.deadline = deadline
            try:
                return fn(*args)
            finally:
                calls.deadline = outer

        return call

    def _deadline(self) -> float:
        deadline = getattr(self._calls, "deadline", None)
        return time.monotonic() + self.lock_wait if deadline is None else deadline

    def _open(self, size: int, populate: bool, sharing: Sharing) -> None:
        folder, name = os.path.split(os.path.abspath(self.path))
        dir_fd = sharing.open_dir(folder)
        try:
            self._lock_fd = sharing.open_file(dir_fd, folder, name + ".lock")
            self._fd = sharing.open_file(dir_fd, folder, name)
        finally:
            os.close(dir_fd)
        with self._locked():
            if os.fstat(self._fd).st_size == 0:
                os.ftruncate(self._fd, size)  # sparse: only pages written take memory
                # The header, table and owners are allocated now: ENOSPC here, not SIGBUS later.
                os.posix_fallocate(self._fd, 0, geometry(size)[4])
                self._map()
                self._format()
            else:
                self._map()
                self._check_header()
                if self.size != size:
                    log.warning("%s exists with %d bytes, not the %d configured: using it as "
                                "it is (remove the file to resize it)", self.path, self.size, size)
            # Every process holds a shared flock on the arena file while it has it open; the
            # one that finds no other holder rebuilds the owners (a crashed writer's pages).
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            else:
                self._recover()
            # An exclusive holder of the arena file (a recovering opener) is waited for too.
            _flock_until(self._fd, fcntl.LOCK_SH, self._deadline(), self.path, self._timed_out)
        if populate:
            self._populate()

    def _map(self) -> None:
        size = os.fstat(self._fd).st_size
        if size < 2 * PAGE + (64 << 10):
            raise ConfigError(f"{self.path}: {size} bytes is too small for an arena")
        self._mm = mmap.mmap(self._fd, size, mmap.MAP_SHARED)
        self.size = size
        self.view = memoryview(self._mm)
        self.addr = buffer_address(self.view)

    def _format(self) -> None:
        pages, buckets, table, owners, data = geometry(self.size)
        if pages < 1:
            raise ConfigError(f"size: {self.size} bytes leaves no room for blocks")
        head = _HEAD.pack(_HEAD_MAGIC, _VERSION, WAYS, pages, buckets, table, owners, data,
                          self.size)
        self.view[:_HEAD.size + 4] = seal(head)
        self._set_geometry(pages, buckets, table, owners, data)

    def _check_header(self) -> None:
        head = unseal(self.view, _HEAD.size)
        magic, version, ways, pages, buckets, table, owners, data, size = _HEAD.unpack(
            head or bytes(_HEAD.size))
        if head is None or magic != _HEAD_MAGIC:
            raise ConfigError(f"{self.path} is not a ucm shared-memory arena")
        if version != _VERSION or ways != WAYS:
            raise ConfigError(f"{self.path} has arena format {version} ({ways} ways); this "
                              f"driver reads format {_VERSION}: remove the file")
        if size != self.size:  # shorter: its last pages would raise SIGBUS when touched
            raise ConfigError(f"{self.path} is {self.size} bytes, but its header says {size}: "
                              "truncated or extended by another process; remove the file")
        if (pages, buckets, table, owners, data) != geometry(size):
            raise ConfigError(f"{self.path}: the header's layout does not match its size: "
                              "not an arena this driver wrote; remove the file")
        self._set_geometry(pages, buckets, table, owners, data)

    def _set_geometry(self, pages: int, buckets: int, table: int, owners: int,
                      data: int) -> None:
        self.pages, self.buckets = pages, buckets
        self.table_offset, self.data_offset = table, data
        assert self._mm is not None, "_map first"
        self.owners = np.frombuffer(self._mm, dtype=np.uint32, count=pages, offset=owners)
        self._table = SlotTable(self.view, table, _ENTRY_MAGIC)

    def _recover(self) -> None:
        """Alone with the arena (and under the lock): clears torn or stale entries and
        rebuilds the owners from the valid ones, which frees a dead writer's pages."""
        owners = self.owners
        owners[:] = 0
        for slot in np.flatnonzero(self._table_words().any(axis=1)).tolist():
            entry = self._table.read(slot)
            if entry is None or not self._block_matches(entry):
                self._table.clear(slot)
                self.recovered_dropped += 1
                continue
            _, npages, _, first, _ = entry
            if owners[first:first + npages].any():  # overlaps a block already kept
                self._table.clear(slot)
                self.recovered_dropped += 1
                continue
            owners[first:first + npages] = slot + 1

    def _block_matches(self, entry: Entry) -> bool:
        digest, npages, _, first, length = entry
        if first + npages > self.pages or _pages(length) != npages or length < PAYLOAD_OFFSET:
            return False
        start = self.data_offset + first * PAGE
        return names_block(self.view, start, digest, length) is not None

    def _populate(self) -> None:
        """Maps the stored blocks' pages into this process (`_mapped.populate`), so the first
        loads copy at memory speed instead of faulting every few pages."""
        used = np.flatnonzero(np.diff(np.concatenate(
            ([0], (self.owners != 0).view(np.int8), [0]))))
        for start, end in zip(used[::2], used[1::2], strict=True):
            first = self.data_offset + int(start) * PAGE
            populate(self.view[first:first + int(end - start) * PAGE])

    # -- entries ----------------------------------------------------------------------------

    def _table_words(self) -> np.ndarray:
        """The table as one row of 16 u32 words per entry (word 0: the magic)."""
        assert self._mm is not None, "the arena is closed"
        return np.frombuffer(self._mm, dtype=np.uint32,
                             count=self.buckets * WAYS * ENTRY_SIZE // 4,
                             offset=self.table_offset).reshape(-1, ENTRY_SIZE // 4)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The writers' lock, waited for until the call's deadline (TimeoutError past it)."""
        with _ArenaLock(self._thread_lock, self._lock_fd, self._deadline(), self.path + ".lock",
                        self._timed_out):
            while self._orphans:  # a failed store's pages, given back now that we may
                self._release(*self._orphans.pop())
            yield

    def _drain(self) -> None:
        with self._locked():  # gives the orphaned pages back
            pass

    def _timed_out(self) -> None:
        self.lock_timeouts += 1

    def _give_back(self, runs: list[tuple[int, int]]) -> None:
        """Frees a failed store's pages: now if the lock comes before the call's deadline,
        else at this process's next turn with the lock."""
        if not runs:
            return
        try:
            with self._locked():
                for first, npages in runs:
                    self._release(first, npages)
        except TimeoutError:
            self._orphans.extend(runs)

    def _find(self, digest: bytes) -> tuple[int, Entry] | None:
        """The slot and entry holding `digest`; lock-free, so a racing writer can hide it."""
        bucket = int.from_bytes(digest[:8], "little") % self.buckets
        at = self._table.at(bucket * WAYS)
        raw = bytes(self.view[at:at + WAYS * ENTRY_SIZE])
        for way in range(WAYS):
            offset = way * ENTRY_SIZE
            if raw[offset + DIGEST_OFFSET:offset + DIGEST_OFFSET + 16] != digest:  # cheap
                continue
            entry = parse_entry(raw[offset:offset + ENTRY_SIZE], _ENTRY_MAGIC)
            if entry is not None and entry.digest == digest:
                return bucket * WAYS + way, entry
        return None

    # -- allocation (with the lock held) ----------------------------------------------------

    def _next_seq(self) -> int:
        seq: int = _U64.unpack_from(self.view, _SEQ_AT)[0] + 1
        _U64.pack_into(self.view, _SEQ_AT, seq)
        return seq

    def _drop(self, slot: int) -> None:
        """Evicts or deletes the block in `slot`: the entry is cleared before its pages are
        free, so a reader that still sees the entry knows the pages are the block's."""
        entry = self._table.read(slot)
        self._table.clear(slot)
        if entry is not None:
            _, npages, _, first, _ = entry
            run = self.owners[first:first + npages]
            run[run == slot + 1] = 0

    def _take(self, npages: int) -> int | None:
        """Pages for a block, taken at the cursor (evicting what is there); None when stores
        in flight hold every place it could go."""
        if npages > self.pages:
            return None
        owners, mine = self.owners, IN_FLIGHT | self._pid
        cursor: int = _U64.unpack_from(self.view, _CURSOR_AT)[0]
        moved = 0
        while moved <= self.pages + npages:
            if cursor + npages > self.pages:
                moved += self.pages - cursor
                cursor = 0
            run = owners[cursor:cursor + npages]
            busy = [int(v) for v in np.unique(run[run >= IN_FLIGHT])
                    if v == mine or pid_alive(int(v) & ~IN_FLIGHT)]
            if busy:  # a store still writing there: go past its last page
                skip = int(np.flatnonzero(np.isin(run, busy))[-1]) + 1
                cursor += skip
                moved += skip
                continue
            for value in np.unique(run[(run != 0) & (run < IN_FLIGHT)]):
                self._drop(int(value) - 1)
                self.evicted += 1
            run[:] = mine
            _U64.pack_into(self.view, _CURSOR_AT, cursor + npages)
            return cursor
        return None

    def _publish(self, digest: bytes, first: int, npages: int, length: int) -> bool:
        """Writes the entry for a block whose bytes are in place; False if its pages are no
        longer this process's (taken back as a dead writer's: see the module docstring)."""
        run = self.owners[first:first + npages]
        if not (run == (IN_FLIGHT | self._pid)).all():
            return False
        bucket = int.from_bytes(digest[:8], "little") % self.buckets
        ways = [(slot, self._table.read(slot))
                for slot in range(bucket * WAYS, (bucket + 1) * WAYS)]
        slot = next((s for s, e in ways if e is not None and e[0] == digest), -1)
        if slot >= 0:  # a replace: the old block goes
            self._drop(slot)
        else:
            slot = next((s for s, e in ways if e is None), -1)
            if slot < 0:  # a full bucket: its oldest block goes
                slot = min(ways, key=lambda way: way[1][2])[0]  # type: ignore[index]
                self._drop(slot)
                self.evicted += 1
        seq = self._next_seq()
        run[:] = slot + 1
        self._table.write(slot, npages, seq, first, length, digest)
        return True

    def _release(self, first: int, npages: int) -> None:
        run = self.owners[first:first + npages]
        run[run == (IN_FLIGHT | self._pid)] = 0

    # -- the Backend ------------------------------------------------------------------------

    def lookup(self, keys: list[bytes]) -> list[bool]:
        return [self._find(key_digest(key)) is not None for key in keys]

    def load(self, keys: list[bytes], views: list[memoryview]) -> list[LoadState]:
        return [self.load_one(key, out) for key, out in zip(keys, views, strict=True)]

    def in_memory(self, keys: list[bytes]) -> bool:
        return True  # the arena is memory (a missing block is a quick MISSING)

    def load_one(self, key: bytes, out: memoryview) -> LoadState:
        found = self._find(key_digest(key))
        if found is None:
            return LoadState.MISSING
        slot, (_, _, seq, first, length) = found
        start = self.data_offset + first * PAGE
        try:
            header = decode_header(self.view[start:start + PAYLOAD_OFFSET], expect_key=key,
                                   expect_namespace=self._ns)
            if header.stored_len != length:
                raise BlockCorrupt("header and entry disagree on the block's length")
            if header.raw_len != out.nbytes:
                if self._table.seq(slot) != seq:
                    return LoadState.MISSING
                raise wrong_size(out, header)  # shared with other processes: storage's word
            # codec NONE: checked and copied in one pass (copy_verified)
            decode_payload_into(header, self.view[start + PAYLOAD_OFFSET:start + length], out)
            state = LoadState.OK
        except BlockCorrupt:
            state = LoadState.CORRUPT
        # Unchanged entry: its pages were never free during the copy, so they held the block.
        return state if self._table.seq(slot) == seq else LoadState.MISSING

    def store(self, keys: list[bytes], views: Sequence[memoryview | Scatter]) -> list[int]:
        placed: list[tuple[bytes, int, int, int] | None] = []
        try:
            for key, view in zip(keys, views, strict=True):
                placed.append(self._place(key, view))
        except BaseException:
            self._give_back([(item[1], item[2]) for item in placed if item is not None])
            raise
        try:
            with self._locked():  # nothing in it raises TimeoutError: only waiting for it does
                sizes = self._publish_all(placed)
        except TimeoutError:  # nothing published: every block of the batch failed
            self._orphans.extend((item[1], item[2]) for item in placed if item is not None)
            raise
        if keys and not any(sizes):
            largest = max(view.nbytes for view in views)
            raise OSError(errno.ENOSPC, f"no room for a block of {largest} bytes in the "
                          f"{self.pages * PAGE}-byte arena beside the stores in flight",
                          self.path)
        return sizes

    def _publish_all(self, placed: list[tuple[bytes, int, int, int] | None]) -> list[int]:
        """Publishes the placed blocks (with the lock held); the bytes stored of each."""
        sizes = []
        for item in placed:
            if item is None:
                sizes.append(0)
                continue
            digest, first, npages, length = item
            ok = self._publish(digest, first, npages, length)
            if not ok:
                self._release(first, npages)
            sizes.append(npages * PAGE if ok else 0)
        return sizes

    def _place(self, key: bytes, view: memoryview | Scatter,
               ) -> tuple[bytes, int, int, int] | None:
        """Copies one block into pages of its own, not yet visible; None if none are free."""
        # NONE: a Scatter as it is
        payload = as_buffer_view(encode_payload(self.codec, view, self.layouts))
        length = PAYLOAD_OFFSET + payload.nbytes
        npages = _pages(length)
        with self._locked():
            first = self._take(npages)
        if first is None:
            return None
        start = self.data_offset + first * PAGE
        try:
            # Allocates the pages before anything touches them: a write fault on a tmpfs that
            # is full would kill the process (SIGBUS), where this returns an error. One call
            # for the block is also faster than a fault per page. (Before Linux 5.14: EINVAL,
            # and the faults stay lazy.)
            err = madvise(self.addr + start, npages * PAGE, MADV_POPULATE_WRITE)
            if err not in (0, errno.EINVAL):
                raise OSError(errno.ENOSPC, f"cannot allocate {npages * PAGE} bytes of the "
                              f"arena ({os.strerror(err)}): is its tmpfs full?", self.path)
            digest = copy_hashed(self.view[start + PAYLOAD_OFFSET:start + length], payload)
            self.view[start:start + PAYLOAD_OFFSET] = encode_header(
                key, self.namespace, self.codec, payload, view.nbytes, digest=digest)
        except BaseException:
            self._give_back([(first, npages)])
            raise
        return key_digest(key), first, npages, length

    def delete(self, keys: list[bytes]) -> None:
        with self._locked():
            for key in keys:
                found = self._find(key_digest(key))
                if found is not None:
                    self._drop(found[0])

    def list_units(self) -> list[list[tuple[bytes, int]]]:
        blocks = []
        for slot in np.flatnonzero(self._table_words()[:, 0] == _ENTRY_MAGIC).tolist():
            entry = self._table.read(slot)
            if entry is None:
                continue
            start = self.data_offset + entry.place * PAGE
            key = names_block(self.view, start, entry.digest)  # None: replaced while listing
            if key is not None and self._table.seq(slot) == entry.seq:
                blocks.append((key, entry.word * PAGE))
        return [blocks]

    def list_unit(self, unit: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        return unit

    def block_region(self, key: bytes) -> tuple[int, int] | None:
        """(offset in the arena file, length) of `key`'s block: for tests and tools."""
        found = self._find(key_digest(key))
        if found is None:
            return None
        _, (_, _, _, first, length) = found
        return self.data_offset + first * PAGE, length

    def statistics(self) -> dict[str, Any]:
        return {"arena_bytes": self.pages * PAGE, "evicted": self.evicted,
                "recovered_dropped": self.recovered_dropped,
                "lock_timeouts": self.lock_timeouts}

    def close(self) -> None:
        if self._orphans and self._mm is not None:
            try:  # one try, no wait: else they are taken back once this process is gone
                self.until(time.monotonic(), self._drain)()
            except TimeoutError:
                pass
        if self._mm is not None:
            self.owners = None  # type: ignore[assignment]  # numpy's export of the mapping
            self.view.release()
            try:
                self._mm.close()
            except BufferError:
                pass  # a view of it is still alive somewhere: unmapped when that goes
            self._mm = None
        for fd in (self._fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)  # drops this process's flocks
        self._fd = self._lock_fd = -1


def _flock_until(fd: int, op: int, deadline: float, path: str,
                 timed_out: Callable[[], None]) -> None:
    """flock(fd, op), retried until `deadline` (time.monotonic()); TimeoutError past it.
    Holders keep the lock for microseconds, so the first retries come soon."""
    delay = 0.00005
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out()
                raise TimeoutError(
                    errno.ETIMEDOUT, "another process held the shared-memory arena's lock "
                    "past this call's deadline (a process sharing the arena is stuck, or "
                    "hostile)", path) from None
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.01)


class _ArenaLock:
    """The writers' lock: this process's threads, then the other processes (flock), each
    waited for until `deadline` at most."""

    __slots__ = ("_deadline", "_fd", "_path", "_thread_lock", "_timed_out")

    def __init__(self, thread_lock: threading.Lock, fd: int, deadline: float, path: str,
                 timed_out: Callable[[], None]) -> None:
        self._thread_lock, self._fd, self._deadline = thread_lock, fd, deadline
        self._path, self._timed_out = path, timed_out

    def __enter__(self) -> None:
        if not self._thread_lock.acquire(timeout=max(0.0, self._deadline - time.monotonic())):
            self._timed_out()
            raise TimeoutError(errno.ETIMEDOUT, "this process's other threads held the "
                               "shared-memory arena's lock past this call's deadline",
                               self._path)
        try:
            _flock_until(self._fd, fcntl.LOCK_EX, self._deadline, self._path, self._timed_out)
        except BaseException:
            self._thread_lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()
