"""`shadow` contains LRU (weight 1): its online weight choice must not leave it below LRU.
Counted on seeded synthetic workloads of several shapes with small fast tiers."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from ucm.bench.policy import zipf_scan_trace, zipf_trace
from ucm.kernel._policy import make_policy


def _recency(n: int, rng: random.Random) -> Iterator[int]:
    """New blocks reused a few times soon after their first use (what LRU is best at)."""
    recent: list[int] = []
    for _ in range(n):
        if recent and rng.random() < 0.6:
            yield rng.choice(recent[-40:])
        else:
            recent.append(len(recent) + 1)
            yield recent[-1]


def _loop(n: int, rng: random.Random) -> Iterator[int]:
    """A 300-block working set read in order, with one-off blocks between."""
    for i in range(n):
        yield rng.randrange(10**6, 2 * 10**6) if rng.random() < 0.1 else i % 300


def _hits(policy: str, trace: list[int], capacity: int) -> int:
    cache = make_policy(policy, capacity, clock=lambda: 0.0)
    hits = 0
    for item in trace:
        key = item.to_bytes(8, "little", signed=True)
        if key in cache:
            hits += 1
            cache.touch(key)
        else:
            assert cache.make_room(1) is not None
            cache.insert(key, 1)
    return hits


def test_shadow_no_longer_loses_to_lru_on_a_recency_workload():
    # With the weight chosen by decayed miniature hits alone, shadow hit 8,081 times here
    # against LRU's 8,399 (1.1 points below); a weight whose miniature hits less than
    # LRU's over the run is now never taken (8,406).
    trace = list(_recency(30_000, random.Random(0)))
    assert _hits("shadow", trace, 20) >= _hits("lru", trace, 20)


@pytest.mark.parametrize("shape", ["zipf", "zipf+scan", "loop"])
@pytest.mark.parametrize("capacity", [20, 100, 500])
def test_shadow_is_at_least_lru_on_small_tiers(shape, capacity):
    rng = random.Random(1)
    trace = list({"zipf": lambda: zipf_trace(30_000, 20_000, rng),
                  "zipf+scan": lambda: zipf_scan_trace(30_000, 20_000, rng),
                  "loop": lambda: _loop(30_000, rng)}[shape]())
    assert _hits("shadow", trace, capacity) >= _hits("lru", trace, capacity)
