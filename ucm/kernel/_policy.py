"""Eviction policies: byte-weighted LRU and S3-FIFO, with pins.

A policy tracks the blocks one tier holds (key -> bytes) and, asked for room, names victims.
Pinned keys are never named. Each policy overrides a few methods of one base class, as in
cachetools; time is injected (`clock`) so tests control pin expiry.

S3-FIFO (Yang et al., SOSP'23): new blocks enter a small FIFO (10% of capacity); a block hit
while there moves to the main FIFO on eviction, otherwise it leaves and its key is remembered
in a ghost FIFO. A ghost that comes back goes straight to main. Main is a FIFO with
reinsertion (CLOCK-like, frequency capped at 3). It keeps one-hit scans from flushing the
working set, which is the usual KV-cache pattern (long documents read once).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping


class Policy:
    """Base: size accounting and pins. Subclasses order the victims."""

    def __init__(self, capacity: int | None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.used = 0
        self._clock = clock
        self._sizes: dict[bytes, int] = {}
        self._pins: dict[bytes, list[float]] = {}  # key -> expiry times, one per pin

    # -- queries -----------------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def size_of(self, key: bytes) -> int | None:
        return self._sizes.get(key)

    @property
    def index(self) -> Mapping[bytes, int]:
        """key -> bytes, read-only by convention (a plain dict, for fast membership probes)."""
        return self._sizes

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._sizes)

    # -- pins --------------------------------------------------------------------------------
    def pin(self, key: bytes, ttl: float) -> None:
        self._pins.setdefault(key, []).append(self._clock() + ttl)

    def unpin(self, key: bytes) -> None:
        expiries = self._pins.get(key)
        if expiries:
            expiries.pop(0)
            if not expiries:
                del self._pins[key]

    def has_pins(self, key: bytes) -> bool:
        """Whether `key` holds pins, live or expired (a read only: safe from other threads)."""
        return key in self._pins

    def is_pinned(self, key: bytes) -> bool:
        expiries = self._pins.get(key)
        if not expiries:
            return False
        now = self._clock()
        live = [t for t in expiries if t > now]
        if live:
            self._pins[key] = live
            return True
        del self._pins[key]
        return False

    @property
    def pinned_count(self) -> int:
        return sum(1 for k in list(self._pins) if self.is_pinned(k))

    # -- updates -----------------------------------------------------------------------------
    def insert(self, key: bytes, size: int, depth: int | None = None) -> None:
        """Records a block (a new one, or a new size for a stored one). `depth`, where the
        caller knows it, is the block's index in its batch (a request's blocks in order)."""
        old = self._sizes.get(key)
        if old is not None:
            self.used += size - old
            self._sizes[key] = size
            self._on_resize(key, old, size)
            self._on_hit(key, depth)
            return
        self._sizes[key] = size
        self.used += size
        self._on_insert(key, depth)

    def touch(self, key: bytes, depth: int | None = None) -> None:
        if key in self._sizes:
            self._on_hit(key, depth)

    def remove(self, key: bytes) -> int:
        size = self._sizes.pop(key, None)
        if size is None:
            return 0
        self.used -= size
        self._on_remove(key, size)
        return size

    def pinned_bytes(self) -> int:
        return sum(self._sizes.get(k, 0) for k in list(self._pins) if self.is_pinned(k))

    def make_room(self, needed: int) -> list[bytes] | None:
        """Victims whose removal leaves `needed` free bytes, or None if pins (or the capacity
        itself) forbid it; then nothing changes. Victims leave the policy at once; the caller
        deletes them from storage."""
        if self.capacity is None or self.capacity - self.used >= needed:
            return []
        if needed > self.capacity - self.pinned_bytes():
            return None
        victims: list[bytes] = []
        while self.capacity - self.used < needed:
            victim = self._next_victim()
            if victim is None:  # unreachable while the pinned-bytes check holds
                break
            victims.append(victim)
            self.used -= self._sizes.pop(victim)
        return victims

    # -- subclass hooks ------------------------------------------------------------------------
    def _on_insert(self, key: bytes, depth: int | None) -> None:
        raise NotImplementedError

    def _on_hit(self, key: bytes, depth: int | None) -> None:
        raise NotImplementedError

    def _on_remove(self, key: bytes, size: int) -> None:
        raise NotImplementedError

    def _on_resize(self, key: bytes, old: int, new: int) -> None:
        pass

    def _next_victim(self) -> bytes | None:
        """Takes the next unpinned victim out of the order, or None if every block is pinned."""
        raise NotImplementedError


class LRUPolicy(Policy):
    def __init__(self, capacity: int | None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(capacity, clock=clock)
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def _on_insert(self, key: bytes, depth: int | None) -> None:
        self._order[key] = None

    def _on_hit(self, key: bytes, depth: int | None) -> None:
        self._order.move_to_end(key)

    def _on_remove(self, key: bytes, size: int) -> None:
        self._order.pop(key, None)

    def _next_victim(self) -> bytes | None:
        for _ in range(len(self._order)):
            key, _ = self._order.popitem(last=False)
            if not self.is_pinned(key):
                return key
            self._order[key] = None  # pinned: skip it, keep it
        return None


class S3FIFOPolicy(Policy):
    SMALL_FRACTION = 0.1
    MAX_FREQ = 3

    def __init__(self, capacity: int | None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(capacity, clock=clock)
        self._small: OrderedDict[bytes, None] = OrderedDict()
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}
        self._small_bytes = 0

    def _on_insert(self, key: bytes, depth: int | None) -> None:
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
            self._small_bytes += self._sizes[key]

    def _on_hit(self, key: bytes, depth: int | None) -> None:
        self._freq[key] = min(self._freq.get(key, 0) + 1, self.MAX_FREQ)

    def _on_remove(self, key: bytes, size: int) -> None:
        self._freq.pop(key, None)
        if key in self._small:
            del self._small[key]
            self._small_bytes -= size
        else:
            self._main.pop(key, None)

    def _on_resize(self, key: bytes, old: int, new: int) -> None:
        if key in self._small:
            self._small_bytes += new - old

    def _next_victim(self) -> bytes | None:
        small_target = self._small_target()
        # Each block can be passed over a bounded number of times (frequency <= MAX_FREQ and
        # pins), so the loop ends; every pass over a pinned block is counted.
        budget = (len(self._small) + len(self._main)) * (self.MAX_FREQ + 2) + 1
        while budget > 0 and (self._small or self._main):
            budget -= 1
            if self._small and (self._small_bytes > small_target or not self._main):
                key, _ = self._small.popitem(last=False)
                self._small_bytes -= self._sizes[key]
                if self.is_pinned(key):
                    self._main[key] = None  # keep it; it will be offered again later
                    continue
                if self._freq.get(key, 0) > 0:
                    self._freq[key] = 0
                    self._main[key] = None
                    continue
                self._freq.pop(key, None)
                self._remember_ghost(key)
                return key
            key, _ = self._main.popitem(last=False)
            if self.is_pinned(key):
                self._main[key] = None
                continue
            freq = self._freq.get(key, 0)
            if freq > 0:
                self._freq[key] = freq - 1
                self._main[key] = None
                continue
            self._freq.pop(key, None)
            return key
        return None

    def _small_target(self) -> float:
        return (self.capacity or 0) * self.SMALL_FRACTION

    def _remember_ghost(self, key: bytes) -> None:
        self._ghost[key] = None
        # The ghost queue remembers about as many keys as main holds.
        limit = max(len(self._main) + len(self._small), 16)
        while len(self._ghost) > limit:
            self._ghost.popitem(last=False)


class AdaptiveS3FIFOPolicy(S3FIFOPolicy):
    """S3-FIFO whose small-queue share adapts, as ARC's split does: a block that returns
    after leaving the small queue unhit (a small-queue ghost) says the small queue was too
    short for the reuse distances seen, so it grows; one that returns after leaving main
    (a main ghost) says main was, so the small queue shrinks. Prefix caches of chats reuse
    blocks at long distances, so both ghost lists remember several capacities' worth of
    keys. Every step is O(1)."""

    GHOST_FACTOR = 4
    MIN_FRACTION = 0.05
    MAX_FRACTION = 0.9

    def __init__(self, capacity: int | None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(capacity, clock=clock)
        self._fraction = self.SMALL_FRACTION
        self._main_ghost: OrderedDict[bytes, None] = OrderedDict()

    def _on_insert(self, key: bytes, depth: int | None) -> None:
        blocks = len(self._sizes)  # ARC's steps: the rarer ghost hit moves the split more
        small, main = len(self._ghost) or 1, len(self._main_ghost) or 1
        if key in self._ghost:
            step = max(1.0, main / small) / blocks
            self._fraction = min(self.MAX_FRACTION, self._fraction + step)
        elif key in self._main_ghost:
            del self._main_ghost[key]
            step = max(1.0, small / main) / blocks
            self._fraction = max(self.MIN_FRACTION, self._fraction - step)
            self._ghost[key] = None  # a block that earned main once goes back there
        super()._on_insert(key, depth)

    def _small_target(self) -> float:
        return (self.capacity or 0) * self._fraction

    def _next_victim(self) -> bytes | None:
        victim = super()._next_victim()
        if victim is not None and victim not in self._ghost:  # it left main
            self._remember(self._main_ghost, victim)
        return victim

    def _remember_ghost(self, key: bytes) -> None:
        self._remember(self._ghost, key)

    def _remember(self, ghost: OrderedDict[bytes, None], key: bytes) -> None:
        ghost[key] = None
        limit = max(self.GHOST_FACTOR * len(self._sizes), 16)
        while len(ghost) > limit:
            ghost.popitem(last=False)


def make_policy(name: str, capacity: int | None, *,
                clock: Callable[[], float] = time.monotonic) -> Policy:
    if name == "lru":
        return LRUPolicy(capacity, clock=clock)
    if name == "s3fifo":
        return S3FIFOPolicy(capacity, clock=clock)
    if name == "adaptive":
        return AdaptiveS3FIFOPolicy(capacity, clock=clock)
    raise ValueError(f"unknown eviction policy {name!r}; choose {', '.join(POLICIES)}")


POLICIES = ("lru", "s3fifo", "adaptive")
