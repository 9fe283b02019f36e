"""`ucm tune`: the AutoTuner from the command line."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if "--mrc" in argv or any(a == "--live" or a.startswith("--live=") for a in argv):
        return _curve_main(argv)
    from ucm.autotune._tuner import AutoTuner

    parser = argparse.ArgumentParser(prog="ucm tune", description="a ucm config searched by "
                                     "replaying sample requests through the cache simulator")
    parser.add_argument("--model", required=True, help="a known name or a config.json path")
    parser.add_argument("--requests", required=True, help="a trace: JSONL (hash_ids), a JSON "
                        "list of token-id lists, or a ucm trace file or directory")
    parser.add_argument("--bench", metavar="JSON",
                        help="`ucm bench --json FILE` records (default: a short probe of this "
                        "machine, cached under the ucm cache directory)")
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


def _curve_main(argv: list[str]) -> int:
    """`ucm tune --mrc --trace FILE` and `ucm tune --live URL`: a miss-ratio curve, the
    capacity a hit ratio needs and the hit ratio a capacity gives."""
    from ucm.autotune import _mrc

    parser = argparse.ArgumentParser(
        prog="ucm tune --mrc | --live", description="a tier's miss-ratio curve: from a trace "
        "(--mrc --trace FILE) or from a running server's ucm_mrc_* series (--live URL)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--mrc", action="store_true", help="from --trace FILE")
    source.add_argument("--live", metavar="URL", help="a server's /metrics")
    parser.add_argument("--trace", metavar="FILE", help="Mooncake JSONL (hash_ids), a JSON "
                        "list of token-id lists, or a ucm trace file or directory")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens a block of a token-id trace (default 16)")
    parser.add_argument("--tier", help="--live: only this tier")
    _mrc.add_replay_options(parser)
    args = parser.parse_args(argv)
    try:
        if args.live:
            reports = _mrc.parse_metrics(_mrc.read_metrics(args.live), args.live)
            if args.tier:
                reports = [r for r in reports if r.tier == args.tier]
                if not reports:
                    raise ValueError(f"{args.live}: no curve for tier {args.tier!r}")
        else:
            if not args.trace:
                parser.error("--mrc needs --trace FILE")
            from ucm.autotune._traces import load_requests

            try:
                requests = load_requests(args.trace, block_size=args.block_size)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{args.trace}: not JSON or JSONL ({exc})") from None
            reports = [_mrc.curve_of_requests(requests, args, args.trace)]
        _mrc.answer(reports, args)
    except (OSError, ValueError) as exc:
        print(f"ucm tune: {exc}", file=sys.stderr)
        return 2
    return 0
