"""The `ucm` command.

    ucm demo [...]          stored KV reused by a second vLLM engine (ucm.demo)
    ucm bench vllm [...]    TTFT on vLLM: recompute, floor, ExampleConnector, ucm (ucm.bench_vllm)
    ucm bench [...]         the kernel benchmark (ucm.bench)

Subcommands import their modules lazily: `ucm --help` needs neither torch nor vLLM.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="ucm", description="Unified Cache Manager")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="cold then warm vLLM engines over a chat workload",
                   add_help=False)
    sub.add_parser("bench", help="benchmarks: `ucm bench vllm ...` or the kernel benchmark",
                   add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from ucm.demo import main as demo_main

        return int(demo_main(rest) or 0)
    if command == "bench":
        if rest and rest[0] == "vllm":
            from ucm.bench_vllm import main as bench_vllm_main

            return int(bench_vllm_main(rest[1:]) or 0)
        from ucm.bench import run_bench

        return int(run_bench(rest) or 0)
    parser.parse_args(argv)  # reports the unknown command
    return 2


if __name__ == "__main__":
    sys.exit(main())
