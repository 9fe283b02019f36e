"""The worker side of the connector: runs in each worker process (one per TP rank).

Loads: `start_load_kv` posts one Load event for every block the step needs. With the cache in
host memory (vLLM on CPU) each block's target is a `Scatter` of its pieces in the cache, so the
storage reads land straight in the KV cache: no staging buffer, no copy (`direct_loads`).
Otherwise the load goes into a reused staging buffer, and the verified blocks are copied into
the cache before the forward pass. In the layerwise mode each layer of each block is stored as
a ucm block of its own, and the step's loads go layer by layer (`LayerwiseLoad`): vLLM waits
for a layer in `wait_for_layer_load`, on entry to that attention layer, while the later layers
are still loading. A block that does not load (missing, corrupt, I/O error,
KernelBusy, deadline, `load_timeout`) is reported through `get_block_ids_with_load_errors`, and
vLLM recomputes it and everything after it: its cache blocks may hold anything until then.
A direct load that times out is cancelled and waited for until it has stopped, so nothing
writes into cache blocks that vLLM recomputes or gives to another request. Loads and stores go
through the engine-neutral `ucm.engine.PageIO` with no kernel deadline: the worker waits
`load_timeout` on its own terms.

Saves: `save_kv_layer` snapshots this step's new full blocks of that layer into a staging
buffer as soon as the layer has written them; `wait_for_save` posts one Store per step and
returns. The write happens in the background; the snapshot, not the KV cache, stays alive until
it completes, so vLLM never has to hold blocks for us. Snapshots waiting to be written are
bounded by `max_store_bytes`: beyond it a save is dropped (a future miss, never a stall).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ucm.codecs.layout import KVLayouts
from ucm.codecs.vllm import cache_layouts
from ucm.drivers import LoadState
from ucm.engine.pages import PageIO, PendingPages
from ucm.errors import ConfigError, UCMError
from ucm.kernel import Prefetch
from ucm.vllm_hook.events import WorkerEvents
from ucm.vllm_hook.hugepages import collapse_cache
from ucm.vllm_hook.keys import group_key, layer_key, rank_key
from ucm.vllm_hook.layerwise import LayerwiseLoad
from ucm.vllm_hook.layout import BlockLayout
from ucm.vllm_hook.metadata import BlockTransfer, UCMConnectorMetadata
from ucm.vllm_hook.sessions import SessionOp
from ucm.vllm_hook.settings import HookSettings, SharedKernel, kernels, wait_running

if TYPE_CHECKING:
    import numpy as np

    from ucm.block import Scatter

# which blocks a step loads where, for which requests (request id, block ids, digests)
_Plan = tuple[tuple[str, tuple[int, ...], tuple[bytes, ...]], ...]

log = logging.getLogger("ucm.vllm_hook")

_SPARE_SNAPSHOT_BYTES = 256 * 2**20  # snapshot buffers kept for reuse once their store ends


class WorkerSide:
    def __init__(self, settings: HookSettings, sinks: tuple[Any, ...] = (),
                 events: WorkerEvents | None = None) -> None:
        """`events`: where completed stores and blocks found gone are noted for vLLM's KV
        events (ucm.vllm_hook.events); None when the engine publishes none."""
        self.settings = settings
        self.events = events
        self._sinks = sinks  # tracer sinks of the kernel (the connector's stats)
        self.stats: Counter[str] = Counter()
        self.layout: BlockLayout | None = None  # group 0's (the only one but hybrid)
        self.layouts: list[BlockLayout] = []  # per KV cache group
        self._row_bytes = 0  # a staging row: the largest group's block
        self.kv_layouts: list[Any] = []  # this cache's KV layouts, given to its kernel
        self._kernel: Any = None
        self._shared: SharedKernel | None = None  # the kernel, as a scheduler side finds it
        self._load_staging: torch.Tensor | None = None
        self._layerwise: LayerwiseLoad | None = None
        self._pages: PageIO | None = None
        self._early: tuple[_Plan, PendingPages] | None = None  # load_early's
        self._load_errors: set[int] = set()
        # hybrid (asynchronous) loads by request: finished this step, and those that failed
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._save_staging: torch.Tensor | None = None
        self._spare: list[torch.Tensor] = []  # snapshot buffers whose stores have ended
        self._snapshot_bases: dict[int, torch.Tensor] = {}  # id(snapshot) -> its buffer
        self._save_rows: list[tuple[BlockTransfer, int]] = []
        self._save_layers_done: set[str] = set()
        self._lock = threading.Lock()
        self._store_bytes = 0  # snapshots not yet written
        # id(completion) -> (store, snapshot, keys per block, the blocks' digests, and their
        # groups' kinds, sizes and indexes)
        self._stores: dict[int, tuple[PendingPages, torch.Tensor, int, list[bytes],
                                      list[tuple[str, int, int]]]] = {}
        self._stores_idle = threading.Event()
        self._stores_idle.set()
        # session ops' kernel work in flight (a prefetch copies blocks in the background)
        self._session_pending: set[concurrent.futures.Future[Any]] = set()

    @property
    def kernel(self) -> Any:
        """This worker's kernel (None before `register_kv_caches`; it may still be starting)."""
        return self._kernel

    @property
    def pages(self) -> PageIO:
        """Loads and stores through the engine-neutral page I/O (set with the kernel)."""
        assert self._pages is not None, "register_kv_caches first"
        return self._pages

    def _key(self, digest: bytes, group: int = 0) -> bytes:
        key = rank_key(digest, self.settings.tp_rank, self.settings.tp_size)
        if self.settings.hybrid:
            g = self.settings.groups[group]
            key = group_key(key, g.index, g.kind)
        return key

    def _keys(self, transfers: list[BlockTransfer]) -> list[bytes]:
        return [self._key(d, t.group) for t in transfers for d in t.digests]

    def _new_rows(self, n_blocks: int) -> torch.Tensor:
        """A staging buffer of `n_blocks` rows, each the largest group's block."""
        assert self.layout is not None, "register_kv_caches first"
        pin = self.layout.device.type == "cuda"
        return torch.empty((n_blocks, self._row_bytes), dtype=torch.uint8, pin_memory=pin)

    # -- set-up ----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor],
                           num_blocks: int | None = None, *, cpu_isa: str | None = None,
                           ) -> None:
        if self.settings.hybrid:  # a layout per group: groups share the cache's tensors
            per_group = [{name: kv_caches[name] for name in g.layers if name in kv_caches}
                         for g in self.settings.groups]
            self.layouts = [BlockLayout(c, num_blocks) for c in per_group]
        else:
            per_group = [kv_caches]
            self.layouts = [BlockLayout(kv_caches, num_blocks)]
        self.layout = self.layouts[0]
        self._row_bytes = max(lay.block_bytes for lay in self.layouts)
        self.stats["kv_groups"] = len(self.layouts)
        # where keys and values sit, for tiers that quantize (ucm.codecs); on CPU the order
        # inside a block is the attention ISA's (`cpu_isa`, the layers' isa)
        found = [layout for caches, lay in zip(per_group, self.layouts, strict=True)
                 for layout in cache_layouts(caches, lay.num_blocks, lay.block_bytes,
                                             interpretable=lay.device.type == "cuda",
                                             cpu_isa=cpu_isa)]
        try:
            self.kv_layouts = list(KVLayouts(found))
        except ConfigError as exc:  # two groups' blocks of one size laid out differently
            log.info("ucm: quantizing tiers store this cache's blocks losslessly: %s", exc)
            self.kv_layouts = []
        self._shared = kernels.acquire(self.settings.ucm_config, self, self._sinks,
                                       layouts=self.kv_layouts)
        self._kernel = self._shared.kernel
        self._pages = PageIO(self._kernel, timeout=self.settings.load_timeout, deadline=None)
        if self.layout.scatters and self.settings.hugepages:
            regions = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                       for t in kv_caches.values()}
            collapse_cache(regions)
        self._reserve_snapshot_buffer()
        self._wait_for_index()
        log.info("ucm: %d layers, %d blocks of %s bytes, namespace %s, rank %d/%d",
                 sum(len(lay.by_layer) for lay in self.layouts), self.layout.num_blocks,
                 "/".join(str(lay.block_bytes) for lay in self.layouts),
                 self.settings.namespace, self.settings.tp_rank, self.settings.tp_size)
        if self.settings.hybrid:
            log.info("ucm: hybrid KV cache, %d groups: %s", len(self.settings.groups),
                     ", ".join(g.tag() for g in self.settings.groups))
        if (self.layout.scatters and "GOMP_SPINCOUNT" not in os.environ
                and "OMP_WAIT_POLICY" not in os.environ):
            log.info("ucm: the KV cache is in CPU memory and OpenMP threads spin after each "
                     "parallel region (300,000 rounds in libgomp), which slows loads that start "
                     "just after one; GOMP_SPINCOUNT=3000 in the engine's environment avoids it "
                     "(`ucm demo` and `ucm bench vllm` set it for their engines)")

    def _reserve_snapshot_buffer(self) -> None:
        """A spare snapshot buffer for the blocks of vLLM's whole token budget per step (within
        the spare and store limits), its pages faulted in now rather than at its first use,
        which would slow the first prompt that saves (figures: docs/performance.md, Snapshot
        buffer reserved at start)."""
        step, layout = self.settings.step_tokens, self.layout
        if not step or layout is None or self.settings.max_store_bytes <= 0 \
                or not self.settings.stores:  # a kv_consumer snapshots nothing
            return
        limit = min(_SPARE_SNAPSHOT_BYTES, self.settings.max_store_bytes) // self._row_bytes
        n = min(-(-step // self.settings.block_size) * len(self.layouts), limit)
        if n < 1:
            return
        buffer = self._new_rows(n)
        buffer.zero_()
        with self._lock:
            self._spare.append(buffer)
        self.stats["snapshot_reserved_bytes"] = buffer.numel()

    def _wait_for_index(self) -> None:
        """Waits up to `index_wait` s for the kernel to start and to index the blocks storage
        already holds. Requests served before that still hit (a lookup asks the driver), but
        their loads compete with the listing for the cores, and the posix tier reads them
        with preadv instead of from its mappings (figures: docs/performance.md, Waiting for
        the index at start)."""
        budget = self.settings.index_wait
        if budget <= 0:
            return
        t0 = time.monotonic()
        done = (wait_running(self._kernel, budget)
                and self._kernel.wait_indexed(max(0.0, budget - (time.monotonic() - t0))))
        waited = time.monotonic() - t0
        self.stats["index_wait_ms"] = round(waited * 1000)
        if done:
            log.info("ucm: what storage holds was indexed %.2f s after the cache registered",
                     waited)
        else:
            log.info("ucm: serving before storage is indexed (index_wait %.1f s passed); "
                     "the listing goes on in the background", budget)

    # -- loads -----------------------------------------------------------------------------------
    def load_early(self, loads: list[BlockTransfer]) -> bool:
        """Starts a step's loads as soon as the scheduler has planned them (it runs in this
        process) or this worker process has received the step (`connector.StepMetadata`), so
        that the copy overlaps what vLLM does before start_load_kv.
        `start_load_kv` waits for them (or, should the step not be the one planned, for them
        to stop). Direct loads into a host-memory cache only, and only where vLLM runs steps
        in turn (`early_loads`), so the blocks a step's schedule gave a request are not in
        use by any forward pass until that step's. True when the loads started.

        The copy threads share the cores with vLLM's input preparation, but the load is done
        by the time it reaches start_load_kv (figures: docs/performance.md, Early loads)."""
        layout, kernel = self.layout, self._kernel
        if (not loads or layout is None or kernel is None or not kernel.running
                or self.settings.layerwise or not self.settings.early_loads
                or not (self.settings.direct_loads and layout.scatters)):
            return False
        self._drop_early()  # planned for a step that did not run
        keys = self._keys(loads)
        buffers = [self.layouts[t.group].scatter(b) for t in loads for b in t.block_ids]
        pending = self._submit_load(keys, buffers, loads[0].req_id)
        if not pending.submitted:
            pending.result()  # counted
            log.debug("ucm: early load not submitted (%s); start_load_kv will try",
                      pending.error)
            return False
        self._early = (_plan(loads), pending)
        self.stats["early_loads"] += 1
        return True

    def _submit_load(self, keys: list[bytes], buffers: list[Any], req_id: str,
                     ) -> PendingPages:
        """Starts a step's Load; `load_ns` counts the time from here until it is done (the
        step's own wait, `load_wait_ns`, is less where the load started early)."""
        t0 = time.perf_counter()
        self.stats["load_events"] += 1
        pending = self.pages.start_load(keys, buffers, promote=self.settings.promote_loads,
                                        request_id=req_id)

        def done(_: concurrent.futures.Future[Any]) -> None:  # on the thread that resolved it
            self.stats["load_ns"] += int((time.perf_counter() - t0) * 1e9)

        if pending.completion is not None:
            pending.completion.add_done_callback(done)
        return pending

    def _drop_early(self) -> None:
        """An early load no step asked for: waits until it has stopped writing into the cache
        (it may be cancelled first), since vLLM may give its blocks out again."""
        early, self._early = self._early, None
        if early is not None:
            early[1].stop(max(1.0, self.settings.load_timeout))
            self.stats["early_loads_unused"] += 1

    def start_load_kv(self, meta: UCMConnectorMetadata) -> None:
        if meta.sessions:  # before this step's stores, which may evict
            self.apply_sessions(meta.sessions)
        if self._layerwise is not None:  # a step whose load errors nobody asked for
            self._layerwise.finish()
            self._layerwise = None
        early = None
        if self._early is not None:
            if meta.loads and self._early[0] == _plan(meta.loads):
                early, self._early = self._early[1], None
            else:
                self._drop_early()
        if not meta.loads or self.layout is None:
            return
        n = sum(len(t.block_ids) for t in meta.loads)
        if early is not None:
            self.stats["load_blocks"] += n
            self._finish_direct_load(meta.loads, early)
            return
        keys = self._keys(meta.loads)
        if self.settings.layerwise:
            self._layerwise = LayerwiseLoad(self, self.layout, meta.loads, keys)
            self.stats["load_blocks"] += n
            return
        buffers: list[Scatter] | list[np.ndarray]
        if self.settings.direct_loads and self.layout.scatters:
            staging = None
            buffers = [self.layouts[t.group].scatter(b) for t in meta.loads for b in t.block_ids]
        else:
            staging = self.load_staging(n)
            sizes = [self.layouts[t.group].block_bytes for t in meta.loads for _ in t.block_ids]
            buffers = [staging[i, :size].numpy() for i, size in enumerate(sizes)]
        pending = None
        if not wait_running(self._kernel, self.settings.start_timeout):
            log.warning("ucm: load not submitted (the kernel has not started); recomputing")
        else:
            pending = self._submit_load(keys, buffers, meta.loads[0].req_id)
            if not pending.submitted:
                log.warning("ucm: load not submitted (%s); recomputing", pending.error)
        self.stats["load_blocks"] += n
        if staging is None:
            self._finish_direct_load(meta.loads, pending)
            return
        states = self.await_load(pending, direct=False)
        for t, first_row, good in self.account(meta.loads, states):
            if good:
                self.layouts[t.group].copy_in(t.block_ids[:good], staging, first_row=first_row)

    def _finish_direct_load(self, loads: list[BlockTransfer],
                            pending: PendingPages | None) -> None:
        """Waits for a load straight into the cache and counts it: its blocks are in place."""
        self.account(loads, self.await_load(pending, direct=True))

    def load_staging(self, rows: int) -> torch.Tensor:
        """The staging buffer loads land in before they are copied into the cache: reused,
        replaced by a larger one when it has fewer than `rows` rows."""
        assert self.layout is not None, "register_kv_caches first"
        staging = self._load_staging
        if staging is None or staging.shape[0] < rows:
            staging = self._load_staging = self._new_rows(rows)
        return staging

    def await_load(self, pending: PendingPages | None, *, direct: bool,
                    what: str = "load") -> tuple[LoadState, ...] | None:
        """Waits up to `load_timeout` for a Load; its states, or None when it failed. A load
        that times out is cancelled; a direct one is waited for until it has stopped writing
        into the cache, a staged one gives up its staging buffer."""
        t0 = time.perf_counter()
        states = None
        if pending is not None:
            pending.result(timeout=self.settings.load_timeout, wait_stopped=direct)
            if pending.error is None:
                states = pending.states
            elif pending.timed_out or isinstance(pending.error, TimeoutError):  # or a deadline
                self.stats["load_timeouts"] += 1
                if not direct:
                    self._load_staging = None  # a driver may still write into it
            elif pending.submitted:
                self.stats["load_failed_events"] += 1
                log.warning("ucm: %s failed (%s); recomputing", what, pending.error)
        self.stats["load_wait_ns"] += int((time.perf_counter() - t0) * 1e9)
        return states

    def account(self, transfers: list[BlockTransfer],
                 states: Sequence[LoadState | None] | None) -> list[tuple[BlockTransfer, int, int]]:
        """Counts a step's loads (states by row, None: the whole load failed) and marks each
        request's blocks from its first failed one on for recompute (prefix semantics).
        Returns (transfer, first row, rows loaded) per request."""
        assert self.layout is not None, "register_kv_caches first"
        ok_rows = []
        row = 0
        for t in transfers:
            n = len(t.block_ids)
            good = 0
            if states is not None:
                while good < n and states[row + good] is LoadState.OK:
                    good += 1
                for s in states[row + good:row + n]:
                    self.stats[f"load_{(s or LoadState.FAILED).name.lower()}"] += 1
                if self.events is not None:  # no tier holds these (a corrupt one is removed)
                    gone = [d for d, s in zip(t.digests, states[row:row + n], strict=True)
                            if s in (LoadState.MISSING, LoadState.CORRUPT)]
                    self.events.gone(gone, [t.group] * len(gone) if self.settings.hybrid
                                     else ())
            else:
                self.stats["load_failed"] += n
            if self.settings.hybrid:  # reported per request (vLLM takes no block ids then)
                self._recv_done.add(t.req_id)
                if good < n:
                    self._recv_failed.add(t.req_id)
            if good < n:
                if not self.settings.hybrid:
                    self._load_errors.update(t.block_ids[good:])
                self.stats["load_error_blocks"] += n - good
            self.stats["loaded_blocks"] += good
            self.stats["loaded_bytes"] += good * self.layouts[t.group].block_bytes
            ok_rows.append((t, row, good))
            row += n
        return ok_rows

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layerwise is not None:  # whole-block loads are in before start_load_kv returns
            self._layerwise.wait_layer(layer_name)

    def take_transfers(self) -> tuple[set[str], set[str]]:
        """The requests whose hybrid (asynchronous) loads ended since the last call, and those
        of them that failed (vLLM recomputes them whole)."""
        done, failed = self._recv_done, self._recv_failed
        self._recv_done, self._recv_failed = set(), set()
        return done, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._layerwise is not None:  # every layer waited for: nothing writes any more
            self._layerwise.finish()
            self._layerwise = None
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -----------------------------------------------------------------------------------
    def save_kv_layer(self, meta: UCMConnectorMetadata, layer_name: str) -> None:
        if not meta.saves or self.layout is None or not self.settings.stores:
            return
        t0 = time.perf_counter()
        try:
            self._snapshot_layer(meta, layer_name)
        finally:  # the step's time in saves (`save_ns`): the demo's per-turn breakdown
            self.stats["save_ns"] += int((time.perf_counter() - t0) * 1e9)

    def _snapshot_layer(self, meta: UCMConnectorMetadata, layer_name: str) -> None:
        assert self.layout is not None, "register_kv_caches first"  # save_kv_layer checked it
        if self._save_staging is None and not self._save_layers_done:
            self._begin_snapshot(meta)
        if self._save_staging is None or layer_name in self._save_layers_done:
            return
        for t, first_row in self._save_rows:
            self.layouts[t.group].copy_out(t.block_ids, self._save_staging, layer=layer_name,
                                           first_row=first_row)
        self._save_layers_done.add(layer_name)

    def _begin_snapshot(self, meta: UCMConnectorMetadata) -> None:
        assert self.layout is not None, "register_kv_caches first"
        n = sum(len(t.block_ids) for t in meta.saves)
        nbytes = n * self._row_bytes
        with self._lock:
            if self._store_bytes + nbytes > self.settings.max_store_bytes:
                self.stats["save_dropped_blocks"] += n
                self._save_layers_done.add("")  # marks this step as skipped
                return
            self._store_bytes += nbytes
        self._save_staging = self._take_snapshot_buffer(n)
        row = 0
        for t in meta.saves:
            self._save_rows.append((t, row))
            row += len(t.block_ids)

    def wait_for_save(self) -> None:
        if self._save_staging is None:
            self._save_rows, self._save_layers_done = [], set()
            return
        t0 = time.perf_counter()
        try:
            self._post_store()
        finally:
            self.stats["save_ns"] += int((time.perf_counter() - t0) * 1e9)

    def apply_sessions(self, ops: list[SessionOp]) -> list[Any]:
        """Holds, releases or prefetches this rank's keys of finished requests' session hints
        (`ucm.vllm_hook.sessions`); a kernel that is not running or refuses one is counted,
        never raised. Returns the kernel's completions (the step does not wait for them)."""
        kernel = self._kernel
        done: list[Any] = []
        if kernel is None or not kernel.running:
            self.stats["session_ops_dropped"] += len(ops)
            return done
        for op in ops:
            if self.settings.hybrid:  # each group's stored blocks (all, without the list)
                per_group = op.group_digests or [op.digests] * len(self.settings.groups)
                keys = [self._key(d, g) for g, ds in enumerate(per_group) for d in ds]
            else:
                keys = [self._key(d) for d in op.digests]
            if self.settings.layerwise and self.layout is not None:
                layers = len(self.layout.by_layer)
                keys = [layer_key(k, j) for k in keys for j in range(layers)]
            try:
                if op.end:
                    done.append(kernel.release(op.session))
                if op.retain_s is not None and keys:
                    done.append(kernel.hold(op.session, keys, op.retain_s))
                if op.prefetch and keys:
                    size = None if (self.settings.layerwise or self.layout is None
                                    or self.settings.hybrid) else self.layout.block_bytes
                    done.append(kernel.submit(Prefetch(keys, block_bytes=size,
                                                       request_id=op.session)))
            except UCMError as exc:
                self.stats["session_ops_dropped"] += 1
                log.debug("ucm: session %s: %s", op.session, exc)
                continue
            self.stats["session_ops"] += 1
        for completion in done:
            with self._lock:
                self._session_pending.add(completion)
            completion.add_done_callback(self._session_done)
        return done

    def _session_done(self, completion: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._session_pending.discard(completion)

    def wait_for_sessions(self, timeout: float | None = None) -> bool:
        """Blocks until the kernel work of every applied session op (holds, releases,
        prefetches) finished, failed or not; False if some did not in time (for tests and
        benches that replay requests one at a time)."""
        with self._lock:
            pending = list(self._session_pending)
        return not concurrent.futures.wait(pending, timeout).not_done

    def _post_store(self) -> None:
        staging, rows = self._save_staging, self._save_rows
        self._save_staging, self._save_rows, self._save_layers_done = None, [], set()
        if staging is None:
            return
        assert self.layout is not None, "register_kv_caches first"  # it made the staging
        self.layout.synchronize()
        keys = self._keys([t for t, _ in rows])
        sizes = [self.layouts[t.group].block_bytes for t, _ in rows for _ in t.digests]
        buffers = [staging[i, :size].numpy() for i, size in enumerate(sizes)]
        kinds = [(self._kind(t.group), t.group) for t, _ in rows for _ in t.digests]
        per_block = 1
        if self.settings.layerwise:  # each layer of each block: a block of its own
            spans = [self.layout.layer_span(name) for name in self.layout.by_layer]
            per_block = len(spans)
            keys = [layer_key(k, j) for k in keys for j in range(per_block)]
            buffers = [b[off:off + nbytes] for b in buffers for off, nbytes in spans]
        if not self._kernel.running:
            log.debug("ucm: store not submitted (the kernel has not started): a future miss")
            self._release(staging)
            return
        pending = self.pages.start_store(keys, buffers, request_id=rows[0][0].req_id)
        completion = pending.completion
        if completion is None:
            pending.result()  # counted
            log.debug("ucm: store not submitted (%s): a future miss", pending.error)
            self._release(staging)
            return
        with self._lock:
            self._stores[id(completion)] = (pending, staging, per_block,
                                            [d for t, _ in rows for d in t.digests],
                                            [(k, s, g) for (k, g), s
                                             in zip(kinds, sizes, strict=True)])
            self._stores_idle.clear()
        completion.add_done_callback(self._store_done)
        self.stats["save_blocks"] += len(keys) // per_block

    def _kind(self, group: int) -> str:
        """The kind of a group's layers, for the stored-bytes counters ("" for one group)."""
        return self.settings.groups[group].kind if self.settings.hybrid else ""

    def _store_done(self, completion: concurrent.futures.Future[Any]) -> None:
        # Runs on the kernel's trio thread (or here if already done): must not raise.
        try:
            with self._lock:
                entry = self._stores.pop(id(completion), None)
                if not self._stores:
                    self._stores_idle.set()
            if entry is None:
                return
            pending, staging, per_block, digests, kinds = entry
            self._release(staging)
            stored = pending.result()  # done: answers at once
            if pending.error is not None:
                self.stats["save_failed_events"] += 1
            else:
                whole = [all(stored[i:i + per_block]) for i in range(0, len(stored), per_block)]
                self.stats["saved_blocks"] += sum(whole)
                for ok, (kind, size, _) in zip(whole, kinds, strict=True):
                    if ok:  # bytes of the cache stored, by the layers' kind (hybrid groups)
                        self.stats["saved_bytes"] += size
                        if kind:
                            self.stats[f"saved_bytes.{kind}"] += size
                self.stats["save_failed_blocks"] += whole.count(False)
                if self.events is not None:  # only what is stored: never a failed block
                    done = [i for i, ok in enumerate(whole) if ok]
                    self.events.stored([digests[i] for i in done],
                                       [kinds[i][2] for i in done] if self.settings.hybrid
                                       else ())
        except Exception:  # pragma: no cover - never let the trio thread see an error
            log.exception("ucm: store callback failed")

    def _take_snapshot_buffer(self, n_blocks: int) -> torch.Tensor:
        """`n_blocks` rows of a spare snapshot buffer (the smallest that fits), else a new one.
        Reusing them matters: a fresh buffer costs page faults and zeroing on first touch,
        several times the copy itself (pinned allocations on a GPU host cost more still)."""
        with self._lock:  # (by position: list.remove would compare tensors elementwise)
            fits = [i for i, t in enumerate(self._spare) if t.shape[0] >= n_blocks]
            best = min(fits, key=lambda i: self._spare[i].shape[0]) if fits else None
            base = self._spare.pop(best) if best is not None else None
        if base is None:
            base = self._new_rows(n_blocks)
        view = base[:n_blocks]
        self._snapshot_bases[id(view)] = base
        return view

    def _release(self, staging: torch.Tensor) -> None:
        """A snapshot's store has ended: its bytes no longer count, its buffer is spare."""
        with self._lock:
            self._store_bytes -= staging.numel()
            base = self._snapshot_bases.pop(id(staging), None)
            if base is None:
                return
            self._spare.append(base)
            while sum(t.numel() for t in self._spare) > _SPARE_SNAPSHOT_BYTES:
                smallest = min(range(len(self._spare)), key=lambda i: self._spare[i].numel())
                del self._spare[smallest]

    def wait_for_stores(self, timeout: float | None = None) -> bool:
        """Blocks until every posted store finished (for shutdown and tests)."""
        return self._stores_idle.wait(timeout)

    # -- end -------------------------------------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        stats: dict[str, Any] = dict(self.stats)
        stats["namespace"] = self.settings.namespace
        if self._kernel is not None:
            try:
                stats["kernel"] = self._kernel.statistics()
            except UCMError:
                pass
        return stats

    def shutdown(self) -> None:
        if self._kernel is None:
            return
        self._drop_early()
        if not self.wait_for_stores(60.0):
            log.warning("ucm: stores still running at shutdown; closing the kernel anyway")
        assert self._shared is not None  # set with the kernel
        kernels.release(self._shared)
        try:
            self._kernel.close(timeout=30.0)
        except UCMError as exc:  # a driver that hangs even its close
            log.warning("ucm: kernel close: %s", exc)
        self._kernel = self._shared = None


def _plan(loads: list[BlockTransfer]) -> _Plan:
    """What identifies a step's loads: which blocks go where, for which requests."""
    return tuple((t.req_id, tuple(t.block_ids), tuple(t.digests)) for t in loads)
