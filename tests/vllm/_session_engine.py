"""The session-hint scenario of tests/vllm/test_sessions_engine.py, on one vLLM engine in this
process (`python _session_engine.py MODEL STORE`): prints one JSON line of what each step's
next turn loaded from which tier, and the connector's counters. `python _session_engine.py
MODEL STORE hybrid` runs a short one on a hybrid-attention model for tests/vllm/test_hybrid.py
(`hybrid`).

Three sessions take a first turn: "held" with `retain_s`, "plain" with no hint, "bad" with a
malformed hint. A flood of other prompts (several times the memory tier) follows, then each
session's next turn (its first turn's prompt and more): which tier served its blocks? Then
"held" ends its session, another flood, and its next turn again; then a turn with `prefetch`,
and the next turn once more; then a hold that expires, and holds over the cap."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from conftest import prompt

from ucm.bench.engines import EngineSpec, make_engine
from ucm.kernel import Lookup
from ucm.vllm_hook.connector import live_connectors
from ucm.vllm_hook.keys import chain_digests, chain_seed, rank_key

MEMORY = 2 * 2**20  # 64 blocks of the tiny model (32 tokens of 1 KiB each)
TURN = 256  # tokens of a first turn: 8 full blocks


def _sides(llm: Any) -> tuple[Any, Any, Callable[..., None]]:
    """The engine's ucm worker and scheduler sides, and a `generate(prompts, hint=None)` that
    runs greedy 4-token requests (the hint as kv_transfer_params) and waits for their stores."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    [worker] = [c.worker for c in live_connectors() if c.worker is not None]
    [scheduler] = [c.scheduler for c in live_connectors() if c.scheduler is not None]

    def generate(prompts: list[list[int]], hint: Any = None) -> None:
        extra = {"kv_transfer_params": hint} if hint is not None else None
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                extra_args=extra)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                     use_tqdm=False)
        assert worker.wait_for_stores(120)

    return worker, scheduler, generate


