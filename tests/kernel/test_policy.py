"""Eviction policies: byte accounting, pins, victim order, and measured hit ratios."""

from __future__ import annotations

import random

import pytest

from ucm.bench.policy import hit_ratio, zipf_scan_trace
from ucm.kernel import LRUPolicy, S3FIFOPolicy
from ucm.kernel._policy import AdaptiveS3FIFOPolicy, ShadowLRUPolicy, make_policy


def k(i: int) -> bytes:
    return i.to_bytes(4, "little")


@pytest.mark.parametrize("cls", [LRUPolicy, S3FIFOPolicy, AdaptiveS3FIFOPolicy,
                                 ShadowLRUPolicy])
def test_accounting_and_room(cls):
    policy = cls(100, clock=lambda: 0.0)
    for i in range(10):
        assert policy.make_room(10) == []
        policy.insert(k(i), 10)
    assert policy.used == 100
    victims = policy.make_room(25)
    assert len(victims) == 3 and policy.used == 70
    assert all(v not in policy for v in victims)
    assert policy.make_room(101) is None  # larger than the whole tier
    policy.insert(k(0), 30)  # a new size for a block is accounted
    assert policy.used == sum(policy.size_of(key) for key in policy)


@pytest.mark.parametrize("cls", [LRUPolicy, S3FIFOPolicy, AdaptiveS3FIFOPolicy,
                                 ShadowLRUPolicy])
def test_pinned_blocks_are_never_victims(cls):
    now = [0.0]
    policy = cls(50, clock=lambda: now[0])
    for i in range(5):
        policy.insert(k(i), 10)
    policy.pin(k(0), ttl=5)
    policy.pin(k(1), ttl=5)
    victims = policy.make_room(30)
    assert k(0) not in victims and k(1) not in victims and len(victims) == 3
    assert policy.make_room(40) is None  # only 30 bytes could ever be freed
    assert policy.used == 20
    now[0] = 6.0  # pins expire
    assert len(policy.make_room(40)) == 1 and policy.used == 10


def test_lru_evicts_the_least_recently_used():
    policy = LRUPolicy(30, clock=lambda: 0.0)
    for i in range(3):
        policy.insert(k(i), 10)
    policy.touch(k(0))
    assert policy.make_room(10) == [k(1)]


def test_s3fifo_keeps_a_reused_block_through_a_scan():
    policy = S3FIFOPolicy(100, clock=lambda: 0.0)
    policy.insert(k(0), 10)
    policy.touch(k(0))
    for i in range(1, 50):  # a scan of one-hit blocks
        policy.make_room(10)
        policy.insert(k(i), 10)
    assert k(0) in policy


def test_s3fifo_beats_lru_on_a_scan_heavy_trace():
    trace = list(zipf_scan_trace(40_000, 5_000, random.Random(1)))
    lru = hit_ratio("lru", trace, 500)
    s3 = hit_ratio("s3fifo", trace, 500)
    assert s3 > lru + 0.02, (s3, lru)


def test_adaptive_moves_its_split_with_each_ghost_hit():
    policy = AdaptiveS3FIFOPolicy(4, clock=lambda: 0.0)

    def put(i: int) -> list[int]:
        victims = policy.make_room(1)
        policy.insert(k(i), 1, 0)
        return [int.from_bytes(v, "little") for v in victims]

    for i in range(4):
        put(i)
    assert [put(4), put(5)] == [[0], [1]]  # unhit blocks leave the small queue as ghosts
    assert policy._fraction == pytest.approx(0.1)
    # Each returning small ghost grows the small queue (by a block, then by more as the
    # ghost list is longer than the main one) and goes to main.
    assert [put(0), put(1)] == [[2], [3]]
    assert policy._fraction == pytest.approx(0.6) and len(policy._main) == 2
    # The small queue (4, 5) is within its share: main's oldest unhit block goes first.
    assert [put(6), put(7), put(8)] == [[0], [4], [5]]
    # 0 returns from main's ghosts: the small queue shrinks to its floor; 0 goes to main.
    assert put(0) == [6]
    assert policy._fraction == pytest.approx(AdaptiveS3FIFOPolicy.MIN_FRACTION)
    assert k(0) in policy._main


def test_depth_hints_are_accepted_by_every_policy():
    for name in ("lru", "s3fifo", "adaptive", "shadow"):
        policy = make_policy(name, 3, clock=lambda: 0.0)
        for i in range(3):
            policy.insert(k(i), 1, i)
        policy.touch(k(0), 0)
        policy.touch(k(9), 1)  # absent: ignored
        assert len(policy) == 3 and policy.used == 3
    with pytest.raises(ValueError, match="lru, s3fifo, adaptive, shadow"):
        make_policy("nope", 1)


def _replay(policy, trace: list[int]) -> int:
    """Block-granular replay (a hit is touched, a miss stored): the number of hits."""
    hits = 0
    for i in trace:
        key = k(i)
        if key in policy:
            hits += 1
            policy.touch(key)
            continue
        policy.make_room(1)
        policy.insert(key, 1)
    return hits


class _WeightOne(ShadowLRUPolicy):
    WEIGHTS = (1.0,)


def test_shadow_with_weight_one_evicts_as_lru_does():
    rng = random.Random(3)
    trace = [rng.randrange(300) for _ in range(5000)]
    lru, shadow = LRUPolicy(100, clock=lambda: 0.0), _WeightOne(100, clock=lambda: 0.0)
    for i in trace:
        key = k(i)
        for policy in (lru, shadow):
            if key in policy:
                policy.touch(key)
            else:
                victims = policy.make_room(1)
                policy.insert(key, 1)
        assert set(lru) == set(shadow), victims
    assert shadow.weight == 1.0


def test_shadow_protects_returned_blocks_from_one_off_blocks():
    """Hot blocks return at a distance LRU cannot hold (a scan of fresh blocks in between):
    the shadows pick a large weight, so fresh blocks go first and the hot set stays."""
    trace = []
    scan = 10_000
    for _ in range(60):
        trace.extend(range(80))  # 80 hot blocks, in a tier of 100
        trace.extend(range(scan, scan + 150))  # 150 blocks never seen again
        scan += 150
    lru = _replay(LRUPolicy(100, clock=lambda: 0.0), trace)
    policy = ShadowLRUPolicy(100, clock=lambda: 0.0)
    shadow = _replay(policy, trace)
    assert lru == 0  # each scan flushes the hot set
    assert shadow >= 50 * 80, shadow  # from the third round on, nearly all 80 hit
    assert policy.weight >= 8


def test_shadow_keeps_lru_where_recency_is_all():
    """Every block is read twice, 90 distinct blocks apart in a tier of 100: LRU hits each
    second read; protecting blocks hit once would only lose. The shadows choose weight 1."""
    trace = []
    for start in range(0, 30_000, 30):
        trace.extend(range(start, start + 30))
        if start:
            trace.extend(range(start - 30, start))
    lru = _replay(LRUPolicy(100, clock=lambda: 0.0), trace)
    policy = ShadowLRUPolicy(100, clock=lambda: 0.0)
    shadow = _replay(policy, trace)
    assert lru == 999 * 30
    assert shadow >= lru - 2 * 30, (shadow, lru)
    assert policy.weight <= 2
