"""One vLLM engine of tests/vllm/test_sparse_vllm.py in this process
(`python _sparse_engine.py SPEC_JSON`): runs the spec's phases (batches of prompts, greedy)
and prints one JSON line: each phase's tokens, vLLM's free-block count around every sparse
free (read from the scheduler's block pool), and both connector sides' counters.

A phase with `"noise": true` re-stores, right after its request's blocks are freed (in the
step's schedule, before that step's forward loads them), one freed block under its own key
with other values: the decode must then attend what ucm holds, not what vLLM computed. A phase
with `"drop": true` deletes every freed block of its request from ucm there instead: no load
can succeed, and the decode must attend only what is resident. A phase with `"reset": true`
first empties vLLM's prefix cache, so that its prompts' prefixes come from ucm."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from ucm.bench.engines import EngineSpec, _reset_prefix_cache, connector_stats, make_engine
from ucm.kernel import Delete
from ucm.vllm_hook.connector import live_connectors
from ucm.vllm_hook.keys import rank_key


def main(spec: dict[str, Any]) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"sparse": spec["sparse"]} if spec.get("sparse") else {}
    llm = make_engine(EngineSpec(model=spec["model"], max_model_len=2048,
                                 kv_cache_bytes=16 * 2**20, connector="ucm",
                                 ucm={"tiers": [{"driver": "memory", "capacity": "64MiB"}]},
                                 extra=extra))
    [worker] = [c.worker for c in live_connectors() if c.worker is not None]
    [scheduler] = [c.scheduler for c in live_connectors() if c.scheduler is not None]
    frees: list[dict[str, Any]] = []
    phases: list[list[list[int]]] = []
    noise: dict[str, Any] = {"armed": False, "stored": [], "drop": False, "dropped": 0}
    freer = scheduler.sparse_blocks
    if freer is not None:
        free = freer._free

        def observed(req_id: str, *args: Any) -> Any:
            pool = freer.kv_manager.block_pool
            before = pool.get_num_free_blocks()
            out = free(req_id, *args)
            if out is not None:
                frees.append({"before": before, "after": pool.get_num_free_blocks(),
                              "offloaded": len(out.freed), "slots": len(out.slots),
                              "kept": freer.freed[-1]["kept_shared"], "req_id": req_id,
                              "phase": len(phases)})
                if noise["armed"]:
                    noise["armed"] = False
                    noise["stored"].append(_restore_noise(worker, out))
                if noise["drop"]:
                    noise["drop"] = False
                    keys = [rank_key(d, 0, 1) for d in out.digests]
                    worker.kernel.submit(Delete(keys)).result(30)
                    noise["dropped"] += len(keys)
            return out

        freer._free = observed
    for phase in spec["phases"]:
        noise["armed"], noise["drop"] = bool(phase.get("noise")), bool(phase.get("drop"))
        if phase.get("reset"):
            assert _reset_prefix_cache(llm)
        params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in phase["prompts"]],
                            params, use_tqdm=False)
        phases.append([list(o.outputs[0].token_ids) for o in outs])
    print("UCM_SPARSE " + json.dumps({"phases": phases, "frees": frees,
                                      "noise": noise["stored"],
                                      "dropped": noise["dropped"], "stats": connector_stats()},
                                     default=str), flush=True)


def _restore_noise(worker: Any, free: Any) -> list[bool]:
    """Stores other values (large, random) under the key of the middle freed block."""
    block = len(free.freed) // 2
    key = rank_key(free.digests[block], worker.settings.tp_rank, worker.settings.tp_size)
    values = torch.randn(worker.layout.block_bytes // 4, generator=torch.Generator().manual_seed(0))
    buffer = (values * 8).numpy().view("uint8")
    pending = worker.pages.start_store([key], [buffer.data])
    return list(pending.result())


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
