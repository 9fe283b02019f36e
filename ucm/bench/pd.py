"""`ucm bench pd`: decode latency under a stream of long prefills, colocated against
prefill/decode disaggregated through ucm.

Two setups in one run, on the same CPUs, the same model and the same requests:
    colocated   one `ucm serve` instance (kv_role both) on every CPU given, doing prefill and
                decode; clients talk to it directly
    disagg      a prefill instance (`--kv-role producer`) on the first half of the CPUs, a
                decode instance (`--kv-role consumer`) on the second half, one posix store,
                `ucm proxy` in front; clients talk to the proxy
Each instance is pinned (taskset, and vLLM's OMP threads by VLLM_CPU_OMP_THREADS_BIND), so the
split is real. The workload: a stream of long prompts (`--long-tokens`, one new prompt every
`--long-every` seconds, one generated token each) runs while `--decodes` requests of
`--short-tokens` prompt tokens each generate `--gen` tokens, `--concurrency` at a time. Their
time to first token (TTFT) and the gaps between their streamed tokens (ITL) are the figures;
the long prompts' TTFT is printed too. That is the trade people split for: decode steps that
no prefill interrupts, against a prompt's KV crossing the store. The model is `ucm bench
vllm`'s random 8-layer model unless `--model` names one.

`--hit-prompts N` (0: off) then measures the decode side alone, with nothing else running: a
producer instance computes each of N prompts of `--hit-tokens` tokens (its store finished,
`--settle` seconds), then a consumer (decode) instance and a colocated instance (kv_role
both), neither of which has the prompt in vLLM's own cache, each load it from ucm and answer;
their TTFTs, measured at the instance, in turn (which goes first alternates), and the median
of their differences.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace

from ucm.bench.processes import ServerProcess, free_port, ucm_command


def _server(args: argparse.Namespace, role: str, cpus: str, config: str, log: str) -> ServerProcess:
    from ucm.bench.engines import engine_env, find_tcmalloc

    port = free_port()
    argv = ["taskset", "-c", cpus, *ucm_command(), "serve", args.model, "--ucm-config", config,
            "--kv-role", role, "--port", str(port), "--max-model-len", str(args.max_model_len),
            "--enforce-eager", "--seed", "0", "--kv-cache-memory-bytes",
            str(args.kv_cache_mib * 2**20)]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    env = {**engine_env(os.environ, tcmalloc=find_tcmalloc()), "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": cpus}
    return ServerProcess(f"the {role} instance", argv, env, log, port)


def _proxy(prefill: int, decode: int, log: str) -> ServerProcess:
    port = free_port()
    argv = [*ucm_command(), "proxy", "--prefill", f"http://127.0.0.1:{prefill}", "--decode",
            f"http://127.0.0.1:{decode}", "--port", str(port)]
    return ServerProcess("ucm proxy", argv, dict(os.environ), log, port, timeout=120)


@dataclass
class Figures:
    ttft: list[float] = field(default_factory=list)  # the decode requests', seconds
    itl: list[float] = field(default_factory=list)  # gaps between their streamed tokens
    long_ttft: list[float] = field(default_factory=list)
    long_sent: int = 0
    errors: list[str] = field(default_factory=list)


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _stream(url: str, model: str, prompt: list[int], max_tokens: int,
            ) -> tuple[float, list[float]]:
    """(TTFT, token arrival times after the first), from a streamed completion."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
        if resp.status_code >= 400:
            resp.read()
            raise RuntimeError(f"status {resp.status_code}: {resp.text[:200]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:]).get("choices"):
                stamps.append(time.perf_counter() - t0)
    if not stamps:
        raise RuntimeError("no token streamed")
    return stamps[0], stamps


def _workload(url: str, args: argparse.Namespace, vocab: int, seed: int) -> Figures:
    out = Figures()
    stop = threading.Event()
    rng = random.Random(seed)
    longs = [_prompt(rng, args.long_tokens, vocab) for _ in range(256)]
    shorts = [_prompt(rng, args.short_tokens, vocab) for _ in range(args.decodes)]
    lock = threading.Lock()

    def long_stream() -> None:
        i = 0
        threads = []
        while not stop.is_set() and i < len(longs):
            def one(p: list[int] = longs[i]) -> None:
                try:
                    ttft, _ = _stream(url, args.model, p, 1)
                    with lock:
                        out.long_ttft.append(ttft)
                except Exception as exc:  # counted; the run goes on
                    with lock:
                        out.errors.append(f"long: {exc}")
            t = threading.Thread(target=one, daemon=True)
            t.start()
            threads.append(t)
            i += 1
            stop.wait(args.long_every)
        out.long_sent = i
        for t in threads:
            t.join(600)

    def decodes(mine: list[list[int]]) -> None:
        for p in mine:
            try:
                ttft, stamps = _stream(url, args.model, p, args.gen)
            except Exception as exc:
                with lock:
                    out.errors.append(f"decode: {exc}")
                continue
            with lock:
                out.ttft.append(ttft)
                out.itl += [b - a for a, b in itertools.pairwise(stamps)]

    background = threading.Thread(target=long_stream, daemon=True)
    background.start()
    time.sleep(min(args.long_every, 2.0))  # the long prompts are already flowing
    workers = [threading.Thread(target=decodes, args=(shorts[k::args.concurrency],))
               for k in range(args.concurrency)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    background.join()
    return out


def _warm(url: str, args: argparse.Namespace, vocab: int) -> None:
    """One long and one short request (first-touch of the KV cache, the store's files)."""
    rng = random.Random(1)
    _stream(url, args.model, _prompt(rng, args.long_tokens, vocab), 1)
    _stream(url, args.model, _prompt(rng, args.short_tokens, vocab), 4)


def _cpus(spec: str | None) -> list[int]:
    cpus = sorted(os.sched_getaffinity(0))
    if spec:
        cpus = [int(c) for c in spec.split(",")]
    if len(cpus) < 2:
        raise SystemExit("ucm bench pd: needs at least 2 CPUs (one per instance when split)")
    return cpus


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def run(args: argparse.Namespace, work: str, vocab: int) -> dict[str, Figures]:
    cpus = _cpus(args.cpus)
    half = len(cpus) // 2
    all_cpus = ",".join(map(str, cpus))
    prefill_cpus, decode_cpus = ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))
    results: dict[str, Figures] = {}
    for setup in args.setups.split(","):
        store = os.path.join(work, f"store-{setup}")
        config = os.path.join(work, f"{setup}.yaml")
        with open(config, "w") as f:
            f.write(f"tiers:\n  - driver: posix\n    path: {store}\n")
        procs: list[ServerProcess] = []
        try:
            if setup == "colocated":
                print(f"colocated: one instance on CPUs {all_cpus} ...", flush=True)
                both = _server(args, "both", all_cpus, config, os.path.join(work, "both.log"))
                procs.append(both)
                url = f"http://127.0.0.1:{both.port}"
            elif setup == "disagg":
                print(f"disagg: prefill on CPUs {prefill_cpus}, decode on {decode_cpus}, "
                      "ucm proxy in front ...", flush=True)
                prefill = _server(args, "producer", prefill_cpus, config,
                                  os.path.join(work, "prefill.log"))
                procs.append(prefill)
                decode = _server(args, "consumer", decode_cpus, config,
                                 os.path.join(work, "decode.log"))
                procs.append(decode)
                proxy = _proxy(prefill.port, decode.port, os.path.join(work, "proxy.log"))
                procs.append(proxy)
                url = f"http://127.0.0.1:{proxy.port}"
            else:
                raise SystemExit(f"ucm bench pd: unknown setup {setup!r} "
                                 "(colocated, disagg)")
            _warm(url, args, vocab)
            print(f"{setup}: {args.decodes} decode requests while long prompts arrive ...",
                  flush=True)
            results[setup] = _workload(url, args, vocab, seed=args.seed)
        finally:
            for p in reversed(procs):
                p.stop()
    return results


