"""ucm as SGLang's HiCache storage tier on an MLA model (issue 36): a DeepSeek-V2-Lite-like
model (latent attention, kv_lora_rank 512 + rope 64, tiny random bf16 weights) on real SGLang,
in .venv-sglang. One engine computes a prompt and stores its pages, then hits it in its own
radix cache (the reference output); a fresh engine loads the pages from ucm and answers with
the same tokens. ucm's own trace counts the pages stored and loaded and their bytes: one latent
of 576 values per token and layer, one shard for every TP rank, no K/V split.

SGLang 0.5.19 on this CPU runs DeepSeek only through sgl_kernel's compiled AMX kernels, which
the test venv lacks, so the engine runs with `UCM_TEST_SGLANG_MLA=absorbed`
(support/run_engine.py: the torch_native attention backend takes MLA's absorbed path for every
forward, the latent read from the pool; and the MLA host pool gets the stand-in's `direct`
copy). HiCache, its MLA host pool and the storage calls are SGLang's own.

A hybrid sliding-window model (a tiny Llama whose config opts into SGLang's hybrid SWA pools)
stops the engine at start, naming its `swa` pool. Without SGLang: the MLA pages of two TP ranks
are one shard (the same key, either rank loads it), and every sidecar pool a hybrid model has
(sliding window, Mamba, DSA indexer, draft, ...) is refused by name when SGLang registers it.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sglang_support import (
    PAGE_SIZE,
    SGLangFailed,
    needs_sglang,
    posix,
    run_sglang,
    ucm_extra,
)

from ucm.bench.models import sample_text
from ucm.errors import ConfigError

LAYERS = 2
LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim: the values per token and layer
MLA_PAGE_BYTES = LAYERS * PAGE_SIZE * LATENT * 2  # bf16
PROMPT = sample_text(330, 11)  # 331 tokens: 20 full pages, past HiCache's 256-token threshold
MLA_ENV = {"UCM_TEST_SGLANG_MLA": "absorbed"}



def engine_test(test: Any) -> Any:
    """A test that reads the SGLang runs: skipped without .venv-sglang, slow."""
    for mark in (pytest.mark.timeout(600), pytest.mark.slow, needs_sglang):
        test = mark(test)
    return test


def build_mla_model(root: Path) -> str:
    """DeepSeek-V2-Lite's attention at a tiny size (ucm.bench.models, as tests/vllm builds it),
    with its checkpoint's yarn rope at factor 1 (plain rope): SGLang's CPU rope for DeepSeek
    takes only `deepseek_yarn` ("Only deepseek_yarn is supported for CPU for now")."""
    from ucm.bench.models import ModelSpec, build_model

    path = build_model(root, ModelSpec(layers=LAYERS, hidden=128, heads=2, kv_heads=2,
                                       max_positions=1024, family="deepseek_v2",
                                       dtype="bfloat16", seed=38))
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_parameters"] = {
        "rope_type": "yarn", "factor": 1.0, "rope_theta": 10000.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 1024}
    config_path.write_text(json.dumps(config, indent=1))
    return str(path)


def build_hybrid_swa_model(root: Path) -> str:
    """A tiny fp32 Llama that SGLang runs as a hybrid sliding-window model: its config opts in
    (`is_hybrid_swa`, layer 0 sliding with a window of 64, layer 1 full), so SGLang gives it an
    `swa` host pool beside the KV one."""
    from ucm.bench.models import ModelSpec, build_model

    path = build_model(root, ModelSpec(dtype="float32"))
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(is_hybrid_swa=True, hybrid_layer_pattern=[1, 0], sliding_window=64)
    config_path.write_text(json.dumps(config, indent=1))
    return str(path)


def start_error(model: str, root: Path) -> str:
    """The output's tail of an engine that did not start (or says that it did)."""
    try:
        run_sglang({"model": model, "backend": "dynamic", "extra": ucm_extra(posix(root)),
                    "prompts": [PROMPT]}, watchdog=180)
    except SGLangFailed as exc:
        return str(exc)
    return "the engine started and answered"


