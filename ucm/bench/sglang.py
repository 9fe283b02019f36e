"""`ucm bench sglang`: time to first token on SGLang (CPU, HiCache) for one prompt whose KV is
recomputed, already in SGLang's host memory, or loaded from a storage backend.

Setups, each engine in its own process of .venv-sglang (scripts/sglang/setup.sh), same model
and prompt, one run:
    recompute   no radix cache: every request computes the whole prompt
    host        HiCache without storage, a device pool smaller than two prompts: requests
                alternate between the prompt and another, so each finds its pages in host
                memory only (SGLang's own host-memory hit: the floor)
    file        SGLang's built-in `file` backend: a store engine writes the prompt's pages,
                then a fresh engine, its caches flushed before each request, loads them
    ucm         the same through ucm (`dynamic` backend, zero-copy interface, posix tier)
TTFT is the wall time of `generate(max_new_tokens=1)`, the median of `--rounds` requests after
one warm-up; the overhead of a storage hit is its TTFT minus the floor's.

    ucm bench sglang [--rounds 5] [--words 700] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PAGE_SIZE = 16


def _engine_args(spec: dict[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        model_path=spec["model"], device="cpu", attention_backend="torch_native",
        dtype="float32", disable_cuda_graph=True, max_running_requests=4, random_seed=0,
        page_size=PAGE_SIZE, log_level="error", enable_cache_report=True,
        max_total_tokens=spec.get("max_total_tokens", 8192))
    if spec.get("hicache"):
        args.update(enable_hierarchical_cache=True, hicache_ratio=spec.get("hicache_ratio", 2.0),
                    hicache_io_backend="direct", hicache_mem_layout="layer_first",
                    hicache_write_policy="write_through",
                    hicache_storage_prefetch_policy="wait_complete")
    else:
        args["disable_radix_cache"] = True
    if spec.get("backend"):
        args["hicache_storage_backend"] = spec["backend"]
    if spec.get("extra") is not None:
        args["hicache_storage_backend_extra_config"] = json.dumps(spec["extra"])
    return args


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in .venv-sglang: one engine, the requests `spec["plan"]` names, their timings."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import sglang

    engine = sglang.Engine(**_engine_args(spec))
    prompts = spec["prompts"]
    sampling = {"temperature": 0, "max_new_tokens": 1}
    timings: list[float] = []
    hits: list[dict[str, Any]] = []
    for i in range(spec["rounds"] + 1):  # the first is a warm-up
        if spec["plan"] == "flush":  # storage hits: device and host emptied first
            _flush(engine)
        elif spec["plan"] == "alternate":  # the other prompt pushes this one to host memory
            engine.generate(prompts[1], sampling)
        start = time.perf_counter()
        out = engine.generate(prompts[0], sampling)
        if i:
            timings.append(time.perf_counter() - start)
            hits.append(dict(out["meta_info"].get("cached_tokens_details") or {}))
        prompt_tokens = int(out["meta_info"]["prompt_tokens"])
    time.sleep(spec.get("settle", 0))
    engine.shutdown()
    return {"timings": timings, "hits": hits, "prompt_tokens": prompt_tokens}


def _flush(engine: Any, tries: int = 100) -> None:
    """Empties SGLang's device and host caches; it refuses while the previous request's pages
    are still being backed up, so this asks again until it is done."""
    for _ in range(tries):
        result = engine.flush_cache()
        if getattr(result, "success", True):
            return
        time.sleep(0.1)
    raise RuntimeError("SGLang did not flush its cache")


def _run(python: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(spec.pop("env", {}))
    proc = subprocess.run([python, "-m", "ucm.bench.sglang", "--worker", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]))
    raise RuntimeError(f"SGLang run failed ({spec.get('name')}):\n{proc.stderr[-4000:]}")


def run_bench(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    from ucm.bench.models import ModelSpec, build_model, sample_text

    python = str(Path(args.venv) / "bin" / "python")
    if not os.path.exists(python):
        raise SystemExit(f"no SGLang venv at {args.venv}: run scripts/sglang/setup.sh")
    work = Path(tempfile.mkdtemp(prefix="ucm-bench-sglang-"))
    model = args.model or str(build_model(work / "model", ModelSpec(dtype="float32")))
    prompt, other = sample_text(args.words, 1), sample_text(args.words, 2)
    base = {"model": model, "prompts": [prompt, other], "rounds": args.rounds}
    ucm_extra = {"backend_name": "ucm", "module_path": "ucm.sglang_hook",
                 "class_name": "UCMStorage", "interface_v1": 1,
                 "ucm": {"tiers": [{"driver": "posix", "path": str(work / "ucm")}]}}
    file_env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(work / "file")}
    # The host setup's device pool holds one prompt, not two; its host pool holds both.
    small = (args.words * 3 // 2 // PAGE_SIZE + 2) * PAGE_SIZE
    runs = {
        "recompute": {**base, "plan": "same"},
        "host": {**base, "plan": "alternate", "hicache": True, "max_total_tokens": small,
                 "hicache_ratio": 4.0},
    }
    for name, backend, extra, env in (("file", "file", None, file_env),
                                      ("ucm", "dynamic", ucm_extra, {})):
        store = {**base, "name": name + "-store", "plan": "same", "rounds": 0, "hicache": True,
                 "backend": backend, "extra": extra, "settle": 5, "env": dict(env)}
        print(f"[bench] {name}: storing", file=sys.stderr)
        _run(python, store, args.timeout)
        runs[name] = {**base, "plan": "flush", "hicache": True, "backend": backend,
                      "extra": extra, "env": dict(env)}
    results = {}
    for name, spec in runs.items():
        print(f"[bench] {name}", file=sys.stderr)
        results[name] = _run(python, {**spec, "name": name}, args.timeout)
    return results


EXPECTED = {"recompute": None, "host": "host", "file": "storage", "ucm": "storage"}


def table(results: dict[str, dict[str, Any]]) -> str:
    """One row per setup, over its requests that hit where the setup means them to (all of
    them, unless a flush or an eviction misfired: the last column counts them)."""

    def counted(name: str) -> list[float]:
        kind = EXPECTED.get(name)
        r = results[name]
        return [t for t, hit in zip(r["timings"], r["hits"], strict=True)
                if (kind is None and not any(hit.get(k) for k in ("device", "host", "storage")))
                or (kind is not None and hit.get(kind, 0) >= 0.9 * r["prompt_tokens"])]

    floor = statistics.median(counted("host"))
    lines = ["| setup | TTFT median (ms) | over the floor (ms) | tokens cached | requests |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        times = counted(name)
        if not times:
            lines.append(f"| {name} | - | - | - | 0 of {len(r['timings'])} |")
            continue
        ttft = statistics.median(times)
        over = "floor" if name == "host" else f"{(ttft - floor) * 1000:+.1f}"
        kind = EXPECTED.get(name)
        cached = (f"{kind} {max(h.get(kind, 0) for h in r['hits'])}" if kind else "none")
        lines.append(f"| {name} | {ttft * 1000:.1f} | {over} | {cached} of "
                     f"{r['prompt_tokens']} | {len(times)} of {len(r['timings'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ucm bench sglang", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed requests per setup")
    parser.add_argument("--words", type=int, default=700, help="prompt length in words "
                        "(about one token each)")
    parser.add_argument("--model", help="a model directory (default: a tiny random fp32 Llama)")
    parser.add_argument("--venv", default=str(ROOT / ".venv-sglang"), help="SGLang's venv")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per engine")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        os._exit(0)  # SGLang's threads can outlive shutdown()
    results = run_bench(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
