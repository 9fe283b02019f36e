"""One vLLM engine of tests/vllm/test_sparse_vllm.py in this process
(`python _sparse_engine.py SPEC_JSON`): runs the spec's phases (batches of prompts, greedy)
and prints one JSON line: each phase's tokens, vLLM's free-block count around every sparse
free (read from the scheduler's block pool), and both connector sides' counters.

A phase with `"noise": true` re-stores, right after its request's blocks are freed (in the
step's schedule, before that step's forward loads them), one freed block under its own key
with other values: the decode must then attend what ucm holds, not what vLLM computed. A phase
with `"drop": true` deletes every freed block of its request from ucm there instead (and each
block the moving window frees later, in the step that frees it): no load can succeed, and the
decode must attend only what is resident. A phase with `"reset": true`
first empties vLLM's prefix cache, so that its prompts' prefixes come from ucm. A phase with
`"stagger": true` submits each prompt once the one before has its first token (its prefill
done): vLLM's prefix cache gives it the blocks it shares with the ones before, and it arrives
in the step that frees the one before's blocks, which sees them held by both. A phase with
`"prefix": false` turns the sparse config's `prefix` off on both sides for its requests (the
engine runs in this process), as a config that turns it off would. The spec's
`codec` is the memory tier's (the tier the offloaded blocks come back from).

vLLM's prefix cache is on; ucm's lookups answer within the step (`lookup_wait`), so that a
request is scheduled in the step it arrives in, not a step later when a lookup takes longer
than the default 2 ms. Besides the tokens, the JSON line names each phase's requests by vLLM's
ids (`ids`) and gives the tokens each sparse request had computed when the scheduler first
saw it (`starts`) and the engine step of that and of each free; `window` lists the later frees
of blocks the moving local window left (their logical blocks, slots, and vLLM's free-block
count around each). A phase's `max_tokens` overrides the spec's."""

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

    extra: dict[str, Any] = {"lookup_wait": 30.0}
    if spec.get("sparse"):
        extra["sparse"] = spec["sparse"]
    llm = make_engine(EngineSpec(model=spec["model"], max_model_len=2048,
                                 kv_cache_bytes=16 * 2**20, connector="ucm", prefix_caching=True,
                                 ucm={"tiers": [{"driver": "memory", "capacity": "64MiB",
                                                 "codec": spec.get("codec")}]},
                                 extra=extra))
    [worker] = [c.worker for c in live_connectors() if c.worker is not None]
    [scheduler] = [c.scheduler for c in live_connectors() if c.scheduler is not None]
    frees: list[dict[str, Any]] = []
    phases: list[list[list[int]]] = []
    ids: list[list[str]] = []
    starts: list[dict[str, Any]] = []  # the tokens each sparse request had computed at its start
    clock = {"step": 0}  # engine steps so far
    noise: dict[str, Any] = {"armed": False, "stored": [], "drop": False, "dropped": 0,
                             "dropping": []}
    window: list[dict[str, Any]] = []  # the frees of blocks the moving window left
    freer = scheduler.sparse_blocks
    if freer is not None:
        def counted(free: Any, record: Any) -> Any:
            """`free` wrapped: a free that gave blocks back is recorded with the pool's free
            count before and after it."""
            def observed(req_id: str, *args: Any) -> Any:
                pool = freer.kv_manager.block_pool
                before = pool.get_num_free_blocks()
                out = free(req_id, *args)
                if out is not None:
                    record(req_id, out, {"before": before, "after": pool.get_num_free_blocks(),
                                         "slots": len(out.slots), "req_id": req_id,
                                         "phase": len(phases), "step": clock["step"]})
                return out
            return observed

        def first_free(req_id: str, out: Any, row: dict[str, Any]) -> None:
            frees.append({**row, "offloaded": len(out.freed),
                          "kept": freer.freed[-1]["kept_shared"]})
            if noise["armed"]:
                noise["armed"] = False
                noise["stored"].append(_restore_noise(worker, out))
            if noise["drop"]:
                noise["drop"] = False
                keys = [rank_key(d, 0, 1) for d in out.digests]
                worker.kernel.submit(Delete(keys)).result(30)
                noise["dropped"] += len(keys)
                noise["dropping"].append(req_id)

        def window_free(req_id: str, out: Any, row: dict[str, Any]) -> None:
            window.append({**row, "freed": out.freed})
            if req_id in noise["dropping"]:  # its first free's blocks were deleted
                keys = [rank_key(d, 0, 1) for d in out.digests]
                worker.kernel.submit(Delete(keys)).result(30)
                noise["dropped"] += len(keys)

        freer._free = counted(freer._free, first_free)
        freer._free_window = counted(freer._free_window, window_free)
        start = freer.start

        def started(req_id: str, computed_tokens: int) -> None:
            starts.append({"req_id": req_id, "computed": computed_tokens,
                           "step": clock["step"]})
            start(req_id, computed_tokens)

        freer.start = started
    [sparse] = [c.sparse for c in live_connectors() if c.worker is not None]
    for phase in spec["phases"]:
        noise["armed"], noise["drop"] = bool(phase.get("noise")), bool(phase.get("drop"))
        if phase.get("reset"):
            assert _reset_prefix_cache(llm)
        saved = (freer.prefix_keys, sparse.config) if freer is not None else None
        if saved is not None and phase.get("prefix") is False:  # both sides' `prefix` off
            freer.prefix_keys = False
            sparse.config = sparse.config.model_copy(update={"prefix": False})
        params = SamplingParams(temperature=0.0, ignore_eos=True,
                                max_tokens=phase.get("max_tokens", spec["max_tokens"]))
        prompts = [TokensPrompt(prompt_token_ids=p) for p in phase["prompts"]]
        tokens, req_ids = _generate(llm, prompts, params, bool(phase.get("stagger")), clock)
        phases.append(tokens)
        ids.append(req_ids)
        if saved is not None:
            freer.prefix_keys, sparse.config = saved
    print("UCM_SPARSE " + json.dumps({"phases": phases, "ids": ids, "starts": starts,
                                      "frees": frees, "window": window,
                                      "noise": noise["stored"],
                                      "dropped": noise["dropped"], "stats": connector_stats()},
                                     default=str), flush=True)


def _generate(llm: Any, prompts: list[Any], params: Any, stagger: bool, clock: dict[str, int],
              ) -> tuple[list[list[int]], list[str]]:
    """Greedy outputs of `prompts` and the ids vLLM's scheduler knows them by (the ones the
    sparse records name). Staggered: each prompt is submitted once the one before has its
    first token; else all at once, as `LLM.generate` does."""
    engine = llm.llm_engine
    ids: list[str] = []  # vLLM's ids, in the prompts' order
    external: dict[str, int] = {}  # the ids outputs carry -> the prompt's index
    done: dict[int, list[int]] = {}
    started: set[int] = set()

    def submit(i: int) -> None:
        name = f"step{clock['step']}-{i}"
        external[name] = i
        ids.append(engine.add_request(name, prompts[i], params))

    for i in range(1 if stagger else len(prompts)):
        submit(i)
    while len(done) < len(prompts):
        clock["step"] += 1
        for out in engine.step():
            i = external[out.request_id] if out.request_id in external \
                else ids.index(out.request_id)
            if out.outputs and out.outputs[0].token_ids:
                started.add(i)
            if out.finished:
                done[i] = list(out.outputs[0].token_ids)
        if len(ids) < len(prompts) and len(ids) - 1 in started:
            submit(len(ids))
    return [done[i] for i in range(len(prompts))], ids


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
