"""The simulator: prefix semantics, tiers, Belady, the trace readers, and agreement with the
kernel on the same events."""

from __future__ import annotations

import json
import os
import random

import pytest

from ucm.autotune import (
    Request,
    SimTier,
    belady,
    from_token_lists,
    load_requests,
    next_uses,
    read_jsonl,
    simulate,
)
from ucm.config import load_config
from ucm.kernel import KernelCore, Load, Lookup, Store

SHARED = "/work/shared/data/mooncake-traces/conversation_trace.jsonl"


def k(i: int) -> bytes:
    return i.to_bytes(8, "little", signed=True)


def req(*ids: int) -> Request:
    return Request(tuple(k(i) for i in ids))


def chat_requests(n: int, seed: int = 0) -> list[Request]:
    """Conversations that return with a longer prefix, among one-off prompts."""
    rng = random.Random(seed)
    sessions: list[list[int]] = [[0] for _ in range(12)]
    fresh = 1000
    out = []
    for _ in range(n):
        if rng.random() < 0.3:
            out.append(req(0, *range(fresh, fresh + 5)))
            fresh += 5
            continue
        s = rng.choice(sessions)
        s.extend(range(fresh, fresh + 2))
        fresh += 2
        out.append(req(*s))
        if len(s) > 20:
            del s[1:]
    return out


def test_prefix_semantics_hit_only_the_leading_run():
    requests = [req(1, 2, 3), req(1, 9, 3), req(1, 2, 3)]
    result = simulate(requests, [SimTier("lru", None)])
    # second: 1 hits, 9 misses, 3 (present) is past the first miss; third: all three
    assert (result.hits, result.accesses, result.requests_with_hit) == (4, 9, 2)


def test_lru_capacity_and_belady_on_a_small_trace():
    requests = [req(1, 2), req(3, 4), req(1, 2), req(5, 6), req(3, 4)]
    lru = simulate(requests, [SimTier("lru", 2)])
    assert lru.hits == 0  # each pair flushes the one before it
    best = belady(requests, 2)
    # Belady keeps 1,2 for the third request (their next use is the nearest), then 3,4
    # cannot be kept both for the fifth: it holds 1,2 until used, then 5,6 are bypassed
    assert best.hits == 2
    assert belady(requests, None).hits == 4  # unbounded: every return hits


def test_belady_is_an_upper_bound_of_the_policies():
    requests = chat_requests(600)
    uses = next_uses(requests)
    for capacity in (10, 40, 160):
        best = belady(requests, capacity, uses).hits
        for name in ("lru", "s3fifo", "adaptive", "shadow"):
            assert simulate(requests, [SimTier(name, capacity)]).hits <= best


def test_a_slow_tier_serves_what_the_fast_one_lost_and_is_promoted():
    requests = [req(1, 2), req(3, 4), req(1, 2)]
    result = simulate(requests, [SimTier("lru", 2), SimTier("lru", None)])
    assert result.hits_by_tier == [0, 2]
    assert result.held[0] == {k(1), k(2)}  # promoted into the fast tier
    again = simulate([*requests, req(1, 2)], [SimTier("lru", 2), SimTier("lru", None)])
    assert again.hits_by_tier == [2, 2]


def test_token_lists_chain_full_blocks_only():
    a = list(range(40))
    b = list(range(32)) + [99] * 8
    requests = from_token_lists([a, b, a[:20]], block_size=16)
    assert [len(r.blocks) for r in requests] == [2, 2, 1]
    assert requests[1].blocks == requests[0].blocks  # the partial block is not keyed
    assert requests[2].blocks == requests[0].blocks[:1]
    c = [7, *a[1:]]
    assert from_token_lists([c], 16)[0].blocks[1] != requests[0].blocks[1]  # chained


def test_readers_of_jsonl_and_token_list_files(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "hash_ids": [0, i]}) + "\n"
                            for i in range(3)))
    requests = load_requests(path)
    assert [r.blocks for r in requests] == [(k(0), k(i)) for i in range(3)]
    assert requests[2].timestamp == 2.0
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([list(range(32)), list(range(16))]))
    assert [len(r.blocks) for r in load_requests(tokens, block_size=16)] == [2, 1]
    assert len(load_requests([list(range(64))], block_size=16)[0].blocks) == 4


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "adaptive", "shadow"])
async def test_the_kernel_evicts_as_the_simulator_predicts(policy, monkeypatch):
    if policy == "shadow":
        # The shadows scale with the capacity in blocks, which the kernel's reservation slack
        # makes one more than the simulator's: one fixed weight compares the mechanics.
        from ucm.kernel._policy import ShadowLRUPolicy

        monkeypatch.setattr(ShadowLRUPolicy, "WEIGHTS", (8.0,))
    requests = chat_requests(120, seed=3)
    size = 4096
    capacity = 24
    sim = simulate(requests, [SimTier(policy, capacity)])
    # The memory driver holds a block in `size` bytes; a store reserves its estimate (one
    # header more) before the driver says: room for one more header keeps `capacity` blocks.
    cfg = load_config({"tiers": [{"driver": "memory", "capacity": (capacity + 1) * size}],
                       "eviction": policy, "promote": False})
    hits = 0
    async with KernelCore.open(cfg) as core:
        tier = core.tiers[0]
        for r in requests:
            keys = list(r.blocks)
            found = (await core.run(Lookup(keys, prefix=True))).hits
            hit = found.index(False) if False in found else len(found)
            hits += hit
            if hit:
                out = [bytearray(size) for _ in range(hit)]
                assert (await core.run(Load(keys[:hit], buffers=out))).ok
            for key in keys[hit:]:  # one event per block: the simulator makes room per block
                if key in tier:
                    assert (await core.run(Load([key], buffers=[bytearray(size)]))).ok
                else:
                    assert (await core.run(Store([key], buffers=[bytes(size)]))).ok
        assert hits == sim.hits
        assert set(tier.policy.index) == sim.held[0]


