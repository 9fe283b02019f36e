"""`ucm tune`: the AutoTuner from the command line."""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> int:
    from ucm.autotune._tuner import AutoTuner

    parser = argparse.ArgumentParser(prog="ucm tune", description="a ucm config searched by "
                                     "replaying sample requests through the cache simulator")
    parser.add_argument("--model", required=True, help="a known name or a config.json path")
    parser.add_argument("--requests", required=True, help="a trace: JSONL (hash_ids), a JSON "
                        "list of token-id lists, or a ucm trace file or directory")
    parser.add_argument("--bench", required=True, metavar="JSON",
                        help="this machine's `ucm bench --json FILE` records")
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--max-memory-gb", type=float)
    parser.add_argument("--max-disk-gb", type=float)
    parser.add_argument("--max-latency-ms", type=float)
    parser.add_argument("--tiers", default="memory,posix")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--plot", metavar="PNG", help="plot the Pareto front")
    parser.add_argument("--out", metavar="FILE", help="write the config as JSON")
    args = parser.parse_args(argv)
    constraints: dict[str, object] = {"tiers": args.tiers.split(",")}
    for name in ("max_memory_gb", "max_disk_gb", "max_latency_ms"):
        if getattr(args, name) is not None:
            constraints[name] = getattr(args, name)
    tuner = AutoTuner(workload=args.workload, constraints=constraints, bench_json=args.bench,
                      tp=args.tp)
    config = tuner.tune(model=args.model, sample_requests=args.requests)
    print(json.dumps({"config": config, "prediction": tuner.report()}, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(config, fh, indent=1)
    if args.plot:
        tuner.plot_pareto(args.plot)
    return 0
