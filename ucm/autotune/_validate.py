"""Validation on vLLM: a slice of a hash-id trace (Mooncake's JSONL) replayed through real
vLLM-CPU with the ucm connector, against the simulator's prediction on the same blocks.

Scaling: each trace block (512 tokens) becomes one vLLM block of `block_size` tokens whose
ids derive from the hash id alone, so equal hash ids give equal token blocks and a request's
blocks chain as its hash ids do; a partial last block in the trace stays a partial one
(scaled). Prediction: the simulator with vLLM's prefix semantics (a lookup covers at most
(len - 1) // block_size blocks, the last token is never loaded; only full blocks are stored)
and the kernel's store accounting (`simulate(..., kernel_stores=True)`), on the connector's
own keys. Measurement: one engine per policy, vLLM's prefix cache off, requests sent one at a
time in trace order with their stores waited for, blocks loaded per request from the
connector's counters. One memory tier, or memory over posix; exact with promotion off (the
kernel promotes in the background). docs/autotune.md, Validation on vLLM.
"""

from __future__ import annotations

import json
import os
import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ucm.autotune._simulate import SimResult, SimTier, simulate
from ucm.autotune._traces import Request
from ucm.block import PAYLOAD_OFFSET
from ucm.kernel._policy import POLICIES

TRACE_BLOCK = 512  # tokens of one Mooncake hash id
FIRST_TOKEN = 3  # ids below are the tiny model's special tokens


@dataclass(frozen=True)
class TraceRequest:
    hash_ids: tuple[int, ...]
    input_length: int  # tokens, in the trace's blocks of TRACE_BLOCK


def read_slice(path: str | os.PathLike[str], *, requests: int = 96, sample: int = 20,
               max_blocks: int = 32) -> list[TraceRequest]:
    """The first `requests` requests of the trace whose conversation is sampled: its second
    hash id (the first after a shared system prompt; the first for a one-block request) has
    CRC-32 divisible by `sample` (1: every request). A contiguous slice of a few dozen requests
    has almost no reuse (conversations return minutes apart), a sample of conversations keeps
    their returns. Requests are cut to `max_blocks` blocks (a cut one ends on a full block)."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            obj = json.loads(line)
            ids = [int(i) for i in obj["hash_ids"]]
            if not ids:
                continue
            root = ids[1] if len(ids) > 1 else ids[0]
            if sample > 1 and zlib.crc32(str(root).encode()) % sample:
                continue
            length = int(obj.get("input_length", len(ids) * TRACE_BLOCK))
            if len(ids) > max_blocks:
                ids, length = ids[:max_blocks], max_blocks * TRACE_BLOCK
            out.append(TraceRequest(tuple(ids), length))
            if len(out) >= requests:
                break
    return out


def block_tokens(hash_id: int, block_size: int, vocab: int) -> list[int]:
    """The token ids of the block a hash id stands for: a function of the id alone."""
    rng = random.Random(f"ucm-validate-{hash_id}")
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(block_size)]


def scale_prompt(request: TraceRequest, block_size: int, vocab: int) -> list[int]:
    """A request's prompt: a block of `block_size` tokens a full trace block, and a partial
    last block scaled from the trace's (at least one token, never a whole block)."""
    full, rest = divmod(request.input_length, TRACE_BLOCK)
    ids = request.hash_ids
    if full + (1 if rest else 0) != len(ids):  # input_length disagrees: trust the ids
        full, rest = len(ids), 0
    tokens = [t for h in ids[:full] for t in block_tokens(h, block_size, vocab)]
    if rest:
        partial = min(block_size - 1, max(1, round(rest * block_size / TRACE_BLOCK)))
        tokens += block_tokens(ids[full], block_size, vocab)[:partial]
    return tokens


def vllm_requests(prompts: Sequence[Sequence[int]], block_size: int, namespace: str,
                  ) -> list[Request]:
    """Simulator requests keyed as the connector keys the prompts (tensor parallel size 1):
    every full block is stored, a lookup covers (len - 1) // block_size blocks."""
    from ucm.vllm_hook.keys import chain_digests, chain_seed

    seed = chain_seed(namespace)
    return [Request(tuple(chain_digests(seed, p, block_size, len(p) // block_size)),
                    lookup=(len(p) - 1) // block_size) for p in prompts]


def predict(requests: Sequence[Request], policy: str, capacity_bytes: int, block_bytes: int,
            *, header_bytes: int = PAYLOAD_OFFSET) -> SimResult:
    """The simulator's hits for one memory tier of `capacity_bytes`, as the kernel counts
    bytes (blocks of `block_bytes`, plus the header a store reserves)."""
    tier = SimTier(policy, None, "memory", capacity_bytes=capacity_bytes,
                   block_bytes=block_bytes, header_bytes=header_bytes)
    return simulate(requests, [tier], kernel_stores=True)


def tier_stack(policy: str, capacity_blocks: int, block_bytes: int, *,
               posix_blocks: int | None = None, posix_path: str | None = None,
               ) -> tuple[list[dict[str, Any]], list[SimTier]]:
    """The ucm tiers (a memory tier of `capacity_blocks`, over a posix tier of `posix_blocks`
    if given) and the simulator's: the memory driver counts a block's payload, a posix block
    file its header too; a store reserves header + payload a block in both."""
    capacity = capacity_blocks * block_bytes
    config: list[dict[str, Any]] = [{"driver": "memory", "capacity": capacity}]
    sim = [SimTier(policy, None, "memory", capacity_bytes=capacity, block_bytes=block_bytes,
                   header_bytes=PAYLOAD_OFFSET)]
    if posix_blocks is not None:
        file_bytes = PAYLOAD_OFFSET + block_bytes
        config.append({"driver": "posix", "path": posix_path,
                       "capacity": posix_blocks * file_bytes})
        sim.append(SimTier(policy, None, "posix", capacity_bytes=posix_blocks * file_bytes,
                           block_bytes=file_bytes))
    return config, sim


def measure(model: str, prompts: Sequence[list[int]], ucm: dict[str, Any], *,
            block_size: int = 32, max_model_len: int = 4096, log_path: str | None = None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Replays the prompts through one vLLM-CPU engine with the ucm connector and config
    `ucm`: vLLM's prefix cache off, one request at a time (its stores waited for), one output
    token. Returns the blocks each request loaded and the connector's counters."""
    from ucm.bench.engines import EngineProcess, EngineSpec, Phase

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
    copies hits from the posix tier up, in the background (so the replay is no longer exact
    in time)."""
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

