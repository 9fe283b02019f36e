"""Sparse decode attention against dense on a real model, SmolLM2-135M-Instruct (bf16 where the
CPU computes it natively, else fp32): passkey retrieval, greedy agreement over real documents,
and decode speed (docs/performance.md, Sparse attention: quality and speed). One engine per
configuration, each in a child process of this script:

    PYTHONPATH=$PWD .venv/bin/python scripts/sparse_quality.py [--out DIR] [--docs 50] \
        [--doc-tokens 2048] [--passkey 2048,4096,7168] [--trials 5] \
        [--methods quest,esa,kvstar,gsa] [--budgets 0.5,0.25,0.125] [--speed-tokens 128]

The first engine (dense) computes every prompt and stores its blocks in a posix tier under
DIR; every later engine finds all of them in ucm, so dense and each sparse method are compared
on the same path (a ucm hit, loaded blocks, then decode), as the project compares a cache hit
with a cache hit. Sparse engines run with the sparse config's `prefix` on (a prefix from ucm
runs sparse), 1 sink block, 2 local blocks, a refresh every 8 steps.

- passkey: a five-digit key in filler text at depths 0.1 ... 0.9 (`--trials` of them) of a
  prompt of each length; correct when the greedy answer (12 tokens) contains the key.
- agreement: the first `--doc-tokens` tokens of `--docs` real documents (the package
  descriptions and licenses installed in this venv, longest first), 64 greedy tokens each:
  the share of positions equal to the dense run's, and how many of the 64 match before the
  first difference. Quest at budget 1 (every offloaded block loaded into a slot) runs
  first: it must equal dense.
- speed: the first 7K passkey prompt alone, generated to 1 token and to 1 + `--speed-tokens`,
  both from ucm; decode tokens/s is the extra tokens over the extra time. The load wait per
  step is the sparse adapter's `load_wait_ns` over its `load_waits` (time a step waited for
  its slots' loads) and over all its steps.

Prints progress, writes DIR/results.json, DIR/table.md and DIR/agreement.png.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

KEY_BLOCK_BYTES = 32 * 30 * 2 * 3 * 64  # elements of one block: tokens x layers x K,V x heads x D
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")


def _say(msg: str) -> None:
    print(f"[sparse-quality {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _documents(tokenizer: Any, n: int, tokens: int) -> list[list[int]]:
    """The first `tokens` tokens of the `n` longest distinct package descriptions and
    licenses in this interpreter's site-packages that have that many (name order on ties)."""
    import site

    texts: dict[str, tuple[int, str, str]] = {}
    for root in site.getsitepackages():
        for dist in sorted(Path(root).glob("*.dist-info")):
            meta = dist / "METADATA"
            found = [(meta.name, email.parser.Parser().parsestr(
                meta.read_text(errors="replace")).get_payload() or "")] if meta.exists() else []
            found += [(p.name, p.read_text(errors="replace"))
                      for p in sorted(dist.rglob("LICEN[CS]E*")) if p.is_file()]
            for name, text in found:
                text = text.strip()
                digest = hashlib.sha1(" ".join(text.split()).encode()).hexdigest()
                if len(text) > tokens * 3 and digest not in texts:
                    texts[digest] = (len(text), f"{dist.name}/{name}", text)
    docs: list[list[int]] = []
    for _, _, text in sorted(texts.values(), key=lambda t: (-t[0], t[1])):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            docs.append(list(ids[:tokens]))
        if len(docs) == n:
            return docs
    raise SystemExit(f"only {len(docs)} documents of {tokens} tokens here (asked for {n})")


def _passkey(tokenizer: Any, length: int, depth: float, key: int) -> list[int]:
    """A prompt of about `length` tokens with the key at `depth` of its filler."""
    head = ("There is an important piece of information hidden inside a lot of irrelevant "
            "text. Find it and memorize it. I will quiz you about it.\n")
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    tail = "\nWhat is the pass key? The pass key is"
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    fixed = len(enc(head + needle + tail))
    per = len(enc(FILLER * 8)) / 8
    reps = max(1, int((length - fixed) / per))
    before = int(reps * depth)
    text = head + FILLER * before + needle + FILLER * (reps - before) + tail
    return list(enc(text))


