"""`ucm bench [NAME] ...` (also `python -m ucm.bench ...`): NAME picks the benchmark module
whose main(argv) runs it; any other first argument goes to the storage benchmark (`ucm bench`,
`ucm bench storage`). `ucm.cli` dispatches here lazily; nothing here imports `ucm.cli`."""

from __future__ import annotations

import importlib

BENCHES = {"vllm": "ucm.bench.vllm", "sglang": "ucm.bench.sglang", "sparse": "ucm.bench.sparse",
           "trace": "ucm.bench.trace", "policy": "ucm.bench.policy", "codec": "ucm.bench.codec",
           "serve": "ucm.bench.serve", "quality": "ucm.bench.quality", "link": "ucm.bench.link",
           "pd": "ucm.bench.pd", "cluster": "ucm.bench.cluster", "mrc": "ucm.bench.mrc",
           "retention": "ucm.bench.retention"}


def main(argv: list[str]) -> int:
    if argv and argv[0] in BENCHES:
        module = importlib.import_module(BENCHES[argv[0]])
        return int(module.main(argv[1:]) or 0)
    from ucm.bench.storage import run_bench

    return int(run_bench(argv) or 0)