@pytest.mark.skipif(not os.path.exists(SHARED), reason="the Mooncake trace is not on this "
                    "machine (/work/shared/data/mooncake-traces)")
def test_the_conversation_trace_reproduces_its_readme_figures():
    requests = read_jsonl(SHARED)
    assert sum(len(r.blocks) for r in requests) == 288_500
    assert round(simulate(requests, [SimTier("lru", 4000)]).hit_ratio, 3) == 0.086
    assert round(belady(requests, 4000).hit_ratio, 3) == 0.322


def test_a_ucm_event_trace_is_a_workload(tmp_path):
    """A kernel's own trace (what a deployment records) replays as requests: each Lookup's
    chain of keys, in order."""
    from ucm.autotune._traces import read_ucm_trace
    from ucm.kernel import Kernel, Lookup

    chains = [[b"a1", b"a2"], [b"a1", b"a2", b"a3"], [b"b1"]]
    config = {"tiers": [{"driver": "memory"}], "trace": {"path": str(tmp_path / "trace")}}
    with Kernel(config) as kernel:
        for chain in chains:
            kernel.submit(Lookup(chain, prefix=True)).result(10)
    requests = read_ucm_trace(tmp_path / "trace")
    assert [list(r.blocks) for r in requests] == [[k[:8] for k in c] for c in chains]


def test_shadow_is_not_below_lru_on_a_chat_trace():
    """Conversations returning among one-off prompts, at capacities from a tenth of the
    working set to all of it: the default policy hits at least as many blocks as LRU."""
    requests = chat_requests(3000, seed=4)
    for capacity in (15, 30, 60, 120, 240):
        lru = simulate(requests, [SimTier("lru", capacity)]).hits
        shadow = simulate(requests, [SimTier("shadow", capacity)]).hits
        assert shadow >= lru, (capacity, shadow, lru)


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "adaptive", "shadow"])
async def test_kernel_stores_replay_one_store_a_request_exactly(policy):
    """As the vLLM connector drives the kernel: a prefix Lookup of the blocks a lookup may
    cover, one Load of the hit, one Store of the rest (held blocks included). With the
    kernel's byte accounting the simulator predicts every request's hits and the held set,
    for every policy as it is (the shadow weights too)."""
    from ucm.block import PAYLOAD_OFFSET

    rng = random.Random(5)
    requests = [r._replace(lookup=len(r.blocks) - rng.randrange(2))
                for r in chat_requests(150, seed=4)]
    size, capacity = 4096, 20 * 4096  # a header as big as a block: batches reserve twice
    tier = SimTier(policy, None, capacity_bytes=capacity, block_bytes=size,
                   header_bytes=PAYLOAD_OFFSET)
    sim = simulate(requests, [tier], kernel_stores=True)
    cfg = load_config({"tiers": [{"driver": "memory", "capacity": capacity}],
                       "eviction": policy})
    async with KernelCore.open(cfg) as core:
        got = [await _as_the_connector(core, r, size) for r in requests]
        assert got == sim.per_request and sum(got) > 0
        assert set(core.tiers[0].policy.index) == sim.held[0]


@pytest.mark.parametrize("policy", ["lru", "shadow"])
async def test_kernel_stores_replay_memory_over_posix_exactly(policy, tmp_path):
    """The same over two tiers, promotion off (its copies run in the background): every store
    goes into both (durability local), a posix block file counts its header, and a hit is
    touched in the fastest tier holding it."""
    from ucm.autotune._validate import tier_stack

    rng = random.Random(6)
    requests = [r._replace(lookup=len(r.blocks) - rng.randrange(2))
                for r in chat_requests(150, seed=7)]
    size = 4096
    tiers, sim_tiers = tier_stack(policy, 12, size, posix_blocks=40,
                                  posix_path=str(tmp_path / "store"))
    sim = simulate(requests, sim_tiers, kernel_stores=True, promote=False)
    cfg = load_config({"tiers": tiers, "eviction": policy, "promote": False})
    async with KernelCore.open(cfg) as core:
        got = [await _as_the_connector(core, r, size) for r in requests]
        assert got == sim.per_request
        assert core.stats["load_hits.memory"] == sim.hits_by_tier[0] > 0
        assert core.stats["load_hits.posix"] == sim.hits_by_tier[1] > 0
        for tier, held in zip(core.tiers, sim.held, strict=True):
            assert set(tier.policy.index) == held


async def _as_the_connector(core, request, size: int) -> int:
    """One request as the vLLM connector runs it: a prefix lookup of what vLLM may load, a
    Load of the hit, a Store of the rest; returns the hit."""
    keys = list(request.blocks)
    looked = keys[:request.lookup]
    hit = 0
    if looked:
        found = (await core.run(Lookup(looked, prefix=True))).hits
        hit = found.index(False) if False in found else len(found)
    if hit:
        out = [bytearray(size) for _ in range(hit)]
        assert (await core.run(Load(keys[:hit], buffers=out))).ok
    if keys[hit:]:
        await core.run(Store(keys[hit:], buffers=[bytes(size)] * len(keys[hit:])))
    return hit
