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
from collections.abc import Iterator
from typing import Any

from ucm.kernel._policy import make_policy

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
            lru = hit_ratio("lru", trace, capacity)
            s3 = hit_ratio("s3fifo", trace, capacity)
            rows.append({"workload": name, "capacity_blocks": capacity, "lru": lru,
                         "s3fifo": s3})
    return rows


def run_policy_bench(json_path: str | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    rows = compare()
    table = Table(title="eviction hit ratio (higher is better; same seeded traces)")
    for col in ("workload", "capacity (blocks)", "LRU", "S3-FIFO", "S3-FIFO - LRU"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["workload"], str(r["capacity_blocks"]), f"{r['lru']:.3f}",
                      f"{r['s3fifo']:.3f}", f"{r['s3fifo'] - r['lru']:+.3f}")
    Console().print(table)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0
