"""The scheduler side of sparse attention (ucm.vllm_hook.sparse_blocks) on vLLM 0.32's own
BlockPool, without an engine: which blocks go back to the pool, which stay as slots (their
prefix-cache hash dropped), that a block another request holds stays in the request, that a
request whose prefix came from a cache is freed too, how requests are named to the worker,
and each reason a request stays dense, counted."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId

from ucm.config import load_config
from ucm.sparse.config import SparseConfig
from ucm.vllm_hook.settings import HookSettings
from ucm.vllm_hook.sparse_blocks import BlockFreer

BS = 32
PROMPT = 600  # 18 full blocks + 24 tokens: 19 blocks at the first decode step
DIGESTS = [bytes([i]) * 16 for i in range(18)]


class _Lookup:
    def __init__(self, hits: list[bool]) -> None:
        self.hits, self.error = tuple(hits), None

    def wait(self, timeout: float | None) -> bool:
        return True

    def result(self) -> tuple[bool, ...]:
        return self.hits

    def cancel(self) -> bool:
        return True


class _Pages:
    """Lookups that find every key but the first `missing[n]` ones at the n-th lookup (the
    last figure from then on)."""

    def __init__(self, *missing: int) -> None:
        self.missing = list(missing) or [0]
        self.lookups = 0

    def start_lookup(self, keys: list[bytes], **kw: object) -> _Lookup:
        missing = self.missing[min(self.lookups, len(self.missing) - 1)]
        self.lookups += 1
        return _Lookup([i >= missing for i in range(len(keys))])


def _freer(pages: _Pages, wait_stores=None, budget: int | float = 4, stride: int = 8,
           **kw: object) -> tuple[BlockFreer, Counter[str]]:
    sparse = SparseConfig(method="quest", budget=budget, block_size=BS, sink_blocks=1,
                          local_blocks=2, stride=stride)
    cfg = load_config({"namespace": "ns", "tiers": [{"driver": "memory", "capacity": "1MiB"}]})
    settings = HookSettings(ucm_config=cfg, namespace="ns", block_size=BS, sparse=sparse,
                            **kw)  # type: ignore[arg-type]
    stats: Counter[str] = Counter()
    return BlockFreer(settings, lambda: pages, stats, wait_stores), stats  # type: ignore[arg-type,return-value]


def _vllm(n_requests: int = 1) -> tuple[BlockPool, dict[str, list], SimpleNamespace]:
    """A block pool with prefix caching, requests "r0".. holding 19 hashed blocks each."""
    pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=BS)
    owned = {}
    for r in range(n_requests):
        blocks = pool.get_new_blocks(19)
        for i, b in enumerate(blocks[:18]):
            pool._insert_block_hash(BlockHashWithGroupId(b"r%d-%d" % (r, i)), b, None)
        owned[f"r{r}"] = blocks
    manager = SimpleNamespace(req_to_blocks={k: list(v) for k, v in owned.items()})
    kv = SimpleNamespace(block_pool=pool,
                         coordinator=SimpleNamespace(single_type_managers=[manager]))
    return pool, owned, kv


def test_free_returns_blocks_keeps_slots_and_shared_blocks():
    pool, owned, kv = _vllm()
    blocks = owned["r0"]
    pool.touch([blocks[7]])  # another request hit block 7 in vLLM's prefix cache
    freer, stats = _freer(_Pages())
    freer.attach(kv)
    freer.start("r0", 0)
    assert freer.plan("r0", PROMPT, 0, 0, DIGESTS) is None  # its prefill is this step
    before = pool.get_num_free_blocks()
    free = freer.plan("r0", PROMPT, PROMPT, 18, DIGESTS)
    assert free is not None
    # blocks 1..15 offloaded (the sink is 0, the window 16-17, 18 is the partial one) but
    # block 7, which another request holds too: it stays, resident, in both
    offloaded = [*range(1, 7), *range(8, 16)]
    assert free.freed == offloaded and free.digests == [DIGESTS[i] for i in offloaded]
    assert free.slots == [b.block_id for b in blocks[1:5]]  # 4 slots: budget 4
    # 10 left the request, back in vLLM's pool
    assert pool.get_num_free_blocks() - before == 10
    assert blocks[7].ref_cnt == 2
    row = kv.coordinator.single_type_managers[0].req_to_blocks["r0"]
    assert [b.is_null for b in row] == [False] * 5 + [True] * 2 + [False] + [True] * 8 + \
        [False] * 3
    # the slots' hashes are gone (their contents will be other blocks'); a freed block keeps
    # its own, with its contents, for vLLM's prefix cache
    for i in range(1, 5):
        assert blocks[i].block_hash is None
        assert pool.cached_block_hash_to_block.get_one_block(
            BlockHashWithGroupId(b"r0-%d" % i)) is None
    assert pool.cached_block_hash_to_block.get_one_block(BlockHashWithGroupId(b"r0-9")) \
        is blocks[9]
    assert stats["sparse_freed_blocks"] == 10 and stats["sparse_kept_shared"] == 1
    assert stats["sparse_slot_blocks"] == 4 and stats["sparse_freed_requests"] == 1
    again = freer.plan("r0", PROMPT, PROMPT + 1, 18, DIGESTS)  # once: later, the window
    assert again is not None and again.window and again.freed == [16]
    assert list(freer.freed) == [{"req_id": "r0", "offloaded": 14, "returned": 10,
                                  "slots": 4, "kept_shared": 1,
                                  "pool_free_after": before + 10}]


def test_slots_are_blocks_no_other_request_holds():
    pool, owned, kv = _vllm()
    pool.touch(owned["r0"][1:4])  # blocks 1-3 shared
    freer, stats = _freer(_Pages())
    freer.attach(kv)
    freer.start("r0", 0)
    free = freer.plan("r0", PROMPT, PROMPT, 18, DIGESTS)
    assert free is not None
    assert free.slots == [b.block_id for b in owned["r0"][4:8]]
    assert free.freed == list(range(4, 16))
    assert stats["sparse_kept_shared"] == 3 and stats["sparse_freed_blocks"] == 8


def test_reasons_to_stay_dense_are_counted():
    pool, _, kv = _vllm(3)
    free_at_start = pool.get_num_free_blocks()
    freer, stats = _freer(_Pages())
    freer.start("r0", 0)
    assert freer.plan("r0", PROMPT, PROMPT, 18, DIGESTS) is None  # no scheduler hook yet
    freer.attach(kv)
    freer.prefix_keys = False  # workers cannot read a prefix's keys (a cache layout unknown)
    freer.start("r1", 64)  # a prefix from vLLM's prefix cache or ucm
    assert freer.plan("r1", PROMPT, PROMPT, 18, DIGESTS) is None
    freer.start("r2", 0)
    assert freer.plan("r2", 100, 100, 3, DIGESTS) is None  # 3 full blocks: sink + window
    assert pool.get_num_free_blocks() == free_at_start  # nothing freed
    assert {k: v for k, v in stats.items() if k.startswith("sparse_dense")} == {
        "sparse_dense.no_manager": 1, "sparse_dense.prefix": 1, "sparse_dense.short": 1}

    freer, stats = _freer(_Pages(), steps_in_turn=False)
    freer.attach(kv)
    freer.start("r0", 0)
    assert freer.plan("r0", PROMPT, PROMPT, 18, DIGESTS) is None
    assert stats["sparse_dense.async"] == 1
    freer.start("r1", 0)  # its prefill runs, then it ends before a decode step
    assert freer.plan("r1", PROMPT, 0, 0, DIGESTS) is None
    freer.finished("r1")
    assert stats["sparse_dense.unfreed"] == 1
    freer.start("r0", 0)  # resumed after a preemption: starts over
    assert stats["sparse_restarts"] == 1 and stats["sparse_dense.async"] == 1


def test_blocks_ucm_does_not_confirm_are_not_freed():
    pool, _, kv = _vllm()
    before = pool.get_num_free_blocks()
    waits: list[float] = []

    def wait_stores(timeout: float) -> bool:  # the worker's stores in flight, then idle
        waits.append(timeout)
        return True

    # one key missing (a store that failed): looked up again after the stores in flight
    # ended, still missing, and past load_timeout (0 here) the request stays dense
    pages = _Pages(1)
    freer, stats = _freer(pages, wait_stores, load_timeout=0.0)
    freer.attach(kv)
    freer.start("r0", 0)
    assert freer.plan("r0", PROMPT, PROMPT, 18, DIGESTS) is None
    assert pages.lookups == 2 and waits == [0.0] and stats["sparse_store_waits"] == 1
    assert stats["sparse_dense.not_stored"] == 1
    assert freer.plan("r0", PROMPT, PROMPT + 1, 18, DIGESTS) is None and pages.lookups == 2
    assert pool.get_num_free_blocks() == before
    # the store landed while the scheduler waited: freed in the same step
    pages = _Pages(1, 0)
    freer, stats = _freer(pages, wait_stores, load_timeout=0.0)
    freer.attach(kv)
    freer.start("r0", 0)
    assert freer.plan("r0", PROMPT, PROMPT, 18, DIGESTS) is not None
    assert pages.lookups == 2 and stats["sparse_freed_requests"] == 1


def test_a_prefix_hit_is_freed_but_for_the_blocks_it_shares():
    # r1 hit r0's first 8 blocks in vLLM's prefix cache (256 tokens computed) while r0 runs:
    # both run sparse; blocks 1-7 are both requests' and stay in both, the rest go
    pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=BS)
    r0 = pool.get_new_blocks(19)
    pool.touch(r0[:8])
    r1 = r0[:8] + pool.get_new_blocks(11)
    manager = SimpleNamespace(req_to_blocks={"r0": list(r0), "r1": list(r1)})
    kv = SimpleNamespace(block_pool=pool,
                         coordinator=SimpleNamespace(single_type_managers=[manager]))
    freer, stats = _freer(_Pages())
    freer.attach(kv)
    freer.prefix_keys = True  # the config's `prefix`, the cache's keys readable
    freer.start("r0", 0)
    freer.start("r1", 256)
    rows: dict[int, str] = {}
    for req_id, blocks, computed in (("r0", r0, PROMPT), ("r1", r1, PROMPT)):
        freer.name_row(rows, req_id, computed, [[b.block_id for b in blocks]])
    # each named by the block its step writes into: its own
    assert rows == {r0[18].block_id: "r0", r1[18].block_id: "r1"}
    before = pool.get_num_free_blocks()
    frees = [freer.plan(r, PROMPT, PROMPT, 18, DIGESTS) for r in ("r0", "r1")]
    assert all(f is not None and f.freed == list(range(8, 16)) for f in frees)
    assert [f.slots for f in frees if f] == [[b.block_id for b in blocks[8:12]]
                                           for blocks in (r0, r1)]
    assert pool.get_num_free_blocks() - before == 2 * 4
    assert all(b.ref_cnt == 2 and not b.is_null for b in r0[1:8])
    for req_id in ("r0", "r1"):
        row = manager.req_to_blocks[req_id]
        assert [b.is_null for b in row] == [False] * 12 + [True] * 4 + [False] * 3
    assert stats["sparse_prefix_requests"] == 1 and stats["sparse_kept_shared"] == 14
    assert not [k for k in stats if k.startswith("sparse_dense")]
    # the worker is told which requests ended, once
    freer.finished("r0")
    freer.start("r1", 0)  # resumed after a preemption: ends, starts over
    assert freer.take_ended() == ["r0", "r1"] and freer.take_ended() == []


def test_blocks_the_moving_window_leaves_are_freed_once_ucm_holds_them():
    # after the first free, each step frees the full blocks that left the worker's local
    # window (its session's last 2 of ceil(tokens / 32) blocks) as its last refresh saw it
    # (up to stride - 1 = 3 tokens back), generated ones too, once a lookup confirms them
    # (no waiting for stores); budget 4: its 4 slots are enough, so they go back to the pool
    pool, _, kv = _vllm()
    row = kv.coordinator.single_type_managers[0].req_to_blocks["r0"]
    digests = [bytes([i]) * 16 for i in range(24)]
    pages = _Pages(0, 0, 1, 0)  # the third lookup misses block 17 (its store in flight)
    freer, stats = _freer(pages, stride=4)
    freer.attach(kv)
    freer.start("r0", 0)
    assert freer.plan("r0", PROMPT, PROMPT, 18, digests) is not None  # blocks 1-15
    assert [freer.window_end(c) for c in (600, 608, 609, 640, 641)] == [17, 17, 18, 18, 19]
    assert [freer.left_window(c) for c in (601, 611, 612)] == [17, 17, 18]
    before = pool.get_num_free_blocks()
    free = freer.plan("r0", PROMPT, PROMPT + 1, 18, digests)  # 601 tokens: block 16 left
    assert free is not None and free.window
    assert (free.freed, free.digests, free.slots) == ([16], [digests[16]], [])
    assert row[16].is_null and pool.get_num_free_blocks() - before == 1
    assert freer.plan("r0", PROMPT, 602, 18, digests) is None  # nothing new
    row.append(pool.get_new_blocks(1)[0])  # block 19, generated tokens
    # block 17 left the window at 609 tokens, the last refresh's window at 612; but ucm
    # does not hold it yet: it waits
    assert freer.plan("r0", PROMPT, 611, 19, digests) is None
    assert freer.plan("r0", PROMPT, 612, 19, digests) is None
    assert not row[17].is_null and stats["sparse_window_waits"] == 1
    free = freer.plan("r0", PROMPT, 613, 19, digests)  # confirmed at a later step
    assert free is not None and free.freed == [17] and row[17].is_null
    # 644 tokens: block 18 (prompt and generated tokens, saved) left; not before it is saved
    row.append(pool.get_new_blocks(1)[0])
    assert freer.plan("r0", PROMPT, 644, 18, digests) is None
    free = freer.plan("r0", PROMPT, 645, 19, digests)
    assert free is not None and free.freed == [18] and free.digests == [digests[18]]
    assert stats["sparse_window_freed_blocks"] == 3 and stats["sparse_window_frees"] == 3
    assert stats["sparse_window_slot_blocks"] == 0 and stats["sparse_freed_blocks"] == 11
    assert pool.get_num_free_blocks() - before == 3 - 2  # 2 allocated for generated tokens
    assert pages.lookups == 5  # the first free's, then one per step with a block to confirm
    freer.finished("r0")  # ended: nothing more
    assert freer.plan("r0", PROMPT, 700, 20, digests) is None and freer.take_ended() == ["r0"]


def test_the_window_keeps_a_slot_for_each_block_the_budget_may_select():
    # budget 1.0: every block between sinks and window may be selected, so each block the
    # window leaves stays the request's as a slot holding itself (its hash dropped), none
    # goes back to the pool; a block another request holds too stays, resident
    pool, owned, kv = _vllm()
    row = kv.coordinator.single_type_managers[0].req_to_blocks["r0"]
    digests = [bytes([i]) * 16 for i in range(24)]
    freer, stats = _freer(_Pages(), budget=1.0, stride=1)
    freer.attach(kv)
    freer.start("r0", 0)
    first = freer.plan("r0", PROMPT, PROMPT, 18, digests)
    assert first is not None and len(first.slots) == 15
    before = pool.get_num_free_blocks()
    free = freer.plan("r0", PROMPT, PROMPT + 1, 18, digests)
    assert free is not None and free.freed == [16] and free.slots == [owned["r0"][16].block_id]
    assert free.holding == [16] and not row[16].is_null and row[16].block_hash is None
    assert pool.get_num_free_blocks() == before
    pool.touch([owned["r0"][17]])  # another request hit block 17 in vLLM's prefix cache
    row.append(pool.get_new_blocks(1)[0])
    assert freer.plan("r0", PROMPT, 609, 19, digests) is None  # shared: it stays
    assert stats["sparse_window_kept_shared"] == 1 and owned["r0"][17].ref_cnt == 2
    assert stats["sparse_window_slot_blocks"] == 1 and stats["sparse_window_freed_blocks"] == 0


def test_the_window_frees_a_block_once_every_rank_holds_its_shard():
    # TP 2: a block leaves once both ranks' shards are found; rank 1's shard of block 17
    # still missing holds it (and the ones after it) back
    from ucm.vllm_hook.keys import rank_key

    digests = [bytes([i]) * 16 for i in range(24)]
    missing = {rank_key(digests[17], 1, 2)}

    class _Held:
        lookups: list[list[bytes]] = []

        def start_lookup(self, keys: list[bytes], **kw: object) -> _Lookup:
            self.lookups.append(keys)
            return _Lookup([k not in missing for k in keys])

    pool, _, kv = _vllm()
    row = kv.coordinator.single_type_managers[0].req_to_blocks["r0"]
    row.append(pool.get_new_blocks(1)[0])
    pages = _Held()
    freer, stats = _freer(pages, stride=1, tp_size=2)  # type: ignore[arg-type]
    freer.attach(kv)
    freer.start("r0", 0)
    assert freer.plan("r0", PROMPT, PROMPT, 18, digests) is not None
    free = freer.plan("r0", PROMPT, 641, 19, digests)  # blocks 16-18 left the window
    assert free is not None and free.freed == [16]
    assert pages.lookups[-1] == [rank_key(digests[i], r, 2) for r in (0, 1)
                                 for i in (16, 17, 18)]
    assert not row[17].is_null and stats["sparse_window_waits"] == 1
    missing.clear()
    free = freer.plan("r0", PROMPT, 642, 19, digests)
    assert free is not None and free.freed == [17, 18] and row[17].is_null and row[18].is_null