def hit_ttft(args: argparse.Namespace, work: str, vocab: int) -> dict[str, list[float]]:
    """The decode instance's TTFT of a prompt the producer stored, beside a colocated
    instance's ucm hit of the same prompt (module docstring)."""
    all_cpus = ",".join(map(str, _cpus(args.cpus)))
    config = os.path.join(work, "hit.yaml")
    with open(config, "w") as f:
        f.write(f"tiers:\n  - driver: posix\n    path: {os.path.join(work, 'store-hit')}\n")
    procs: list[ServerProcess] = []
    out: dict[str, list[float]] = {"consumer": [], "colocated": []}
    try:
        for role in ("producer", "consumer", "both"):
            print(f"hit: starting the {role} instance ...", flush=True)
            procs.append(_server(args, role, all_cpus, config,
                                 os.path.join(work, f"hit-{role}.log")))
        producer, consumer, both = (f"http://127.0.0.1:{p.port}" for p in procs)
        rng = random.Random(args.seed + 1)
        for i in range(args.hit_prompts + 1):  # the first warms each instance up
            prompt = _prompt(rng, args.hit_tokens, vocab)
            _stream(producer, args.model, prompt, 1)
            time.sleep(args.settle)  # its blocks are stored: the consumer waits for none
            order = [("consumer", consumer), ("colocated", both)]
            for name, url in (order if i % 2 else order[::-1]):
                ttft, _ = _stream(url, args.model, prompt, 2)
                if i:
                    out[name].append(ttft)
            if i:
                print(f"  {i}/{args.hit_prompts}: consumer {out['consumer'][-1] * 1000:.1f} ms, "
                      f"colocated {out['colocated'][-1] * 1000:.1f} ms", flush=True)
    finally:
        for p in reversed(procs):
            p.stop()
    return out


