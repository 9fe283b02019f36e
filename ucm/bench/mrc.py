"""`ucm bench mrc`: what the live miss-ratio curve costs the kernel, and how close it is.

- Cost (`--overhead`, the default): the first `--requests` requests of a trace replayed through
  a one-tier memory kernel as the vLLM connector drives it (a prefix Lookup, a Load of the
  hits, a Store of the rest), with `mrc:` off and on, alternating, best of `--repeat` each;
  the process's CPU seconds for each side and their ratio, and the estimator alone fed the
  same references.
- Accuracy (`--accuracy`): the estimator's curve against the simulator's exact one (the same
  policy replayed at each capacity) on the trace and on the seeded synthetic workloads of
  `ucm bench policy`, over `--seeds` samples (hash seeds); the largest error in points.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from collections.abc import Sequence
from typing import Any

from ucm.autotune._mrc import exact_curve, sampled_curve
from ucm.autotune._traces import Request, read_jsonl
from ucm.bench.policy import chat_trace, zipf_scan_trace, zipf_trace
from ucm.kernel import Kernel, Load, Lookup, Store
from ucm.kernel._mrc import MissRatioCurve, default_min_blocks

TRACE = "/work/shared/data/mooncake-traces/conversation_trace.jsonl"
KiB, MiB = 1 << 10, 1 << 20


def kernel_keys(requests: Sequence[Request]) -> list[list[bytes]]:
    """16-byte digests, as the connector's keys are."""
    return [[hashlib.blake2b(k, digest_size=16).digest() for k in r.blocks] for r in requests]


def replay(config: dict[str, Any], requests: list[list[bytes]], block: int) -> float:
    """CPU seconds of the process while one kernel serves the requests."""
    payload = bytes(block)
    with Kernel(config) as kernel:
        start = time.process_time()
        for keys in requests:
            hit = kernel.submit(Lookup(keys, prefix=True)).result(30).prefix_len
            if hit:
                kernel.submit(Load(keys[:hit], buffers=[bytearray(block)
                                                        for _ in range(hit)])).result(30)
            if hit < len(keys):
                kernel.submit(Store(keys[hit:], buffers=[payload] * (len(keys) - hit))
                              ).result(30)
        return time.process_time() - start


def estimator_alone(requests: list[list[bytes]], capacity: int, block: int, rate: float,
                    max_keys: int, min_blocks: int, policy: str,
                    native: bool | None = None) -> float:
    """CPU seconds of the curve alone fed the same references, `native` as MissRatioCurve's
    (False: the Python policies' miniatures)."""
    from ucm.kernel._core import MRC_FRACTIONS

    mrc = MissRatioCurve(policy, [int(capacity * f) for f in MRC_FRACTIONS], rate=rate,
                         max_keys=max_keys, min_blocks=min_blocks, native=native)
    # this thread's CPU: the process's would count the kernels' idle threads left running
    start = time.thread_time()
    for keys in requests:  # called as Tier calls it
        mrc.access(keys[0], block, True)
        for key in keys[1:]:
            mrc.access(key, block)
    return time.thread_time() - start


def overhead(args: argparse.Namespace) -> None:
    requests = kernel_keys(read_jsonl(args.trace, limit=args.requests))
    refs = sum(len(r) for r in requests)
    tier = {"driver": "memory", "capacity": args.capacity}
    off = {"tiers": [tier], "eviction": args.policy}
    on = {**off, "mrc": {"sample_rate": args.rate, "max_keys": args.max_keys,
                         "min_blocks": args.min_blocks}}
    print(f"ucm bench mrc: {len(requests)} requests ({refs} block references) of "
          f"{args.trace}, memory tier of {args.capacity} bytes, {args.block} B blocks, policy "
          f"{args.policy}, mrc sample_rate {args.rate} max_keys {args.max_keys} min_blocks "
          f"{args.min_blocks}, best of "
          f"{args.repeat}")
    probe = MissRatioCurve(args.policy, [1])
    used = "C" if type(probe.front).__module__ == "ucm._mrcsim" else "Python"
    # the baseline, in the same run: the same curve on the Python policies' miniatures
    kinds: list[bool | None] = [None, False] if used == "C" else [None]
    best = {"off": float("inf"), "on": float("inf")}
    alone = {kind: float("inf") for kind in kinds}
    for _ in range(args.repeat):  # interleaved: this machine's speed drifts
        for side, config in (("off", off), ("on", on)):
            best[side] = min(best[side], replay(config, requests, args.block))
        for kind in kinds:
            alone[kind] = min(alone[kind], estimator_alone(
                requests, args.capacity, args.block, args.rate, args.max_keys,
                args.min_blocks, args.policy, kind))
    print(f"kernel CPU, mrc off: {best['off']:.3f} s ({1e6 * best['off'] / refs:.1f} us a "
          "reference)")
    print(f"kernel CPU, mrc on:  {best['on']:.3f} s (ratio on/off {best['on'] / best['off']:.4f})")
    print(f"the estimator alone ({used} miniatures, the kernel's): {alone[None]:.3f} s = "
          f"{100 * alone[None] / best['off']:.2f} % of the kernel's CPU with it off "
          f"({1e6 * alone[None] / refs:.3f} us a reference)")
    if False in alone:
        print(f"the estimator alone (Python miniatures):  {alone[False]:.3f} s = "
              f"{100 * alone[False] / best['off']:.2f} % ({1e6 * alone[False] / refs:.3f} us a "
              f"reference); {used} / Python: {alone[None] / alone[False]:.3f}")


