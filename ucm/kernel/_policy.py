"""Eviction policies, byte-weighted, with pins: `shadow` (two LRU segments, the fresh one's
weight picked online; the config's default), `lru`, `s3fifo` and `adaptive` (S3-FIFO whose
small queue's share adapts), made by name with `make_policy`.

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

import math
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator, Mapping


class Policy:
    """Base: size accounting and pins. Subclasses order the victims."""

    def __init__(self, capacity: int | None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.used = 0
        self._clock = clock
        self._sizes: dict[bytes, int] = {}
        self._pins: dict[bytes, list[float]] = {}  # key -> expiry times, one per pin
        self.held: Container[bytes] = frozenset()  # keys sessions hold (`_holds.Holds`)

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
        if key in self.held:
            return True
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
        if needed > self.capacity - (self.pinned_bytes() if self._pins else 0):
            return None
        victims: list[bytes] = []
        while self.capacity - self.used < needed:
            victim = self._next_victim()
            if victim is None:  # unreachable while the pinned-bytes check holds
                break
            victims.append(victim)
            self.used -= self._sizes.pop(victim)
        return victims

    def resize(self, capacity: int) -> list[bytes]:
        """A new capacity; returns the victims evicted to fit it (pins permitting)."""
        self.capacity = capacity
        return self.make_room(0) or []

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


class _Group:
    """The state of the weight caches that are in the same state (`_WeightCaches`): the
    segments (key -> (stamp, bytes)), the ghost keys and the bytes held, and the indexes of
    its weights, by weight."""

    __slots__ = ("fresh", "ghost", "main", "members", "used")

    def __init__(self, fresh: OrderedDict[bytes, tuple[int, int]],
                 main: OrderedDict[bytes, tuple[int, int]], ghost: OrderedDict[bytes, None],
                 used: int, members: list[int]) -> None:
        self.fresh = fresh
        self.main = main
        self.ghost = ghost
        self.used = used
        self.members = members

    def same_state(self, other: _Group) -> bool:
        return (self.used == other.used and len(self.fresh) == len(other.fresh)
                and len(self.main) == len(other.main) and len(self.ghost) == len(other.ghost)
                and self.main == other.main and self.fresh == other.fresh
                and self.ghost == other.ghost)  # OrderedDict equality compares the orders


class _WeightCaches:
    """`shadow`'s miniatures, one per candidate weight, all of one capacity and fed the same
    sampled references; each counts its own hits (byte-weighted, no pins). A miniature is a
    two-segment LRU with a fixed weight: a miss enters `fresh` (or `main`, if its key is in
    the ghost list of keys evicted), a hit moves to `main`; the victim is the oldest of the
    segment whose oldest block has the larger age, a fresh block's age counting the weight
    times; victims join the ghost list (`ghost_limit` keys).

    Miniatures in the same state are run once: they start as one group, a group splits
    where its weights disagree on a victim (the heavier ones take the fresh segment's
    oldest, the lighter ones main's: a threshold in the weight), and `merge` joins groups
    whose states have become equal again (small caches converge within a few capacities of
    references). Hit for hit and victim for victim the same as one cache per weight
    (tests/kernel/test_shadow_weight_caches.py runs that reference beside it). It saves
    most while the caches are young or restarted from one state (`_mrc._MiniatureShadow`):
    once they fill, different weights hold different blocks and the groups stay apart."""

    __slots__ = ("capacity", "clock", "ghost_limit", "groups", "hits", "total_hits",
                 "weights")

    def __init__(self, capacity: float, weights: tuple[float, ...], ghost_limit: int) -> None:
        self.capacity = capacity
        self.weights = weights
        self.ghost_limit = ghost_limit
        self.clock = 0
        self.hits = [0.0] * len(weights)
        self.total_hits = [0] * len(weights)  # never decayed
        self.groups = [_Group(OrderedDict(), OrderedDict(), OrderedDict(), 0,
                              sorted(range(len(weights)), key=weights.__getitem__))]

    def access(self, key: bytes, size: int) -> None:
        """One reference to every weight's miniature."""
        self.clock = clock = self.clock + 1
        groups = self.groups
        for group in tuple(groups):  # not those split off: see `_admit`
            fresh, main = group.fresh, group.main
            entry = fresh.pop(key, None) or main.pop(key, None)
            if entry is not None:
                hits, total = self.hits, self.total_hits
                for m in group.members:
                    hits[m] += 1
                    total[m] += 1
                main[key] = (clock, entry[1])
            else:
                self._admit(group, key, size, clock, group.used + size)

    def _admit(self, group: _Group, key: bytes, size: int, clock: int, used: int) -> None:
        """A miss's evictions and insertion in `group`, which holds `used` bytes with the
        key's. A group that splits off finishes here, so `access` goes over the groups it
        started with."""
        capacity = self.capacity
        fresh, main, ghost = group.fresh, group.main, group.ghost
        while used > capacity and (fresh or main):
            if not main:
                queue = fresh
            elif not fresh:
                queue = main
            else:
                age_fresh = clock - next(iter(fresh.values()))[0]
                age_main = clock - next(iter(main.values()))[0]
                members, weights = group.members, self.weights  # by weight, fresh-first last
                if age_fresh * weights[members[0]] >= age_main:
                    queue = fresh
                elif age_fresh * weights[members[-1]] < age_main:
                    queue = main
                else:
                    cut = 1
                    while age_fresh * weights[members[cut]] < age_main:
                        cut += 1
                    # the lighter weights take main's oldest: they go on in a copy of this
                    other = _Group(fresh.copy(), main.copy(), ghost.copy(), used,
                                   members[:cut])
                    group.members = members[cut:]
                    self.groups.append(other)
                    self._admit(other, key, size, clock, used)
                    queue = fresh
            victim, (_, vsize) = queue.popitem(last=False)
            used -= vsize
            ghost[victim] = None
            if len(ghost) > self.ghost_limit:
                ghost.popitem(last=False)
        group.used = used
        if key in ghost:
            del ghost[key]
            main[key] = (clock, size)
        else:
            fresh[key] = (clock, size)

    def merge(self) -> None:
        """Joins the groups whose states are equal."""
        groups = self.groups
        if len(groups) < 2:
            return
        kept: list[_Group] = []
        for group in groups:
            for into in kept:
                if into.same_state(group):
                    into.members = sorted(into.members + group.members,
                                          key=self.weights.__getitem__)
                    break
            else:
                kept.append(group)
        self.groups = kept


class ShadowLRUPolicy(Policy):
    """Two LRU segments: `fresh` holds blocks stored once and never hit, `main` blocks hit
    since or stored again after an eviction (a ghost list remembers evicted keys for
    GHOST_FACTOR times the held count). The victim is the oldest of the segment whose
    oldest block has the larger age, a fresh block's age counting WEIGHT times: weight 1 is
    LRU, a large weight keeps fresh blocks only while main has older ones.

    The right weight depends on the capacity and the workload (on the Mooncake conversation
    trace: 64 and more at 1,000-4,000 blocks, 2-4 at 16,000-32,000, 1 at 64,000), so it is
    chosen online: a spatial sample of the keys (SAMPLE_BLOCKS blocks' worth of the capacity,
    by CRC-32 of the key) feeds one miniature cache per candidate weight, scaled to the
    sample rate, and every period the weight whose miniature hit most (decayed counts) is
    used. Each access is O(1): a CRC, and for sampled keys one step in each miniature."""

    WEIGHTS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
    GHOST_FACTOR = 4
    SAMPLE_BLOCKS = 256
    DECAY = 0.5

    def __init__(self, capacity: int | None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(capacity, clock=clock)
        self._fresh: OrderedDict[bytes, int] = OrderedDict()  # key -> stamp (access count)
        self._main: OrderedDict[bytes, int] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._tick = 0
        self.weight = self.WEIGHTS[0]
        self._shadows: _WeightCaches | None = None
        self._threshold = 0  # sampled keys have crc32 below it (set at the first insert)
        self._sampled = 0
        self._period = 1

    def _start_shadows(self, size: int) -> None:
        # Sample rate from the first block's size: tiers hold blocks of one size in practice.
        if self.capacity is None or size <= 0:
            return
        blocks = max(1, self.capacity // size)
        rate = min(1.0, self.SAMPLE_BLOCKS / blocks)
        self._threshold = int(rate * 2**32)
        mini = self.capacity * rate
        ghosts = max(16, int(self.GHOST_FACTOR * mini / size))
        self._shadows = _WeightCaches(mini, self.WEIGHTS, ghosts)
        self._period = max(8, int(mini / size))

    def resize(self, capacity: int) -> list[bytes]:
        # the miniatures are scaled to the capacity: start them again at the next insert
        self._shadows, self._threshold, self._sampled = None, 0, 0
        return super().resize(capacity)

    def _sample(self, key: bytes) -> None:
        shadows = self._shadows
        if shadows is None or zlib.crc32(key) >= self._threshold:
            return
        shadows.access(key, self._sizes[key])
        self._sampled += 1
        if self._sampled >= self._period:
            self._sampled = 0
            shadows.merge()
            weights, hits = self.WEIGHTS, shadows.hits
            here = math.log2(self.weight)
            # The most hits wins; among equals the weight nearest the current one.
            best = max(range(len(weights)),
                       key=lambda i: (hits[i], -abs(math.log2(weights[i]) - here)))
            # weight 1 is LRU, the policy shadow must never fall below: a weight whose
            # miniature hits less than LRU's over the run gives way to it
            if shadows.total_hits[best] < shadows.total_hits[0]:
                best = 0
            self.weight = weights[best]
            for i in range(len(hits)):
                hits[i] *= self.DECAY

    def _on_insert(self, key: bytes, depth: int | None) -> None:
        if self._shadows is None and self._threshold == 0:
            self._start_shadows(self._sizes[key])
        self._tick += 1
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = self._tick
        else:
            self._fresh[key] = self._tick
        self._sample(key)

    def _on_hit(self, key: bytes, depth: int | None) -> None:
        self._tick += 1
        if self._fresh.pop(key, None) is not None or key in self._main:
            self._main.pop(key, None)
            self._main[key] = self._tick
        self._sample(key)

    def _on_remove(self, key: bytes, size: int) -> None:
        if self._fresh.pop(key, None) is None:
            self._main.pop(key, None)

    def _next_victim(self) -> bytes | None:
        for _ in range(len(self._fresh) + len(self._main)):
            fresh = self._fresh
            if fresh and (not self._main or (self._tick - next(iter(fresh.values()))) *
                          self.weight >= self._tick - next(iter(self._main.values()))):
                queue = fresh
            else:
                queue = self._main
            key, _ = queue.popitem(last=False)
            if self.is_pinned(key):
                self._tick += 1
                queue[key] = self._tick  # pinned: kept, as if used now
                continue
            self._ghost[key] = None
            limit = max(16, self.GHOST_FACTOR * len(self._sizes))
            while len(self._ghost) > limit:
                self._ghost.popitem(last=False)
            return key
        return None


def make_policy(name: str, capacity: int | None, *,
                clock: Callable[[], float] = time.monotonic) -> Policy:
    if name == "lru":
        return LRUPolicy(capacity, clock=clock)
    if name == "s3fifo":
        return S3FIFOPolicy(capacity, clock=clock)
    if name == "adaptive":
        return AdaptiveS3FIFOPolicy(capacity, clock=clock)
    if name == "shadow":
        return ShadowLRUPolicy(capacity, clock=clock)
    raise ValueError(f"unknown eviction policy {name!r}; choose {', '.join(POLICIES)}")


POLICIES = ("lru", "s3fifo", "adaptive", "shadow")
