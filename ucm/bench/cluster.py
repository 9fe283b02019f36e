"""`ucm bench cluster`: several vLLM instances on one ucm store behind `ucm proxy`, requests
sent in turn (round robin) against sent to the instance that holds the longest prefix (prefix
routing on ucm's KV events), against one instance alone.

Each instance is `ucm serve` (kv_role both), on a CPU of its own (one instance: on all), with a
ucm config of its own: a memory tier of `--memory-mib` over one posix store that all share, and
vLLM's KV events published on a ZMQ endpoint of its own; `ucm proxy --instances ... --route
roundrobin|prefix` is the front. Every (instances, route) pair starts fresh instances on an
empty store, and replays the same requests, `--concurrency` at a time:
    chat      `--sessions` chats, each a document of `--doc-tokens` tokens of its own and
              `--turns` turns, every turn's prompt the whole conversation so far (the demo's
              shape, in token ids: turn 1 of every session, then turn 2, ...)
    mooncake  the first `--requests` requests of the Mooncake conversation trace
              (`--trace`); each hash id is `--block-tokens` token ids of its own, so the
              trace's shared prefixes are shared prompt prefixes here
Figures per run: the hit ratio (prompt tokens vLLM did not compute: its own prefix cache or
ucm's loads, from `vllm:prompt_tokens_by_source_total`), the share of hits served from memory
(vLLM's own cache, and ucm's memory tier: `ucm_load_hits_total{tier}` in blocks, turned into
tokens), and the client's TTFT p50/p99. The model is `ucm bench vllm`'s random 8-layer model
unless `--model` names one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass

from ucm.bench.pd import _pct, _stream, bench_model
from ucm.bench.processes import ServerProcess, free_port, ucm_command

TRACE = "/work/shared/data/mooncake-traces/conversation_trace.jsonl"


@dataclass
class Run:
    instances: int
    route: str
    ttft: list[float]
    sources: dict[str, float]  # prompt tokens by source, summed over the instances
    loaded: dict[str, float]  # ucm's loaded blocks by tier
    errors: int
    routed_by_prefix: int


def chat_requests(sessions: int, turns: int, doc_tokens: int, vocab: int,
                  seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    convs = [[rng.randrange(3, vocab) for _ in range(doc_tokens)] for _ in range(sessions)]
    out = []
    for _turn in range(turns):
        for conv in convs:
            conv += [rng.randrange(3, vocab) for _ in range(48)]  # the user's turn
            out.append(list(conv))
            conv += [rng.randrange(3, vocab) for _ in range(16)]  # the answer, as history
    return out


def trace_requests(path: str, count: int, block_tokens: int, vocab: int,
                   max_tokens: int) -> list[list[int]]:
    """The first `count` requests, each hash id `block_tokens` token ids of its own, a prompt
    cut to `max_tokens`."""
    from ucm.autotune._traces import jsonl_records

    out = []
    for ids, _ in jsonl_records(path):
        prompt: list[int] = []
        for h in ids:
            rng = random.Random(h)
            prompt += [rng.randrange(3, vocab) for _ in range(block_tokens)]
        out.append(prompt[:max_tokens])
        if len(out) >= count:
            break
    if not out:
        raise SystemExit(f"ucm bench cluster: no requests in {path}")
    return out


def _metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _server(args: argparse.Namespace, work: str, i: int, store: str, cpus: str,
            ) -> tuple[ServerProcess, int]:
    from ucm.bench.engines import engine_env, find_tcmalloc

    config = os.path.join(work, f"instance{i}.yaml")
    with open(config, "w") as f:
        f.write(f"tiers:\n  - driver: memory\n    capacity: {args.memory_mib}MiB\n"
                f"  - driver: posix\n    path: {store}\n")
    port, events = free_port(), free_port()
    argv = ["taskset", "-c", cpus, *ucm_command(), "serve", args.model, "--ucm-config", config,
            "--port", str(port),
            "--max-model-len", str(args.max_model_len), "--enforce-eager", "--seed", "0",
            "--kv-cache-memory-bytes", str(args.kv_cache_mib * 2**20),
            "--kv-events-config", json.dumps({"enable_kv_cache_events": True,
                                              "publisher": "zmq",
                                              "endpoint": f"tcp://*:{events}"})]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    env = {**engine_env(os.environ, tcmalloc=find_tcmalloc()), "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": cpus}
    return ServerProcess(f"instance {i}", argv, env, os.path.join(work, f"instance{i}.log"),
                         port), events


def run_one(args: argparse.Namespace, work: str, instances: int, route: str,
            requests: list[list[int]]) -> Run:
    run_dir = os.path.join(work, f"{instances}-{route}")
    os.makedirs(run_dir)
    store = os.path.join(run_dir, "store")
    procs: list[ServerProcess] = []
    try:
        servers = []
        cpus = sorted(os.sched_getaffinity(0))
        for i in range(instances):
            # one instance: every CPU; more: each its own CPU (in turn when fewer CPUs)
            mine = ",".join(map(str, cpus)) if instances == 1 else str(cpus[i % len(cpus)])
            server, events = _server(args, run_dir, i, store, mine)
            procs.append(server)
            servers.append((server, events))
        urls = ",".join(f"http://127.0.0.1:{s.port}" for s, _ in servers)
        argv = [*ucm_command(), "proxy", "--instances", urls, "--route", route,
                "--port", str(port := free_port())]
        if route == "prefix":
            argv += ["--kv-events", ",".join(f"tcp://127.0.0.1:{e}" for _, e in servers)]
        proxy = ServerProcess("ucm proxy", argv, dict(os.environ),
                              os.path.join(run_dir, "proxy.log"), port, timeout=120)
        procs.append(proxy)
        time.sleep(0.5)  # the proxy's subscriptions join before the first events
        ttft, errors = _replay(f"http://127.0.0.1:{port}", args, requests)
        time.sleep(2)  # the last steps' stats reach /metrics
        sources: dict[str, float] = {}
        loaded: dict[str, float] = {}
        for server, _ in servers:
            for (name, labels), value in _metrics(server.port).items():
                lab = dict(labels)
                if name == "vllm:prompt_tokens_by_source_total":
                    sources[lab["source"]] = sources.get(lab["source"], 0) + value
                elif name == "ucm_load_hits_total" and "tier" in lab:
                    loaded[lab["tier"]] = loaded.get(lab["tier"], 0) + value
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as resp:
            health = json.loads(resp.read())
        return Run(instances, route, ttft, sources, loaded, errors,
                   int(health.get("routed_by_prefix", 0)))
    finally:
        for p in reversed(procs):
            p.stop()


def _replay(url: str, args: argparse.Namespace, requests: list[list[int]],
            ) -> tuple[list[float], int]:
    ttft: list[float] = []
    errors = [0]
    lock = threading.Lock()
    queue = list(enumerate(requests))

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                i, prompt = queue.pop(0)
            try:
                first, _ = _stream(url, args.model, prompt, args.gen)
            except Exception as exc:  # counted; the replay goes on
                with lock:
                    errors[0] += 1
                print(f"  request {i}: {exc}", flush=True)
                continue
            with lock:
                ttft.append(first)
                done = len(ttft) + errors[0]
            if done % 10 == 0:
                print(f"  {done}/{len(requests)} requests", flush=True)

    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttft, errors[0]


def _print(runs: list[Run], args: argparse.Namespace, requests: list[list[int]]) -> None:
    tokens = sum(len(r) for r in requests)
    print(f"\n{args.workload}: {len(requests)} requests, {tokens:,} prompt tokens, "
          f"{args.concurrency} at a time; memory tier {args.memory_mib} MiB per instance\n")
    head = ("instances", "route", "hit ratio", "vLLM cache", "ucm memory", "ucm posix",
            "TTFT p50", "TTFT p99", "by prefix", "errors")
    print("".join(f"{h:>12}" for h in head))
    for r in runs:
        total = sum(r.sources.values()) or 1.0
        local = r.sources.get("local_cache_hit", 0.0)
        external = r.sources.get("external_kv_transfer", 0.0)
        hits = local + external or 1.0
        blocks = sum(r.loaded.values()) or 1.0
        memory = external * r.loaded.get("memory", 0.0) / blocks
        posix = external - memory
        cells = [str(r.instances), r.route, f"{(local + external) / total:.0%}",
                 f"{local / hits:.0%}", f"{memory / hits:.0%}", f"{posix / hits:.0%}",
                 f"{_pct(r.ttft, 0.5):.0f}ms", f"{_pct(r.ttft, 0.99):.0f}ms",
                 str(r.routed_by_prefix), str(r.errors)]
        print("".join(f"{c:>12}" for c in cells))
    print("\nhit ratio: prompt tokens not computed; vLLM cache / ucm memory / ucm posix: the "
          "share of those hits from vLLM's own prefix cache, ucm's memory tier, the shared "
          "posix store (ucm's loaded blocks by tier); by prefix: requests the proxy sent to a "
          "prefix holder that round robin would not have picked")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ucm bench cluster", description=__doc__.split("\n")[0])
    p.add_argument("--instances", default="1,2", help="instance counts, e.g. 1,2,4")
    p.add_argument("--routes", default="roundrobin,prefix")
    p.add_argument("--workload", choices=("chat", "mooncake"), default="chat")
    p.add_argument("--sessions", type=int, default=7,
                   help="sessions (odd, so that round robin moves a session between 2 instances)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--doc-tokens", type=int, default=1024)
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--block-tokens", type=int, default=128,
                   help="token ids per trace hash id (the trace's blocks are 512 tokens)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--gen", type=int, default=4, help="tokens generated per request")
    p.add_argument("--memory-mib", type=int, default=96)
    p.add_argument("--model", help="a model directory (default: the random test model)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-mib", type=int, default=48,
                   help="vLLM's own KV cache per instance (small, so that ucm's tiers matter)")
    p.add_argument("--work", help="work directory (default: a temporary one, removed)")
    args = p.parse_args(argv)
    try:
        counts = [int(c) for c in args.instances.split(",")]
    except ValueError:
        p.error(f"--instances must be counts like 1,2,4, not {args.instances!r}")
    routes = args.routes.split(",")
    if any(c < 1 for c in counts):
        p.error("--instances: each count must be at least 1")
    if any(r not in ("roundrobin", "prefix") for r in routes):
        p.error(f"--routes: roundrobin and/or prefix, not {args.routes!r}")
    for name in ("sessions", "turns", "doc_tokens", "requests", "block_tokens", "concurrency",
                 "gen", "memory_mib"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.workload == "mooncake" and not os.path.exists(args.trace):
        p.error(f"--trace {args.trace}: no such file")
    work = args.work or tempfile.mkdtemp(prefix="ucm-bench-cluster-")
    runs: list[Run] = []
    try:
        vocab = bench_model(args, work)
        requests = (chat_requests(args.sessions, args.turns, args.doc_tokens, vocab)
                    if args.workload == "chat" else
                    trace_requests(args.trace, args.requests, args.block_tokens, vocab,
                                   args.max_model_len - args.gen))
        longest = max(len(r) for r in requests) + args.gen
        if longest > args.max_model_len:
            p.error(f"the longest prompt and its tokens ({longest}) exceed --max-model-len")
        for count in counts:
            for route in (routes if count > 1 else routes[:1]):
                print(f"{count} instance(s), route {route} ...", flush=True)
                runs.append(run_one(args, work, count, route, requests))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    _print(runs, args, requests)
    return 0 if all(r.errors == 0 for r in runs) else 1
