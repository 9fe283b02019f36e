"""The scheduler side of the connector: runs in the scheduler process (vLLM's EngineCore).

For each waiting request it posts one Lookup (prefix semantics) to the kernel and answers
`get_num_new_matched_tokens` without stalling the scheduler step: it waits at most
`lookup_wait` inline, then answers None ("ask again later") until the lookup finishes or
`lookup_timeout` passes (a miss). Any kernel error (KernelBusy, a deadline, a failing driver) is
a miss. Lookups go through the engine-neutral `ucm.engine.PageIO` (no kernel deadline, as
before: the scheduler waits on its own terms). The last prompt token is never claimed, so vLLM
always computes at least one token.
Each step it tells the workers which blocks to load and which newly computed full blocks to
save.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from ucm.engine.pages import PageIO, PendingPages
from ucm.errors import UCMError
from ucm.kernel import LookupResult
from ucm.vllm_hook.events import SchedulerEvents
from ucm.vllm_hook.keys import RequestChain, chain_seed, group_key, layer_key, rank_key
from ucm.vllm_hook.metadata import BlockTransfer, UCMConnectorMetadata
from ucm.vllm_hook.next_turn import NextTurnTimer
from ucm.vllm_hook.sessions import SessionOp, parse_hint
from ucm.vllm_hook.settings import (
    HookSettings,
    SharedKernel,
    kernels,
    scheduler_config,
    start_kernel,
)
from ucm.vllm_hook.sparse_blocks import BlockFreer

log = logging.getLogger("ucm.vllm_hook")


@dataclass
class _RequestState:
    request: Any
    chain: RequestChain
    lookup: PendingPages | None = None
    looked_up_blocks: int = 0  # blocks the finished lookup covered
    hit_blocks: int | None = None  # leading blocks storage holds (None: not known yet)
    local_tokens: int = 0  # tokens vLLM's own prefix cache supplied
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    saved_blocks: int = 0  # leading blocks already stored (or being stored)
    pending_loads: list[BlockTransfer] = field(default_factory=list)  # one per group
    external_tokens: int = 0
    waiting_since: float | None = None  # a consumer's wait for blocks not stored yet
    looked_up_at: float = 0.0


class SchedulerSide:
    def __init__(self, settings: HookSettings, *, layers: int | None = None,
                 sinks: tuple[Any, ...] = (), events: bool = False,
                 event_groups: tuple[tuple[str, int | None], ...] = ()) -> None:
        """`layers`: the KV cache layers of the model (vLLM's KVCacheConfig). The layerwise
        mode stores each layer of a block on its own, so a block is a hit only when every
        layer is stored; without the count only the first layer is looked up. `sinks`: tracer
        sinks of a lookup kernel of its own (the connector's stats). `events`: whether the
        engine publishes KV events (ucm's stored and removed blocks: `self.events`);
        `event_groups`: each KV cache group's kind and window as the events name them."""
        self.settings = settings
        self._sinks = sinks
        self.block_size = settings.block_size
        self.layers = (layers or 1) if settings.layerwise else 1
        if settings.layerwise and not layers:
            log.warning("ucm: layerwise lookups check each block's first layer only (vLLM "
                        "passed no KV cache config): a block missing a later layer is "
                        "claimed, then recomputed")
        self.stats: Counter[str] = Counter()
        self._reqs: dict[str, _RequestState] = {}
        self._kernel: Any = None
        self._pages: PageIO | None = None
        self._shared: SharedKernel | None = None  # the worker's kernel, in one-process mode
        self._own_kernel = False
        self._kernel_wait_since: float | None = None
        # vLLM's KV events of ucm's blocks, when the engine publishes events
        self.events = SchedulerEvents(settings.ucm_config, self.block_size, settings.tp_size,
                                     event_groups if settings.hybrid else ()) if events else None
        self._session_ops: list[SessionOp] = []  # finished requests' hints, for the next step
        # sessions.predict_next_turn: prefetches of predicted next turns (ucm.vllm_hook.next_turn)
        self.next_turn = NextTurnTimer(self._prefetch_next_turn) \
            if settings.ucm_config.sessions.predict_next_turn else None
        self._next_turn_ops: deque[SessionOp] = deque()  # for the next step (another process)
        # sparse attention: frees sparse requests' offloaded blocks in vLLM's cache
        self.sparse_blocks = BlockFreer(settings, lambda: self.pages, self.stats,
                                        self._wait_worker_stores) \
            if settings.sparse is not None else None

    # -- the kernel ------------------------------------------------------------------------------
    @property
    def owns_kernel(self) -> bool:
        """Whether it looks up in a kernel of its own (not in a worker side's, one process)."""
        return self._own_kernel

    @property
    def shares_kernel(self) -> bool:
        """Whether it looks up in a worker side's kernel (one process), which it hands each
        step's loads as soon as it has planned them."""
        return self._shared is not None

    def _get_kernel(self) -> Any:
        if self._kernel is None:
            self._shared = kernels.find(self.settings.ucm_config)
            if self._shared is not None:
                self._kernel = self._shared.kernel
            else:
                self._kernel = start_kernel(scheduler_config(self.settings.ucm_config),
                                            self._sinks)
                self._own_kernel = True
            self._pages = PageIO(self._kernel, timeout=self.settings.lookup_timeout,
                                 deadline=None)
        return self._kernel

    def _wait_worker_stores(self, timeout: float) -> bool:
        """Waits for the stores of a worker side in this process (sparse attention frees only
        blocks ucm holds); False where there is none."""
        shared = self._shared
        return shared is not None and shared.wait_for_stores(timeout)

    @property
    def pages(self) -> PageIO:
        """Lookups through the engine-neutral page I/O (its counters: `pages.statistics()`)."""
        self._get_kernel()
        assert self._pages is not None
        return self._pages

    # -- matching --------------------------------------------------------------------------------
    def _state(self, request: Any) -> _RequestState:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            lora = getattr(request, "lora_request", None)
            seed = chain_seed(self.settings.namespace,
                              cache_salt=getattr(request, "cache_salt", None),
                              lora=getattr(lora, "lora_name", None) if lora else None)
            st = _RequestState(request, RequestChain(seed, self.block_size))
            self._reqs[request.request_id] = st
            self.stats["requests"] += 1
        return st

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   ) -> tuple[int | None, bool]:
        t0 = time.perf_counter()
        try:
            return self._match(request, num_computed_tokens)
        finally:  # the scheduler's time in ucm (`schedule_ns`): the demo's breakdown
            self.stats["schedule_ns"] += int((time.perf_counter() - t0) * 1e9)

    def _match(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        st.local_tokens = num_computed_tokens
        tokens = request.all_token_ids
        n_full = (len(tokens) - 1) // self.block_size  # never the last token
        if n_full * self.block_size <= num_computed_tokens:
            st.hit_blocks = st.hit_blocks or 0
            return 0, False
        if st.hit_blocks is None or st.looked_up_blocks < n_full:
            if (self.settings.consumer and st.lookup is None
                    and time.monotonic() - st.looked_up_at < _RELOOK_EVERY):
                return None, False  # a consumer waiting: the next lookup a little later
            hit = self._poll_lookup(st, tokens, n_full)
            if hit is None:
                return None, False
            st.hit_blocks, st.looked_up_blocks = hit, n_full
            st.looked_up_at = time.monotonic()
            if self.settings.consumer and self._wait_for_blocks(st, n_full):
                st.hit_blocks = None  # looked up again at a later call
                return None, False
        n_external = max(0, st.hit_blocks * self.block_size - num_computed_tokens)
        # With several KV cache groups vLLM takes no block-level load errors (it cannot map a
        # block id to a request): the load is asynchronous, into blocks no step uses until
        # it is done, and a request whose load failed is recomputed whole (load_failed).
        return n_external, self.settings.hybrid and n_external > 0

    def _poll_lookup(self, st: _RequestState, tokens: Any, n_full: int) -> int | None:
        """Leading hit blocks once known; None while the lookup is in flight."""
        if st.lookup is None:
            kernel = self._get_kernel()
            if not kernel.running:  # still opening its tiers: ask later, then a miss
                if self._kernel_wait_since is None:
                    self._kernel_wait_since = time.monotonic()
                if time.monotonic() - self._kernel_wait_since < self.settings.start_timeout:
                    self.stats["lookup_deferred"] += 1
                    return None
                self.stats["lookup_kernel_not_ready"] += 1
                return 0
            digests = st.chain.upto(tokens, n_full)
            size = self.settings.tp_size
            keys = [rank_key(d, r, size) for r in range(size) for d in digests]
            if self.settings.hybrid:  # every group's blocks, rank after rank, group by group
                keys = [group_key(k, g.index, g.kind)
                        for r in range(size) for g in self.settings.groups
                        for k in keys[r * n_full:(r + 1) * n_full]]
            elif self.settings.layerwise:  # each block's layers, in order, block after block
                keys = [layer_key(k, i) for k in keys for i in range(self.layers)]
            # No promotion: the step's Load reads these blocks next (and promotes them where
            # promote_loads asks); docs/performance.md, Promotion on lookup and load.
            st.lookup = self.pages.start_lookup(keys, prefix=size == 1 and not self.settings.hybrid,
                                                promote=False,
                                                request_id=st.request.request_id)
            if not st.lookup.submitted:  # KernelBusy, closed: a miss
                return self._lookup_failed(st)
            self.stats["lookups"] += 1
        lookup = st.lookup
        if not lookup.wait(self.settings.lookup_wait):
            if time.monotonic() - lookup.started < self.settings.lookup_timeout:
                self.stats["lookup_deferred"] += 1
                return None
            lookup.result(timeout=0, wait_stopped=False)  # cancels it: a lookup writes nothing
            if lookup.timed_out:
                self.stats["lookup_timeouts"] += 1
                st.lookup = None
                return 0
        lookup.result()
        if isinstance(lookup.error, TimeoutError):  # the kernel's deadline (the config's)
            self.stats["lookup_timeouts"] += 1
            st.lookup = None
            return 0
        if lookup.error is not None:
            return self._lookup_failed(st)
        st.lookup = None
        found = lookup.value  # a LookupResult: the tier of each hit
        if (self.events is not None and isinstance(found, LookupResult)
                and self.settings.tp_size == 1 and not self.settings.layerwise):
            digests = st.chain.digests[:n_full]
            if self.settings.hybrid:  # every key answered, group by group
                for g in self.settings.groups:
                    part = slice(g.index * n_full, (g.index + 1) * n_full)
                    self.events.looked_up_each(digests, found.tiers[part], found.hits[part],
                                               group=g.index)
            else:
                self.events.looked_up(digests, found.tiers, _leading(found.hits))
        # With TP, a block is a hit only when every rank's shard is stored; layerwise, only
        # when every layer is.
        if self.settings.hybrid:
            return self._hybrid_hit(lookup.hits, n_full)
        hits, n = lookup.hits, n_full * self.layers
        per_rank = [hits[r * n:(r + 1) * n] for r in range(self.settings.tp_size)]
        return min(_leading(h) for h in per_rank) // self.layers

    def _hybrid_hit(self, hits: Any, n_full: int) -> int:
        """The longest prefix (in blocks) that every KV cache group can serve on every rank:
        a full-attention group needs each block before it, a sliding-window group the blocks
        within its window before it (vLLM's coordinator asks the same of its own cache)."""
        groups = self.settings.groups
        per_group = len(groups) * n_full
        held = [[all(hits[r * per_group + g.index * n_full + i]
                     for r in range(self.settings.tp_size)) for i in range(n_full)]
                for g in groups]
        end = min([_leading(held[g.index]) for g in groups if g.window is None],
                  default=n_full)
        for boundary in range(end, 0, -1):
            if all(all(held[g.index][max(0, boundary - (g.window_blocks or 0)):boundary])
                   for g in groups if g.window is not None):
                return boundary
        return 0

    def _wait_for_blocks(self, st: _RequestState, n_full: int) -> bool:
        """A consumer's request whose prompt's full blocks are not all stored: whether it
        waits on (its prefill instance may still be writing them). Bounded by consumer_wait;
        then the missing blocks are recomputed, counted in `consumer_missing_blocks`."""
        assert st.hit_blocks is not None
        now = time.monotonic()
        if st.hit_blocks >= n_full:
            if st.waiting_since is not None:
                self.stats["consumer_waits_complete"] += 1
            return False
        if st.waiting_since is None:
            st.waiting_since = now
        if now - st.waiting_since < self.settings.consumer_wait:
            return True
        self.stats["consumer_waits_expired"] += 1
        self.stats["consumer_missing_blocks"] += n_full - st.hit_blocks
        log.info("ucm: %s: %d of %d prompt blocks not stored after %.1f s; recomputed",
                 st.request.request_id, n_full - st.hit_blocks, n_full,
                 self.settings.consumer_wait)
        return False

    def _lookup_failed(self, st: _RequestState) -> int:
        lookup, st.lookup = st.lookup, None
        if lookup is not None:
            lookup.result()  # counts the failure in the page I/O's statistics
        self.stats["lookup_errors"] += 1
        log.debug("ucm lookup for %s failed (a miss): %s", st.request.request_id,
                  lookup.error if lookup is not None else None)
        return 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int,
                                 ) -> None:
        st = self._state(request)
        local_blocks = st.local_tokens // self.block_size
        # Blocks storage holds, or this engine computed already, are not saved again.
        st.saved_blocks = max(st.saved_blocks, st.hit_blocks or 0, local_blocks)
        if num_external_tokens <= 0:
            return
        n = num_external_tokens // self.block_size
        if self.settings.hybrid:
            st.pending_loads = self._hybrid_loads(request.request_id, st, blocks,
                                                  local_blocks, local_blocks + n)
        else:
            block_ids = blocks.get_block_ids()[0]
            digests = st.chain.digests[local_blocks:local_blocks + n]
            st.pending_loads = [BlockTransfer(request.request_id,
                                              list(block_ids[local_blocks:local_blocks + n]),
                                              digests)]
        st.external_tokens = num_external_tokens
        self.stats["hit_tokens"] += num_external_tokens
        log.debug("ucm: %s loads %d tokens (%d local)", request.request_id,
                  num_external_tokens, st.local_tokens)

    def _hybrid_loads(self, req_id: str, st: _RequestState, blocks: Any, first: int,
                      end: int) -> list[BlockTransfer]:
        """One load per KV cache group for the hit's blocks `first..end-1`: a full group's
        every block, a sliding group's those within its window before `end` (vLLM gave the
        ones before it the null block)."""
        loads = []
        per_group = blocks.blocks
        for g in self.settings.groups:
            start = first if g.window_blocks is None else max(first, end - g.window_blocks)
            ids = [b.block_id for b in per_group[g.index][start:end]]
            nulls = [getattr(b, "is_null", False) for b in per_group[g.index][start:end]]
            if any(nulls):  # vLLM skipped more of the window than it needs: load what it kept
                keep = [i for i, null in enumerate(nulls) if not null]
                ids = [ids[i] for i in keep]
                digests = [st.chain.digests[start + i] for i in keep]
            else:
                digests = st.chain.digests[start:start + len(ids)]
            if ids:
                loads.append(BlockTransfer(req_id, ids, list(digests), g.index))
        return loads

    # -- per-step plan ---------------------------------------------------------------------------
    def build_connector_meta(self, so: Any) -> UCMConnectorMetadata:
        t0 = time.perf_counter()
        try:
            return self._plan_step(so)
        finally:
            self.stats["schedule_ns"] += int((time.perf_counter() - t0) * 1e9)

    def _plan_step(self, so: Any) -> UCMConnectorMetadata:
        meta = UCMConnectorMetadata()
        computed_before: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = [list(ids) for ids in new.block_ids or ()]
            computed_before[new.req_id] = new.num_computed_tokens
            if self.sparse_blocks is not None:
                self.sparse_blocks.start(new.req_id, new.num_computed_tokens)
            meta.loads.extend(st.pending_loads)
            st.pending_loads = []
        cached = so.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = [list(ids) for ids in new_ids or ()]
                if self.sparse_blocks is not None:
                    self.sparse_blocks.start(req_id, cached.num_computed_tokens[i])
            else:
                if new_ids:
                    if not st.block_ids:
                        st.block_ids = [[] for _ in new_ids]
                    for mine, ids in zip(st.block_ids, new_ids, strict=True):
                        mine.extend(ids)
                self._recompute_after_load_error(st, cached.num_computed_tokens[i])
            computed_before[req_id] = cached.num_computed_tokens[i]
            meta.loads.extend(st.pending_loads)
            st.pending_loads = []
        for req_id, n_scheduled in so.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or req_id not in computed_before:
                continue
            meta.saves.extend(self._plan_save(st, computed_before[req_id] + n_scheduled))
            if self.sparse_blocks is not None:
                self.sparse_blocks.name_row(meta.sparse_rows, req_id, computed_before[req_id],
                                            st.block_ids)
                free = self.sparse_blocks.plan(req_id, len(st.request.prompt_token_ids),
                                               computed_before[req_id], st.saved_blocks,
                                               st.chain.digests)
                if free is not None:
                    meta.sparse.append(free)
        if self.sparse_blocks is not None:
            meta.sparse_ended = self.sparse_blocks.take_ended()
        for st in self._reqs.values():  # asynchronous loads: requests vLLM did not schedule
            if st.pending_loads:
                meta.loads.extend(st.pending_loads)
                st.pending_loads = []
        while self._next_turn_ops:
            self._session_ops.append(self._next_turn_ops.popleft())
        if self._session_ops:
            meta.sessions, self._session_ops = self._session_ops, []
        shared = self._shared  # the worker side's kernel: that side is in this process
        if meta.loads and self.settings.early_loads and shared and shared.load_early(meta.loads):
            self.stats["early_loads"] += 1
        return meta

    def _recompute_after_load_error(self, st: _RequestState, num_computed: int) -> None:
        """A running request's computed tokens only fall when vLLM truncated them at a block
        whose load failed (invalid block ids): the blocks from there on are recomputed, and
        stored again, since what storage held for them could not be served."""
        redo = num_computed // self.block_size
        if redo < st.saved_blocks:
            self.stats["restore_blocks"] += st.saved_blocks - redo
            st.saved_blocks = redo

    def _plan_save(self, st: _RequestState, computed_after: int) -> list[BlockTransfer]:
        if not self.settings.stores or not st.block_ids:  # a kv_consumer loads only
            return []
        request = st.request
        tokens = request.all_token_ids
        limit = len(tokens) if self.settings.save_generated else len(request.prompt_token_ids)
        n_full = min(computed_after, limit) // self.block_size
        n_full = min([n_full, *(len(ids) for ids in st.block_ids)])
        if n_full <= st.saved_blocks:
            return []
        digests = st.chain.upto(tokens, n_full)
        start, st.saved_blocks = st.saved_blocks, n_full
        self.stats["save_blocks"] += n_full - start
        if not self.settings.hybrid:
            if self.events is not None:
                self.events.planned(request, start, digests[start:])
            return [BlockTransfer(request.request_id, st.block_ids[0][start:n_full],
                                  digests[start:])]
        saves = []
        for g in self.settings.groups:
            span = range(start, n_full) if g.window_blocks is None else \
                _window_blocks(len(request.prompt_token_ids), self.block_size,
                               g.window_blocks, start, n_full)
            ids = st.block_ids[g.index]
            keep = [i for i in span if ids[i] != _NULL_BLOCK]
            if keep:
                saves.append(BlockTransfer(request.request_id, [ids[i] for i in keep],
                                           [digests[i] for i in keep], g.index))
                if self.events is not None:  # per group: a sliding one names its window
                    self.events.planned(request, 0, [digests[i] for i in keep],
                                        group=g.index, positions=keep)
        return saves

    def load_failed(self, req_ids: set[str]) -> None:
        """Requests whose asynchronous load failed on a worker (vLLM's failed_recving): vLLM
        recomputes them from the start, and their next lookup is a miss, not the same hit."""
        for req_id in req_ids:
            st = self._reqs.get(req_id)
            if st is not None:
                st.hit_blocks, st.looked_up_blocks = 0, 1 << 62
                # recomputed whole: stored again but for what this engine computed itself
                st.saved_blocks = min(st.saved_blocks, st.local_tokens // self.block_size)
                self.stats["load_failed_requests"] += 1

    def request_finished(self, request: Any, block_ids: list[int],
                         ) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st.lookup is not None:
            st.lookup.cancel()
        if self.sparse_blocks is not None:
            self.sparse_blocks.finished(request.request_id)
        self._session_hint(request, st)
        # Saves snapshot their blocks inside the step that computed them, so vLLM may free
        # the blocks at once.
        return False, None

    def _session_hint(self, request: Any, st: _RequestState | None) -> None:
        """Queues a finished request's session hint (`ucm.vllm_hook.sessions`) for the workers,
        with the digests of its full blocks that ucm holds; a malformed hint is counted and
        logged, never raised."""
        try:
            op, problem = parse_hint(getattr(request, "kv_transfer_params", None),
                                     max_retain_s=self.settings.ucm_config.sessions.max_retain_s)
        except Exception as exc:  # whatever a client sent: never an error into the engine
            op, problem = None, repr(exc)
        if problem is not None:
            self.stats["session_hints_malformed"] += 1
            log.warning("ucm: %s: session hint ignored: %s", request.request_id, problem)
            return
        if op is None:
            if self.next_turn is not None and st is not None:
                self.next_turn.after(st.chain.digests[:st.saved_blocks])
            return
        if st is not None and (op.retain_s is not None or op.prefetch):
            op.digests = list(st.chain.digests[:st.saved_blocks])
            if self.settings.hybrid:  # each group's blocks as _plan_save stored them
                prompt = len(request.prompt_token_ids)
                op.group_digests = [
                    op.digests if g.window_blocks is None else
                    [op.digests[i] for i in _window_blocks(prompt, self.block_size,
                                                           g.window_blocks, 0, st.saved_blocks)]
                    for g in self.settings.groups]
        for kind, on in (("hold", op.retain_s is not None), ("end", op.end),
                         ("prefetch", op.prefetch)):
            if on:
                self.stats[f"session_hints.{kind}"] += 1
        if not (op.digests or op.end):
            return
        # One process: the worker side applies it now (an idle engine runs no next step);
        # otherwise it goes to the workers with the next step.
        shared = self._shared
        if shared is None or not shared.apply_sessions([op]):
            self._session_ops.append(op)

    def _prefetch_next_turn(self, digests: list[bytes]) -> None:
        """The next-turn timer's due blocks (its thread): a prefetch for the workers, at once
        where the worker side is in this process, else with the next step."""
        self.stats["next_turn.prefetches"] += 1
        self.stats["next_turn.blocks"] += len(digests)
        op = SessionOp("next-turn", prefetch=True, digests=digests)
        shared = self._shared
        if shared is None or not shared.apply_sessions([op]):
            self._next_turn_ops.append(op)

    def hit_tokens(self, req_id: str) -> int:
        st = self._reqs.get(req_id)
        return st.external_tokens if st else 0

    def shutdown(self) -> None:
        if self.next_turn is not None:
            self.next_turn.stop()
        if self._own_kernel and self._kernel is not None:
            try:
                self._kernel.close(timeout=10.0)
            except UCMError as exc:
                log.warning("ucm: kernel close: %s", exc)
        self._kernel = self._shared = self._pages = None


_RELOOK_EVERY = 0.02  # seconds between a waiting consumer's lookups
_NULL_BLOCK = 0  # vLLM's null block (its block pool's first), where a window skipped a block


def _window_blocks(prompt_tokens: int, block_size: int, window_blocks: int, start: int,
                   end: int) -> range:
    """The blocks of `start..end-1` that a sliding-window group stores: the `window_blocks`
    before the boundary where the same prompt hits again (its full blocks before its last
    token, which is always computed). Nothing else, so what a sliding group stores is one
    window, not the prompt; a longer prompt that extends this one hits there too, and
    computes the rest (docs/vllm.md, Hybrid models)."""
    boundary = (prompt_tokens - 1) // block_size
    return range(max(start, boundary - window_blocks), min(end, boundary))


def _leading(hits: Any) -> int:
    n = 0
    for hit in hits:
        if not hit:
            break
        n += 1
    return n
