"""The reuse statistics and the bounds of `ucm.autotune._analysis`, counted by hand on a small
trace, and `ucm bench policy --trace --analysis` writing them."""

from __future__ import annotations

import json

from ucm.autotune import Request, SimTier, simulate
from ucm.autotune._analysis import best_semi_oracle, oracle_lru, reuse_stats, semi_oracle
from ucm.bench.policy import main as policy_main


def req(*ids: int) -> Request:
    return Request(tuple(i.to_bytes(8, "little", signed=True) for i in ids))


# flat positions: 0-3 | 4-8 | 9-11 | 12-16; 17 block accesses, 9 distinct blocks
TRACE = [req(0, 1, 2, 3), req(0, 1, 2, 4, 5), req(0, 6, 7), req(0, 1, 2, 4, 8)]


def test_reuse_stats_count_first_time_blocks_and_signals():
    s = reuse_stats(TRACE)
    assert s.accesses == 17
    assert (s.first_time.blocks, s.first_time.reused) == (9, 4)  # 0, 1, 2, 4 come back
    assert sorted(s.distances) == [4, 4, 4, 8]
    # first-time blocks stored between a block's first access and its reuse
    assert sorted(s.new_between) == [1, 2, 3, 3]
    assert (s.median_distance, s.median_new_between) == (4, 3)
    assert (s.last_block.blocks, s.last_block.reused) == (4, 0)  # 3, 5, 7, 8
    assert {k: (v.blocks, v.reused) for k, v in s.by_return.items()} == {
        "first turn (hit <= 1 block)": (4, 3), "returning (hit > 1 block)": (1, 1)}
    assert {k: (v.blocks, v.reused) for k, v in s.by_new_index.items()} == {"0-4": (5, 4)}
    assert {k: (v.blocks, v.reused) for k, v in s.by_request_blocks.items()} == {"0-9": (5, 4)}
    assert {k: (v.blocks, v.reused) for k, v in s.by_seen.items()} == {
        "1": (4, 3), "2": (3, 1), ">=3": (1, 0)}


def test_oracle_lru_admits_only_blocks_used_again():
    # unbounded, it hits what any unbounded cache hits: 3 + 1 + 4 blocks
    assert oracle_lru(TRACE, 100) == 8 / 17
    assert simulate(TRACE, [SimTier("lru", None)]).hits == 8
    # two slots: the second request's stores push 0 out before the third comes; the fourth
    # finds 0 (stored again by the third) and misses 1
    assert oracle_lru(TRACE, 2) == 1 / 17


def test_semi_oracle_counts_with_and_without_a_fifo():
    # no FIFO: a block is held only from its second access on (Belady over seen blocks):
    # the third request hits 0, the fourth 0, 1, 2
    assert semi_oracle(TRACE, 4, 0) == 4 / 17
    # all FIFO: the second request hits 0, 1, 2, which then have no Belady slot
    assert semi_oracle(TRACE, 4, 4) == 3 / 17
    # half: 2 (next use farthest) is not kept, so the fourth request hits 0 and 1 only
    assert semi_oracle(TRACE, 4, 2) == 3 / 17
    # FIFO 3, one Belady slot: the second request hits 0, 1, 2 and keeps 0 (nearest next
    # use), which the third and fourth hit: 5 hits, the best split
    assert semi_oracle(TRACE, 4, 3) == 5 / 17
    assert best_semi_oracle(TRACE, 4) == (5 / 17, 0.9)


def test_bench_policy_analysis_writes_stats_and_bounds(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "hash_ids": [
        int.from_bytes(b, "little", signed=True) for b in r.blocks]}) + "\n"
        for i, r in enumerate(TRACE)))
    out = tmp_path / "a.json"
    assert policy_main(["--trace", str(trace), "--analysis", "--capacities", "2,100",
                        "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["requests"] == 4
    assert data["reuse"]["first_time"] == {"blocks": 9, "reused": 4}
    assert [b["capacity_blocks"] for b in data["bounds"]] == [2, 100]
    assert data["bounds"][0]["oracle_lru"] == 1 / 17
    assert data["bounds"][1]["belady"] == data["bounds"][1]["oracle_lru"] == 8 / 17