def build_prompts(model: str, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    passkeys = []
    for length in args.passkey:
        for t in range(args.trials):
            depth = (t + 0.5) / args.trials
            key = rng.randrange(10000, 100000)
            passkeys.append({"length": length, "depth": round(depth, 2), "key": key,
                             "ids": _passkey(tok, length, depth, key)})
    return {"passkey": passkeys, "docs": _documents(tok, args.docs, args.doc_tokens)}


# ---- one engine (the child) ---------------------------------------------------------------

def child(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from ucm.bench.engines import EngineSpec, connector_stats, make_engine

    prompts = json.loads(Path(spec["prompts"]).read_text())
    extra: dict[str, Any] = {"lookup_wait": 60.0}
    if spec["sparse"]:
        extra["sparse"] = {**spec["sparse"], "sink_blocks": 1, "local_blocks": 2,
                           "stride": 8, "prefix": True}
    longest = max(len(p["ids"]) for p in prompts["passkey"])
    blocks = sum(len(d) // 32 + 3 for d in prompts["docs"])  # the bigger batch, 64 tokens on
    blocks = max(blocks, sum(len(p["ids"]) // 32 + 2 for p in prompts["passkey"]))
    llm = make_engine(EngineSpec(
        model=spec["model"], dtype=spec["dtype"], block_size=32,
        max_model_len=longest + spec["speed_tokens"] + 64,
        kv_cache_bytes=(blocks + 16) * KEY_BLOCK_BYTES * (2 if spec["dtype"] == "bfloat16"
                                                            else 4),
        connector="ucm", extra=extra, max_num_seqs=64,
        ucm={"tiers": [{"driver": "posix", "path": spec["store"], "capacity": "40GiB"}]}))
    greedy = dict(temperature=0.0)
    out: dict[str, Any] = {}
    if not spec.get("speed_only"):
        t0 = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=p["ids"]) for p in prompts["passkey"]],
                           SamplingParams(max_tokens=12, **greedy), use_tqdm=False)
        out["passkey"] = [r.outputs[0].text for r in res]
        out["passkey_s"] = time.perf_counter() - t0
        connector_stats()  # the stores (the first engine's) before the next batch looks up
        t0 = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=d) for d in prompts["docs"]],
                           SamplingParams(max_tokens=64, ignore_eos=True, **greedy),
                           use_tqdm=False)
        out["docs"] = [list(r.outputs[0].token_ids) for r in res]
        out["docs_s"] = time.perf_counter() - t0
    stats = connector_stats()
    long = next(p for p in prompts["passkey"] if len(p["ids"]) == longest)["ids"]
    speed = []
    for n in (1, 1 + spec["speed_tokens"]) * spec.get("speed_repeat", 2):
        before = _sparse_counters()
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=long)],
                     SamplingParams(max_tokens=n, ignore_eos=True, **greedy), use_tqdm=False)
        after = _sparse_counters()
        speed.append({"tokens": n, "s": time.perf_counter() - t0,
                      **{k: after.get(k, 0) - before.get(k, 0) for k in after}})
    out["speed"] = speed
    out["speed_prompt_tokens"] = len(long)
    out["scheduler"] = {k: v for k, v in stats.get("scheduler", {}).items()
                        if k.startswith("sparse_") and isinstance(v, int)}
    out["worker"] = {k: v for k, v in _sparse_counters().items()}
    out["loads"] = {k: v for k, v in stats.get("worker", {}).items()
                    if k in ("loaded_blocks", "load_hits", "lookups", "hit_blocks")
                    and isinstance(v, int)}
    return out


def _sparse_counters() -> dict[str, int]:
    from ucm.vllm_hook.connector import live_connectors

    for c in live_connectors():
        adapter = c.sparse if c.worker is not None else None
        if adapter is not None:
            return {k: int(v) for k, v in adapter.stats.items()}
    return {}