def ucm_ops(trace_dir: Path, op: str) -> list[dict[str, Any]]:
    """The fields of ucm's "op" records of kind `op` (load, store) in a trace directory."""
    from ucm.trace import read_trace

    return [r.fields for r in read_trace(trace_dir)
            if r.phase == "op" and r.fields.get("op") == op and "error" not in r.fields]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The storing engine (PROMPT cold, then its radix hit) and a fresh one over its store."""
    tmp = tmp_path_factory.mktemp("sglang-mla")
    model = build_mla_model(tmp / "model")
    root = tmp / "store"

    def ucm(trace: Path) -> dict[str, Any]:
        return ucm_extra(posix(root, trace={"path": str(trace)}))

    spec = {"model": model, "dtype": "bfloat16", "backend": "dynamic"}
    with ThreadPoolExecutor(max_workers=1) as pool:  # beside the MLA engines: two cores
        hybrid = pool.submit(start_error, build_hybrid_swa_model(tmp / "swa-model"),
                             tmp / "swa-store")
        cold = run_sglang({**spec, "extra": ucm(tmp / "trace-cold"),
                           "prompts": [PROMPT, PROMPT], "settle": 2}, env=MLA_ENV)
        [fresh] = run_sglang({**spec, "extra": ucm(tmp / "trace-fresh"), "prompts": [PROMPT],
                              "settle": 0.5}, env=MLA_ENV)
        hybrid_error = hybrid.result()
    return SimpleNamespace(root=root, cold=cold, fresh=fresh, stored=ucm_ops(
        tmp / "trace-cold", "store"), loaded=ucm_ops(tmp / "trace-fresh", "load"),
        hybrid_error=hybrid_error)


def page_files(root: Path) -> tuple[str, list[Path]]:
    [ns_dir] = [p for p in root.iterdir() if p.is_dir()]
    return ns_dir.name, sorted(ns_dir.rglob("*.blk"))


@engine_test
def test_stored_mla_pages_hold_one_latent_per_token_and_layer(runs):
    namespace, files = page_files(runs.root)
    assert "sglang.layer_first.mla" in namespace and "bfloat16" in namespace
    cold = runs.cold[0]
    assert cold["storage_tokens"] == 0
    stored = sum(op["stored"] for op in runs.stored)
    # every full page of the prompt, once: one file per page, no shard per rank
    assert stored == len(files) >= cold["prompt_tokens"] // PAGE_SIZE
    # 576 bf16 values per token and layer: no K/V split, no heads
    assert sum(op["bytes"] for op in runs.stored) == stored * MLA_PAGE_BYTES


@engine_test
def test_a_fresh_engine_loads_the_stored_mla_prefix_with_the_radix_hits_output(runs):
    hit = runs.cold[1]
    fresh = runs.fresh
    # the reference went through a cache too: the first engine's own radix (device) hit
    assert hit["cached_tokens"] >= 0.9 * hit["prompt_tokens"] and hit["storage_tokens"] == 0
    assert fresh["details"].get("storage_backend") == "UCMStorage"
    assert fresh["storage_tokens"] >= 0.9 * fresh["prompt_tokens"], fresh
    # ucm's side: the pages SGLang counts as loaded from storage, each one MLA page
    loaded = sum(op["hits"] for op in runs.loaded)
    assert loaded == fresh["storage_tokens"] // PAGE_SIZE
    assert sum(op["bytes"] for op in runs.loaded) == loaded * MLA_PAGE_BYTES
    assert fresh["output_ids"] == hit["output_ids"] and fresh["text"] == hit["text"]
    assert len(fresh["output_ids"]) == 8


@engine_test
def test_sglang_with_a_hybrid_swa_model_stops_at_start_naming_its_swa_pool(runs):
    # SGLang would otherwise call the v2 interface for the pool and hang the request
    assert "ConfigError" in runs.hybrid_error and "host pool 'swa'" in runs.hybrid_error
    assert "--disable-hybrid-swa-memory" in runs.hybrid_error


# -- without SGLang ------------------------------------------------------------------------------
class MLAPool:
    """SGLang's MLA host pool, layer_first: kv_buffer[layers, tokens, 1, 576], a page's pieces
    one per layer (its get_page_buffer_meta)."""

    layout = "layer_first"
    page_size = 4

    def __init__(self, seed: int, tokens: int = 32) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn((LAYERS, tokens, 1, LATENT), generator=g).bfloat16()
        self.dtype = self.kv_buffer.dtype
        self.layer_num = LAYERS

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        ptrs = [self.kv_buffer[layer, first].data_ptr()
                for first in indices.tolist()[::self.page_size] for layer in range(LAYERS)]
        return ptrs, [self.page_size * LATENT * 2] * len(ptrs)

    def get_dummy_flat_data_page(self) -> Any:
        return self.page(0).clone()

    def page(self, first: int) -> Any:
        return self.kv_buffer[:, first:first + self.page_size].flatten()


def storage_config(ucm: Any, *, is_mla: bool, tp_rank: int = 0, tp_size: int = 1) -> Any:
    return SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                           is_mla_model=is_mla, model_name="unused",
                           extra_config={"ucm": ucm, "model_id": "m"})


def pages(*first: int) -> Any:
    import torch

    return torch.cat([torch.arange(f, f + MLAPool.page_size) for f in first])


KEYS = [f"{i:064x}" for i in range(1, 4)]


def test_mla_pages_are_one_shard_that_every_tp_rank_reads(tmp_path):
    pytest.importorskip("torch")
    from ucm.sglang_hook import UCMStorageBase

    ucm = posix(tmp_path)
    src, dst = MLAPool(seed=1), MLAPool(seed=2)
    rank0 = UCMStorageBase(storage_config(ucm, is_mla=True, tp_rank=0, tp_size=2))
    rank1 = UCMStorageBase(storage_config(ucm, is_mla=True, tp_rank=1, tp_size=2))
    rank0.register_mem_pool_host(src)
    rank1.register_mem_pool_host(dst)
    assert rank0.namespace == rank1.namespace and ".mla-" in rank0.namespace
    assert rank0._keys(KEYS) == rank1._keys(KEYS)
    assert rank0.kv_layouts == []  # no K/V split: quantizing tiers store it losslessly
    assert rank0.batch_set_v1(KEYS[:2], pages(0, 4)) == [True, True]
    assert rank1.batch_exists(KEYS) == 2
    assert rank1.batch_get_v1(KEYS[:2], pages(8, 16)) == [True, True]
    import torch

    assert torch.equal(dst.page(8), src.page(0)) and torch.equal(dst.page(16), src.page(4))
    assert len(list(tmp_path.rglob("*.blk"))) == 2  # one copy for both ranks
    mha = [UCMStorageBase(storage_config(ucm, is_mla=False, tp_rank=r, tp_size=2))
           for r in (0, 1)]
    for b in mha:
        b.seed = rank0.seed
    assert mha[0]._keys(KEYS) != mha[1]._keys(KEYS)  # an MHA page: a shard per rank
    rank0.close()
    rank1.close()


class PoolName(StrEnum):  # as SGLang's (sglang.srt.mem_cache.hicache_storage)
    KV = "kv"
    SWA = "swa"
    MAMBA = "mamba"
    INDEXER = "indexer"
    DRAFT = "draft"
    DEEPSEEK_V4_C4 = "deepseek_v4_c4"


@pytest.mark.parametrize("pool", [p for p in PoolName if p is not PoolName.KV],
                         ids=lambda p: p.value)
def test_a_hybrid_models_sidecar_pool_is_refused_by_name_at_start(pool):
    from ucm.sglang_hook import UCMStorageBase

    b = UCMStorageBase(storage_config({"tiers": [{"driver": "memory"}]}, is_mla=False))
    b.register_mem_host_pool_v2(object(), PoolName.KV)  # every model's KV pool: accepted
    with pytest.raises(ConfigError, match=f"host pool '{pool.value}'"):
        b.register_mem_host_pool_v2(object(), pool)
    # what SGLang would call with such a pool: misses, never an exception
    transfer = SimpleNamespace(name=pool, keys=KEYS[:2], host_indices=None)
    assert b.batch_exists_v2(KEYS, [transfer]).kv_hit_pages == 0
    assert b.batch_get_v2([transfer]) == {pool.value: [False, False]}
    assert b.batch_set_v2([transfer]) == {pool.value: [False, False]}
