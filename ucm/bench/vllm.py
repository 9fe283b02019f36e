"""`ucm bench vllm`: time to first token on vLLM when the prompt's KV is recomputed, already in
vLLM's own cache, or loaded by a connector.

Setups (per prompt length; a connector's store pass runs in its own earlier engine process):
    recompute   no connector, no prefix cache
    example     vLLM's built-in ExampleConnector (safetensors files), full hit
    ucm-posix   ucm, posix tier only, page cache warm: stored with O_DIRECT (`direct_writes`,
                as the README advises for vLLM on CPU; `--no-direct-writes` for buffered
                stores), the hit engine's listing reads the blocks in when it starts
    ucm-posix-int8, ucm-posix-int4
                ucm-posix with the tier compressed (`codec: int8` or `codec: int4`):
                each its own store pass and directory; their overhead is shown over
                ucm-posix's (a compressed hit decodes what an uncompressed one copies)
    ucm-shm     ucm, memory tier shared through /dev/shm (one arena file that every process
                maps: loads copied and checked in one pass)
    ucm-pmem    ucm, pmem tier with its pool file in /dev/shm (one mapping and one owner
                process; loads as ucm-shm's)
    null        a connector that does nothing (ucm.bench.null_connector): vLLM's connector
                path alone
    all-miss    ucm on, nothing stored, stores of earlier prompts running (the ucm-posix store
                pass); against recompute, and against the null connector, which run just
                before it. With `--miss-engines` k > 1, k - 1 more pairs of recompute and
                all-miss engines run at the end, the second pair all-miss first, the third
                recompute first, and so on (whole engines drift over a run: in turn, a
                steady drift favours neither side), and both sides are medians over
                all their engines' prompts
Batches (`--batch 1,4,16`): per length and batch size N, N distinct stored prompts submitted
together, loaded by each connector setup and then hit in vLLM's own prefix cache in the same
engine (the floor), `--rounds` times (vLLM's cache emptied before each load); the batch's TTFT
is the wall time of one `generate(max_tokens=1)` for all N. Beside the overhead (median of the
per-round differences) it prints the time one thread's memcpy takes for the bytes the batch
loaded (median of 7, buffers touched beforehand, measured in the same run), and whether the
overhead holds 1.25 x that + 5 ms. With `--batch`, only the batch table runs. The batches
also take the setup
    lmcache     LMCache 0.5.6 in its multi-process mode (the only one that runs on vLLM's CPU
                backend): an `lmcache server` on loopback, started for the setup, holds the KV
                in its DRAM (L1, a /dev/shm segment the engine copies through); its engines
                run in .venv-lmcache (scripts/lmcache/setup.sh), with vLLM's hybrid KV cache
                manager off (ucm.bench.lmcache_server)
A prompt of length n is n KV tokens (`--lengths`, whole blocks) and then `--tail` more (2 by
default), so every setup loads or finds the same n tokens and computes only the tail: the floor
is a 2-token step, not a recomputed block (vLLM always computes a prompt's last token, so a
block-aligned prompt recomputes its whole last block, whose run-to-run noise is larger than
the overheads measured). A tail of 1 would make
ExampleConnector miss: it names a stored prompt by its first (P - 1) // bs blocks and looks it
up by its first (P - 2) // bs.

TTFT is the wall time of `generate(max_tokens=1)` for one prompt after a warm-up request.
Engines run on tcmalloc, as vLLM's CPU backend asks, where the system has it: with glibc's
malloc the page faults of a long prefill's tensors make prefill times unreadable
(ucm.vllm_hook.environment.TCMALLOC_PATHS). After each store pass the files written are synced,
so no writeback runs while hits are timed. Each connector's engine runs `--repeat` stored prompts,
each twice in a row with vLLM's prefix cache on: first loaded by the connector, then vLLM's own
hit in the same engine (the floor: nothing to load, the limit); and that `--rounds` times,
vLLM's prefix cache emptied before each load (not the connector's storage). The overhead is the
median of the per-pair differences. ucm's effective load bandwidth is the KV bytes it loaded
over its overhead, next to its Load's own time (submitted to done) and the part of it the step
waited for (less than the whole: the loads start when the scheduler plans the step); the raw
read bandwidth is plain preadv()s of the same block files into memory as large as the KV, with
the page cache warm. A closing line says how each ucm engine's kernel ran its Loads.

The floor is the same prompt again right after the loaded one: its forward pass reads KV and
weights that the previous one left in the CPU's caches, and a loaded prompt's does not (ucm
writes the cache past the CPU caches). On this machine, flushing the caches before the floor
removed the difference between a loaded step's forward pass and the floor's. (Figures behind
these choices: docs/performance.md, How the benchmarks are built.)
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from ucm.bench.lmcache_server import (
    SETUP_SCRIPT,
    LMCacheMissing,
    LMCacheServer,
    lmcache_env,
    lmcache_venv,
)
from ucm.bench.models import ModelSpec, build_model

SPEC = ModelSpec(layers=8, hidden=1024, heads=16, kv_heads=8, intermediate=2816, vocab=2048,
                 max_positions=16384, dtype="bfloat16")


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, SPEC.vocab) for _ in range(n)]


def _prompts(lengths: list[int], tail: int, repeat: int, seed: int) -> dict[int, list[list[int]]]:
    """`repeat` prompts of n + tail tokens for each n, distinct across lengths and seeds."""
    return {n: [_prompt(n + tail, seed * n + i) for i in range(repeat)] for n in lengths}


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
    ap.add_argument("--lengths", default="4096,8192",
                    help="KV tokens a full hit loads (whole blocks) per prompt")
    ap.add_argument("--tail", type=int, default=2,
                    help="prompt tokens after them, computed by every setup (0: block-aligned "
                         "prompts, whose last block is recomputed)")
    ap.add_argument("--repeat", type=int, default=3, help="prompts per length")
    ap.add_argument("--rounds", type=int, default=3,
                    help="times each stored prompt is loaded and then hit in a hit engine "
                         "(vLLM's own prefix cache emptied before each load)")
    ap.add_argument("--miss-engines", type=int, default=4,
                    help="engines that time all-miss prefills, with no connector and with ucm "
                         "each, in pairs of alternating order (whole engines differ by several "
                         "percent)")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--workdir", default=None,
                    help="where the model, the stored blocks and engines.log go, all kept "
                         "(default: a temporary directory, of which only engines.log is kept)")
    ap.add_argument("--hugepages", action=argparse.BooleanOptionalAction, default=None,
                    help="ucm setups with the connector's hugepages option on or off (default: "
                         "the connector's default)")
    ap.add_argument("--direct-writes", action=argparse.BooleanOptionalAction, default=True,
                    help="the posix tiers (ucm-posix and the all-miss engines) store with "
                         "O_DIRECT (the posix driver's direct_writes option, which the README "
                         "advises for vLLM on CPU; on by default): stores take no page-cache "
                         "pages, and the hit engine's listing reads the blocks in")
    ap.add_argument("--layerwise", action=argparse.BooleanOptionalAction, default=False,
                    help="ucm setups in the layerwise mode (each layer of a block stored on "
                         "its own, loaded while earlier layers compute)")
    ap.add_argument("--setups", default="null,example,ucm-posix,ucm-shm,ucm-pmem",
                    help="connector setups (recompute always runs)")
    ap.add_argument("--runs", type=int, default=1,
                    help="whole runs, each with fresh store passes and engines (a store pass "
                         "then its hit engine, started right after it exits); with more than "
                         "one, the distribution of each setup's overhead over the runs")
    ap.add_argument("--posix-map-bytes", default=None,
                    help="--batch: the posix tier's map_bytes (e.g. 1GiB, 0: off; default: "
                         "the driver's, auto: a quarter of the memory)")
    ap.add_argument("--batch", default=None,
                    help="batch sizes, e.g. 1,4,16: time N prompts submitted together per "
                         "length instead of the single-prompt table (with --lengths 1536,4096 "
                         "and --setups example,ucm-posix,ucm-shm, say)")
    ap.add_argument("--lmcache-venv", default=None,
                    help="--batch: LMCache's venv for the lmcache setup (default: "
                         "$UCM_LMCACHE_VENV, else .venv-lmcache in the repository, which "
                         "scripts/lmcache/setup.sh builds)")
    args = ap.parse_args(argv)
    setups = args.setups.split(",")
    if args.batch is not None:
        sizes = [int(x) for x in args.batch.split(",")]
        if not sizes or min(sizes) < 1:
            ap.error("--batch takes batch sizes of 1 or more, e.g. 1,4,16")
        if args.tail == 1 and "example" in setups:
            ap.error("--tail 1 makes ExampleConnector miss every prompt: use 0 or 2 and more")
        if "lmcache" in setups:
            try:
                lmcache_venv(args.lmcache_venv)
            except LMCacheMissing as e:
                ap.error(str(e))
        for k in range(args.runs):
            if args.runs > 1:
                _say(f"run {k + 1} of {args.runs} (load average {os.getloadavg()[0]:.2f})")
            workdir = args.workdir and (os.path.join(args.workdir, f"run{k + 1}")
                                        if args.runs > 1 else args.workdir)
            _run_batches(args, setups, sizes, workdir)
        return 0
    if args.tail < 0:
        ap.error("--tail must be 0 or more")
    if "lmcache" in setups:
        ap.error("the lmcache setup runs with --batch only (its engine has no single-prompt "
                 "table here)")
    if args.repeat < 1 or args.rounds < 1 or args.miss_engines < 1 or args.runs < 1:
        ap.error("--repeat, --rounds, --miss-engines and --runs must be 1 or more")
    if args.tail == 1 and "example" in setups:
        ap.error("--tail 1 makes ExampleConnector miss every prompt (it stores a prompt of P "
                 "tokens under its first (P - 1) // block size blocks and looks it up by its "
                 "first (P - 2) // block size): use 0 or 2 and more")
    per_run: list[dict[str, dict[int, Row]]] = []
    loads: list[float] = []
    for k in range(args.runs):
        if args.runs > 1:
            loads.append(os.getloadavg()[0])
            _say(f"run {k + 1} of {args.runs} (load average {loads[-1]:.2f})")
        workdir = args.workdir and (os.path.join(args.workdir, f"run{k + 1}") if args.runs > 1
                                    else args.workdir)  # each run stores afresh
        per_run.append(_run_once(args, setups, workdir))
    if args.runs > 1:
        _print_distribution(per_run, loads)
    return 0


def _run_once(args: argparse.Namespace, setups: list[str], workdir: str | None,
              ) -> dict[str, dict[int, Row]]:
    """One whole run: every setup's store pass and hit engine; prints its table."""
    from ucm.bench.engines import EngineSpec, Phase, run_in_subprocess

    lengths = [int(x) for x in args.lengths.split(",")]
    work = workdir or tempfile.mkdtemp(prefix="ucm-bench-vllm-")
    os.makedirs(work, exist_ok=True)
    shm = tempfile.mkdtemp(prefix="ucm-bench-", dir="/dev/shm")
    log = os.path.join(work, "engines.log")
    _say(f"model: {SPEC.layers} layers, hidden {SPEC.hidden}, {SPEC.kv_heads} KV heads, "
         f"{SPEC.dtype}, block {args.block_size}; prompts of {lengths} tokens + {args.tail}; "
         f"repeat {args.repeat}; "
         f"{os.cpu_count()} CPUs; ucm {'layerwise' if args.layerwise else 'whole blocks'}"
         + ("" if args.hugepages is None else f", hugepages {'on' if args.hugepages else 'off'}")
         + (", posix direct writes" if args.direct_writes else ", posix buffered writes")
         + "; "
         f"logs {log}")
    model = str(build_model(os.path.join(work, "model"), SPEC))
    max_len = max(lengths) + args.tail + 256
    base = {"model": model, "dtype": SPEC.dtype, "block_size": args.block_size,
            "max_model_len": max_len, "kv_cache_bytes": 2 * 2**30, "max_num_seqs": 4}
    warmup = Phase([_prompt(lengths[0] + args.tail, 1)], max_tokens=1, name="warmup")
    hits = _prompts(lengths, args.tail, args.repeat, 10)
    misses = _prompts(lengths, args.tail, args.repeat, 1000)

    def store_pass() -> list[Phase]:
        # Timed too: on ucm-posix these are the all-miss runs (nothing stored yet, the stores
        # of the earlier prompts running).
        return [warmup] + [Phase([p], max_tokens=1, name=f"store{n}.{i}")
                           for n in lengths for i, p in enumerate(hits[n])]

    def paired_hits() -> list[Phase]:
        # Each prompt twice in a row in one engine with vLLM's prefix cache on: first loaded
        # by the connector, then vLLM's own hit (the floor). Pairing them cancels the
        # differences between engine processes, which on a small shared machine are as large
        # as the overheads measured. Then again in later rounds, vLLM's own prefix cache
        # emptied before each load: more pairs per stored prompt, for no more store passes.
        return [Phase([p], max_tokens=1, name=f"{kind}{n}.{i}.{r}",
                      reset_prefix_cache=kind == "hit")
                for r in range(args.rounds) for n in lengths for i, p in enumerate(hits[n])
                for kind in ("hit", "again")]

    allocators: set[str] = set()

    def run(label: str, phases: list[Phase], **kw: Any) -> dict:
        _say(f"{label}: fresh engine process")
        result = run_in_subprocess(EngineSpec(**{**base, **kw}), phases, log_path=log,
                                   progress=lambda m: _say(f"  {label}: {m}"))
        allocators.add(result["allocator"])
        return result

    def walls(result: dict, name: str, n: int) -> list[float]:
        return [_median_ms(result, f"{name}{n}.{i}") for i in range(args.repeat)]

    def pairs(result: dict, n: int) -> list[tuple[str, float, float]]:
        """(hit phase, its TTFT, the floor's) for every prompt and round."""
        return [(f"hit{n}.{i}.{r}", _median_ms(result, f"hit{n}.{i}.{r}"),
                 _median_ms(result, f"again{n}.{i}.{r}"))
                for r in range(args.rounds) for i in range(args.repeat)]

    ucm_extra: dict[str, Any] = {"layerwise": True} if args.layerwise else {}
    if args.hugepages is not None:
        ucm_extra["hugepages"] = args.hugepages
    def posix_tier(path: str, bits: int | None = None) -> dict:
        return {"tiers": [{"driver": "posix", "path": path,
                           **({"direct_writes": True} if args.direct_writes else {}),
                           **({"codec": f"int{bits}"} if bits else {})}]}

    ucm_posix = posix_tier(os.path.join(work, "ucm-store"))
    ucm_shm = {"tiers": [{"driver": "memory", "shared": True, "shm_dir": shm,
                          "size": "4GiB"}]}  # sparse, as the pool below
    ucm_pmem = {"tiers": [{"driver": "pmem", "path": os.path.join(shm, "pmem"),
                           "size": "4GiB"}]}  # sparse: only what is stored takes memory
    connectors = [("example", {"connector": "example", "extra": {
                      "shared_storage_path": os.path.join(work, "example-store")}}),
                  ("ucm-posix", {"connector": "ucm", "ucm": ucm_posix, "extra": ucm_extra}),
                  *((f"ucm-posix-int{bits}", {"connector": "ucm", "extra": ucm_extra,
                                              "ucm": posix_tier(os.path.join(
                                                  work, f"ucm-store-int{bits}"), bits)})
                    for bits in (8, 4)),
                  ("ucm-shm", {"connector": "ucm", "ucm": ucm_shm, "extra": ucm_extra}),
                  ("ucm-pmem", {"connector": "ucm", "ucm": ucm_pmem, "extra": ucm_extra})]
    rows: dict[str, dict[int, Row]] = {}
    miss_ms: dict[str, dict[int, float]] = {}
    loaded_bytes: dict[int, int] = {}
    try:
        def recompute_pass(label: str, **kw: Any) -> dict:
            return run(label, [warmup, *(Phase([p], max_tokens=1, name=f"miss{n}.{i}")
                                         for n in lengths for i, p in enumerate(misses[n]))],
                       **kw)

        miss_walls: dict[str, dict[int, list[float]]] = {"recompute": {n: [] for n in lengths},
                                                          "ucm": {n: [] for n in lengths}}

        def baselines() -> None:
            # Right before ucm-posix's store pass (its all-miss engine) when it runs: whole
            # engines drift over a run, so the pair runs together.
            recompute = recompute_pass("recompute")
            for n in lengths:
                miss_walls["recompute"][n] += walls(recompute, "miss", n)
            if "null" in setups:  # vLLM's connector path alone, on the same prompts
                null = recompute_pass("null connector", connector="null")
                miss_ms["null"] = {n: statistics.median(walls(null, "miss", n)) for n in lengths}

        if "ucm-posix" not in setups:
            baselines()
        for name, kw in connectors:
            if name not in setups:
                continue
            if name == "ucm-posix":
                baselines()
            cold = run(f"{name} store pass", store_pass(), **kw)
            # Write the stored files back now: writeback during the timed hits slows the
            # posix tier's loads.
            os.sync()
            if name == "ucm-posix":
                for n in lengths:
                    miss_walls["ucm"][n] += walls(cold, "store", n)
            r = run(name, [warmup, *paired_hits()], prefix_caching=True, **kw)
            rows[name] = {}
            for n in lengths:
                timed = pairs(r, n)
                hit, again = [h for _, h, _ in timed], [a for _, _, a in timed]
                _say(f"  {name}: {n}+{args.tail} tokens, TTFT ms loaded / vLLM's own hit: "
                     + ", ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(hit, again, strict=True)))
                deltas = [next(p for p in r["phases"] if p["name"] == phase)["worker_delta"]
                          for phase, _, _ in timed]
                load_ms = statistics.median(d.get("load_ns", 0) for d in deltas) / 1e6
                wait_ms = statistics.median(d.get("load_wait_ns", 0) for d in deltas) / 1e6
                if name.startswith("ucm"):
                    loaded_bytes[n] = max(d.get("loaded_bytes", 0) for d in deltas)
                rows[name][n] = Row(statistics.median(hit), statistics.median(again),
                                    statistics.median(a - b for a, b in zip(hit, again,
                                                                            strict=True)),
                                    load_ms if name.startswith("ucm") else None,
                                    wait_ms if name.startswith("ucm") else None)
            if name.startswith("ucm"):
                _say(f"  {name}: {_load_paths(r)}")
        if "ucm-posix" in setups:
            # More all-miss engines (whole engines differ by several percent), in turn: the
            # first pair ran recompute first, the second runs
            # all-miss first, and so on, so that a steady drift favours neither side.
            for k in range(2, args.miss_engines + 1):
                scratch = posix_tier(os.path.join(work, f"ucm-miss-{k}"))
                if k % 2:
                    rec = recompute_pass(f"recompute ({k})")
                miss = run(f"all-miss ({k})", store_pass(), connector="ucm", ucm=scratch,
                           extra=ucm_extra)
                os.sync()
                shutil.rmtree(os.path.join(work, f"ucm-miss-{k}"), ignore_errors=True)
                if not k % 2:
                    rec = recompute_pass(f"recompute ({k})")
                for n in lengths:
                    miss_walls["recompute"][n] += walls(rec, "miss", n)
                    miss_walls["ucm"][n] += walls(miss, "store", n)
        miss_ms.update({what: {n: statistics.median(ms) for n, ms in by_len.items()}
                        for what, by_len in miss_walls.items() if all(by_len.values())})
        files = glob.glob(os.path.join(work, "ucm-store", "**", "*.blk"), recursive=True)
        kv = max(loaded_bytes.values(), default=0)
        raw_bw, raw_bytes = _raw_read_bandwidth(files, kv) if files and kv else (0.0, 0)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if not workdir:
            _drop_bulk(work)
    _print_table(lengths, miss_ms, rows, loaded_bytes, raw_bw, raw_bytes, tail=args.tail)
    print(f"engine processes' malloc: {', '.join(sorted(allocators))}"
          + ("" if allocators == {"tcmalloc"} else
             " (vLLM on CPU asks for tcmalloc: see ucm.vllm_hook.environment.TCMALLOC_PATHS)"))
    return rows


@dataclass(frozen=True)
class BatchRow:
    """One setup at one (length, batch size): ms, medians over the rounds."""

    setup: str
    length: int
    batch: int
    ttft: float  # the batch loaded by the connector
    floor: float  # the same batch again: vLLM's own prefix hit, same engine
    overhead: float  # median of the per-round differences
    loaded_bytes: int  # what the batch loaded (ucm's count; 0 where unknown)
    memcpy: float | None  # one thread's memcpy of loaded_bytes, ms (median of 7)

    @property
    def limit(self) -> float | None:
        """The overhead the issue allows: 1.25 x the memcpy time + 5 ms."""
        return None if self.memcpy is None else 1.25 * self.memcpy + 5.0


def memcpy_ms(nbytes: int, repeat: int = 7) -> float:
    """Median ms of one thread copying `nbytes` between two buffers touched beforehand."""
    import numpy as np

    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _run_batches(args: argparse.Namespace, setups: list[str], sizes: list[int],
                 workdir: str | None) -> list[BatchRow]:
    """Per connector setup: a store pass of max(sizes) prompts per length, then one hit engine
    that, per round, length and batch size, loads a batch (vLLM's cache emptied first) and hits
    it again in vLLM's own cache. Prints the batch table."""
    from ucm.bench.engines import EngineSpec, Phase, run_in_subprocess

    lengths = [int(x) for x in args.lengths.split(",")]
    top = max(sizes)
    work = workdir or tempfile.mkdtemp(prefix="ucm-bench-vllm-")
    os.makedirs(work, exist_ok=True)
    shm = tempfile.mkdtemp(prefix="ucm-bench-", dir="/dev/shm")
    log = os.path.join(work, "engines.log")
    _say(f"batches {sizes} of prompts of {lengths} tokens + {args.tail}; {args.rounds} rounds; "
         f"model: {SPEC.layers} layers, hidden {SPEC.hidden}, {SPEC.kv_heads} KV heads, "
         f"{SPEC.dtype}, block {args.block_size}; {os.cpu_count()} CPUs; logs {log}")
    model = str(build_model(os.path.join(work, "model"), SPEC))
    kv = SPEC.kv_bytes_per_token()
    cache = max(2 * 2**30, int(1.25 * top * (max(lengths) + args.tail + args.block_size) * kv))
    base = {"model": model, "dtype": SPEC.dtype, "block_size": args.block_size,
            "max_model_len": max(lengths) + args.tail + 256, "kv_cache_bytes": cache,
            "max_num_seqs": max(4, top)}
    prompts = _prompts(lengths, args.tail, top, 20)
    warmup = Phase([_prompt(lengths[0] + args.tail, 2)], max_tokens=1, name="warmup")
    # One prompt at a time: each prefills in one step (a chunked one can miss ExampleConnector)
    store = [warmup] + [Phase([p], max_tokens=1, name=f"store{n}.{i}")
                        for n in lengths for i, p in enumerate(prompts[n])]
    timed = [Phase(prompts[n][:b], max_tokens=1, name=f"{kind}{n}x{b}.{r}",
                   reset_prefix_cache=kind == "hit")
             for r in range(args.rounds) for n in lengths for b in sizes
             for kind in ("hit", "again")]
    tier_bytes = f"{max(4, -(-2 * top * sum(lengths) * kv // 2**30))}GiB"
    kws = {"example": {"connector": "example", "extra": {
               "shared_storage_path": os.path.join(work, "example-store")}},
           "ucm-posix": {"connector": "ucm", "ucm": {"tiers": [{
               "driver": "posix", "path": os.path.join(work, "ucm-store"),
               **({"direct_writes": True} if args.direct_writes else {}),
               **({"map_bytes": args.posix_map_bytes} if args.posix_map_bytes else {})}]}},
           "ucm-shm": {"connector": "ucm", "ucm": {"tiers": [{
               "driver": "memory", "shared": True, "shm_dir": shm, "size": tier_bytes}]}}}
    kws["lmcache"] = {"connector": "lmcache"}  # its server's address: when it starts
    unknown = [name for name in setups if name not in kws]
    if unknown:
        _say(f"batches run {', '.join(kws)}; skipping {', '.join(unknown)}")
    if "lmcache" not in setups:
        _say(f"LMCache not timed: add lmcache to --setups (it runs in its own venv, built by "
             f"bash {SETUP_SCRIPT})")
    rows: list[BatchRow] = []
    servers = contextlib.ExitStack()  # the lmcache server, stopped also on failure
    try:
        for name in (n for n in kws if n in setups):
            kw, python, env = kws[name], None, None
            if name == "lmcache":  # its server runs through both of its engines
                kw, python, env = _start_lmcache(servers, args, os.path.join(work, "lmcache"),
                                                 top * sum(lengths) * kv)
            _say(f"{name} store pass: fresh engine process")
            run_in_subprocess(EngineSpec(**{**base, **kw}), store, log_path=log,
                              progress=lambda m, name=name: _say(f"  {name} store: {m}"),
                              python=python, env=env)
            os.sync()
            _say(f"{name}: fresh engine process")
            result = run_in_subprocess(EngineSpec(**{**base, **kw, "prefix_caching": True}),
                                       [warmup, *timed], log_path=log,
                                       progress=lambda m, name=name: _say(f"  {name}: {m}"),
                                       python=python, env=env)
            servers.close()
            _say_mapped(name, result)
            if name.startswith("ucm"):
                _say(f"  {name}: {_load_paths(result)}")
            by_name = {p["name"]: p for p in result["phases"]}
            for n in lengths:
                for b in sizes:
                    hits = [by_name[f"hit{n}x{b}.{r}"] for r in range(args.rounds)]
                    again = [by_name[f"again{n}x{b}.{r}"] for r in range(args.rounds)]
                    h = [p["wall_s"][-1] * 1e3 for p in hits]
                    a = [p["wall_s"][-1] * 1e3 for p in again]
                    loaded = max(p["worker_delta"].get("loaded_bytes", 0) for p in hits)
                    if name.startswith("ucm") and loaded < b * n * kv:
                        _say(f"  {name}: {n} tokens x {b}: loaded {loaded} bytes of "
                             f"{b * n * kv} (a partial hit: see {log})")
                    short = [c for p in hits for c in p["num_cached_tokens"] if c < n]
                    if name == "lmcache" and short:  # LMCache's own count is not reported
                        _say(f"  {name}: {n} tokens x {b}: {len(short)} requests found fewer "
                             f"tokens ({min(short)} the fewest; a partial hit: see {log})")
                    _say(f"  {name}: {n}+{args.tail} tokens x {b}, ms loaded / vLLM's own hit: "
                         + ", ".join(f"{x:.0f}/{y:.0f}" for x, y in zip(h, a, strict=True)))
                    if name.startswith("ucm"):
                        _say(f"  {name}: {n} tokens x {b}, per round: "
                             + ", ".join(_load_round(p["worker_delta"]) for p in hits))
                    rows.append(BatchRow(name, n, b, statistics.median(h), statistics.median(a),
                                         statistics.median(x - y for x, y in
                                                           zip(h, a, strict=True)),
                                         loaded if name.startswith("ucm") else b * n * kv,
                                         None))
        copies: dict[int, float] = {}
        for row in rows:  # after the engines: each size once, in this process
            if row.loaded_bytes and row.loaded_bytes not in copies:
                copies[row.loaded_bytes] = memcpy_ms(row.loaded_bytes)
        rows = [BatchRow(**{**r.__dict__, "memcpy": copies.get(r.loaded_bytes)}) for r in rows]
    finally:
        servers.close()
        shutil.rmtree(shm, ignore_errors=True)
        if not workdir:
            _drop_bulk(work)
    _print_batches(rows, tail=args.tail)
    return rows


def _load_round(delta: dict[str, int]) -> str:
    """One timed batch's loads from its worker's counters: the Load events the steps posted,
    their blocks, ms from each load's submission until it was done (summed) and ms the steps
    waited for them."""
    return (f"{delta.get('load_events', 0)} loads of {delta.get('load_blocks', 0)} blocks "
            f"({delta.get('early_loads', 0)} early) {delta.get('load_ns', 0) / 1e6:.0f} ms, "
            f"waited {delta.get('load_wait_ns', 0) / 1e6:.0f}")


def _say_mapped(name: str, result: dict[str, Any]) -> None:
    """The hit engine's mapped posix blocks (from its worker's kernel statistics)."""
    kernel = result.get("stats", {}).get("worker", {}).get("kernel", {})
    for key, driver in kernel.items():
        if key.startswith("tier.") and isinstance(driver, dict) and "mapped_loads" in driver:
            _say(f"  {name}: {key[5:-7]} tier: {driver['mapped_blocks']} blocks mapped "
                 f"({driver['mapped_bytes'] / 2**20:.0f} MiB), {driver['loaded']} loaded, "
                 f"{driver['mapped_loads']} from mappings ({driver.get('mapped_on_load', 0)} "
                 f"mapped by their load, {driver.get('maps_dropped', 0)} dropped for room); "
                 f"kernel loads from memory: {kernel.get('loads_from_memory', 0)}")


def _start_lmcache(stack: contextlib.ExitStack, args: argparse.Namespace, work: str,
                   stored: int) -> tuple[dict[str, Any], str, dict[str, str]]:
    """Starts an LMCache server on `stack` with an L1 for `stored` bytes and a quarter more;
    returns the engine spec's keys, the python and the environment of its engines."""
    venv = lmcache_venv(args.lmcache_venv)
    server = stack.enter_context(LMCacheServer(venv, work, chunk_size=args.block_size,
                                               l1_gb=max(1, -(-5 * stored // (4 * 2**30)))))
    _say(f"lmcache: server on 127.0.0.1:{server.port}, L1 {server.l1_gb:g} GiB in "
         f"{server.shm_path}, log {server.log_path}")
    return ({"connector": "lmcache", "extra": server.connector_config()},
            str(venv / "bin" / "python"), lmcache_env({}, work))


def _print_batches(rows: list[BatchRow], *, tail: int) -> None:
    print("\nbatches of N prompts submitted together: TTFT of the batch (ms, median over the "
          "rounds) loaded by the connector, vLLM's own prefix hit of the same batch in the same "
          "engine (the floor), the overhead (median of the per-round differences), one "
          "thread's memcpy of the bytes loaded, and the limit 1.25 x memcpy + 5 ms")
    print(f"{'setup':<11}{'tokens':>10}{'N':>4}{'MiB':>7}{'TTFT':>9}{'floor':>9}"
          f"{'overhead':>10}{'memcpy':>8}{'ratio':>7}{'limit':>8}  holds")
    for r in rows:
        ratio = f"{r.overhead / r.memcpy:>7.2f}" if r.memcpy else f"{'n/a':>7}"
        limit = r.limit
        print(f"{r.setup:<11}{f'{r.length}+{tail}':>10}{r.batch:>4}"
              f"{r.loaded_bytes / 2**20:>7.0f}{r.ttft:>9.1f}{r.floor:>9.1f}{r.overhead:>10.1f}"
              + (f"{r.memcpy:>8.1f}" if r.memcpy is not None else f"{'':>8}") + ratio
              + (f"{limit:>8.1f}  {'yes' if r.overhead <= limit else 'NO'}"
                 if limit is not None else ""))
    if any(r.setup == "lmcache" for r in rows):
        print("lmcache: LMCache 0.5.6 in its multi-process mode (LMCacheMPConnector), its L1 "
              "the server process's DRAM, copied through /dev/shm; the server shares the CPUs "
              "with the engine and its copies are inside the TTFT. Its MiB are the batch's KV "
              "(LMCache's own count is not read); its floor, vLLM's own hit, still passes its "
              "connector; vLLM's hybrid KV cache manager is off in its engines (needed to start "
              "with lmcache imported)")


def _print_distribution(per_run: list[dict[str, dict[int, Row]]], loads: list[float], *,
                        limit_ms: float = 10.0) -> None:
    """Each setup's overhead (ms over vLLM's own hit) in every run, with min / median / max,
    and whether every run held `limit_ms` (the hit-overhead target at 4K)."""
    print(f"\noverhead over vLLM's own hit (ms) in each of {len(per_run)} runs "
          f"(load average at each run's start: {', '.join(f'{x:.2f}' for x in loads)})")
    names = [name for name in per_run[0] if all(name in run for run in per_run)]
    for name in names:
        for n in per_run[0][name]:
            ms = [run[name][n].overhead for run in per_run]
            held = sum(1 for x in ms if x <= limit_ms)
            print(f"{name:<15} {n:>6} tok: " + " ".join(f"{x:6.1f}" for x in ms)
                  + f"   min {min(ms):.1f} median {statistics.median(ms):.1f} "
                    f"max {max(ms):.1f}; <= {limit_ms:g} ms in {held} of {len(ms)} runs")


def _drop_bulk(work: str) -> None:
    """Empties a temporary work directory but for engines.log: a full run stores about 3 GiB
    (model, ExampleConnector's files, ucm's posix tier)."""
    for name in os.listdir(work):
        path = os.path.join(work, name)
        if name == "engines.log":
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


@dataclass(frozen=True)
class Row:
    """One connector setup at one prompt length (ms, medians over the prompts)."""

    ttft: float  # loaded by the connector
    floor: float  # the same prompt again: vLLM's own prefix-cache hit, same engine
    overhead: float  # median of the per-pair differences (prompts x rounds)
    load: float | None  # the ucm worker's Load, from its submission until it was done
    load_wait: float | None  # the part of it the step waited for (less when it started early)


def _load_paths(result: dict[str, Any]) -> str:
    """How the engine's kernel ran its Loads (off the trio thread, for blocks in memory; with
    the waiting worker thread copying too; started early), and how long the worker waited at
    start for the blocks storage holds to be indexed (`index_wait` caps it)."""
    worker = result.get("stats", {}).get("worker", {})
    kernel = worker.get("kernel", {})
    fast, helped = kernel.get("loads_from_memory", 0), kernel.get("loads_from_memory_helped", 0)
    return (f"{fast} loads of blocks in memory off the kernel thread ({helped} with the worker "
            f"thread copying too), {kernel.get('load_keys', 0)} blocks loaded in all, "
            f"{worker.get('early_loads', 0)} loads started early; the worker waited "
            f"{worker.get('index_wait_ms', 0)} ms at start for storage to be indexed")


def _print_table(lengths: list[int], miss_ms: dict, rows: dict[str, dict[int, Row]],
                 loaded: dict[int, int], raw_bw: float, raw_bytes: int, *, tail: int = 0,
                 ) -> None:
    """`tail`: the prompt tokens after the n KV tokens of each length (labels "n+tail")."""

    def label(n: int) -> str:
        return f"{n}+{tail}" if tail else str(n)

    print("\nTTFT (ms, median): loaded by the connector, vLLM's own prefix hit in the same "
          "engine (the floor), and the overhead (median of the per-pair differences)")
    print(f"{'setup':<15}" + "".join(f"{f'{label(n)} tok':>12}{'floor':>8}{'overhead':>10}"
                                      for n in lengths))
    print(f"{'recompute':<15}" + "".join(f"{miss_ms['recompute'][n]:>12.1f}{'':>18}"
                                         for n in lengths))
    for name, per_n in rows.items():
        print(f"{name:<15}" + "".join(f"{per_n[n].ttft:>12.1f}{per_n[n].floor:>8.1f}"
                                      f"{per_n[n].overhead:>10.1f}" for n in lengths))
    for n in lengths:
        parts = []
        example = rows.get("example", {}).get(n)
        plain = rows.get("ucm-posix", {}).get(n)
        for name in ("ucm-posix", "ucm-posix-int8", "ucm-posix-int4", "ucm-shm", "ucm-pmem"):
            row = rows.get(name, {}).get(n)
            if row is None:
                continue
            if name.startswith("ucm-posix-int") and plain is not None:
                if plain.overhead > 0:
                    parts.append(f"{name} overhead / ucm-posix overhead = "
                                 f"{row.overhead / plain.overhead:.2f} (target <= 1.5)")
                else:  # the floor moved more than the uncompressed load cost: noise
                    parts.append(f"{name} overhead / ucm-posix overhead n/a (ucm-posix "
                                 f"overhead <= 0)")
            if example is not None:
                ratio = (row.overhead / example.overhead if example.overhead > 0
                         else float("nan"))
                parts.append(f"{name} overhead / example overhead = {ratio:.2f}")
            if loaded.get(n) and row.overhead > 0:
                parts.append(f"{name} effective load bandwidth "
                             f"{loaded[n] / (row.overhead / 1e3) / 2**30:.2f} GiB/s")
            elif loaded.get(n):  # the floor moved more than the load cost: noise
                parts.append(f"{name} effective load bandwidth n/a (overhead <= 0)")
            if row.load and loaded.get(n):
                parts.append(f"{name} load {row.load:.1f} ms "
                             f"({loaded[n] / (row.load / 1e3) / 2**30:.2f} GiB/s), the step "
                             f"waited {row.load_wait or 0:.1f} ms of it")
        if loaded.get(n):
            parts.append(f"{loaded[n] / 2**20:.0f} MiB of KV")
        print(f"{label(n)} tokens: " + "; ".join(parts))
    if raw_bytes:
        print(f"raw preadv() of the same block files into {raw_bytes / 2**20:.0f} MiB of memory "
              f"(page cache warm, best of 1 and 2 threads): {raw_bw / 2**30:.2f} GiB/s")
    if "ucm" in miss_ms:
        for n in lengths:
            rec, ucm = miss_ms["recompute"][n], miss_ms["ucm"][n]
            line = (f"all-miss {label(n)} tokens: no connector {rec:.0f} ms, ucm on {ucm:.0f} ms, "
                    f"overhead {(ucm - rec) / rec:+.1%} (target <= 5%)")
            if "null" in miss_ms:
                null = miss_ms["null"][n]
                line += (f"; vLLM's connector path alone (null connector) {null:.0f} ms "
                         f"({(null - rec) / rec:+.1%}), ucm over it {(ucm - null) / null:+.1%}")
            print(line)
