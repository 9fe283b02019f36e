"""GSA's decode-time scoring, old (torch's ops) against new (numpy), in one process: the block
similarities of one layer at SmolLM2-135M's shape (9 query heads over 3 KV heads, head dim 64)
for a 7K-token prompt in 32-token blocks and 128-bit codes (docs/performance.md, Sparse
attention: quality and speed). Checks that both give the same similarities, then times them
in alternating rounds and prints each one's median and the ratio:

    PYTHONPATH=$PWD .venv/bin/python scripts/gsa_scoring_bench.py [--tokens 7168] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from ucm.sparse import GSA, SparseConfig
from ucm.sparse.methods import best_similarity_reference, pack_bits_reference


def _us(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=7168)
    ap.add_argument("--hash-bits", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=100, help="calls per round")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    hkv, hq, d = 3, 9, 64
    m = GSA(SparseConfig(method="gsa", block_size=32, hash_bits=args.hash_bits))
    reps = m.prepare(torch.randn(hkv, args.tokens, d, generator=g).to(torch.bfloat16))
    codes = reps.per_block["codes"]
    query = torch.randn(hq, d, generator=g).to(torch.bfloat16)
    proj = m.projection(d, query.device)

    def old() -> torch.Tensor:  # GSA.block_similarity as it was: every step in torch
        qc = pack_bits_reference(query.float() @ proj > 0).reshape(hkv, hq // hkv, -1)
        return best_similarity_reference(qc, codes).reshape(hq, -1)

    def new() -> torch.Tensor:
        return m.block_similarity(reps, query)

    if not torch.equal(old(), new()):
        raise SystemExit("the similarities differ")
    times: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(args.rounds):
        times["old"].append(_us(old, args.calls))
        times["new"].append(_us(new, args.calls))
    o, n = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"codes {tuple(codes.shape)}, {hq} query heads: block_similarity old {o:.0f} us, "
          f"new {n:.0f} us a layer (medians of {args.rounds} rounds of {args.calls}); "
          f"old / new = {o / n:.1f}x")


if __name__ == "__main__":
    main()
