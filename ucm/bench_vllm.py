"""`ucm bench vllm`: time to first token on vLLM when the prompt's KV is recomputed, already in
vLLM's own cache, or loaded by a connector; each setup in a fresh engine process.

Setups (per prompt length; the store pass for a connector runs in its own earlier process):
    recompute   no connector, no prefix cache
    floor       vLLM's own prefix-cache hit in the same engine: nothing to load, the limit
    example     vLLM's built-in ExampleConnector (safetensors files), full hit
    ucm-posix   ucm, posix tier only (page cache warm: the files were just written)
    ucm-shm     ucm, memory tier shared through /dev/shm
    all-miss    ucm on, nothing stored, stores of earlier prompts running; vs recompute
TTFT is the wall time of `generate(max_tokens=1)` for one prompt after a warm-up request;
the median of `--repeat` runs. Overhead is TTFT minus the floor's. ucm's effective load
bandwidth is the KV bytes it loaded over its overhead, next to the worker's own wait for the
load; the raw read bandwidth is plain preadv()s of the same block files into memory as large
as the KV, with the page cache warm.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import shutil
import statistics
import tempfile
import time
from typing import Any

from ucm.models import ModelSpec, build_model

SPEC = ModelSpec(layers=8, hidden=1024, heads=16, kv_heads=8, intermediate=2816, vocab=2048,
                 max_positions=16384, dtype="bfloat16")


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, SPEC.vocab) for _ in range(n)]


def _say(msg: str) -> None:
    print(f"[ucm bench vllm] {msg}", flush=True)


def _median_ms(result: dict, name: str) -> float:
    phase = next(p for p in result["phases"] if p["name"] == name)
    return statistics.median(phase["wall_s"]) * 1e3


def _raw_read_bandwidth(paths: list[str], nbytes: int) -> tuple[float, int]:
    """Bytes/s of plain preadv()s of block files into memory as large as one prompt's KV
    (`nbytes`, touched beforehand; each file into its own place, as a load into the KV cache
    does), best of one and two threads; the page cache is warm (one untimed pass first).
    Reading every file into one small reused buffer would be faster, since it stays in the
    CPU cache, but it is not the work a load does."""
    import concurrent.futures

    import numpy as np

    size = max(os.path.getsize(p) for p in paths)
    paths = paths[:max(1, nbytes // size)]
    dest = np.ones((len(paths), size), np.uint8)

    def read(i: int) -> int:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            return os.preadv(fd, [memoryview(dest[i])], 0)
        finally:
            os.close(fd)

    best, total = 0.0, 0
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for attempt in range(7):
            threads = 1 + attempt % 2
            t0 = time.perf_counter()
            if threads == 1:
                total = sum(read(i) for i in range(len(paths)))
            else:
                total = sum(pool.map(read, range(len(paths))))
            dt = time.perf_counter() - t0
            if attempt:
                best = max(best, total / dt)
    return best, total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ucm bench vllm", description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,8192", help="prompt lengths in tokens")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--setups", default="recompute,floor,example,ucm-posix,ucm-shm")
    args = ap.parse_args(argv)

    from ucm.vllm_run import EngineSpec, Phase, run_in_subprocess

    lengths = [int(x) for x in args.lengths.split(",")]
    setups = args.setups.split(",")
    work = args.workdir or tempfile.mkdtemp(prefix="ucm-bench-vllm-")
    shm = tempfile.mkdtemp(prefix="ucm-bench-", dir="/dev/shm")
    log = os.path.join(work, "engines.log")
    _say(f"model: {SPEC.layers} layers, hidden {SPEC.hidden}, {SPEC.kv_heads} KV heads, "
         f"{SPEC.dtype}, block {args.block_size}; prompts {lengths}; repeat {args.repeat}; "
         f"{os.cpu_count()} CPUs; logs {log}")
    model = str(build_model(os.path.join(work, "model"), SPEC))
    max_len = max(lengths) + 256
    base = {"model": model, "dtype": SPEC.dtype, "block_size": args.block_size,
            "max_model_len": max_len, "kv_cache_bytes": 2 * 2**30, "max_num_seqs": 4}
    warmup = Phase([_prompt(lengths[0], 1)], max_tokens=1, name="warmup")
    hits = {n: _prompt(n, 10 + n) for n in lengths}
    misses = {n: [_prompt(n, 1000 * n + i) for i in range(args.repeat)] for n in lengths}

    def timed_hits() -> list[Phase]:
        return [Phase([hits[n]], max_tokens=1, name=f"hit{n}", repeat=args.repeat)
                for n in lengths]

    def store_pass() -> list[Phase]:
        return [warmup] + [Phase([hits[n]], max_tokens=1, name=f"store{n}") for n in lengths]

    def timed_misses() -> list[Phase]:
        return [Phase([p], max_tokens=1, name=f"miss{n}.{i}")
                for n in lengths for i, p in enumerate(misses[n])]

    def run(label: str, phases: list[Phase], **kw: Any) -> dict:
        _say(f"{label}: fresh engine process")
        result = run_in_subprocess(EngineSpec(**{**base, **kw}), phases, log_path=log,
                                   progress=lambda m: _say(f"  {label}: {m}"))
        for phase in result["phases"]:
            if phase["name"].startswith("hit"):
                runs = ", ".join(f"{w * 1e3:.0f}" for w in phase["wall_s"])
                _say(f"  {label}: {phase['name']} TTFT ms per run: {runs}")
        return result

    ucm_posix = {"tiers": [{"driver": "posix", "path": os.path.join(work, "ucm-store")}]}
    ucm_shm = {"tiers": [{"driver": "memory", "shared": True, "shm_dir": shm}]}
    ttft: dict[str, dict[int, float]] = {}
    miss_ms: dict[str, dict[int, float]] = {}
    loaded_bytes: dict[int, int] = {}
    load_ms: dict[str, dict[int, float]] = {"ucm-posix": {}, "ucm-shm": {}}
    try:
        recompute = run("recompute", [warmup, *timed_misses()])
        miss_ms["recompute"] = {n: statistics.median(_median_ms(recompute, f"miss{n}.{i}")
                                                     for i in range(args.repeat))
                                for n in lengths}
        ttft["recompute"] = miss_ms["recompute"]
        floor = run("floor", [warmup, *store_pass()[1:], *timed_hits()], prefix_caching=True)
        ttft["floor"] = {n: _median_ms(floor, f"hit{n}") for n in lengths}
        if "example" in setups:
            extra = {"shared_storage_path": os.path.join(work, "example-store")}
            run("example store pass", store_pass(), connector="example", extra=extra)
            r = run("example", [warmup, *timed_hits()], connector="example", extra=extra)
            ttft["example"] = {n: _median_ms(r, f"hit{n}") for n in lengths}
        for name, cfg in (("ucm-posix", ucm_posix), ("ucm-shm", ucm_shm)):
            if name not in setups:
                continue
            phases = store_pass() + (timed_misses() if name == "ucm-posix" else [])
            cold = run(f"{name} store pass", phases, connector="ucm", ucm=cfg)
            if name == "ucm-posix":
                miss_ms["ucm"] = {n: statistics.median(_median_ms(cold, f"miss{n}.{i}")
                                                       for i in range(args.repeat))
                                  for n in lengths}
            r = run(name, [warmup, *timed_hits()], connector="ucm", ucm=cfg)
            ttft[name] = {n: _median_ms(r, f"hit{n}") for n in lengths}
            for n in lengths:
                phase = next(p for p in r["phases"] if p["name"] == f"hit{n}")
                delta = phase["worker_delta"]
                loaded_bytes[n] = delta.get("loaded_bytes", 0) // args.repeat
                load_ms[name][n] = delta.get("load_wait_ns", 0) / args.repeat / 1e6
        files = glob.glob(os.path.join(work, "ucm-store", "**", "*.blk"), recursive=True)
        kv = max(loaded_bytes.values(), default=0)
        raw_bw, raw_bytes = _raw_read_bandwidth(files, kv) if files and kv else (0.0, 0)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    _print_table(lengths, ttft, miss_ms, loaded_bytes, load_ms, raw_bw, raw_bytes)
    return 0


def _print_table(lengths: list[int], ttft: dict, miss_ms: dict, loaded: dict[int, int],
                 load_ms: dict[str, dict[int, float]], raw_bw: float, raw_bytes: int) -> None:
    print("\nTTFT (ms, median) and overhead over the floor")
    print(f"{'setup':<12}" + "".join(f"{f'{n} tok':>14}{'overhead':>10}" for n in lengths))
    for name, row in ttft.items():
        line = f"{name:<12}"
        for n in lengths:
            over = row[n] - ttft["floor"][n]
            line += f"{row[n]:>14.1f}{over:>10.1f}"
        print(line)
    for n in lengths:
        floor = ttft["floor"][n]
        parts = []
        if "example" in ttft:
            ex = ttft["example"][n] - floor
            for name in ("ucm-posix", "ucm-shm"):
                if name in ttft:
                    parts.append(f"{name} overhead / example overhead = "
                                 f"{(ttft[name][n] - floor) / ex if ex > 0 else float('nan'):.2f}")
        if n in loaded and "ucm-posix" in ttft:
            over_s = max(1e-6, (ttft["ucm-posix"][n] - floor) / 1e3)
            parts.append(f"ucm-posix effective load bandwidth {loaded[n] / over_s / 2**30:.2f} "
                         f"GiB/s ({loaded[n] / 2**20:.0f} MiB)")
        for name, per_n in load_ms.items():
            if per_n.get(n) and n in loaded:
                parts.append(f"{name} load wait {per_n[n]:.1f} ms "
                             f"({loaded[n] / (per_n[n] / 1e3) / 2**30:.2f} GiB/s)")
        print(f"{n} tokens: " + "; ".join(parts))
    if raw_bytes:
        print(f"raw preadv() of the same block files into {raw_bytes / 2**20:.0f} MiB of memory "
              f"(page cache warm, best of 1 and 2 threads): {raw_bw / 2**30:.2f} GiB/s")
    if "ucm" in miss_ms:
        for n in lengths:
            rec, ucm = miss_ms["recompute"][n], miss_ms["ucm"][n]
            print(f"all-miss {n} tokens: no connector {rec:.0f} ms, ucm on {ucm:.0f} ms, "
                  f"overhead {(ucm - rec) / rec:+.1%} (target <= 5%)")