def main(model: str, store: str) -> None:

    ucm = {"tiers": [{"driver": "memory", "capacity": MEMORY},
                     {"driver": "posix", "path": store}],
           "sessions": {"max_pinned": "40%"}}  # 25.6 blocks: three sessions of 8, not four
    llm = make_engine(EngineSpec(model=model, connector="ucm", ucm=ucm,
                                 kv_cache_bytes=64 * 2**20, max_model_len=2048))
    worker, scheduler, generate = _sides(llm)

    def hits(prompt_tokens: list[int], hint: Any = None) -> dict[str, int]:
        before = worker.kernel.statistics()
        generate([prompt_tokens], hint)
        after = worker.kernel.statistics()
        return {tier: after.get(f"load_hits.{tier}", 0) - before.get(f"load_hits.{tier}", 0)
                for tier in ("memory", "posix")}

    def in_memory(tokens: list[int]) -> int:
        """Blocks of `tokens` in the memory tier, once the prefetch in flight has finished."""
        digests = chain_digests(chain_seed(worker.settings.namespace), tokens, 32, TURN // 32)
        keys = [rank_key(d, 0, 1) for d in digests]
        for _ in range(300):  # the Prefetch runs in the kernel's background
            tiers = worker.kernel.submit(Lookup(keys, promote=False)).result(10).tiers
            if all(t == "memory" for t in tiers):
                break
            time.sleep(0.1)
        return sum(t == "memory" for t in tiers)

    def flood(seed: int) -> None:
        for i in range(12):  # 2 prompts a call: each step's stores fit the memory tier
            generate([prompt(TURN, seed + 2 * i), prompt(TURN, seed + 2 * i + 1)])

    first = {name: prompt(TURN, 10 + i) for i, name in enumerate(("held", "plain", "bad"))}
    generate([first["held"]], {"ucm": {"session": "held", "retain_s": 300}})
    generate([first["plain"]])
    generate([first["bad"]], {"ucm": {"session": "bad", "retain_s": -5, "pin": True}})
    flood(1000)
    out: dict[str, Any] = {"next": {}}
    for i, (name, tokens) in enumerate(first.items()):
        out["next"][name] = hits(tokens + prompt(40, 20 + i))
    out["held_after_flood"] = worker.kernel.statistics().get("tier.memory.held_sessions")
    generate([first["held"] + prompt(40, 30)], {"ucm": {"session": "held", "end": True}})
    flood(2000)
    out["after_end"] = hits(first["held"] + prompt(40, 31))
    out["held_after_end"] = worker.kernel.statistics().get("tier.memory.held_sessions")
    # prefetch: the session's blocks go up to memory before its next turn
    generate([first["held"] + prompt(40, 32)], {"ucm": {"session": "held", "prefetch": True}})
    out["prefetched"] = in_memory(first["held"])
    out["after_prefetch"] = hits(first["held"] + prompt(40, 33))
    # expiry and the cap: "short" holds for 0.5 s; then four sessions of 8 blocks each ask
    # for more than sessions.max_pinned allows, so the oldest goes
    short = prompt(TURN, 40)
    generate([short], {"ucm": {"session": "short", "retain_s": 0.5}})
    time.sleep(1.0)  # past its retain_s: the next hold's expiry check releases it
    capped = [prompt(TURN, 50 + i) for i in range(4)]
    for i, tokens in enumerate(capped):
        generate([tokens], {"ucm": {"session": f"c{i}", "retain_s": 300}})
    flood(3000)
    out["expired"] = hits(short + prompt(40, 41))
    out["capped"] = [hits(tokens + prompt(40, 60 + i)) for i, tokens in enumerate(capped)]
    stats = worker.kernel.statistics()
    out["kernel"] = {k: v for k, v in stats.items() if k.startswith("session")}
    out["held_sessions"] = stats.get("tier.memory.held_sessions")
    out["held_bytes"] = stats.get("tier.memory.held_bytes")
    out["block_bytes"] = stats["tier.memory.bytes"] // max(1, stats["tier.memory.blocks"])
    out["scheduler"] = {k: v for k, v in scheduler.stats.items() if k.startswith("session")}
    out["worker"] = {k: v for k, v in worker.stats.items() if k.startswith("session")}
    print("UCM_SESSIONS " + json.dumps(out), flush=True)


def hybrid(model: str, store: str) -> None:
    """A held session and a plain one on a sliding-window model (several KV cache groups,
    blocks of 32): their first turns, a flood several times the memory tier, vLLM's prefix
    cache emptied, then each one's next turn: which tier served its blocks, and the tokens
    ucm supplied."""

    from ucm.bench.engines import _reset_prefix_cache

    ucm = {"tiers": [{"driver": "memory", "capacity": 2**20},
                     {"driver": "posix", "path": store}]}
    llm = make_engine(EngineSpec(model=model, connector="ucm", ucm=ucm, prefix_caching=True,
                                 kv_cache_bytes=32 * 2**20, max_model_len=1024))
    worker, scheduler, generate = _sides(llm)

    first = {"held": prompt(TURN, 70), "plain": prompt(TURN, 71)}
    generate([first["held"]], {"ucm": {"session": "held", "retain_s": 300}})
    generate([first["plain"]])
    for i in range(12):  # 24 first turns' blocks: more than 3 times the memory tier
        generate([prompt(TURN, 5000 + 2 * i), prompt(TURN, 5001 + 2 * i)])
    assert _reset_prefix_cache(llm)
    out: dict[str, Any] = {"next": {}}
    for i, (name, tokens) in enumerate(first.items()):
        before, hit = worker.kernel.statistics(), scheduler.stats["hit_tokens"]
        generate([tokens + prompt(40, 80 + i)])
        after = worker.kernel.statistics()
        out["next"][name] = {
            **{t: after.get(f"load_hits.{t}", 0) - before.get(f"load_hits.{t}", 0)
               for t in ("memory", "posix")},
            "hit_tokens": scheduler.stats["hit_tokens"] - hit}
    stats = worker.kernel.statistics()
    out["held_bytes"] = stats.get("tier.memory.held_bytes")
    out["evictions"] = stats.get("evictions.memory", 0)
    out["worker"] = {k: v for k, v in worker.stats.items()
                     if k.startswith(("session", "saved_bytes", "kv_groups"))}
    print("UCM_SESSIONS " + json.dumps(out), flush=True)


if __name__ == "__main__":
    (hybrid if sys.argv[3:] == ["hybrid"] else main)(sys.argv[1], sys.argv[2])
