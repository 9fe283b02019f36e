"""`ucm bench`: store, load and lookup through the kernel, next to a baseline in the same run.

For each tier of the config (the embedded default when none is given), the benchmark opens a
one-tier kernel on that driver and measures, per block size and number of concurrent
submitters:

- store and load through `Kernel.submit`, against a raw baseline doing the same I/O without
  the kernel: for posix, a plain pwritev/preadv loop over the very files the driver wrote;
  for every other driver, the driver called directly (the kernel's own overhead);
- lookup of 10,000 keys in one batch against the kernel's index, against the driver's own
  lookup of the same keys.

Cells alternate kernel and baseline runs and keep each side's best of `--repeat` rounds, so a
noisy neighbour hurts both sides alike. `ucm bench policy` compares eviction policies;
`ucm bench vllm`, `ucm bench sparse` and `ucm bench trace` are the other benchmarks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import trio

from ucm.block import PAYLOAD_OFFSET, checksum
from ucm.config import TierConfig, UCMConfig, load_config
from ucm.drivers import LoadState, get_driver_class
from ucm.kernel import Delete, Kernel, Load, Lookup, Store

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = (64 * KiB, 256 * KiB, 2 * MiB, 8 * MiB)
DEFAULT_CONCURRENCY = (1, 2, 4)


@dataclass
class Record:
    driver: str
    op: str
    block_bytes: int
    concurrency: int
    gbps: float | None
    baseline_gbps: float | None
    baseline: str
    keys_per_s: float | None = None
    baseline_keys_per_s: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.gbps and self.baseline_gbps:
            return self.gbps / self.baseline_gbps
        if self.keys_per_s and self.baseline_keys_per_s:
            return self.keys_per_s / self.baseline_keys_per_s
        return None


# Bytes per Load/Store event. The vLLM hook posts one Load per engine step with every hit block
# of the step's requests: 62 MiB for one 4K-token prompt of `ucm bench vllm`'s model. Events
# of 16 MiB measure per-event hand-offs (caller -> kernel thread -> copy threads and back) more
# than transfers: `--batch 16MiB` shows them.
DEFAULT_BATCH_BYTES = 64 * MiB


def _batch_for(size: int, batch_bytes: int = DEFAULT_BATCH_BYTES) -> int:
    """Blocks per event: `batch_bytes` worth, 1 to 64."""
    return max(1, min(64, batch_bytes // size))


def _split(items: list, parts: int) -> list[list]:
    return [items[i::parts] for i in range(parts)]


def _timed_threads(parts: list[list[Any]], fn: Callable[[list[Any]], None]) -> float:
    """Runs fn(part) for each part in its own thread, all released at once; wall seconds."""
    barrier = threading.Barrier(len(parts) + 1)
    errors: list[BaseException] = []

    def run(part: list[Any]) -> None:
        barrier.wait()
        try:
            fn(part)
        except BaseException as exc:
            errors.append(exc)

    with ThreadPoolExecutor(len(parts)) as pool:
        for part in parts:
            pool.submit(run, part)
        barrier.wait()
        start = time.perf_counter()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return elapsed


class _DirectDriver:
    """The driver of a tier, opened in a trio loop of its own thread, called without the
    kernel: the baseline that shows what the kernel itself costs."""

    def __init__(self, tier: TierConfig, namespace: str) -> None:
        self._portal_ready = threading.Event()
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main, tier, namespace),
                                        daemon=True, name="ucm-bench-direct")
        self._thread.start()
        self._portal_ready.wait()
        if self._error:
            raise self._error

    async def _main(self, tier: TierConfig, namespace: str) -> None:
        self._error = None
        try:
            factory = get_driver_class(tier.driver)
            self.driver = await factory.open(tier.options, name=tier.name or tier.driver,
                                             namespace=namespace, codec=tier.codec)
        except BaseException as exc:
            self._error = exc
            self._portal_ready.set()
            return
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        self._portal_ready.set()
        await self._stop.wait()
        await self.driver.aclose()

    def call(self, method: str, *args: Any) -> Any:
        fn = getattr(self.driver, method)
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def close(self) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join()


def _raw_baseline(tier: TierConfig, namespace: str) -> Any:
    """The driver's raw client from `ucm.bench.baselines` (`raw_baseline(options, namespace)`:
    an object with label, store(keys, bufs), load(keys, outs, batch), delete(keys), close()),
    or None where the driver has none."""
    import importlib

    if tier.codec != "none":
        return None
    try:
        module = importlib.import_module(f"ucm.bench.baselines.{tier.driver}")
    except ModuleNotFoundError as exc:
        if exc.name != f"ucm.bench.baselines.{tier.driver}":
            raise
        return None
    return module.raw_baseline(tier.options.model_dump(), namespace)


class TierBench:
    """Benchmarks one tier: a one-tier kernel and its baseline over the same blocks."""

    def __init__(self, tier: TierConfig, *, total_bytes: int, repeat: int,
                 batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        self.tier = tier
        self.name = tier.name or tier.driver
        self.total_bytes = total_bytes
        self.repeat = repeat
        self.batch_bytes = batch_bytes
        self.namespace = f"ucm-bench-{os.getpid()}"
        single = {"driver": tier.driver, "name": self.name, "codec": tier.codec,
                  "concurrency": max(tier.concurrency, 8),
                  **tier.options.model_dump(exclude_defaults=True)}
        config = UCMConfig.model_validate(
            {"tiers": [single], "namespace": self.namespace, "promote": False,
             "inbox_size": 1 << 16})
        resolved = config.tiers[0]  # its codec set: a tier without one takes the default
        self.kernel = Kernel(config)
        self.kernel.start()
        self.raw_files = tier.driver == "posix" and resolved.codec == "none"
        self.raw = None if self.raw_files else _raw_baseline(resolved, self.namespace)
        # A driver that owns its storage (pmem) cannot be opened twice on one namespace.
        direct_ns = self.namespace + ("-direct" if self.raw is not None else "")
        self.direct = _DirectDriver(resolved, direct_ns)

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()
        self.direct.close()
        self.kernel.close()
        self._remove_namespace_files()

    def _remove_namespace_files(self) -> None:
        """Removes what the bench namespaces left on local storage (empty shard directories,
        pmem pool files), which deleting the blocks does not."""
        import glob
        import shutil

        from ucm.drivers.kit import safe_dir_name
        from ucm.drivers.memory import SHM_ROOT

        options = self.tier.options.model_dump()
        roots = options.get("path") or []
        roots = [roots] if isinstance(roots, str) else list(roots)
        if self.tier.driver == "memory" and options.get("shared"):
            roots.append(options.get("shm_dir") or SHM_ROOT)
        ns = safe_dir_name(self.namespace)
        for root in roots:
            base = glob.escape(root)
            for leftover in (glob.glob(os.path.join(base, ns + "*"))
                             + glob.glob(os.path.join(base, "raw-" + ns + "*"))):
                if os.path.isdir(leftover):
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    os.unlink(leftover)

    # -- data -------------------------------------------------------------------------------
    def _blocks(self, size: int, tag: str) -> tuple[list[bytes], list[memoryview]]:
        """Keys and their payloads: one random block's bytes, copied into memory of its own
        for every key. (One buffer stored over and over stays in the CPU cache, so both sides
        would copy from cache, faster than any real KV source.)"""
        count = max(4, self.total_bytes // size)
        rng = random.Random(size)
        keys = [f"{tag}-{size}-{i}".encode() + rng.randbytes(8) for i in range(count)]
        data = memoryview(bytearray(os.urandom(size)) * count)
        return keys, [data[i * size:(i + 1) * size] for i in range(count)]

    @staticmethod
    def _destinations(count: int, size: int) -> list[memoryview]:
        """One load buffer per block, written once so no page faults land in a timed run.
        (A few buffers reused round the batch stay in the CPU cache, which no real load
        target does.)"""
        data = memoryview(bytearray(b"\x01") * (count * size))
        return [data[i * size:(i + 1) * size] for i in range(count)]

    def _cleanup(self, keys: list[bytes]) -> None:
        for start in range(0, len(keys), 4096):
            self.kernel.submit(Delete(keys[start:start + 4096])).result()

    # -- kernel side ------------------------------------------------------------------------
    def _kernel_store(self, keys: list[bytes], bufs: list[memoryview], batch: int) -> None:
        for i in range(0, len(keys), batch):
            result = self.kernel.submit(
                Store(keys[i:i + batch], buffers=bufs[i:i + batch])).result()
            if not result.ok:
                raise RuntimeError(f"{self.name}: store failed: {result.errors}")

    def _kernel_load(self, keys: list[bytes], outs: list[memoryview], batch: int) -> None:
        for i in range(0, len(keys), batch):
            part = keys[i:i + batch]
            result = self.kernel.submit(Load(part, buffers=outs[i:i + batch])).result()
            if not result.ok:
                raise RuntimeError(f"{self.name}: load failed: {result.states}")

    # -- baselines --------------------------------------------------------------------------
    def _direct_store(self, keys: list[bytes], bufs: list[memoryview], batch: int) -> None:
        for i in range(0, len(keys), batch):
            sizes = self.direct.call("store", keys[i:i + batch], bufs[i:i + batch])
            if not all(sizes):
                raise RuntimeError(f"{self.name}: direct store failed")

    def _direct_load(self, keys: list[bytes], outs: list[memoryview], batch: int) -> None:
        for i in range(0, len(keys), batch):
            states = self.direct.call("load", keys[i:i + batch], outs[i:i + batch])
            if any(s is not LoadState.OK for s in states):
                raise RuntimeError(f"{self.name}: direct load failed")

    def _raw_store(self, keys: list[bytes], bufs: list[memoryview], batch: int) -> None:
        header = memoryview(bytes(PAYLOAD_OFFSET))
        for key, buf in zip(keys, bufs, strict=True):
            path = self.direct.driver.block_path(key) + ".raw"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.pwritev(fd, [header, buf], 0)
            finally:
                os.close(fd)

    def _raw_load(self, keys: list[bytes], outs: list[memoryview], *,
                  verify: bool = False) -> None:
        for key, buf in zip(keys, outs, strict=True):
            fd = os.open(self.direct.driver.block_path(key), os.O_RDONLY)
            try:
                os.preadv(fd, [buf], PAYLOAD_OFFSET)
            finally:
                os.close(fd)
            if verify:
                checksum(buf)

    def _raw_unlink(self, keys: list[bytes]) -> None:
        for key in keys:
            try:
                os.unlink(self.direct.driver.block_path(key) + ".raw")
            except FileNotFoundError:
                pass

    # -- cells ------------------------------------------------------------------------------
    def _best(self, kernel_fn: Callable[[], float], base_fn: Callable[[], float], *,
              settle: Callable[[], None] | None = None) -> tuple[float, float]:
        """Best time of each side over `repeat` alternating rounds. `settle` runs before every
        timed run (stores: write back dirty pages first, so neither side inherits the other's
        writeback throttling)."""
        best_k = best_b = float("inf")
        for _ in range(self.repeat):
            if settle:
                settle()
            best_k = min(best_k, kernel_fn())
            if settle:
                settle()
            best_b = min(best_b, base_fn())
        return best_k, best_b

    def run_size(self, size: int, concurrency: int) -> list[Record]:
        batch = _batch_for(size, self.batch_bytes)
        keys, bufs = self._blocks(size, "b")
        nbytes = len(keys) * size
        # (keys, sources, load buffers) of each submitter; every side uses the same memory.
        parts = list(zip(_split(keys, concurrency), _split(bufs, concurrency),
                         _split(self._destinations(len(keys), size), concurrency),
                         strict=True))
        baseline = "raw pwritev/preadv" if self.raw_files else "driver direct"
        if self.raw_files:
            base_store = lambda p: self._raw_store(p[0], p[1], batch)  # noqa: E731
            base_load = lambda p: self._raw_load(p[0], p[2])  # noqa: E731
        elif self.raw is not None:
            baseline = self.raw.label
            base_store = lambda p: self.raw.store(p[0], p[1])  # noqa: E731
            base_load = lambda p: self.raw.load(p[0], p[2], batch)  # noqa: E731
        else:
            base_store = lambda p: self._direct_store(p[0], p[1], batch)  # noqa: E731
            base_load = lambda p: self._direct_load(p[0], p[2], batch)  # noqa: E731

        def kernel_store() -> float:
            return _timed_threads(parts, lambda p: self._kernel_store(p[0], p[1], batch))

        def kernel_load() -> float:
            return _timed_threads(parts, lambda p: self._kernel_load(p[0], p[2], batch))

        settle = os.sync if self.tier.options.model_dump().get("path") else None
        store_k, store_b = self._best(kernel_store, lambda: _timed_threads(parts, base_store),
                                      settle=settle)
        load_k, load_b = self._best(kernel_load, lambda: _timed_threads(parts, base_load))
        extra: list[Record] = []
        if self.raw_files:
            # The same reads plus the checksum every ucm load must verify: what is left of
            # the gap is the kernel's and the driver's own cost.
            verify = lambda p: self._raw_load(p[0], p[2], verify=True)  # noqa: E731
            load_k2, load_v = self._best(kernel_load, lambda: _timed_threads(parts, verify))
            extra.append(Record(self.name, "load", size, concurrency,
                                nbytes / 1e9 / min(load_k, load_k2), nbytes / 1e9 / load_v,
                                "raw preadv + xxh3 verify"))
        if self.raw_files:
            self._raw_unlink(keys)
        elif self.raw is not None:
            self.raw.delete(keys)
            self.direct.call("delete", keys)
        else:
            self.direct.call("delete", keys)
        self._cleanup(keys)
        gb = nbytes / 1e9
        return [
            Record(self.name, "store", size, concurrency, gb / store_k, gb / store_b, baseline),
            Record(self.name, "load", size, concurrency, gb / load_k, gb / load_b, baseline),
            *extra,
        ]

    def run_lookup(self, count: int = 10_000) -> Record:
        keys, bufs = self._blocks(4 * KiB, "l")
        keys = (keys * (count // len(keys) + 1))[:count] if len(keys) < count else keys[:count]
        unique = list(dict.fromkeys(keys))
        self._kernel_store(unique, bufs[:len(unique)], 256)
        self._direct_store(unique, bufs[:len(unique)], 256)

        def kernel() -> float:
            start = time.perf_counter()
            result = self.kernel.submit(Lookup(keys)).result()
            elapsed = time.perf_counter() - start
            assert all(result.hits)
            return elapsed

        def direct() -> float:
            start = time.perf_counter()
            hits = self.direct.call("lookup", keys)
            elapsed = time.perf_counter() - start
            assert all(hits)
            return elapsed

        best_k, best_b = self._best(kernel, direct)
        self.direct.call("delete", unique)
        self._cleanup(unique)
        return Record(self.name, "lookup", 0, 1, None, None, "driver lookup",
                      keys_per_s=len(keys) / best_k, baseline_keys_per_s=len(keys) / best_b)

    def run_batch_overhead(self, size: int = 2 * MiB, batch: int = 64) -> Record:
        """One 64-block batch load, kernel vs the driver called directly."""
        keys, bufs = self._blocks(size, "o")
        keys, bufs = keys[:batch], bufs[:batch]
        while len(keys) < batch:
            keys.append(f"o-extra-{len(keys)}".encode())
            bufs.append(bufs[0])
        self._kernel_store(keys, bufs, batch)
        self._direct_store(keys, bufs, batch)
        out = [memoryview(bytearray(size)) for _ in range(batch)]

        def kernel() -> float:
            start = time.perf_counter()
            assert self.kernel.submit(Load(keys, buffers=out)).result().ok
            return time.perf_counter() - start

        def direct() -> float:
            start = time.perf_counter()
            states = self.direct.call("load", keys, out)
            assert all(s is LoadState.OK for s in states)
            return time.perf_counter() - start

        best_k, best_b = self._best(kernel, direct)
        self.direct.call("delete", keys)
        self._cleanup(keys)
        gb = batch * size / 1e9
        return Record(self.name, f"load-batch{batch}", size, 1, gb / best_k, gb / best_b,
                      "driver direct")


def _format_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def print_table(records: list[Record]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="ucm bench (ratio = kernel / baseline, measured in this run)")
    for col in ("driver", "op", "block", "conc", "kernel", "baseline", "ratio", "baseline is"):
        table.add_column(col, justify="right" if col not in ("driver", "op", "baseline is")
                         else "left")
    for r in records:
        if r.keys_per_s is not None:
            kernel = f"{r.keys_per_s / 1e6:.2f} Mkeys/s"
            base = f"{r.baseline_keys_per_s / 1e6:.2f} Mkeys/s"
            block = "10k keys"
        else:
            kernel, base = f"{r.gbps:.2f} GB/s", f"{r.baseline_gbps:.2f} GB/s"
            block = _format_size(r.block_bytes)
        ratio = f"{r.ratio:.3f}" if r.ratio is not None else "-"
        table.add_row(r.driver, r.op, block, str(r.concurrency), kernel, base, ratio,
                      r.baseline)
    Console().print(table)


def run_storage_bench(config: UCMConfig, *, sizes: tuple[int, ...],
                      concurrency: tuple[int, ...], total_bytes: int, repeat: int,
                      drivers: list[str] | None,
                      batch_bytes: int = DEFAULT_BATCH_BYTES) -> list[Record]:
    from rich.progress import Progress

    tiers = [t for t in config.tiers if drivers is None or (t.name or t.driver) in drivers]
    records: list[Record] = []
    steps = len(tiers) * (len(sizes) * len(concurrency) + 2)
    with Progress(transient=True) as progress:
        task = progress.add_task("benchmarking", total=steps)
        for tier in tiers:
            bench = TierBench(tier, total_bytes=total_bytes, repeat=repeat,
                              batch_bytes=batch_bytes)
            try:
                for size in sizes:
                    for conc in concurrency:
                        progress.update(task, description=f"{bench.name} "
                                        f"{_format_size(size)} x{conc}")
                        records.extend(bench.run_size(size, conc))
                        progress.advance(task)
                progress.update(task, description=f"{bench.name} lookup")
                records.append(bench.run_lookup())
                progress.advance(task)
                progress.update(task, description=f"{bench.name} 64-block batch")
                records.append(bench.run_batch_overhead())
                progress.advance(task)
            finally:
                bench.close()
    return records


def _parse_size(text: str) -> int:
    from pydantic import ByteSize, TypeAdapter

    return int(TypeAdapter(ByteSize).validate_python(text))


def run_bench(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ucm bench", description=__doc__.split("\n\n")[0],
        epilog="other benchmarks: ucm bench vllm|sparse|trace --help")
    parser.add_argument("what", nargs="?", default="storage", choices=["storage", "policy"],
                        help="storage (default): drivers through the kernel; policy: eviction")
    parser.add_argument("--config", help="a ucm config file (default: the embedded default)")
    parser.add_argument("--json", metavar="FILE", help="write the records as JSON")
    parser.add_argument("--sizes", default=",".join(_format_size(s).replace(" ", "")
                                                    for s in DEFAULT_SIZES))
    parser.add_argument("--concurrency", default=",".join(map(str, DEFAULT_CONCURRENCY)))
    parser.add_argument("--total", default="256MiB", help="bytes moved per cell")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batch", default=f"{DEFAULT_BATCH_BYTES // MiB}MiB",
                        help="bytes per Load/Store event (1 to 64 blocks; a vLLM step loads "
                             "all of its requests' hit blocks in one event: 62 MiB for a "
                             "4K-token prompt of the vLLM bench's model)")
    parser.add_argument("--driver", action="append", help="only these tiers (by name)")
    args = parser.parse_args(argv)
    if args.what == "policy":
        from ucm.bench.policy import run_policy_bench

        return run_policy_bench(args.json)
    config = load_config(args.config)
    sizes = tuple(_parse_size(s) for s in args.sizes.split(","))
    concurrency = tuple(int(c) for c in args.concurrency.split(","))
    print(f"ucm bench: {len(config.tiers)} tier(s) "
          f"[{', '.join(t.name or t.driver for t in config.tiers)}], sizes "
          f"{', '.join(_format_size(s) for s in sizes)}, concurrency {concurrency}, "
          f"{args.total} per cell, {args.batch} per event, best of {args.repeat}, "
          f"{os.cpu_count()} CPUs")
    records = run_storage_bench(config, sizes=sizes, concurrency=concurrency,
                                total_bytes=_parse_size(args.total), repeat=args.repeat,
                                drivers=args.driver, batch_bytes=_parse_size(args.batch))
    print_table(records)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([{**asdict(r), "ratio": r.ratio} for r in records], fh, indent=1)
        print(f"records written to {args.json}")
    return 0


def main() -> None:  # python -m ucm.bench.storage
    raise SystemExit(run_bench())


if __name__ == "__main__":
    main()
