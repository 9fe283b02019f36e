"""`ucm bench quality`: what KV compression does to a real model's answers, through vLLM with
the ucm connector.

On SmolLM2-135M-Instruct (bf16, built locally by `ucm.bench.smollm2`) and prompts cut from real
English documents (`ucm.bench.texts`, 1K to 6K tokens each), it runs:

    cold     one engine prefills every prompt; its connector stores each block on three posix
             tiers at once (durability: all), one per codec: none, int8, int4
    loaders  one fresh engine per codec, reading only that codec's directory: for each prompt
             the prefix loads from ucm, then (a) a held-out continuation of the document is
             scored (its tokens' logprobs given the loaded prefix: perplexity) and (b) the
             model continues the prefix greedily for 64 tokens
    control  a second fresh engine on the uncompressed directory: the same path twice, which
             shows what agreement a lossless load gives
    paths    (`--paths`) the same prompts without ucm, on other numeric paths: `recompute`, a
             fresh engine with no connector and no prefix cache (one prefill pass over each
             prompt), and `vllm-hit`, a fresh engine whose own prefix cache holds each prefix
             (prefilled just before). Their agreement with the uncompressed ucm load is what a
             lossless change of path alone gives on this model: the scale to read a codec's by

and reports, per codec against the uncompressed load (a ucm hit compared with a ucm hit: a
loaded prefix is a different numeric path from one prefill pass, for vLLM's own cache too),
the bytes stored per token, the greedy exact-match rate and first-divergence position, and the
perplexity change. Prefixes are whole blocks, so a loaded prefix is all of it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucm.block import Codec, decode_header

# Prompt lengths in tokens, cycled: most prompts short (as chat traffic is), a few long.
LENGTHS = (1024, 1024, 1536, 2048, 1024, 1536, 3072, 1024, 4096, 6144)
BLOCK = 32
# Lossless paths without ucm, for the scale of path noise (--paths).
PATHS = {"recompute": "no connector, no prefix cache: one prefill pass",
         "vllm-hit": "vLLM's own prefix cache holds the prefix"}
CODECS = {"none": {"codec": "none"}, "int8": {"codec": "int8"}, "int4": {"codec": "int4"}}


@dataclass
class Sample:
    source: str
    prefix: list[int]
    continuation: list[int]


def _say(msg: str) -> None:
    print(f"[ucm bench quality] {msg}", flush=True)


def build_samples(tokenizer: Any, count: int, continuation: int,
                  lengths: tuple[int, ...] = LENGTHS) -> list[Sample]:
    """`count` prompts: the first L tokens of distinct documents (L cycling through `lengths`,
    each a whole number of blocks), each with the document's next `continuation` tokens held
    out. A document serves one prompt; the longest lengths take the longest documents."""
    from ucm.bench.texts import documents

    docs = [(label, tokenizer(text, add_special_tokens=False)["input_ids"])
            for label, text in documents(min_chars=3000)]
    wanted = sorted(((lengths[i % len(lengths)], i) for i in range(count)), reverse=True)
    pool = sorted(docs, key=lambda d: len(d[1]), reverse=True)
    chosen: dict[int, Sample] = {}
    for length, slot in wanted:
        need = length + continuation
        pick = next((d for d in reversed(pool) if len(d[1]) >= need), None)  # tightest fit
        if pick is None:
            raise RuntimeError(f"no installed document has {need} tokens left for a "
                               f"{length}-token prompt ({len(chosen)} prompts built)")
        pool.remove(pick)
        label, ids = pick
        chosen[slot] = Sample(label, ids[:length], ids[length:need])
    return [chosen[i] for i in range(count)]


def _tier(path: str, codec: str) -> dict[str, Any]:
    return {"name": f"posix-{codec}", "driver": "posix", "path": path, "capacity": "16GiB",
            "direct_writes": True,
            **CODECS[codec]}


def stored_blocks(path: str) -> tuple[int, int, dict[str, int]]:
    """Blocks, bytes and blocks per codec under a posix tier's directory (from the headers)."""
    blocks = size = 0
    codecs: dict[str, int] = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                head = f.read(4096)
            try:
                header = decode_header(head)
            except Exception:
                continue  # not a block (an index, a lock file)
            blocks += 1
            size += os.path.getsize(full)
            codec = Codec(header.codec).name.lower()
            codecs[codec] = codecs.get(codec, 0) + 1
    return blocks, size, codecs