def _print_hits(hits: dict[str, list[float]], args: argparse.Namespace) -> None:
    cons, col = hits["consumer"], hits["colocated"]
    diffs = [a - b for a, b in zip(cons, col, strict=True)]
    print(f"\n{args.hit_tokens}-token prompts stored by a producer, then loaded from ucm "
          f"(median of {len(cons)}): decode instance TTFT {_pct(cons, 0.5):.1f} ms, "
          f"colocated ucm hit {_pct(col, 0.5):.1f} ms; difference, prompt by prompt: median "
          f"{statistics.median(diffs) * 1000:+.1f} ms (min {min(diffs) * 1000:+.1f}, max "
          f"{max(diffs) * 1000:+.1f})")


def _print(results: dict[str, Figures], args: argparse.Namespace) -> None:
    print(f"\ndecode requests: {args.short_tokens}-token prompts, {args.gen} tokens each, "
          f"{args.concurrency} at a time; long prompts: {args.long_tokens} tokens, one every "
          f"{args.long_every:g} s (1 token each)\n")
    cols = ("TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "long TTFT p50", "long sent",
            "errors")
    print(f"{'setup':<11}" + "".join(f"{c:>15}" for c in cols) + "   (ms)")
    rows: dict[str, list[float]] = {}
    for name, r in results.items():
        rows[name] = [_pct(r.ttft, 0.5), _pct(r.ttft, 0.99), _pct(r.itl, 0.5), _pct(r.itl, 0.99),
                      _pct(r.long_ttft, 0.5)]
        print(f"{name:<11}" + "".join(f"{v:>15.1f}" for v in rows[name])
              + f"{r.long_sent:>15}{len(r.errors):>15}")
        for e in r.errors[:3]:
            print(f"    {e}")
    if "colocated" in rows and "disagg" in rows:
        ratio = [d / c if c else float("nan")
                 for c, d in zip(rows["colocated"], rows["disagg"], strict=True)]
        print(f"{'disagg/col.':<11}" + "".join(f"{v:>14.2f}x" for v in ratio))
    if results:
        print(f"\n(medians of {statistics.median(len(r.ttft) for r in results.values()):.0f} "
              "decode requests per setup; ITL over all their token gaps)")


def bench_model(args: argparse.Namespace, work: str) -> int:
    """Sets args.model (built in `work` unless given) and args.dtype; the model's vocabulary
    size (the benches' prompts are random token ids below it)."""
    args.dtype = None
    if args.model:
        with open(os.path.join(args.model, "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    from ucm.bench.models import build_model
    from ucm.bench.vllm import SPEC

    spec = replace(SPEC, max_positions=max(SPEC.max_positions, args.max_model_len))
    args.model = str(build_model(os.path.join(work, "model"), spec))
    args.dtype = spec.dtype
    return spec.vocab


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ucm bench pd", description=__doc__.split("\n")[0])
    p.add_argument("--setups", default="colocated,disagg")
    p.add_argument("--model", help="a model directory (default: the random test model)")
    p.add_argument("--cpus", help="CPUs to use, comma separated (default: this process's)")
    p.add_argument("--long-tokens", type=int, default=2048)
    p.add_argument("--long-every", type=float, default=2.0, help="seconds between long prompts")
    p.add_argument("--short-tokens", type=int, default=256)
    p.add_argument("--gen", type=int, default=32, help="tokens each decode request generates")
    p.add_argument("--decodes", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-mib", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hit-prompts", type=int, default=7,
                   help="prompts of the decode-side hit TTFT measurement (0: skip it)")
    p.add_argument("--hit-tokens", type=int, default=4000)
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds the producer's stores get before the prompt is loaded")
    p.add_argument("--work", help="work directory (default: a temporary one, removed)")
    args = p.parse_args(argv)
    for name in ("long_tokens", "short_tokens", "gen", "decodes", "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.long_every <= 0:
        p.error("--long-every must be > 0")
    if args.hit_prompts < 0 or args.settle < 0:
        p.error("--hit-prompts and --settle must be at least 0")
    if args.hit_prompts and args.hit_tokens + 2 > args.max_model_len:
        p.error("--hit-tokens and 2 generated tokens must fit --max-model-len")
    if args.long_tokens + 1 > args.max_model_len or args.short_tokens + args.gen > \
            args.max_model_len:
        p.error("a prompt and its tokens must fit --max-model-len")
    work = args.work or tempfile.mkdtemp(prefix="ucm-bench-pd-")
    try:
        vocab = bench_model(args, work)
        results = run(args, work, vocab) if args.setups else {}
        hits = hit_ttft(args, work, vocab) if args.hit_prompts else None
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if results:
        _print(results, args)
    if hits is not None:
        _print_hits(hits, args)
    return 0 if all(not r.errors for r in results.values()) else 1
