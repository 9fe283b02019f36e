"""The live next-turn prefetch (`sessions.predict_next_turn`) on one vLLM engine in this
process, for tests/vllm/test_next_turn_engine.py (`python _next_turn_engine.py MODEL STORE
on|off`): prints one JSON line of what the conversation's third turn loaded from which tier,
the blocks in memory just before it, and the counters.

A conversation without hints takes two turns (the second extends the first) a gap apart; a
flood of other prompts (twice the memory tier) pushes its blocks down to disk, shorter than
the gap; then the third turn arrives after the predicted time (the second turn plus the
gap). With the predictor on, its blocks were prefetched back into memory at that time."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from _session_engine import MEMORY, TURN, _sides
from conftest import prompt

from ucm.bench.engines import EngineSpec, make_engine
from ucm.kernel import Lookup
from ucm.vllm_hook.keys import chain_digests, chain_seed, rank_key


def main(model: str, store: str, predict: bool) -> None:
    ucm = {"tiers": [{"driver": "memory", "capacity": MEMORY},
                     {"driver": "posix", "path": store}],
           "sessions": {"predict_next_turn": predict}}
    llm = make_engine(EngineSpec(model=model, connector="ucm", ucm=ucm,
                                 kv_cache_bytes=64 * 2**20, max_model_len=2048))
    worker, scheduler, generate = _sides(llm)

    def flood(seed: int, calls: int) -> float:
        start = time.monotonic()
        for i in range(calls):  # 2 prompts a call: each step's stores fit the memory tier
            generate([prompt(TURN, seed + 2 * i), prompt(TURN, seed + 2 * i + 1)])
        return time.monotonic() - start

    took = flood(1000, 8)  # 16 first turns: twice the memory tier
    turn1 = prompt(TURN, 10)
    turn2 = turn1 + prompt(TURN // 2, 11)  # 12 full blocks, the first 8 turn 1's
    generate([turn1])
    time.sleep(2 * took + 2)  # the gap: longer than a flood and its stores
    generate([turn2])
    second_at = time.monotonic()
    gap = 2 * took + 2
    flood(2000, 8)  # pushes turn 2's blocks down to disk, within the gap
    digests = chain_digests(chain_seed(worker.settings.namespace), turn2, 32,
                            len(turn2) // 32)  # the 12 blocks turn 2 stored
    keys = [rank_key(d, 0, 1) for d in digests]

    def in_memory() -> int:
        tiers = worker.kernel.submit(Lookup(keys, promote=False)).result(10).tiers
        return sum(t == "memory" for t in tiers)

    after_flood = in_memory()
    time.sleep(max(0.0, second_at + gap + 1.0 - time.monotonic()))  # past the predicted time
    for _ in range(100):  # the Prefetch runs in the kernel's background
        if not predict or in_memory() == len(keys):
            break
        time.sleep(0.1)
    out: dict[str, Any] = {"blocks": len(keys), "after_flood": after_flood,
                           "before_turn3": in_memory()}
    before = worker.kernel.statistics()
    generate([turn2 + prompt(40, 12)])
    after = worker.kernel.statistics()
    out["turn3"] = {t: after.get(f"load_hits.{t}", 0) - before.get(f"load_hits.{t}", 0)
                    for t in ("memory", "posix")}
    out["kernel"] = {k: v for k, v in after.items()
                     if k == "prefetched" or k.endswith((".prefetch_hits", ".prefetch_evicted"))}
    out["scheduler"] = {k: v for k, v in scheduler.stats.items() if k.startswith("next_turn")}
    out["fed"] = scheduler.next_turn.fed if scheduler.next_turn is not None else None
    print("UCM_NEXT_TURN " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "on")
