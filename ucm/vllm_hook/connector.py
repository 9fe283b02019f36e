"""`UCMConnector`: the KVConnectorBase_V1 facade vLLM loads. Runs in both processes: vLLM
builds it once with role SCHEDULER (in the EngineCore process) and once per worker with role
WORKER; the facade builds the matching side and forwards the calls that side answers.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ucm.codecs.vllm import attention_isa
from ucm.vllm_hook.events import UCMKVEvents, WorkerEvents, group_metadata
from ucm.vllm_hook.metadata import UCMConnectorMetadata
from ucm.vllm_hook.settings import kv_layer_count, settings_from_vllm
from ucm.vllm_hook.sparse import SparseAttention, install_scheduler, prefix_keys_readable
from ucm.vllm_hook.stats import SideStats, UCMConnectorStats, UCMPromMetrics

if TYPE_CHECKING:
    import torch
    from vllm.v1.outputs import KVConnectorOutput

    from ucm.vllm_hook.scheduler import SchedulerSide
    from ucm.vllm_hook.worker import WorkerSide

log = logging.getLogger("ucm.vllm_hook")

_live: weakref.WeakSet[UCMConnector] = weakref.WeakSet()


def live_connectors() -> list[UCMConnector]:
    """The connectors alive in this process (for statistics and tests)."""
    return list(_live)


class StepMetadata(UCMConnectorMetadata):
    """A step's metadata with loads, as the scheduler sends it to worker processes (vLLM's
    multiprocess executor pickles it). Unpickled in a worker process, that is as soon as the
    worker receives the step, it starts the step's loads there (`WorkerSide.load_early`), so
    they run while vLLM prepares the step's inputs; `start_load_kv` then waits for them."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        try:
            load_on_arrival(self)
        except Exception:  # never fail vLLM's unpickling: start_load_kv loads instead
            log.exception("ucm: early load on arrival failed")


def load_on_arrival(meta: UCMConnectorMetadata) -> bool:
    """Starts `meta`'s loads on this process's worker side, unless a scheduler side lives here
    too (one process: it started them when it planned the step). True when they started."""
    live = live_connectors()
    if not meta.loads or any(c.scheduler is not None for c in live):
        return False
    workers = [c.worker for c in live if c.worker is not None]
    return len(workers) == 1 and workers[0].load_early(meta.loads)


