"""Session holds in the simulator (`simulate(..., retention=)`), counted on hand-built traces
where each request's last block is partial (as in hash-id traces) and so is not held: a held
session outlives a flood, expiry and the cap release holds as the kernel's `Holds` does, and
`ucm bench retention` prints its table on a short slice."""

from __future__ import annotations

import json

import pytest

from ucm.autotune import Request, Retention, SimTier, simulate
from ucm.autotune._simulate import chain_session
from ucm.bench.retention import agent_trace, main, returning_only, trace_session


def req(t: float, *ids: int, session: str | None = None) -> Request:
    return Request(tuple(i.to_bytes(8, "little", signed=True) for i in ids), t,
                   session=session)


def keys(*ids: int) -> set[bytes]:
    return {i.to_bytes(8, "little", signed=True) for i in ids}


# a session's two turns 10 s apart, and a one-off flood of five blocks between them that
# turns a four-block fast tier over
TURNS = [req(0, 1, 2, 90, session="s"), req(5, 50, 51, 52, 53, 54),
         req(10, 1, 2, 3, 91, session="s")]


def held_by(retention: Retention | None, trace: list[Request], capacity: int = 4) -> object:
    return simulate(trace, [SimTier("lru", capacity)], retention=retention)


def test_without_holds_the_flood_evicts_the_session():
    r = held_by(None, TURNS)
    assert (r.hits, r.sessions) == (0, {})


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "adaptive", "shadow"])
def test_a_held_session_survives_the_flood(policy):
    r = simulate(TURNS, [SimTier(policy, 4)],
                 retention=Retention(60, session_of=trace_session))
    assert r.hits == 2  # blocks 1 and 2, held through the flood
    assert r.sessions["session_holds"] == 2
    assert keys(1, 2, 3) <= r.held[0]  # the second turn's hold added block 3


def test_returning_hints_skip_each_sessions_last_request():
    r = simulate(TURNS, [SimTier("lru", 4)],
                 retention=Retention(60, session_of=returning_only(TURNS, trace_session)))
    assert r.hits == 2 and r.sessions["session_holds"] == 1  # the first turn's only
    assert r.sessions["held_blocks"] == 2  # blocks 1 and 2 until 60 s; 3 was never held


def test_held_blocks_are_served_from_the_fast_tier_over_a_slow_one():
    r = simulate(TURNS, [SimTier("lru", 4), SimTier("lru", None)],
                 retention=Retention(60, session_of=trace_session))
    plain = simulate(TURNS, [SimTier("lru", 4), SimTier("lru", None)])
    assert (plain.hits_by_tier, r.hits_by_tier) == ([0, 2], [2, 0])


def test_expiry_releases_the_hold_before_the_flood_evicts():
    r = held_by(Retention(3, session_of=trace_session), TURNS)
    assert r.hits == 0  # held until 3 s, the flood came at 5 s
    assert r.sessions["session_releases.expired"] == 1  # at the flood's store
    # the second turn's three blocks alone are over the cap (2): released at once
    assert (r.sessions["session_releases.cap"], r.sessions["held_sessions"]) == (1, 0)


def test_the_cap_releases_the_oldest_holds_first():
    # three sessions of two full blocks each, then a flood of an eight-block tier
    trace = [req(0, 11, 12, 91, session="a"), req(1, 21, 22, 92, session="b"),
             req(2, 31, 32, 93, session="c"), req(3, *range(100, 108))]
    capped = held_by(Retention(60, max_pinned=0.5, session_of=trace_session), trace, 8)
    assert capped.sessions["session_releases.cap"] == 1  # 6 blocks over a cap of 4: "a"
    assert keys(21, 22, 31, 32) <= capped.held[0]
    assert not keys(11, 12) & capped.held[0]
    roomy = held_by(Retention(60, max_pinned=0.75, session_of=trace_session), trace, 8)
    assert "session_releases.cap" not in roomy.sessions
    assert keys(11, 12, 21, 22, 31, 32) <= roomy.held[0]


def test_chains_are_sessions_by_default():
    # Mooncake-style: block 0 every request shares, the conversation named by the second
    assert chain_session(req(0, 0, 7, 8, 99)) == chain_session(req(9, 0, 7, 8, 9, 98))
    assert chain_session(req(0, 0)) is None
    trace = [req(0, 0, 7, 8, 99), req(5, 0, 60, 61, 62, 63, 64, 65), req(10, 0, 7, 8, 9, 98)]
    r = simulate(trace, [SimTier("lru", 6)], retention=Retention(60))
    # the flood hits the shared block 0 and stores around the held 0, 7, 8; its own hold (six
    # blocks, cap 3) then releases the oldest (the conversation's), then itself; the next
    # turn finds 0, 7, 8 all the same, as the flood's store had left them
    assert r.hits == 1 + 3
    assert r.sessions["session_releases.cap"] == 2
    assert r.sessions["held_sessions"] == 1


def test_retention_needs_the_plain_replay():
    with pytest.raises(ValueError):
        simulate(TURNS, [SimTier("lru", 4)], kernel_stores=True, retention=Retention(60))
    with pytest.raises(ValueError):
        Retention(0)


def test_the_agent_workload_is_seeded():
    a, b = agent_trace(3, agents=20), agent_trace(3, agents=20)
    assert a == b and a != agent_trace(4, agents=20)
    assert [r.timestamp for r in a] == sorted(r.timestamp for r in a)
    sessions = {r.session for r in a}
    assert len(sessions - {None}) == 20 and None in sessions  # one-off requests too


def test_the_command_prints_the_table_on_a_short_slice(tmp_path, capsys):
    trace, out = tmp_path / "t.jsonl", tmp_path / "rows.json"
    with open(trace, "w") as fh:
        for turn in range(6):  # two conversations of three turns, interleaved
            conv = turn % 2
            ids = [0, *range(100 * conv + 1, 100 * conv + 3 + turn), 1000 + turn]
            fh.write(json.dumps({"timestamp": 1000 * turn, "hash_ids": ids}) + "\n")
    assert main(["--trace", str(trace), "--capacities", "4,8", "--retain", "30,600",
                 "--json", str(out)]) == 0
    captured = capsys.readouterr()
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 2 * 3  # capacities x policies x (no holds, 30 s, 10 min)
    assert {r["retain_s"] for r in rows} == {None, 30.0, 600.0}
    assert all(r["accesses"] == rows[0]["accesses"] for r in rows)
    assert "10 min" in captured.out and "[12/12]" in captured.err
    assert main(["--agents", "--limit", "200", "--capacities", "50", "--retain", "60",
                 "--policies", "lru"]) == 0
    assert "synthetic agent workload (seed 0)" in capsys.readouterr().out
    assert "share of the hits served from the fast tier" in captured.out
    assert main(["--trace", str(trace), "--capacities", "4", "--retain", "30",
                 "--slow-blocks", "0", "--hints", "returning"]) == 0
    out = capsys.readouterr().out
    assert "hints: returning" in out and "holds by retain time: hit ratio" in out
    assert main(["--trace", str(tmp_path / "missing.jsonl")]) == 2
