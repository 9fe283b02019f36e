"""`ucm demo`: the KV cache of a chat service, stored by one vLLM engine and reused by the next.

It builds a small random Llama model and tokenizer locally, then replays a realistic workload
(chat sessions that each discuss one of a few shared long documents, several turns each, every
turn's prompt carrying the conversation so far) through vLLM with the ucm connector on the
embedded default config (a memory tier over ~/.cache/ucm):

    round 1  cold: a fresh engine process, empty store; turns compute and store their KV
    round 2  warm: another fresh engine process replays the sessions; their KV loads from ucm

Per turn it prints prefill tokens computed vs loaded, the hit rate, TTFT p50/p90 and bytes
moved. vLLM's own prefix cache stays on (as in production); its hits are shown apart.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from ucm.bench.models import ModelSpec, build_model, sample_text

SPEC = ModelSpec(layers=8, hidden=512, heads=8, kv_heads=4, vocab=2048, max_positions=8192,
                 dtype="float32")
BLOCK = 32


def _say(msg: str) -> None:
    print(f"[ucm demo] {msg}", flush=True)


def build_workload(tokenizer: Any, *, sessions: int, turns: int, doc_words: int,
                   ) -> list[list[list[int]]]:
    """turns x sessions prompts (token ids): turn t of a session extends turn t-1 with an
    answer and a new question. Sessions share a system prompt and one of 3 documents."""
    system = "You are a helpful assistant. Answer from the document. " + sample_text(60, 7)
    docs = [sample_text(doc_words, 100 + d) for d in range(3)]
    history = [f"{system}\n\nDocument:\n{docs[s % 3]}\n" for s in range(sessions)]
    out = []
    for t in range(turns):
        batch = []
        for s in range(sessions):
            if t:
                history[s] += f"\nAssistant: {sample_text(24, 1000 * s + t)}"
            history[s] += f"\nUser: question {t + 1}: {sample_text(20, 50 * s + t)}?"
            batch.append(tokenizer(history[s])["input_ids"])
        out.append(batch)
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def _report(round_name: str, result: dict[str, Any], bytes_per_token: int) -> dict[str, float]:
    totals = {"prompt": 0, "loaded": 0, "local": 0, "computed": 0}
    header = (f"{'turn':>5} {'reqs':>5} {'prompt tok':>11} {'computed':>9} {'ucm loaded':>11} "
              f"{'vLLM local':>11} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p90':>9} "
              f"{'bytes moved':>12}")
    print(f"\n{round_name}\n{header}")
    for phase in result["phases"]:
        if phase["name"] == "warmup":
            continue
        delta = phase["worker_delta"]
        prompt = sum(phase["prompt_tokens"])
        loaded = delta.get("loaded_blocks", 0) * BLOCK
        cached = sum(phase["num_cached_tokens"])
        local = max(0, cached - loaded)
        computed = prompt - cached
        moved = delta.get("loaded_bytes", 0) + delta.get("save_blocks", 0) * BLOCK * bytes_per_token
        ttft = phase["ttft_s"]
        print(f"{phase['name']:>5} {len(phase['prompt_tokens']):>5} {prompt:>11,} {computed:>9,} "
              f"{loaded:>11,} {local:>11,} {cached / prompt:>8.0%} "
              f"{_pct(ttft, .5) * 1e3:>7.0f}ms {_pct(ttft, .9) * 1e3:>7.0f}ms "
              f"{moved / 2**20:>9.1f} MiB")
        totals["prompt"] += prompt
        totals["loaded"] += loaded
        totals["local"] += local
        totals["computed"] += computed
    totals["ttft_p50"] = statistics.median(t for p in result["phases"] for t in p["ttft_s"])
    totals["ttft_first"] = statistics.median(result["phases"][1]["ttft_s"])
    return totals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ucm demo", description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--doc-words", type=int, default=1200, help="words per shared document")
    ap.add_argument("--workdir", default=None, help="where the model is built (default: tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the stored blocks afterwards")
    args = ap.parse_args(argv)

    from ucm.bench.engines import EngineSpec, Phase, run_in_subprocess
    from ucm.config import default_cache_dir

    work = args.workdir or tempfile.mkdtemp(prefix="ucm-demo-")
    t0 = time.perf_counter()
    _say(f"building a random {SPEC.layers}-layer Llama (hidden {SPEC.hidden}) and a tokenizer "
         f"in {work}")
    model = build_model(os.path.join(work, "model"), SPEC)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    turns = build_workload(tokenizer, sessions=args.sessions, turns=args.turns,
                           doc_words=args.doc_words)
    warmup = Phase([tokenizer(sample_text(300, 9))["input_ids"]], max_tokens=2, name="warmup")
    phases = [warmup] + [Phase(batch, max_tokens=16, name=str(t + 1), stepwise=True)
                         for t, batch in enumerate(turns)]
    n_tokens = sum(len(p) for batch in turns for p in batch)
    _say(f"workload: {args.sessions} chat sessions x {args.turns} turns over 3 shared "
         f"documents, {n_tokens:,} prompt tokens")
    # The run's own model id keeps an earlier demo's blocks from making round 1 warm.
    run_id = f"demo{os.getpid()}x{int(time.time())}"
    spec = EngineSpec(model=str(model), dtype=SPEC.dtype, block_size=BLOCK,
                      max_model_len=8192, kv_cache_bytes=512 * 2**20, connector="ucm",
                      extra={"model_id": run_id}, prefix_caching=True,
                      chunked_prefill_tokens=4096)
    log = os.path.join(work, "engines.log")
    # Both engines record the kernel's event trace (UCM_TRACE), one file set per process.
    trace_dir = os.environ.get("UCM_TRACE") or str(default_cache_dir() / "traces" / run_id)
    bpt = SPEC.kv_bytes_per_token()
    results = {}
    for name, label in (("cold", "round 1: cold engine (fresh process, empty store)"),
                        ("warm", "round 2: warm engine (fresh process, same store)")):
        _say(f"{label}: starting")
        results[name] = run_in_subprocess(spec, phases, log_path=log,
                                          env={"UCM_TRACE": trace_dir},
                                          progress=lambda m, n=name: _say(f"  {n}: {m}"))
    summary = {name: _report(f"== {name} round ==", r, bpt) for name, r in results.items()}
    cold, warm = summary["cold"], summary["warm"]
    print(f"\nprefill tokens computed: cold {cold['computed']:,} -> warm {warm['computed']:,} "
          f"({warm['loaded']:,} loaded from ucm; vLLM's own cache served the repeats inside "
          f"each engine); turn-1 TTFT p50 {cold['ttft_first'] * 1e3:.0f} ms -> "
          f"{warm['ttft_first'] * 1e3:.0f} ms")
    ns = results["warm"]["stats"].get("worker", {}).get("namespace")
    store = default_cache_dir() / "blocks"
    print(f"store: {store} (embedded default config; namespace {ns})")
    print(f"event trace: {trace_dir} (read it with: ucm-trace summary {trace_dir})")
    print(f"engine logs: {log}; total {time.perf_counter() - t0:.0f} s")
    if not args.keep and ns:
        from ucm.drivers.kit import safe_dir_name

        shutil.rmtree(store / safe_dir_name(ns), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