def first_divergence(a: list[int], b: list[int]) -> int:
    """The index of the first differing token, or the length when all agree."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def perplexity(tails: list[list[float]]) -> float:
    flat = [lp for tail in tails for lp in tail]
    return math.exp(-sum(flat) / len(flat))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ucm bench quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--generate", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--continuation", type=int, default=128,
                    help="held-out tokens scored for perplexity")
    ap.add_argument("--codecs", default="int8,int4")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                    help="prompt lengths in tokens, cycled (whole blocks of 32)")
    ap.add_argument("--no-control", action="store_true",
                    help="skip the second uncompressed load (the lossless noise floor)")
    ap.add_argument("--paths", default="",
                    help="also run these lossless paths without ucm: recompute, vllm-hit "
                         "(comma-separated)")
    ap.add_argument("--work", help="working directory (kept); default a temporary one")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="write a plot of the first-divergence positions here")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from ucm.bench.engines import EngineSpec, Phase, run_in_subprocess
    from ucm.bench.smollm2 import build_smollm2

    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    unknown = [c for c in codecs if c not in CODECS or c == "none"]
    if unknown:
        ap.error(f"unknown codec(s) {unknown}; choose from int8, int4")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if [p for p in paths if p not in PATHS]:
        ap.error(f"unknown path(s) {[p for p in paths if p not in PATHS]}; choose from "
                 f"{', '.join(PATHS)}")
    lengths = tuple(int(x) for x in args.lengths.split(","))
    if any(n <= 0 or n % BLOCK for n in lengths):
        ap.error(f"--lengths must be positive multiples of {BLOCK}")

    model = str(build_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(model)
    samples = build_samples(tokenizer, args.prompts, args.continuation, lengths)
    prefix_tokens = sum(len(s.prefix) for s in samples)
    _say(f"SmolLM2-135M-Instruct bf16, {len(samples)} prompts of "
         f"{min(len(s.prefix) for s in samples)}-{max(len(s.prefix) for s in samples)} "
         f"tokens ({prefix_tokens} in all) from {len({s.source for s in samples})} documents")

    work = Path(args.work or tempfile.mkdtemp(prefix="ucm-quality-"))
    if work.exists() and args.work:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    dirs = {c: str(work / f"store-{c}") for c in ["none", *codecs]}
    max_len = max(len(s.prefix) for s in samples) + args.continuation + args.generate + BLOCK

    def spec(tiers: list[dict[str, Any]], durability: str = "local", seqs: int = 64,
             ) -> EngineSpec:
        return EngineSpec(model=model, dtype="bfloat16", block_size=BLOCK,
                          max_model_len=max_len, kv_cache_bytes=1 << 30, connector="ucm",
                          ucm={"tiers": tiers, "durability": durability}, max_num_seqs=seqs)

    def progress(msg: str) -> None:
        _say(f"  {msg}")

    t0 = time.perf_counter()
    _say(f"cold: one engine stores every prefix on {len(dirs)} tiers ({', '.join(dirs)})")
    run_in_subprocess(spec([_tier(dirs[c], c) for c in dirs], durability="all"),
                      [Phase([s.prefix for s in samples], max_tokens=1, name="store")],
                      timeout=7200, log_path=str(work / "cold.log"), progress=progress)
    stored = {c: stored_blocks(d) for c, d in dirs.items()}
    _say(f"cold done in {time.perf_counter() - t0:.0f} s")

    scored = [s.prefix + s.continuation for s in samples]
    runs: dict[str, dict[str, Any]] = {}
    order = ["none", *codecs] + ([] if args.no_control else ["none (again)"])
    for name in order:
        codec = name.split()[0]
        t1 = time.perf_counter()
        _say(f"loader: a fresh engine on the {codec} store{' (control)' if ' ' in name else ''}")
        # The loader stores what it computes (the continuations): it gets a hard-linked copy
        # of the cold store, so no run loads blocks an earlier loader wrote.
        tag = name.replace(" (again)", "-again")
        store = work / f"run-{tag}"
        shutil.copytree(dirs[codec], store, copy_function=os.link)
        result = run_in_subprocess(
            # One request at a time: in bf16 a batch's shape changes the numbers, and two
            # loads of the same bytes must score the same (the control row checks it).
            spec([_tier(str(store), codec)], seqs=1),
            [Phase(scored, max_tokens=1, name="score", logprob_tail=args.continuation - 1),
             Phase([s.prefix for s in samples], max_tokens=args.generate, name="generate")],
            timeout=7200, log_path=str(work / f"load-{tag}.log"), progress=progress)
        score, generate = result["phases"]
        runs[name] = {"tails": score["tail_logprobs"], "tokens": generate["tokens"],
                      "loaded": sum(score["num_cached_tokens"]),
                      "loaded_generate": sum(generate["num_cached_tokens"])}
        _say(f"  done in {time.perf_counter() - t1:.0f} s")
    for name in paths:
        t1 = time.perf_counter()
        _say(f"{name}: a fresh engine without ucm ({PATHS[name]})")
        runs[name] = _path_run(name, samples, args, model, max_len, work)
        _say(f"  done in {time.perf_counter() - t1:.0f} s")

    report = _report(samples, stored, runs, args.generate, model)
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        _plot(report, args.plot)
    _say(f"total {time.perf_counter() - t0:.0f} s; work directory {work}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _path_run(name: str, samples: list[Sample], args: argparse.Namespace, model: str,
              max_len: int, work: Path) -> dict[str, Any]:
    """The loaders' two phases on a lossless path without ucm (see PATHS), one request at a
    time as theirs; for `vllm-hit` each prompt's prefix is prefilled first, so that scoring
    and generating find it in vLLM's own prefix cache (prompt by prompt: the cache holds a
    few prefixes, not all)."""
    from ucm.bench.engines import EngineSpec, Phase, run_in_subprocess

    hit = name == "vllm-hit"
    spec = EngineSpec(model=model, dtype="bfloat16", block_size=BLOCK, max_model_len=max_len,
                      kv_cache_bytes=1 << 30, prefix_caching=hit, max_num_seqs=1)
    tail = args.continuation - 1
    if hit:
        phases = [phase for i, s in enumerate(samples) for phase in (
            Phase([s.prefix], max_tokens=1, name=f"warm{i}"),
            Phase([s.prefix + s.continuation], max_tokens=1, name=f"score{i}",
                  logprob_tail=tail),
            Phase([s.prefix], max_tokens=args.generate, name=f"generate{i}"))]
    else:
        phases = [Phase([s.prefix + s.continuation for s in samples], max_tokens=1,
                        name="score", logprob_tail=tail),
                  Phase([s.prefix for s in samples], max_tokens=args.generate,
                        name="generate")]
    result = run_in_subprocess(spec, phases, timeout=7200, log_path=str(work / f"{name}.log"),
                               progress=lambda m: _say(f"  {m}"))
    score = [p for p in result["phases"] if p["name"].startswith("score")]
    generate = [p for p in result["phases"] if p["name"].startswith("generate")]
    return {"tails": [t for p in score for t in p["tail_logprobs"]],
            "tokens": [t for p in generate for t in p["tokens"]],
            "loaded": sum(n for p in score for n in p["num_cached_tokens"]),
            "loaded_generate": sum(n for p in generate for n in p["num_cached_tokens"])}


def _raw_bytes_per_token(model: str) -> int:
    config = json.loads(Path(model, "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head * 2  # bf16


def _report(samples: list[Sample], stored: dict[str, tuple[int, int, dict[str, int]]],
            runs: dict[str, dict[str, Any]], generate: int, model: str) -> dict[str, Any]:
    raw = _raw_bytes_per_token(model)
    base = runs["none"]
    base_ppl = perplexity(base["tails"])
    prefix_tokens = sum(len(s.prefix) for s in samples)
    rows = []
    for name, run in runs.items():
        codec = name.split()[0]
        blocks, size, kinds = stored.get(codec, (0, 0, {}))  # a path without ucm stores none
        divergence = [first_divergence(a, b)
                      for a, b in zip(run["tokens"], base["tokens"], strict=True)]
        ppl = perplexity(run["tails"])
        rows.append({
            "run": name, "blocks": blocks, "block_codecs": kinds,
            "bytes_per_token": size / (blocks * BLOCK) if blocks else 0.0,
            "saved": 1 - size / (blocks * BLOCK * raw) if blocks else 0.0,
            "loaded_share": run["loaded"] / prefix_tokens,
            "exact": sum(d >= generate for d in divergence) / len(divergence),
            "divergence_median": statistics.median(divergence),
            "divergence_min": min(divergence),
            "divergence": divergence,
            "perplexity": ppl, "perplexity_change": ppl / base_ppl - 1,
        })
    return {"model": "SmolLM2-135M-Instruct bf16", "prompts": len(samples),
            "prefix_tokens": prefix_tokens, "raw_bytes_per_token": raw,
            "generate": generate, "rows": rows,
            "lengths": [len(s.prefix) for s in samples],
            "sources": [s.source for s in samples],
            "tail_logprobs": {name: run["tails"] for name, run in runs.items()}}


def _print(report: dict[str, Any]) -> None:
    print(f"\n{report['model']}: {report['prompts']} prompts, {report['prefix_tokens']} prefix "
          f"tokens; raw KV {report['raw_bytes_per_token']} B/token; each run against the "
          f"uncompressed load")
    exact = f"exact@{report['generate']}"
    head = (f"{'run':14} {'B/token':>8} {'saved':>7} {'loaded':>7} {exact:>9} "
            f"{'1st diff p50':>12} {'min':>5} {'ppl':>8} {'ppl chg':>8}  blocks by codec")
    print(head)
    print("-" * len(head))
    for r in report["rows"]:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["block_codecs"].items()))
        print(f"{r['run']:14} {r['bytes_per_token']:8.0f} {r['saved']:7.1%} "
              f"{r['loaded_share']:7.1%} {r['exact']:9.1%} {r['divergence_median']:12.0f} "
              f"{r['divergence_min']:5d} {r['perplexity']:8.4f} {r['perplexity_change']:+8.2%}"
              f"  {kinds}")


def _plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in report["rows"]:
        if r["run"] == "none":
            continue
        xs = sorted(r["divergence"])
        ax.step(xs, [i / len(xs) for i in range(1, len(xs) + 1)], where="post",
                label=f"{r['run']} (ppl {r['perplexity_change']:+.2%})")
    ax.set_xlabel("first generated token that differs from the uncompressed load")
    ax.set_ylabel("share of prompts")
    ax.set_xlim(0, report["generate"] + 1)
    ax.set_title(f"{report['model']}: greedy agreement after a compressed load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
