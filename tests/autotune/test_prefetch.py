"""Next-turn prefetch in the two-tier simulator, counted on a five-request trace: a
conversation of three turns (10 s apart) among fillers that flush a three-block fast tier."""

from __future__ import annotations

from ucm.autotune import Request, SimTier, simulate
from ucm.autotune._prefetch import NextTurnPrefetch, OracleNextTurn


def req(t: float, *ids: int) -> Request:
    return Request(tuple(i.to_bytes(8, "little", signed=True) for i in ids), t)


# each request's last block is partial (hash-id traces): the next turn shares the others
TRACE = [req(0, 1, 2, 90), req(5, 50, 51, 52, 53), req(10, 1, 2, 3, 91),
         req(15, 60, 61, 62, 63), req(20, 1, 2, 3, 4, 92)]
TIERS = [SimTier("lru", 3), SimTier("lru", None)]


def test_without_prefetch_the_returning_turns_hit_only_the_slow_tier():
    r = simulate(TRACE, TIERS)
    # the third request hits 1, 2 and the fifth 1, 2, 3, all in the slow tier
    assert r.hits_by_tier == [0, 5]
    assert (r.prefetched, r.prefetch_hits, r.prefetch_evicted) == (0, 0, 0)


def test_last_gap_prefetch_promotes_the_previous_turn_in_time():
    p = NextTurnPrefetch()
    r = simulate(TRACE, TIERS, prefetch=p)
    # the third request is the second turn (gap 10 s): its full blocks 1, 2, 3 are promoted
    # at 20 s, before the fifth request's lookup, which hits them in the fast tier
    assert p.scheduled == 2  # after the third and the fifth request
    assert r.hits_by_tier == [3, 2]
    assert (r.prefetched, r.prefetch_hits, r.prefetch_evicted) == (3, 3, 0)


def test_an_early_prefetch_is_flushed_and_counted_unused():
    r = simulate(TRACE, TIERS, prefetch=NextTurnPrefetch(scales=(0.1,)))
    # promoted at 11 s, i.e. before the fourth request, whose four stores evict them
    assert r.hits_by_tier == [0, 5]
    assert (r.prefetched, r.prefetch_hits, r.prefetch_evicted) == (3, 0, 3)


def test_a_turn_that_comes_first_cancels_its_late_prefetch():
    p = NextTurnPrefetch(scales=(5.0,))  # due at 60 s: the fifth request comes at 20 s
    r = simulate(TRACE, TIERS, prefetch=p)
    assert (p.cancelled, r.prefetched) == (1, 0)


def test_first_turns_are_prefetched_with_min_turns_one():
    p = NextTurnPrefetch(min_turns=1, first_gap=10.0)
    r = simulate(TRACE, TIERS, prefetch=p)
    # the first request's 1, 2 are promoted at 10 s (due before the third request), the
    # fillers' blocks at 15 s and 25 s (they never return), the third's at 20 s
    assert r.hits_by_tier == [5, 0]
    assert r.prefetch_hits == 5
    assert r.prefetched == 5 + 3  # 50, 51, 52 promoted at 15 s, flushed by the fourth
    assert r.prefetch_evicted == 3


def test_oracle_timing_promotes_just_before_each_next_turn():
    r = simulate(TRACE, TIERS, prefetch=OracleNextTurn(TRACE))
    assert r.hits_by_tier == [5, 0]
    assert (r.prefetched, r.prefetch_hits, r.prefetch_evicted) == (5, 5, 0)
