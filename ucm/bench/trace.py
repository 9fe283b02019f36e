"""What tracing costs: the same kernel workloads with tracing off and on, in one process.

    ucm bench trace [--rounds 7] [--seconds 0.4]      (or python -m ucm.bench.trace)

Two kernels with identical memory tiers; one without a tracer, one with a `Tracer` writing
segment files to a temporary directory (the full path: ring, drain thread, zstd, files).
Each round runs every workload on both kernels, alternating which goes first; the figure per
workload is the median over rounds of the per-round ratio (traced time / untraced time), so
slow drifts of a shared machine cancel out. On a noisy machine that ratio scatters by more
than the effect, so the bench also prints the computed overhead: the measured cost per record
(emit, and drain + compress + write) times the records per event, over the untraced event
time. Workloads go through `Kernel.submit` from the
host thread, `window` events in flight at a time.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from ucm.kernel import Kernel, Load, Lookup, Store
from ucm.trace import Tracer, read_trace


def _keys(prefix: bytes, n: int) -> list[bytes]:
    return [prefix + i.to_bytes(4, "big") + b"\0" * 11 for i in range(n)]


class Workload:
    def __init__(self, name: str, blocks: int, block_bytes: int, make_event: Callable,
                 window: int, unit: str) -> None:
        self.name, self.blocks, self.block_bytes = name, blocks, block_bytes
        self.make_event, self.window, self.unit = make_event, window, unit


def workloads() -> list[Workload]:
    big = _keys(b"L", 8)
    big_buffers = [bytearray(2 << 20) for _ in range(4)]
    mid = _keys(b"M", 32)
    mid_buffers = [bytearray(64 << 10) for _ in range(16)]
    small = _keys(b"S", 64)
    small_buffers = [bytearray(4096) for _ in range(32)]
    many = _keys(b"K", 10_000)

    def load_2mib(i: int) -> Load:
        return Load([big[i % 8]], buffers=[big_buffers[i % 4]])

    def load_64kib(i: int) -> Load:
        return Load([mid[i % 32]], buffers=[mid_buffers[i % 16]])

    def load_4kib(i: int) -> Load:
        return Load([small[i % 64]], buffers=[small_buffers[i % 32]])

    def lookup_10k(i: int) -> Lookup:
        return Lookup(many)

    return [
        Workload("load 2 MiB (1 block/event)", 8, 2 << 20, load_2mib, 4, "GiB/s"),
        Workload("load 64 KiB (1 block/event)", 32, 64 << 10, load_64kib, 16, "events/s"),
        Workload("load 4 KiB (1 block/event)", 64, 4096, load_4kib, 32, "events/s"),
        Workload("lookup 10k keys", 10_000, 64, lookup_10k, 2, "Mkeys/s"),
    ]


def _fill(kernel: Kernel, prefix: bytes, n: int, size: int) -> None:
    data = bytes(size)
    keys = _keys(prefix, n)
    for start in range(0, n, 256):
        batch = keys[start: start + 256]
        kernel.submit(Store(batch, buffers=[data] * len(batch))).result(60)


def run_cell(kernel: Kernel, work: Workload, seconds: float) -> tuple[int, float]:
    """Runs `work` for about `seconds`; returns (events, elapsed)."""
    submit, make, window = kernel.submit, work.make_event, work.window
    events = [make(i) for i in range(64)]  # built outside the timed loop
    done = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        pending = [submit(events[(done + j) % 64]) for j in range(window)]
        for c in pending:
            c.result(60)
        done += window
        if time.perf_counter() >= end:
            break
    return done, time.perf_counter() - t0


def record_cost(n: int = 200_000) -> tuple[float, float]:
    """(emit, drain-and-write) nanoseconds per record, for records like a Load's."""
    tracer = Tracer(tempfile.mkdtemp(prefix="ucm-trace-cost-"), ring_events=2 * n)
    fields = ({"type": "Load", "keys": 1, "request_id": None},
              {"tier": "memory", "op": "load", "keys": 1, "t0": 1 << 40, "hits": 1,
               "bytes": 65536}, {"outcome": "ok"})
    emit = tracer.emit
    t0 = time.perf_counter_ns()
    for i in range(n // 4):
        emit("submit", i, fields[0])
        emit("start", i, fields[0])
        emit("op", i, fields[1])
        emit("done", i, fields[2])
    t1 = time.perf_counter_ns()
    written = tracer.flush()
    t2 = time.perf_counter_ns()
    tracer.close()
    return (t1 - t0) / n, (t2 - t1) / max(written, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ucm bench trace", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=0.4, help="per cell")
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="ucm-trace-bench-")
    config = {"tiers": [{"driver": "memory", "capacity": "1GiB"}], "promote": False}
    tracer = Tracer(os.path.join(tmp, "trace"))
    kernels = {"off": Kernel(config), "on": Kernel(config, tracer=tracer)}
    works = workloads()
    print(f"ucm.bench.trace: {args.rounds} rounds x {args.seconds:g} s per cell, one memory "
          f"tier, CPUs {os.cpu_count()}; trace files in {tmp}")
    try:
        for kernel in kernels.values():
            kernel.start()
            _fill(kernel, b"L", 8, 2 << 20)
            _fill(kernel, b"M", 32, 64 << 10)
            _fill(kernel, b"S", 64, 4096)
            _fill(kernel, b"K", 10_000, 64)
        gc.collect()
        gc.freeze()  # the stored blocks' index need not be rescanned by every collection
        for work in works:  # warm-up
            for kernel in kernels.values():
                run_cell(kernel, work, args.seconds / 4)
        rates: dict[tuple[str, str], list[float]] = {}
        ratios: dict[str, list[float]] = {w.name: [] for w in works}
        for r in range(args.rounds):
            for work in works:
                order = ("off", "on") if r % 2 == 0 else ("on", "off")
                per_event = {}
                for mode in order:
                    n, elapsed = run_cell(kernels[mode], work, args.seconds)
                    per_event[mode] = elapsed / n
                    rates.setdefault((work.name, mode), []).append(n / elapsed)
                ratios[work.name].append(per_event["on"] / per_event["off"])
    finally:
        for kernel in kernels.values():
            kernel.close()
    records = list(read_trace(os.path.join(tmp, "trace")))
    per_event = len(records) / max(1, len({r.event_id for r in records if r.event_id}))
    emit_ns, write_ns = record_cost()
    cost_us = per_event * (emit_ns + write_ns) / 1000
    print(f"{'workload':30} {'off':>14} {'on':>14} {'on/off time':>12} {'range':>16} "
          f"{'computed':>9}")
    for work in works:
        scale = {"GiB/s": work.block_bytes / 2**30, "events/s": 1.0,
                 "Mkeys/s": work.blocks / 1e6}[work.unit]
        off = statistics.median(rates[(work.name, "off")]) * scale
        on = statistics.median(rates[(work.name, "on")]) * scale
        rs = ratios[work.name]
        print(f"{work.name:30} {off:9.2f} {work.unit:>4} {on:9.2f} {work.unit:>4} "
              f"{statistics.median(rs):12.4f} {min(rs):7.3f}-{max(rs):.3f} "
              f"{cost_us * statistics.median(rates[(work.name, 'off')]) / 1e4:8.2f}%")
    print(f"trace: {len(records)} records written ({per_event:.1f} per event), "
          f"{tracer.dropped} dropped; per record: emit {emit_ns:.0f} ns, drain+compress+write "
          f"{write_ns:.0f} ns -> {cost_us:.2f} us per event ('computed': that cost / the "
          "untraced event time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
