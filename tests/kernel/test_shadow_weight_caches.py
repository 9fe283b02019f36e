"""`shadow`'s weight miniatures run as groups of equal states (`_WeightCaches`) give the same
hits, victims and weights as one miniature per weight (the implementation they replaced,
kept here as the reference), on seeded streams that split and merge the groups."""

from __future__ import annotations

import math
import random
import zlib
from collections import OrderedDict
from collections.abc import Mapping

import pytest

from ucm.kernel._mrc import MissRatioCurve, _MiniatureShadow
from ucm.kernel._policy import ShadowLRUPolicy, _WeightCaches


class _ShadowCache:
    """One weight's miniature: a two-segment LRU with a fixed eviction weight, fed a key
    sample of the real tier's accesses; it only counts its own hits."""

    def __init__(self, capacity: float, weight: float, ghost_limit: int) -> None:
        self.capacity = capacity
        self.weight = weight
        self.used = 0
        self.clock = 0
        self.hits = 0.0
        self.total_hits = 0
        self.fresh: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self.main: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self.ghost: OrderedDict[bytes, None] = OrderedDict()
        self.ghost_limit = ghost_limit

    def access(self, key: bytes, size: int) -> None:
        self.clock += 1
        entry = self.fresh.pop(key, None) or self.main.pop(key, None)
        if entry is not None:
            self.hits += 1
            self.total_hits += 1
            self.main[key] = (self.clock, entry[1])
            return
        self.used += size
        while self.used > self.capacity and (self.fresh or self.main):
            queue = self.fresh if _fresh_first(self.fresh, self.main, self.clock,
                                               self.weight) else self.main
            victim, (_, vsize) = queue.popitem(last=False)
            self.used -= vsize
            self.ghost[victim] = None
            if len(self.ghost) > self.ghost_limit:
                self.ghost.popitem(last=False)
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = (self.clock, size)
        else:
            self.fresh[key] = (self.clock, size)


def _fresh_first(fresh: Mapping[bytes, tuple[int, int]], main: Mapping[bytes, tuple[int, int]],
                 clock: int, weight: float) -> bool:
    if not fresh:
        return False
    if not main:
        return True
    return (clock - next(iter(fresh.values()))[0]) * weight >= (
        clock - next(iter(main.values()))[0])


class _Reference(ShadowLRUPolicy):
    """`shadow` with one `_ShadowCache` per weight, as before the groups."""

    def _start_shadows(self, size: int) -> None:
        super()._start_shadows(size)
        if self._shadows is not None:
            caches = self._shadows
            self._caches = [_ShadowCache(caches.capacity, w, caches.ghost_limit)
                            for w in self.WEIGHTS]

    def _sample(self, key: bytes) -> None:
        if self._shadows is None or zlib.crc32(key) >= self._threshold:
            return
        size = self._sizes[key]
        for shadow in self._caches:
            shadow.access(key, size)
        self._sampled += 1
        if self._sampled >= self._period:
            self._sampled = 0
            current = self.weight
            best = max(self._caches, key=lambda s: (s.hits, -abs(math.log2(s.weight)
                                                                  - math.log2(current))))
            lru = self._caches[0]
            if best.total_hits < lru.total_hits:
                best = lru
            self.weight = best.weight
            for shadow in self._caches:
                shadow.hits *= self.DECAY


