"""`ucm bench serve`: a multi-turn chat workload replayed through vLLM's OpenAI server.

For each setup, a first server runs the workload (a connector stores what it computes), then
a fresh server on the same store replays it, as after a restart or on a second replica; the
replay is measured:
    none      no connector (vLLM's own prefix cache only; nothing survives the restart)
    ucm       UCMConnector (`ucm serve`), a posix tier in the work directory
    example   vLLM's ExampleConnector (safetensors files in the work directory)

The workload: `--conversations` chats run concurrently, each a system prompt holding a document
of its own and `--turns` user turns, each turn's prompt the whole conversation so far (earlier
answers included). TTFT is the client's (streamed, the first chunk with a token); throughput is
generated tokens over the replay's wall time; the hit rate is the share of prompt tokens vLLM
did not compute (`vllm:prompt_tokens_by_source_total`: a connector's load or its own cache),
"loaded" the share a connector loaded.
The model is `ucm bench vllm`'s random-weight 8-layer model unless `--model` names one
(its chat template then comes with it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import replace
from typing import Any

from ucm.bench.processes import ServerProcess, free_port
from ucm.bench.vllm import SPEC  # the random 8-layer model of `ucm bench vllm`

SETUPS = ("none", "ucm", "example")
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def _kv_config(setup: str, work: str) -> dict[str, Any] | None:
    from ucm.vllm_hook.serve import kv_transfer_config

    if setup == "ucm":
        config = kv_transfer_config()
        config["kv_connector_extra_config"] = {
            "ucm": {"tiers": [{"driver": "posix", "path": os.path.join(work, "ucm")}]}}
        return config
    if setup == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "shared_storage_path": os.path.join(work, "example")}}
    return None


class _Server:
    def __init__(self, args: argparse.Namespace, setup: str, work: str, name: str) -> None:
        from ucm.bench.engines import engine_env, find_tcmalloc
        from ucm.vllm_hook.serve import SERVER_MODULE

        self.port = free_port()
        argv = [sys.executable, "-m", SERVER_MODULE, "--model", args.model,
                "--max-model-len", str(args.max_model_len), "--enforce-eager", "--seed", "0",
                "--kv-cache-memory-bytes", str(args.kv_cache_mib * 2**20),
                "--host", "127.0.0.1", "--port", str(self.port)]
        if args.template:
            argv += ["--chat-template", args.template]
        if args.dtype:
            argv += ["--dtype", args.dtype]
        kvt = _kv_config(setup, work)
        if kvt is not None:
            argv += ["--kv-transfer-config", json.dumps(kvt)]
        env = {**engine_env(os.environ, tcmalloc=find_tcmalloc()), "HF_HUB_OFFLINE": "1"}
        self._process = ServerProcess(f"{setup} server", argv, env,
                                      os.path.join(work, f"{setup}-{name}.log"), self.port)

    def prompt_tokens_by_source(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "vllm:prompt_tokens_by_source_total":
                    out[s.labels["source"]] = out.get(s.labels["source"], 0) + s.value
        return out

    def stop(self) -> None:
        self._process.stop()


def _document(seed: int, n_words: int) -> str:
    from ucm.bench.models import sample_text

    return sample_text(n_words, seed)


def _workload(server: _Server, args: argparse.Namespace) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none",
                           timeout=600)
    ttfts: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def chat(conv: int) -> None:
        messages = [{"role": "system", "content": _document(1000 + conv, args.doc_words)}]
        for turn in range(args.turns):
            messages.append({"role": "user", "content": _document(conv * 100 + turn, 20)})
            t0, first, text, n = time.perf_counter(), None, "", 0
            # The first token is the first chunk with a logprob (the first chunk only names
            # the role; a random model's token may decode to no text).
            for chunk in client.chat.completions.create(
                    model=args.model, messages=messages, max_tokens=args.max_tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True},
                    logprobs=True, extra_body={"ignore_eos": True}):
                choice = chunk.choices[0] if chunk.choices else None
                if choice is not None:
                    if first is None and choice.logprobs and choice.logprobs.content:
                        first = time.perf_counter() - t0
                    text += choice.delta.content or ""
                if chunk.usage:
                    n = chunk.usage.completion_tokens
            messages.append({"role": "assistant", "content": text})
            with lock:
                ttfts.append(first if first is not None else time.perf_counter() - t0)
                tokens[0] += n

    # vLLM's first request on a fresh server pays one-off work: not the workload's
    client.completions.create(model=args.model, prompt=_document(7, 8), max_tokens=1)
    before = server.prompt_tokens_by_source()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=chat, args=(c,)) for c in range(args.conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = server.prompt_tokens_by_source()
    delta = {k: v - before.get(k, 0) for k, v in after.items()}
    total = sum(delta.values())
    ttfts.sort()
    return {"ttft_p50_ms": statistics.median(ttfts) * 1000,
            "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1000,
            "tokens_per_s": tokens[0] / wall,
            "hit_rate": (total - delta.get("local_compute", 0)) / total,
            "loaded_rate": delta.get("external_kv_transfer", 0) / total,
            "requests": len(ttfts), "wall_s": wall}


def run_setup(args: argparse.Namespace, setup: str, work: str) -> dict[str, Any]:
    first = _Server(args, setup, work, "first")
    try:
        _workload(first, args)
    finally:
        first.stop()
    replay = _Server(args, setup, work, "replay")
    try:
        return _workload(replay, args)
    finally:
        replay.stop()


def _plot(results: dict[str, dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    xs = range(len(names))
    ax.bar([x - width / 2 for x in xs], [results[n]["ttft_p50_ms"] for n in names], width,
           label="TTFT p50")
    ax.bar([x + width / 2 for x in xs], [results[n]["ttft_p99_ms"] for n in names], width,
           label="TTFT p99")
    ax.set_xticks(list(xs), [f"{n}\nhit {results[n]['hit_rate']:.0%}" for n in names])
    ax.set_ylabel("ms")
    ax.set_title("multi-turn chat replayed on a restarted server")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ucm bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--model", help="a model directory (default: the random test model)")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--doc-words", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--plot", default="ucm-bench-serve.png")
    p.add_argument("--work", help="work directory (default: a temporary one, removed)")
    args = p.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="ucm-bench-serve-")
    args.template, args.dtype = None, None
    if not args.model:
        from ucm.bench.models import build_model

        spec = replace(SPEC, max_positions=max(SPEC.max_positions, args.max_model_len))
        args.model = str(build_model(os.path.join(work, "model"), spec))
        args.template = os.path.join(work, "chat.jinja")
        with open(args.template, "w") as f:
            f.write(TEMPLATE)
        args.dtype = spec.dtype
    results: dict[str, dict[str, Any]] = {}
    try:
        for setup in args.setups.split(","):
            print(f"{setup}: first server, then the replay ...", flush=True)
            results[setup] = run_setup(args, setup, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.conversations} conversations x {args.turns} turns, replayed on a "
          f"restarted server\n")
    print(f"{'setup':<10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'tokens/s':>10}{'hit rate':>10}"
          f"{'loaded':>8}")
    for name, r in results.items():
        print(f"{name:<10}{r['ttft_p50_ms']:>13.0f}{r['ttft_p99_ms']:>13.0f}"
              f"{r['tokens_per_s']:>10.1f}{r['hit_rate']:>10.0%}{r['loaded_rate']:>8.0%}")
    print("\nhit rate: prompt tokens not computed (a connector's load or vLLM's own cache); "
          "loaded: by the connector")
    try:
        _plot(results, args.plot)
        print(f"\nplot: {args.plot}")
    except ImportError:
        print("\n(no plot: matplotlib is missing; pip install 'ucm[trace]')")
    return 0