# ---- the parent -----------------------------------------------------------------------------

def _run(name: str, spec: dict[str, Any], out: Path) -> dict[str, Any]:
    done = out / f"{name}.json"
    if done.exists():  # a rerun picks up where a stopped one left off
        return dict(json.loads(done.read_text()))
    _say(f"{name}: starting an engine")
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                              stdout=subprocess.PIPE, stderr=log, text=True, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("SPARSE_QUALITY ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{name} failed (rc {proc.returncode}); see {out / (name + '.log')}")
    result = dict(json.loads(lines[-1].split(" ", 1)[1]))
    done.write_text(json.dumps(result))
    _say(f"{name}: done in {time.perf_counter() - t0:.0f} s")
    return result


def _agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float, int]:
    same = sum(a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))
    prefix = []
    for r, g in zip(ref, got, strict=True):
        k = next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), len(r))
        prefix.append(k)
    total = sum(len(r) for r in ref)
    whole = sum(k == len(r) for k, r in zip(prefix, ref, strict=True))
    return same / total, sum(prefix) / len(prefix), whole


def _speed(result: dict[str, Any], extra: int) -> dict[str, float]:
    runs = result["speed"]
    short = min(r["s"] for r in runs if r["tokens"] == 1)
    long = min(r["s"] for r in runs if r["tokens"] > 1)
    longs = [r for r in runs if r["tokens"] > 1]
    waits = sum(r.get("load_wait_ns", 0) for r in longs)
    steps = sum(r.get("steps", 0) for r in longs)
    n_waits = sum(r.get("load_waits", 0) for r in longs)
    return {"tok_s": extra / max(long - short, 1e-9),
            "wait_ms_per_step": waits / 1e6 / steps if steps else 0.0,
            "wait_ms_per_load": waits / 1e6 / n_waits if n_waits else 0.0,
            "loads_per_step": n_waits / steps if steps else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--out", default="/tmp/ucm-sparse-quality")
    ap.add_argument("--docs", type=int, default=50)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--passkey", default="2048,4096,7168")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--methods", default="quest,esa,kvstar,gsa")
    ap.add_argument("--budgets", default="0.5,0.25,0.125")
    ap.add_argument("--speed-tokens", type=int, default=128)
    ap.add_argument("--speed-only", action="store_true", help=(
        "after a full run in the same DIR: time decode alone, dense and each method at the "
        "first budget, dense again last, on a machine left quiet"))
    args = ap.parse_args()
    if args.child:
        print("SPARSE_QUALITY " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    from ucm.bench.smollm2 import build_smollm2

    args.passkey = [int(x) for x in args.passkey.split(",")]
    out = Path(args.out)
    (out / "store").mkdir(parents=True, exist_ok=True)
    model = str(build_smollm2())
    prompts_file = out / "prompts.json"
    if not prompts_file.exists():
        prompts_file.write_text(json.dumps(build_prompts(model, args)))
    prompts = json.loads(prompts_file.read_text())
    base = {"model": model, "dtype": "bfloat16" if _native_bf16() else "float32",
            "store": str(out / "store"), "prompts": str(prompts_file),
            "speed_tokens": args.speed_tokens}
    _say(f"{len(prompts['passkey'])} passkey prompts, {len(prompts['docs'])} documents of "
         f"{args.doc_tokens} tokens, {base['dtype']}")
    if args.speed_only:
        speed(base, args, out)
        return
    results = {"computed": _run("computed", {**base, "sparse": None}, out),
               "dense": _run("dense", {**base, "sparse": None}, out)}
    # quest at budget 1 loads every offloaded block into a slot: it must equal dense (a check)
    configs = [("quest", 1.0)] + [(m, float(b)) for m in args.methods.split(",")
                                  for b in args.budgets.split(",")]
    for method, budget in configs:
        results[f"{method}@{budget:g}"] = _run(
            f"{method}@{budget:g}", {**base, "sparse": {"method": method, "budget": budget}}, out)
    report(results, prompts, args, out, base["dtype"])


def speed(base: dict[str, Any], args: argparse.Namespace, out: Path) -> None:
    """Decode tokens/s at the longest passkey prompt, from ucm, each config in its own engine
    (dense first and last: the drift of the machine between them)."""
    budget = float(args.budgets.split(",")[0])
    runs = [("dense", None)] + [(f"{m}@{budget:g}", {"method": m, "budget": budget})
                                for m in args.methods.split(",")] + [("dense-again", None)]
    rows = []
    for name, sparse in runs:
        res = _run(f"speed-{name}", {**base, "sparse": sparse, "speed_only": True,
                                     "speed_repeat": 3}, out)
        rows.append({"run": name, **_speed(res, args.speed_tokens)})
    lines = [f"| run | decode tok/s at {res['speed_prompt_tokens']} tokens | load wait per step "
             "(ms) | per loading step (ms) | steps that load |", "|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['tok_s']:.1f} | {r['wait_ms_per_step']:.2f} | "
              f"{r['wait_ms_per_load']:.2f} | {r['loads_per_step']:.0%} |" for r in rows]
    print("\n".join(lines))
    (out / "speed.md").write_text("\n".join(lines) + "\n")
    (out / "speed.json").write_text(json.dumps(rows, indent=1))


def report(results: dict[str, Any], prompts: dict[str, Any], args: argparse.Namespace,
           out: Path, dtype: str) -> None:
    keys = [p["key"] for p in prompts["passkey"]]
    lengths = args.passkey
    dense = results["dense"]
    rows = []
    for name, res in results.items():
        ok = [str(k) in text for k, text in zip(keys, res["passkey"], strict=True)]
        acc = {n: sum(o for o, p in zip(ok, prompts["passkey"], strict=True)
                      if p["length"] == n) for n in lengths}
        same, prefix, whole = _agreement(dense["docs"], res["docs"])
        sp = _speed(res, args.speed_tokens)
        rows.append({"run": name, "passkey": acc, "agree": same, "prefix": prefix,
                     "whole": whole, **sp,
                     "freed": res["scheduler"].get("sparse_freed_blocks", 0),
                     "loaded": res["worker"].get("loaded_blocks", 0)})
    n = args.trials
    head = ("| run | " + " | ".join(f"passkey {x // 1024}K" for x in lengths) +
            " | same token as dense (64 x 50) | tokens before the first difference | "
            "documents equal | blocks freed | blocks loaded |")
    lines = [head, "|" + "---|" * (len(lengths) + 6)]
    for r in rows:
        lines.append(f"| {r['run']} | " + " | ".join(f"{r['passkey'][x]}/{n}" for x in lengths)
                     + f" | {r['agree']:.1%} | {r['prefix']:.1f} | {r['whole']} | "
                     f"{r['freed']} | {r['loaded']} |")
    table = "\n".join(lines)
    print(table)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"dtype": dtype, "rows": rows}, indent=1))
    try:
        _plot(rows, out / "agreement.png")
    except ImportError:
        _say("matplotlib not installed: no plot")


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    methods = sorted({r["run"].split("@")[0] for r in rows if "@" in r["run"]})
    for m in methods:
        pts = sorted((float(r["run"].split("@")[1]), r["agree"]) for r in rows
                     if r["run"].startswith(m + "@"))
        ax.plot([p[0] for p in pts], [p[1] * 100 for p in pts], marker="o", label=m)
    computed = next((r for r in rows if r["run"] == "computed"), None)
    if computed is not None:  # the numeric path alone: dense computed against dense loaded
        ax.axhline(computed["agree"] * 100, color="grey", linestyle="--",
                   label="dense, computed (not loaded)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (share of the blocks between sinks and window)")
    ax.set_ylabel("greedy tokens equal to dense (%)")
    ax.set_title("SmolLM2-135M-Instruct, 50 documents x 64 tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
