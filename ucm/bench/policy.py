"""Hit ratios of the eviction policies on seeded synthetic KV-cache workloads.

Workloads (block-granular, equal block sizes):
- zipf: requests for blocks drawn from a Zipf(1.0) popularity over 20,000 blocks;
- zipf+scan: the same, interleaved with one-off scans (long documents read once), the pattern
  that flushes an LRU cache;
- chat: multi-turn conversations whose prefixes are re-read each turn, plus one-off prompts.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from typing import Any

from ucm.kernel._policy import POLICIES, make_policy

BLOCK = 1


def zipf_trace(n: int, blocks: int, rng: random.Random) -> Iterator[int]:
    weights = [1.0 / (i + 1) for i in range(blocks)]
    yield from rng.choices(range(blocks), weights=weights, k=n)


def zipf_scan_trace(n: int, blocks: int, rng: random.Random) -> Iterator[int]:
    hot = zipf_trace(n, blocks, rng)
    scan_id = 10 * blocks
    for i, key in enumerate(hot):
        yield key
        if i % 4 == 0:  # one scanned block every 4 requests
            scan_id += 1
            yield scan_id


def chat_trace(n: int, blocks: int, rng: random.Random) -> Iterator[int]:
    sessions: list[list[int]] = [[] for _ in range(200)]
    next_id = 0
    emitted = 0
    while emitted < n:
        if rng.random() < 0.3:  # a one-off prompt: 8 blocks never seen again
            for _ in range(8):
                next_id += 1
                yield -next_id
            emitted += 8
            continue
        session = rng.choice(sessions)
        yield from list(session)  # the whole history is looked up again
        for _ in range(2):  # the new turn adds two blocks
            next_id += 1
            session.append(next_id)
        if len(session) > 64:
            session.clear()
        emitted += len(session) + 2


def hit_ratio(policy_name: str, trace: list[int], capacity: int) -> float:
    policy = make_policy(policy_name, capacity * BLOCK, clock=lambda: 0.0)
    hits = 0
    for item in trace:
        key = item.to_bytes(8, "little", signed=True)
        if key in policy:
            hits += 1
            policy.touch(key)
            continue
        victims = policy.make_room(BLOCK)
        assert victims is not None
        policy.insert(key, BLOCK)
    return hits / len(trace)


def compare(seed: int = 0, n: int = 200_000) -> list[dict[str, Any]]:
    rows = []
    for name, make in (("zipf", zipf_trace), ("zipf+scan", zipf_scan_trace),
                       ("chat", chat_trace)):
        trace = list(make(n, 20_000, random.Random(seed)))
        for capacity in (500, 2000, 5000):
            rows.append({"workload": name, "capacity_blocks": capacity,
                         **{p: hit_ratio(p, trace, capacity) for p in POLICIES}})
    return rows


def run_policy_bench(json_path: str | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    rows = compare()
    table = Table(title="eviction hit ratio (higher is better; same seeded traces)")
    for col in ("workload", "capacity (blocks)", *POLICIES, "S3-FIFO - LRU"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["workload"], str(r["capacity_blocks"]),
                      *(f"{r[p]:.3f}" for p in POLICIES), f"{r['s3fifo'] - r['lru']:+.3f}")
    Console().print(table)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


def trace_rows(path: str, capacities: list[int], *, block_size: int = 16,
               limit: int | None = None) -> list[dict[str, Any]]:
    """Block hit ratio per capacity on a trace (any format `ucm.autotune` reads): every
    policy, replayed by the simulator over the kernel's policy code, and Belady's optimum."""
    from ucm.autotune import belady, load_requests, next_uses, simulate
    from ucm.autotune._simulate import SimTier

    requests = load_requests(path, block_size=block_size, limit=limit)
    uses = next_uses(requests)
    rows = []
    for capacity in capacities:
        row: dict[str, Any] = {"capacity_blocks": capacity,
                               "belady": belady(requests, capacity, uses).hit_ratio}
        slowest = 0.0
        for name in POLICIES:
            t0 = time.perf_counter()
            row[name] = simulate(requests, [SimTier(name, capacity)]).hit_ratio
            slowest = max(slowest, time.perf_counter() - t0)
        row["slowest_replay_s"] = slowest  # the bound: under 10 s per replay
        rows.append(row)
    return rows


def plot_rows(rows: list[dict[str, Any]], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    caps = [r["capacity_blocks"] for r in rows]
    for name in ("belady", *POLICIES):
        ax.plot(caps, [r[name] for r in rows], marker="o",
                linestyle="--" if name == "belady" else "-", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("block hit ratio (prefix semantics)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """`ucm bench policy [--trace FILE --capacities ... --plot PNG] [--json FILE]`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="ucm bench policy", description="eviction hit ratios: seeded synthetic "
        "workloads, or a request trace (with Belady's optimum) given --trace")
    parser.add_argument("--trace", help="a JSONL trace (hash_ids), a JSON list of token-id "
                        "lists, or a ucm trace file or directory")
    parser.add_argument("--capacities", default="1000,4000,16000,64000",
                        help="capacities in blocks, comma separated")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per block, for token-id traces")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--plot", metavar="PNG", help="plot hit ratio against capacity")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args(argv)
    if not args.trace:
        if args.plot:
            parser.error("--plot needs --trace")
        return run_policy_bench(args.json)
    from rich.console import Console
    from rich.table import Table

    capacities = [int(c) for c in args.capacities.split(",")]
    rows = trace_rows(args.trace, capacities, block_size=args.block_size, limit=args.limit)
    table = Table(title=f"block hit ratio on {args.trace} (prefix semantics)")
    for col in ("capacity (blocks)", "belady", *POLICIES, *(f"{p}/belady" for p in POLICIES),
                "slowest replay (s)"):
        table.add_column(col, justify="right")
    for r in rows:
        b = r["belady"]
        table.add_row(str(r["capacity_blocks"]), f"{b:.3f}", *(f"{r[p]:.4f}" for p in POLICIES),
                      *(f"{r[p] / b:.3f}" if b else "-" for p in POLICIES),
                      f"{r['slowest_replay_s']:.1f}")
    Console().print(table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.plot:
        plot_rows(rows, args.plot, f"hit ratio vs capacity: {args.trace.rsplit('/', 1)[-1]}")
    return 0
