"""A first-fit free list of byte extents, coalesced on release: the allocator behind the
drivers that carve blocks out of one region (Mooncake's registered staging pool, the pmem
pool). Not thread-safe: its owner holds its own lock."""

from __future__ import annotations

from bisect import bisect_left, insort


class Extents:
    def __init__(self, free: list[tuple[int, int]] | None = None) -> None:
        self._free: list[tuple[int, int]] = sorted(free or [])  # (offset, length)

    @classmethod
    def gaps(cls, used: list[tuple[int, int]], start: int, end: int) -> Extents:
        """The free list of [start, end) around the (offset, length) extents in use."""
        free, at = [], start
        for offset, length in sorted(used):
            if offset > at:
                free.append((at, offset - at))
            at = max(at, offset + length)
        if at < end:
            free.append((at, end - at))
        return cls(free)

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)

    def allocate(self, length: int) -> int | None:
        """The offset of `length` free bytes (first fit), or None if no extent is that big."""
        for i, (offset, size) in enumerate(self._free):
            if size >= length:
                if size == length:
                    del self._free[i]
                else:
                    self._free[i] = (offset + length, size - length)
                return offset
        return None

    def release(self, offset: int, length: int) -> None:
        """Returns an extent, merging it with free neighbours."""
        free = self._free
        i = bisect_left(free, (offset, 0))
        if i < len(free) and offset + length == free[i][0]:
            length += free.pop(i)[1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:
            offset, length = free[i - 1][0], free[i - 1][1] + length
            del free[i - 1]
        insort(free, (offset, length))
