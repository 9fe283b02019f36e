"""How many requests vLLM runs at once, dense against sparse, with one KV cache size
(docs/performance.md, Sparse attention: memory). One engine per run, in this process:

    PYTHONPATH=$PWD .venv/bin/python scripts/sparse_memory.py MODEL [--budget 0.25] \
        [--prompt 2048] [--requests 12] [--fit 4] [--max-tokens 64] [--method quest]

MODEL is a model directory, or `smollm2` for SmolLM2-135M-Instruct (built once from PyPI; bf16
where the CPU computes it natively, else fp32); the block's bytes come from its config.

The KV cache holds `--fit` dense requests of `--prompt` + `--max-tokens` tokens (blocks of
32); `--requests` prompts are submitted at once. Prints one JSON line: the most requests
vLLM's scheduler ran at once, vLLM's preemption count, its free blocks right after the first
request's prefill and first decode step, and ucm's sparse counters. Without `--budget` the
run is dense (the connector, no sparse)."""

from __future__ import annotations

import argparse
import json
import math
import random
from typing import Any

from ucm.bench.engines import EngineSpec, _preemptions, connector_stats, make_engine


def _block_bytes(model: str, dtype: str) -> int:
    """One 32-token block of every layer's K and V, from the model's config."""
    with open(f"{model}/config.json") as f:
        config = json.load(f)
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 32 * config["num_hidden_layers"] * 2 * heads * head_dim * (
        2 if dtype == "bfloat16" else 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--budget", type=float, default=None)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--fit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--method", default="quest")
    args = ap.parse_args()
    dtype = "float32"
    if args.model == "smollm2":
        from ucm.bench.smollm2 import build_smollm2

        args.model = str(build_smollm2())
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        dtype = "bfloat16" if "amx_bf16" in flags or "avx512_bf16" in flags else "float32"
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    blocks = math.ceil((args.prompt + args.max_tokens) / 32)
    extra = {} if args.budget is None else {"sparse": {"method": args.method,
                                                        "budget": args.budget}}
    block_bytes = _block_bytes(args.model, dtype)
    store = 2 * args.requests * blocks * block_bytes  # every prompt's blocks, twice over
    llm = make_engine(EngineSpec(
        model=args.model, dtype=dtype, max_model_len=args.prompt + args.max_tokens + 32,
        kv_cache_bytes=(args.fit * blocks + 1) * block_bytes, connector="ucm",
        ucm={"tiers": [{"driver": "memory", "capacity": max(store, 2**30)}]}, extra=extra))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    total = pool.num_gpu_blocks - 1  # less vLLM's null block
    seen: dict[str, Any] = {"total_blocks": total, "max_running": 0, "used_blocks": 0}
    inner = scheduler.schedule

    def schedule(*a: Any, **kw: Any) -> Any:
        out = inner(*a, **kw)
        if len(scheduler.running) >= seen["max_running"]:  # blocks in use at the most running
            seen["max_running"] = len(scheduler.running)
            seen["used_blocks"] = total - pool.get_num_free_blocks()
        return out

    scheduler.schedule = schedule
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, 2000) for _ in range(args.prompt)])
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    stats = connector_stats()
    sched = {k: v for k, v in stats.get("scheduler", {}).items() if k.startswith("sparse_")
             and k != "sparse_freed"}
    worker = {k: v for k, v in stats.get("worker", {}).get("sparse", {}).items()
              if isinstance(v, int)}
    print(json.dumps({"budget": args.budget, "method": args.method, "dtype": dtype,
                      "prompt": args.prompt, "fit": args.fit, "block_bytes": block_bytes,
                      "blocks_per_request": blocks, **seen,
                      "preemptions": _preemptions(llm), "scheduler": sched,
                      "worker": worker}), flush=True)


if __name__ == "__main__":
    main()
