"""The `ucm` command.

    ucm demo [...]          stored KV reused by a second vLLM engine (ucm.bench.demo)
    ucm serve MODEL [...]   vLLM's OpenAI server with the connector (ucm.vllm_hook.serve)
    ucm proxy [...]         prefill/decode disaggregation: an OpenAI-compatible front over
                            prefill and decode instances (ucm.proxy)
    ucm bench vllm [...]    TTFT on vLLM: recompute, floor, ExampleConnector, ucm (ucm.bench.vllm)
    ucm bench sglang [...]  TTFT on SGLang: recompute, host-memory floor, file backend, ucm
                            (ucm.bench.sglang)
    ucm bench sparse [...]  sparse selection and KV codecs on the CPU (ucm.bench.sparse)
    ucm bench trace [...]   what tracing costs (ucm.bench.trace)
    ucm bench codec [...]   block codec encode/decode rates next to memcpy (ucm.bench.codec)
    ucm bench serve [...]   multi-turn chat through vLLM's OpenAI server (ucm.bench.serve)
    ucm bench quality [...] KV compression on a real model: agreement, perplexity, bytes
                            (ucm.bench.quality)
    ucm bench policy [...]  eviction hit ratios: synthetic, or a trace vs Belady (ucm.bench.policy)
    ucm bench [...]         the kernel benchmark (ucm.bench.storage)
    ucm tune [...]          a config searched by replaying sample requests (ucm.autotune)

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
    sub.add_parser("serve", help="vLLM's OpenAI-compatible server with the ucm connector: "
                   "`ucm serve MODEL [vLLM options]`", add_help=False)
    sub.add_parser("proxy", help="OpenAI-compatible front over prefill and decode instances: "
                   "`ucm proxy --prefill URL[,URL...] --decode URL[,URL...] "
                   "[--route roundrobin|prefix]`", add_help=False)
    sub.add_parser("tune", help="search a config for a model and sample requests",
                   add_help=False)
    sub.add_parser("bench", help="benchmarks: `ucm bench [storage|policy|vllm|sglang|serve|"
                   "sparse|trace|codec|quality|link|pd|cluster|mrc] ...` (storage by default)",
                   add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from ucm.bench.demo import main as demo_main

        return int(demo_main(rest) or 0)
    if command == "serve":
        from ucm.vllm_hook.serve import main as serve_main

        return int(serve_main(rest) or 0)
    if command == "proxy":
        from ucm.proxy import main as proxy_main

        return int(proxy_main(rest) or 0)
    if command == "tune":
        from ucm.autotune._cli import main as tune_main

        return int(tune_main(rest) or 0)
    if command == "bench":  # the benchmarks' own dispatch (ucm.bench.command)
        from ucm.bench.command import main as bench_main

        return bench_main(rest)
    parser.parse_args(argv)  # reports the unknown command
    return 2


if __name__ == "__main__":
    sys.exit(main())