class UCMConnector(KVConnectorBase_V1, SupportsHMA):
    """Implements `SupportsHMA`, so vLLM keeps its hybrid KV cache manager on: with more than
    one KV cache group (sliding-window and full layers) blocks are kept per group
    (`HookSettings.groups`); one group is the dense path."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None,
                 ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = settings_from_vllm(vllm_config, kv_cache_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.sparse: SparseAttention | None = None
        self._stats = SideStats()  # fed by this side's kernel; vLLM's /metrics shows them
        kv_events = getattr(vllm_config, "kv_events_config", None)
        publishes = bool(kv_events is not None and kv_events.enable_kv_cache_events)
        sinks = (self._stats.sink,)
        if role == KVConnectorRole.SCHEDULER:
            from ucm.vllm_hook.scheduler import SchedulerSide

            self.scheduler = SchedulerSide(self.settings, layers=kv_layer_count(kv_cache_config),
                                           sinks=sinks, events=publishes,
                                           event_groups=group_metadata(kv_cache_config)
                                           if publishes and self.settings.hybrid else ())
            if self.settings.sparse is not None:  # hands us vLLM's KV cache manager (.sparse)
                install_scheduler()
                freer = self.scheduler.sparse_blocks
                if freer is not None and freer.prefix_keys:
                    freer.prefix_keys = prefix_keys_readable(vllm_config)
            # A block that does not load is a miss: vLLM recomputes it (unless the user asked
            # for "fail"). The scheduler reads this right after building its connector.
            kvt = vllm_config.kv_transfer_config
            if kvt.kv_load_failure_policy != self.settings.load_failure:
                kvt.kv_load_failure_policy = self.settings.load_failure
        else:
            from ucm.vllm_hook.worker import WorkerSide

            self.worker = WorkerSide(self.settings, sinks,
                                     WorkerEvents() if publishes else None)
            self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
            self._layers = kv_layer_count(kv_cache_config)
            if self.settings.sparse is not None:  # wraps vLLM's CPU attention (.sparse)
                self.sparse = SparseAttention(self.settings.sparse, self.worker)
                self.sparse.activate()
        _live.add(self)

    def _scheduler_side(self) -> SchedulerSide:
        if self.scheduler is None:
            raise RuntimeError("ucm: a scheduler call reached a worker's connector")
        return self.scheduler

    def _worker_side(self) -> WorkerSide:
        if self.worker is None:
            raise RuntimeError("ucm: a worker call reached the scheduler's connector")
        return self.worker

    def _meta(self) -> UCMConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, UCMConnectorMetadata)
        return meta

    # -- scheduler side --------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   ) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int,
                                 ) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        scheduler = self._scheduler_side()
        meta = scheduler.build_connector_meta(scheduler_output)
        if meta.loads and self.settings.early_loads and not scheduler.shares_kernel:
            return StepMetadata(loads=meta.loads, saves=meta.saves,  # loads on arrival
                                sessions=meta.sessions, sparse=meta.sparse,
                                sparse_rows=meta.sparse_rows, sparse_ended=meta.sparse_ended)
        return meta

    def attach_kv_manager(self, kv_manager: Any) -> None:
        """vLLM's KVCacheManager, from the scheduler hook of sparse attention (.sparse)."""
        freer = self.scheduler.sparse_blocks if self.scheduler is not None else None
        if freer is not None and freer.kv_manager is not kv_manager:
            freer.attach(kv_manager)

    def request_finished(self, request: Any, block_ids: list[int],
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...],
                                     ) -> tuple[bool, dict[str, Any] | None]:
        # Saves snapshot their blocks in the step that computed them, in every group: vLLM
        # may free them all at once.
        return self._scheduler_side().request_finished(request, list(block_ids[0])
                                                       if block_ids else [])

    # -- worker side -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(
            kv_caches, self._num_blocks, cpu_isa=attention_isa(self._vllm_config, list(kv_caches)))
        if self.settings.layerwise and self._layers not in (None, len(kv_caches)):
            # The scheduler looks up this many layers per block; stores write len(kv_caches).
            log.warning("ucm: vLLM's KV cache config names %d layers but %d caches were "
                        "registered; layerwise lookups will miss", self._layers, len(kv_caches))
        if self.sparse is not None:
            self.sparse.register(list(kv_caches))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # before the forward: vLLM 0.32 calls start_load_kv after it when no load is sync,
        # and the step's attention must already skip the blocks freed in its schedule
        if self.sparse is not None and isinstance(connector_metadata, UCMConnectorMetadata):
            self.sparse.observe(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker_side().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._worker_side().save_kv_layer(self._meta(), layer_name)

    def wait_for_save(self) -> None:
        self._worker_side().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Hybrid loads are asynchronous: each request's load is reported when it ends (a
        # failed one in failed_recving too, which vLLM recomputes whole).
        if self.worker is None or not self.settings.hybrid:
            return super().get_transfer_results(finished_req_ids)
        done, failed = self.worker.take_transfers()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors() if self.worker else set()

    # -- vLLM's connector stats: ucm's metrics in the server's /metrics (ucm.vllm_hook.stats) --
    def get_kv_connector_stats(self) -> UCMConnectorStats | None:
        if self.worker is not None:
            return self._stats.take(side_stats=self.worker.stats, kernel=self.worker.kernel)
        if self.scheduler is not None:
            # Its own lookup kernel's counts (in one process the worker side reports the
            # kernel they share, this sink gets nothing) and its consumer counters
            stats = self._stats.take(scheduler_stats=self.scheduler.stats)
            return None if stats.is_empty() else stats
        return None

    # -- vLLM's KV events: ucm's stored and removed blocks (ucm.vllm_hook.events) ---------------
    def get_kv_connector_kv_cache_events(self) -> UCMKVEvents | None:
        if self.worker is None or self.worker.events is None:
            return None
        return self.worker.events.take()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.scheduler is not None and connector_output.failed_recving:
            self.scheduler.load_failed(set(connector_output.failed_recving))
        if self.scheduler is not None and self.scheduler.events is not None:
            self.scheduler.events.add(connector_output.kv_cache_events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        if self.scheduler is None or self.scheduler.events is None:
            return ()
        return self.scheduler.events.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None,
                                 ) -> UCMConnectorStats | None:
        return UCMConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type[Any], type[Any]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> UCMPromMetrics:
        return UCMPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- both ------------------------------------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        """Counters of this side (and its kernel, on the worker side)."""
        if self.worker is not None:
            stats = self.worker.statistics()
            if self.sparse is not None:
                stats["sparse"] = self.sparse.statistics()
            return stats
        scheduler = self._scheduler_side()
        out: dict[str, Any] = dict(scheduler.stats)
        if scheduler.sparse_blocks is not None:
            out["sparse_freed"] = list(scheduler.sparse_blocks.freed)
        return out

    def shutdown(self) -> None:
        if self.worker is not None and self.sparse is not None:
            self.sparse.deactivate()
        side = self.worker or self.scheduler
        if side is not None:
            side.shutdown()
