"""`predict_holds` on a clock (the validation's expiry, `ucm bench retention --validate
--time-scale`): a hold whose session pauses longer than `retain_s` expires and its blocks are
evicted by the next store, one whose pause is shorter keeps its blocks in the fast tier;
counted by the kernel's own `Holds`. Blocks: a memory tier of 6 over posix."""

from __future__ import annotations

from ucm.autotune import Request
from ucm.autotune._validate import predict_holds, tier_stack
from ucm.bench.validate import clock_ambiguous, hold_pauses


def _key(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def _requests() -> list[Request]:
    a, b = (_key("a1"), _key("a2")), (_key("b1"), _key("b2"))
    flood = tuple(_key(f"x{i}") for i in range(6))
    return [Request(a, session="a"), Request(b, session="b"), Request(flood),
            Request(a), Request(b)]


def _tiers():
    return tier_stack("lru", 6, 32768, posix_blocks=100, posix_path="unused")[1]


def test_a_pause_longer_than_retain_expires_a_shorter_one_is_kept():
    # a holds at 0 (until 10), b at 5 (until 15); the flood's store at 12 releases a
    # (expired) and evicts it; a returns from posix at 13, b from memory at 14
    hits, stats = predict_holds(_requests(), _tiers(), retain_s=10.0, max_pinned="100%",
                                times=[0.0, 5.0, 12.0, 13.0, 14.0])
    assert hits[3] == [0, 2] and hits[4] == [2, 0]
    assert stats == {"session_holds": 2, "session_releases.expired": 1}
    # the clock standing still keeps both, no holds loses both
    hits, stats = predict_holds(_requests(), _tiers(), retain_s=10.0, max_pinned="100%")
    assert hits[3] == [2, 0] and hits[4] == [2, 0] and stats == {"session_holds": 2}
    hits, stats = predict_holds(_requests(), _tiers(), retain_s=None)
    assert hits[3] == [0, 2] and hits[4] == [0, 2] and stats == {}


def test_an_expired_hold_is_released_at_the_next_store_not_before():
    # both holds have expired by 13, but no store came after 10 before a's return: the
    # kernel releases lazily (before an eviction, a hold or a statistics read), so a's blocks
    # are still in memory; the end's read releases both as expired
    reqs = _requests()
    hits, stats = predict_holds([reqs[0], reqs[1], reqs[3], reqs[4]], _tiers(),
                                retain_s=1.0, max_pinned="100%", times=[0.0, 5.0, 13.0, 14.0])
    assert hits[2] == [2, 0] and hits[3] == [2, 0]
    assert stats == {"session_holds": 2, "session_releases.expired": 2}


def test_the_pauses_and_the_clock_check():
    sessions = ["a", "b", None, "a", "b"]
    returning = ["a", "b", None, None, None]
    pauses = hold_pauses(sessions, returning, [0.0, 5.0, 12.0, 13.0, 14.0], 10.0)
    assert [(h["request"], h["returns"], h["expires_before_return"]) for h in pauses] == [
        (1, 4, True), (2, 5, False)]
    arrivals = [0.0, 5.0, 12.0, 13.0, 14.0]
    # each request ran 0.5 s: every expiry is a second or more from every check
    ends = [t + 0.5 for t in arrivals]
    assert clock_ambiguous(arrivals, arrivals, ends, 14.6, returning, 10.0) == []
    # a's hold (0 + 10) against request 3 (12): a start 2.5 s late leaves it open
    starts = [0.0, 5.0, 9.5, 13.0, 14.0]
    ends = [0.5, 5.5, 10.5, 13.5, 14.5]
    assert clock_ambiguous(arrivals, starts, ends, 14.6, returning, 10.0) == [(1, 3)]


def test_promotion_copies_a_returning_sessions_posix_hits_into_memory():
    # a expired and was evicted (above); with promotion its return's 2 posix hits are copied
    # up after the load, so a third visit is served from memory
    reqs = _requests()
    hits, stats = predict_holds([*reqs, reqs[3]], _tiers(), retain_s=10.0, max_pinned="100%",
                                times=[0.0, 5.0, 12.0, 13.0, 14.0, 14.5], promote=True)
    assert hits[3] == [0, 2] and hits[5] == [2, 0]
    assert stats == {"session_holds": 2, "session_releases.expired": 1, "promoted": 2}


def test_end_releases_the_hold_so_the_flood_evicts_it():
    # a and b hold; a's next request ends a (it loads from memory, then releases): the flood
    # evicts a's blocks, b's stay held. Without the end both stay.
    a, b, flood = _requests()[0], _requests()[1], _requests()[2]
    reqs = [a, b, Request(a.blocks), flood, Request(a.blocks), Request(b.blocks)]
    ends = [None, None, "a", None, None, None]
    hits, stats = predict_holds(reqs, _tiers(), retain_s=10.0, max_pinned="100%", ends=ends)
    assert hits[2] == [2, 0] and hits[4] == [0, 2] and hits[5] == [2, 0]
    assert stats == {"session_holds": 2, "session_releases.end": 1}
    hits, stats = predict_holds(reqs, _tiers(), retain_s=10.0, max_pinned="100%")
    assert hits[4] == [2, 0] and stats == {"session_holds": 2}
    # an end of a session that holds nothing counts nothing, as `Kernel.release` returns False
    hits, stats = predict_holds(reqs, _tiers(), retain_s=10.0, max_pinned="100%",
                                ends=[None, None, "zz", None, None, None])
    assert stats == {"session_holds": 2}


def test_an_expired_hold_not_yet_released_is_counted_as_ended():
    # a's hold expired at 1 but nothing checked before its end at 2 (no store, no hold)
    a = _requests()[0]
    hits, stats = predict_holds([a, Request(a.blocks)], _tiers(), retain_s=1.0,
                                max_pinned="100%", times=[0.0, 2.0], ends=[None, "a"])
    assert hits[1] == [2, 0] and stats == {"session_holds": 1, "session_releases.end": 1}


def test_prefetch_copies_posix_blocks_up_and_counts_what_became_of_them():
    # no holds: the flood evicts a from memory; a prefetch request loads a from posix, then
    # copies it up, so a's next request is served from memory (2 prefetch hits)
    a, flood = _requests()[0], _requests()[2]
    reqs = [Request(a.blocks), flood, Request(a.blocks), Request(a.blocks)]
    hits, stats = predict_holds(reqs, _tiers(), retain_s=None,
                                prefetches=[False, False, True, False])
    assert hits[2] == [0, 2] and hits[3] == [2, 0]
    assert stats == {"prefetched": 2, "promoted": 2, "tier.memory.prefetch_hits": 2}
    # a flood between the prefetch and the return evicts them unused
    flood2 = Request(tuple(_key(f"y{i}") for i in range(6)))
    reqs = [Request(a.blocks), flood, Request(a.blocks), flood2, Request(a.blocks)]
    hits, stats = predict_holds(reqs, _tiers(), retain_s=None,
                                prefetches=[False, False, True, False, False])
    assert hits[4] == [0, 2]
    assert stats == {"prefetched": 2, "promoted": 2, "tier.memory.prefetch_evicted": 2}
    # blocks already in memory are not copied: nothing counted
    hits, stats = predict_holds([Request(a.blocks), Request(a.blocks)], _tiers(),
                                retain_s=None, prefetches=[False, True])
    assert stats == {}


def test_hint_plan_and_prefetch_prompt():
    from ucm.bench.validate import hint_plan, prefetch_prompt

    sessions = ["a", "b", "a", None, "a", "b", "a"]
    plan = hint_plan(sessions)
    assert [p["hold"] for p in plan] == ["a", "b", "a", None, "a", None, None]
    assert [p["end"] for p in plan] == [None] * 7
    assert [p["previous"] for p in plan] == [None, None, 0, None, 2, 1, 4]
    plan = hint_plan(sessions, end_after=3)  # a ends at its 3rd, b at its last (2nd)
    assert [p["hold"] for p in plan] == ["a", "b", "a", None, None, None, None]
    assert [p["end"] for p in plan] == [None, None, None, None, "a", "b", None]
    prev, nxt = list(range(100)), list(range(70)) + [999] * 40
    assert prefetch_prompt(prev, nxt, 32) == [*range(64), 64]
    assert prefetch_prompt(prev, [999] * 50, 32) is None
    assert prefetch_prompt(list(range(64)), list(range(64)), 32) == [*range(64), 63]
