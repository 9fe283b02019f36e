"""Validation on vLLM, the engine's side (`ucm bench policy --trace F --validate`): a scaled
slice of a hash-id trace (`ucm.autotune._validate`) replayed through real vLLM-CPU with the ucm
connector, one engine per policy, vLLM's prefix cache off, requests sent one at a time in trace
order with their stores waited for, blocks loaded per request from the connector's counters;
against the simulator's prediction on the same keys. One memory tier, or memory over posix;
exact with promotion off (the kernel promotes in the background). docs/autotune.md,
Validation on vLLM.

`validate_retention` (`ucm bench retention --validate`): the same with session holds (each
request's hint as its `kv_transfer_params`), memory over posix, each request's hits by tier
against `ucm.autotune._validate.predict_holds`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ucm.autotune._simulate import SimTier, simulate
from ucm.autotune._traces import Request
from ucm.autotune._validate import (
    predict_holds,
    read_slice,
    scale_prompt,
    tier_stack,
    trace_session,
    vllm_requests,
)
from ucm.bench.engines import EngineProcess, EngineSpec, Phase
from ucm.block import PAYLOAD_OFFSET
from ucm.kernel._policy import POLICIES


def measure(model: str, prompts: Sequence[list[int]], ucm: dict[str, Any], *,
            hints: Sequence[Any] | None = None, block_size: int = 32,
            max_model_len: int = 4096, log_path: str | None = None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Replays the prompts through one vLLM-CPU engine with the ucm connector and config
    `ucm`: vLLM's prefix cache off, one request at a time (its stores waited for), one output
    token, each with its hint as `kv_transfer_params` (`hints`, None: none). Returns the blocks
    each request loaded (in all, and from each tier) and the connector's counters."""
    spec = EngineSpec(model=model, block_size=block_size, max_model_len=max_model_len,
                      kv_cache_bytes=64 * 2**20, connector="ucm", ucm=ucm,
                      prefix_caching=False, max_num_seqs=1)
    loaded, cached, by_tier = [], [], []
    label = ucm.get("eviction", "")
    names = [t.get("name") or t["driver"] for t in ucm["tiers"]]

    def engine_progress(line: str) -> None:  # not a line per request
        if progress is not None and not line.startswith("request:"):
            progress(line)

    with EngineProcess(spec, timeout=1800, log_path=log_path,
                       progress=engine_progress) as engine:
        for i, prompt in enumerate(prompts):
            hint = None if hints is None else [hints[i]]
            out = engine.run(Phase([prompt], max_tokens=1, name="request", wait_stores=True,
                                   hints=hint, tier_loads=True))
            loaded.append(int(out["worker_delta"].get("loaded_blocks", 0)))
            cached.append(int(out["num_cached_tokens"][0]))
            by_tier.append([int(out["tier_loads"].get(n, 0)) for n in names])
            if progress is not None and (i + 1) % 10 == 0:
                progress(f"{label}: {i + 1}/{len(prompts)} requests")
        done = engine.finish()
    worker = done["stats"].get("worker", {})
    kernel = worker.get("kernel", {})
    held = {n: (int(kernel.get(f"tier.{n}.bytes", 0)), int(kernel.get(f"tier.{n}.blocks", 0)))
            for n in names}
    return {"loaded_blocks": loaded, "cached_tokens": cached, "by_request_tier": by_tier,
            "namespace": worker.get("namespace"),
            "loaded_by_tier": [int(kernel.get(f"load_hits.{n}", 0)) for n in names],
            "held_block_bytes": {n: b // k for n, (b, k) in held.items() if k},
            "worker": {k: v for k, v in worker.items() if k != "kernel"},
            "kernel": kernel}


def validate(trace: str, model: str, *, policies: Sequence[str] = POLICIES,
             requests: int = 96, sample: int = 20, max_blocks: int = 32,
             capacity_blocks: int = 256, posix_blocks: int | None = None,
             promote: bool = False, block_size: int = 32, vocab: int = 2048,
             block_bytes: int, log_path: str | None = None,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Predicted against measured block hits of each policy on a scaled slice of `trace`.
    `block_bytes`: the KV bytes of one vLLM block of `model` (all layers, K and V); the memory
    tier holds `capacity_blocks` of them (less the headers its stores reserve), over a posix
    tier of `posix_blocks` if given (in a fresh directory per engine). `promote`: the kernel
    copies hits from the posix tier up, in the background (so the replay is not exact in
    time)."""
    import shutil
    import tempfile

    slice_ = read_slice(trace, requests=requests, sample=sample, max_blocks=max_blocks)
    prompts = [scale_prompt(r, block_size, vocab) for r in slice_]
    capacity = capacity_blocks * block_bytes
    hash_requests = [Request(tuple(i.to_bytes(8, "little", signed=True) for i in r.hash_ids))
                     for r in slice_]
    rows = []
    for policy in policies:
        root = tempfile.mkdtemp(prefix="ucm-validate-") if posix_blocks is not None else None
        try:
            tiers, sim_tiers = tier_stack(policy, capacity_blocks, block_bytes,
                                          posix_blocks=posix_blocks, posix_path=root)
            got = measure(model, prompts, {"tiers": tiers, "eviction": policy,
                                           "promote": promote},
                          block_size=block_size,
                          max_model_len=max(4096, max(len(p) for p in prompts) + 16),
                          log_path=log_path, progress=progress)
        finally:
            if root is not None:
                shutil.rmtree(root, ignore_errors=True)
        _check_block_bytes(got, sim_tiers)
        reqs = vllm_requests(prompts, block_size, got["namespace"])
        pred = simulate(reqs, sim_tiers, kernel_stores=True, promote=promote)
        measured = sum(got["loaded_blocks"])
        per_request = pred.per_request
        # What the tuner's replay of the same slice says: hash ids as blocks, capacity in
        # blocks, every block looked up (a partial last one too), no store headers.
        plain = [SimTier(policy, capacity_blocks)] + (
            [SimTier(policy, posix_blocks)] if posix_blocks is not None else [])
        trace_level = simulate(hash_requests, plain, promote=promote)
        rows.append({
            "policy": policy, "accesses": pred.accesses,
            "predicted_by_tier": pred.hits_by_tier, "measured_by_tier": got["loaded_by_tier"],
            "predicted_hits": pred.hits, "measured_hits": measured,
            "predicted": pred.hit_ratio,
            "measured": measured / pred.accesses if pred.accesses else 0.0,
            "trace_level": trace_level.hit_ratio,
            "requests_differing": sum(1 for p, m in zip(per_request, got["loaded_blocks"],
                                                         strict=True) if p != m),
            "measured_per_request": got["loaded_blocks"], "predicted_per_request": per_request,
            "cached_tokens": got["cached_tokens"], "worker": got["worker"]})
    distinct = len({k for r in vllm_requests(prompts, block_size, "x") for k in r.blocks})
    return {"trace": trace, "requests": len(prompts), "sample": sample,
            "max_blocks": max_blocks, "block_size": block_size, "block_bytes": block_bytes,
            "capacity_blocks": capacity_blocks, "capacity_bytes": capacity,
            "posix_blocks": posix_blocks, "promote": promote,
            "header_bytes": PAYLOAD_OFFSET, "prompt_tokens": sum(len(p) for p in prompts),
            "distinct_blocks": distinct, "rows": rows}



def _check_block_bytes(got: dict[str, Any], sim_tiers: Sequence[SimTier]) -> None:
    """The engine's tiers hold blocks of the bytes the simulator's tiers count."""
    expected = {t.name: t.block_bytes for t in sim_tiers}
    for name, size in got["held_block_bytes"].items():
        if size != expected[name]:
            raise RuntimeError(f"the {name} tier counts {size} bytes a block, not "
                               f"{expected[name]}: the prediction would count other bytes")


def validate_retention(trace: str, model: str, *, retain: bool, policy: str = "lru",
                       requests: int = 16, sample: int = 50, max_blocks: int = 12,
                       capacity_blocks: int = 24, posix_blocks: int = 4096,
                       retain_s: float = 600.0, max_pinned: str = "50%",
                       block_size: int = 32, vocab: int = 2048, block_bytes: int,
                       log_path: str | None = None) -> dict[str, Any]:
    """Predicted against measured hits by tier, request by request, of a scaled slice of
    `trace` on a memory tier of `capacity_blocks` over a posix tier of `posix_blocks` (a
    fresh directory), promotion off, with session holds (`retain`) or without. Sessions are
    the trace's conversation chains (`trace_session`); a request asks for a hold of
    `retain_s` when its conversation comes back later in the slice (`ucm bench retention
    --hints returning`: a client that knows it will return). `retain_s` outlasts the replay
    (seconds), so no hold expires on either side; `max_pinned` caps them on both."""
    import shutil
    import tempfile

    slice_ = read_slice(trace, requests=requests, sample=sample, max_blocks=max_blocks)
    prompts = [scale_prompt(r, block_size, vocab) for r in slice_]
    sessions = [trace_session(r) for r in slice_]
    returning = [s if s is not None and s in sessions[i + 1:] else None
                 for i, s in enumerate(sessions)]
    hints = [{"ucm": {"session": s, "retain_s": retain_s}} if retain and s else None
             for s in returning]
    root = tempfile.mkdtemp(prefix="ucm-validate-")
    try:
        tiers, sim_tiers = tier_stack(policy, capacity_blocks, block_bytes,
                                      posix_blocks=posix_blocks, posix_path=root)
        got = measure(
            model, prompts, {"tiers": tiers, "eviction": policy, "promote": False,
                             "sessions": {"max_pinned": max_pinned}},
            hints=hints, block_size=block_size,
            max_model_len=max(4096, max(len(p) for p in prompts) + 16), log_path=log_path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _check_block_bytes(got, sim_tiers)
    reqs = [r._replace(session=s) for r, s in
            zip(vllm_requests(prompts, block_size, got["namespace"]), returning, strict=True)]
    pred, sim_sessions = predict_holds(reqs, sim_tiers, retain_s=retain_s if retain else None,
                         max_pinned=max_pinned)
    measured = got["by_request_tier"]
    return {"trace": trace, "requests": len(prompts), "sample": sample,
            "max_blocks": max_blocks, "capacity_blocks": capacity_blocks,
            "posix_blocks": posix_blocks, "policy": policy, "retain": retain,
            "retain_s": retain_s, "max_pinned": max_pinned, "block_bytes": block_bytes,
            "hints": sum(1 for h in hints if h),
            "lookup_blocks": sum(r.lookup or 0 for r in reqs),
            "predicted_by_request": pred, "measured_by_request": measured,
            "predicted_fast": sum(p[0] for p in pred), "measured_fast": sum(m[0] for m in measured),
            "predicted_hits": sum(map(sum, pred)), "measured_hits": sum(map(sum, measured)),
            "requests_differing": sum(1 for p, m in zip(pred, measured, strict=True) if p != m),
            "cached_tokens": got["cached_tokens"],
            "sessions": {k: v for k, v in got["kernel"].items() if k.startswith("session")},
            "predicted_sessions": sim_sessions}