def _stream(seed: int, n: int, universe: int) -> list[int]:
    """A hot set read again and again, with one-off scans and a drifting working set."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        shape = rng.random()
        if shape < 0.5:
            out += [int(universe * rng.random() ** 3) for _ in range(rng.randrange(1, 20))]
        elif shape < 0.8:
            start = rng.randrange(universe, 50 * universe)
            out += range(start, start + rng.randrange(5, 60))
        else:
            base = rng.randrange(universe)
            out += [base + rng.randrange(30) for _ in range(rng.randrange(5, 30))]
    return out[:n]


def _key(i: int) -> bytes:
    return i.to_bytes(8, "little")


@pytest.mark.parametrize(("capacity", "sizes", "seed"), [
    (3, (1,), 0), (12, (1,), 1), (40, (1,), 2), (150, (1,), 3),
    (2000, (1,), 4),  # over SAMPLE_BLOCKS: the miniatures see a sample
    (60, (1, 2, 3), 5),  # blocks of several sizes
])
def test_groups_give_the_same_hits_victims_and_weights(capacity, sizes, seed):
    rng = random.Random(seed + 100)
    new = ShadowLRUPolicy(capacity, clock=lambda: 0.0)
    ref = _Reference(capacity, clock=lambda: 0.0)
    splits = weight_changes = 0
    before = 1
    weight = new.weight
    for i in _stream(seed, 20_000, 4 * capacity):
        key, size = _key(i), rng.choice(sizes)
        outcome = []
        for policy in (new, ref):
            if key in policy:
                policy.touch(key)
                outcome.append(("hit",))
            else:
                outcome.append(("miss", policy.make_room(size)))
                policy.insert(key, size)
        assert outcome[0] == outcome[1]
        assert new.weight == ref.weight
        groups = len(new._shadows.groups) if new._shadows is not None else 1
        splits += groups > before
        before = groups
        weight_changes += new.weight != weight
        weight = new.weight
    assert new._shadows is not None
    assert new._shadows.hits == [c.hits for c in ref._caches]
    assert new._shadows.total_hits == [c.total_hits for c in ref._caches]
    assert splits > 0  # the weights disagreed (small caches also join again: below)
    assert weight_changes > 0
    assert list(new) == list(ref)


def test_weight_caches_alone_match_one_cache_per_weight():
    weights = ShadowLRUPolicy.WEIGHTS
    caches = _WeightCaches(20.0, weights, 16)
    refs = [_ShadowCache(20.0, w, 16) for w in weights]
    most = merges = 0
    for n, i in enumerate(_stream(7, 10_000, 60)):
        caches.access(_key(i), 1)
        for ref in refs:
            ref.access(_key(i), 1)
        most = max(most, len(caches.groups))
        if n % 8 == 7:
            before = len(caches.groups)
            caches.merge()
            merges += len(caches.groups) < before
    assert caches.total_hits == [r.total_hits for r in refs]
    for group in caches.groups:
        for m in group.members:
            assert (group.fresh, group.main, group.ghost) == (refs[m].fresh, refs[m].main,
                                                              refs[m].ghost)
    assert most > 2 and merges > 10


def _replay_both(a, b, stream, sizes=(1,), seed=0):
    """Both policies fed the same stream; asserts the same victims and weights each step."""
    rng = random.Random(seed)
    for i in stream:
        key, size = _key(i), rng.choice(sizes)
        outcome = []
        for policy in (a, b):
            if key in policy:
                policy.touch(key)
                outcome.append(("hit",))
            else:
                outcome.append(("miss", policy.make_room(size)))
                policy.insert(key, size)
        assert outcome[0] == outcome[1]
        assert a.weight == b.weight


def test_a_large_miniature_runs_as_the_tiers_own_policy():
    """At SAMPLE_BLOCKS blocks and more the weight miniatures see a sample: no cycle."""
    mini, full = _MiniatureShadow(1000, clock=lambda: 0.0), ShadowLRUPolicy(1000)
    _replay_both(mini, full, _stream(11, 20_000, 4000))
    assert mini._shadows is not None and full._shadows is not None
    assert mini._shadows.hits == full._shadows.hits
    assert mini._periods == 0  # never counted a cycle


class _AlwaysActive(_MiniatureShadow):
    ACTIVE = CYCLE = 8


def test_a_small_miniature_always_active_is_the_tiers_own_policy():
    mini, full = _AlwaysActive(60, clock=lambda: 0.0), ShadowLRUPolicy(60)
    _replay_both(mini, full, _stream(12, 20_000, 240), sizes=(1, 2))
    assert mini._shadows.total_hits == full._shadows.total_hits


def test_a_small_miniature_feeds_its_weight_miniatures_active_of_each_cycle():
    fed = []

    class _Counting(_WeightCaches):
        __slots__ = ()

        def access(self, key: bytes, size: int) -> None:
            fed.append(key)
            super().access(key, size)

    mini = _MiniatureShadow(40, clock=lambda: 0.0)
    changes, weight = 0, mini.weight
    for i in _stream(13, 40_000, 160):
        key = _key(i)
        if mini._shadows is not None and type(mini._shadows) is _WeightCaches:
            mini._shadows.__class__ = _Counting
        if key in mini:
            mini.touch(key)
        else:
            mini.make_room(1)
            mini.insert(key, 1)
        changes += mini.weight != weight
        weight = mini.weight
    period = mini._period
    cycles = 40_000 // (period * mini.CYCLE)
    # ACTIVE of CYCLE periods, give or take the cycle under way
    assert (cycles * mini.ACTIVE * period - 1 <= len(fed)  # the first, before the swap
            <= (cycles + 1) * mini.ACTIVE * period)
    assert changes > 0  # the weight still moves
    # each restart starts every weight from the miniature's state: one group
    assert len(mini._shadows.groups) <= len(mini.WEIGHTS)


def test_the_live_curve_of_large_miniatures_is_unchanged(monkeypatch):
    """Miniatures of SAMPLE_BLOCKS blocks and more (the readers' `min_blocks`): the curve of
    the reference `shadow` (one cache per weight), cell for cell."""
    keys = [zlib.crc32(_key(i)).to_bytes(4, "big") + _key(i) for i in _stream(9, 30_000, 8000)]
    curves = []
    for make in (None, lambda name, capacity: _Reference(capacity, clock=lambda: 0.0)):
        if make is not None:
            monkeypatch.setattr("ucm.kernel._mrc._make_miniature", make)
        mrc = MissRatioCurve("shadow", [3000, 6000, 12000], rate=0.1, min_blocks=300,
                             native=False)
        for n, key in enumerate(keys):
            mrc.access(key, 1, n % 10 == 0)
        minis = mrc.front.minis.minis  # type: ignore[attr-defined]
        assert all(m._threshold < 2**32 for m in minis)  # sampled weight miniatures
        curves.append((mrc.curve(), mrc.hits, mrc.sampled))
    assert curves[0] == curves[1]