def synthetic(name: str, seed: int = 0, n: int = 100_000) -> list[Request]:
    make = {"zipf": zipf_trace, "zipf+scan": zipf_scan_trace, "chat": chat_trace}[name]
    return [Request((k.to_bytes(8, "little", signed=True),))
            for k in make(n, 20_000, random.Random(seed))]


def accuracy_row(label: str, requests: Sequence[Request], policy: str,
                 capacities: Sequence[int], rate: float, min_blocks: int, seeds: int,
                 ) -> dict[str, Any]:
    exact = exact_curve(requests, policy, capacities)
    worst = [0.0] * len(exact)
    estimates = []
    for seed in range(seeds):
        curve, _ = sampled_curve(requests, policy, capacities, rate=rate,
                                 min_blocks=min_blocks, seed=seed)
        estimates.append([h for _, h in curve])
        worst = [max(w, abs(a - b)) for w, (_, a), (_, b) in zip(worst, curve, exact,
                                                                 strict=True)]
    return {"workload": label, "policy": policy, "exact": [h for _, h in exact],
            "references": sum(len(r.blocks) for r in requests), "estimates": estimates,
            "max_error_points": [100 * w for w in worst], "capacities": list(capacities)}


def plot_accuracy(rows: Sequence[dict[str, Any]], out: str, rate: float,
                  min_blocks: int) -> None:
    """One panel a workload: each policy's exact curve, and its estimates (one a seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.8),
                             squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for n, row in enumerate(r for r in rows if r["workload"] == workload):
            color = f"C{n}"
            caps = row["capacities"]
            ax.plot(caps, row["exact"], color=color, label=f"{row['policy']} exact")
            for i, estimate in enumerate(row["estimates"]):
                ax.plot(caps, estimate, color=color, linestyle="none", marker="x", alpha=0.6,
                        label=f"{row['policy']} estimated" if i == 0 else None)
        ax.set_xscale("log")
        refs = next(r["references"] for r in rows if r["workload"] == workload)
        ax.set_title(f"{workload} ({refs:,} references)")
        ax.set_xlabel("capacity (blocks)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("hit ratio")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"live miss-ratio curve against the exact one: rate {rate}, min_blocks "
                 f"{min_blocks}, one x per hash seed")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def accuracy(args: argparse.Namespace) -> None:
    rows = []
    workloads = args.workloads.split(",")
    unknown = set(workloads) - {"trace", "zipf", "zipf+scan", "chat"}
    if unknown:
        raise SystemExit(f"ucm bench mrc: unknown workloads {sorted(unknown)}")
    trace = (read_jsonl(args.trace, limit=args.requests if args.requests else None)
             if "trace" in workloads else [])
    caps = [int(c) for c in args.capacities.split(",")]
    for policy in args.policies.split(","):
        if "trace" in workloads:
            rows.append(accuracy_row("trace", trace, policy, caps, args.rate,
                                     args.min_blocks, args.seeds))
        for name in ("zipf", "zipf+scan", "chat"):
            if name in workloads:
                rows.append(accuracy_row(name, synthetic(name, n=args.synthetic_refs), policy,
                                         (500, 2000, 5000, 10000), args.rate,
                                         args.min_blocks, args.seeds))
    if args.plot:
        plot_accuracy(rows, args.plot, args.rate, args.min_blocks)
        print(f"plot: {args.plot}")
    for row in rows:
        print(f"{row['workload']:>10} {row['policy']:>7} "
              f"({row['references']} references): " + ", ".join(
            f"{c}: {h:.4f} (+-{e:.2f})" for c, h, e in zip(
                row["capacities"], row["exact"], row["max_error_points"], strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ucm bench mrc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--accuracy", action="store_true", help="the accuracy table instead")
    parser.add_argument("--trace", default=TRACE, help="a JSONL trace (hash_ids)")
    parser.add_argument("--requests", type=int, default=2000,
                        help="requests of the trace (--accuracy: 0 for all)")
    parser.add_argument("--block", type=int, default=64 * KiB, help="bytes a block")
    parser.add_argument("--capacity", type=int, default=256 * MiB, help="the tier's bytes")
    parser.add_argument("--policy", default="shadow")
    parser.add_argument("--policies", default="lru,shadow", help="--accuracy")
    parser.add_argument("--capacities", default="1000,2000,4000,8000,16000,32000,64000",
                        help="--accuracy, on the trace (blocks)")
    parser.add_argument("--rate", type=float, help="default: 0.01 (cost), 0.1 (--accuracy)")
    parser.add_argument("--min-blocks", type=int,
                        help="default: the kernel's (1000 where the curve runs in C, else 0; "
                        "cost), 1000 (--accuracy)")
    parser.add_argument("--max-keys", type=int, default=16384)
    parser.add_argument("--workloads", default="trace,zipf,zipf+scan,chat",
                        help="--accuracy: which of trace, zipf, zipf+scan, chat")
    parser.add_argument("--synthetic-refs", type=int, default=100_000,
                        help="--accuracy: references of each synthetic workload (over 20,000 "
                        "blocks)")
    parser.add_argument("--seeds", type=int, default=4, help="--accuracy: samples drawn")
    parser.add_argument("--plot", metavar="PNG", help="--accuracy: the curves as a plot")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if args.rate is None:
        args.rate = 0.1 if args.accuracy else 0.01
    if args.min_blocks is None:
        args.min_blocks = 1000 if args.accuracy else default_min_blocks(args.policy)
    (accuracy if args.accuracy else overhead)(args)
    return 0
