"""The layerwise mode's loads (worker process): each layer of a block is a ucm block of its
own, and a step's loads go layer by layer, later layers loading while earlier ones compute.
vLLM waits for a layer in `wait_for_layer_load`, on entry to that attention layer."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ucm.drivers import LoadState
from ucm.engine.pages import PendingPages
from ucm.vllm_hook.keys import layer_key
from ucm.vllm_hook.metadata import BlockTransfer

if TYPE_CHECKING:
    import numpy as np

    from ucm.block import Scatter
    from ucm.engine.pages import PageIO
    from ucm.vllm_hook.layout import BlockLayout
    from ucm.vllm_hook.settings import HookSettings

log = logging.getLogger("ucm.vllm_hook")


class Host(Protocol):
    """What a LayerwiseLoad uses of the worker side that starts it (`WorkerSide`): its
    settings and page I/O, its reused staging buffer, and its wait for a load and count of a
    step's loads, so that a layerwise step is waited for and counted as a whole-block one."""

    @property
    def settings(self) -> HookSettings: ...
    @property
    def pages(self) -> PageIO: ...

    def load_staging(self, rows: int) -> torch.Tensor: ...

    def await_load(self, pending: PendingPages | None, *, direct: bool,
                   what: str = "load") -> tuple[LoadState, ...] | None: ...

    def account(self, transfers: list[BlockTransfer], states: Sequence[LoadState | None] | None,
                ) -> list[tuple[BlockTransfer, int, int]]: ...


class LayerwiseLoad:
    """One step's loads in the layerwise mode, where each layer of each block is a ucm block
    of its own (`layer_key`): checked on its own, so a layer can be used as soon as it is in.

    Layers load in forward order, two Load events in flight at a time (a finished one submits
    the next from its done callback): the first layer arrives as fast as one layer can, and
    the rest load while the layers before them compute. `wait_layer` (vLLM's
    wait_for_layer_load, on entry to each attention layer) waits for one layer; `finish`
    waits for every layer and says which blocks did not load whole."""

    WINDOW = 2

    def __init__(self, worker: Host, layout: BlockLayout, transfers: list[BlockTransfer],
                 keys: list[bytes]) -> None:
        self.worker, self.layout, self.transfers, self.keys = worker, layout, transfers, keys
        self.layers = list(layout.by_layer)
        self.index = {name: i for i, name in enumerate(self.layers)}
        self.block_ids = [b for t in transfers for b in t.block_ids]
        self.direct = worker.settings.direct_loads and layout.scatters
        self.staging: torch.Tensor | None = None
        if not self.direct:
            self.staging = worker.load_staging(len(keys))
        self._lock = threading.Lock()
        self._next = 0
        self._closed = False  # no more submissions (a layer gave up waiting to be submitted)
        self._submitted = [threading.Event() for _ in self.layers]
        self.pendings: list[PendingPages | None] = [None] * len(self.layers)
        self.states: list[tuple[LoadState, ...] | None] = [None] * len(self.layers)
        self._waited: set[int] = set()
        for _ in range(min(self.WINDOW, len(self.layers))):
            self._submit_next()

    def _submit_next(self) -> None:
        with self._lock:
            i = self._next
            if i >= len(self.layers) or self._closed:
                return
            self._next += 1
        name, layout = self.layers[i], self.layout
        pending = None
        try:
            keys = [layer_key(k, i) for k in self.keys]
            buffers: list[Scatter] | list[np.ndarray]
            if self.staging is None:
                buffers = [layout.scatter_layer(b, name) for b in self.block_ids]
            else:
                off, nbytes = layout.layer_span(name)
                buffers = [self.staging[r, off:off + nbytes].numpy()
                           for r in range(len(self.keys))]
            # numpy's stubs give ndarray the buffer protocol (__buffer__) only from Python 3.12
            pending = self.worker.pages.start_load(
                keys, buffers,  # type: ignore[arg-type]
                promote=self.worker.settings.promote_loads,
                request_id=self.transfers[0].req_id)
            if not pending.submitted:
                log.warning("ucm: load of layer %s not submitted (%s); recomputing", name,
                            pending.error)
        except Exception:  # it may run on the kernel's thread: never raise there
            log.exception("ucm: load of layer %s not submitted", name)
        self.pendings[i] = pending
        self._submitted[i].set()
        if pending is not None and pending.completion is not None:
            pending.completion.add_done_callback(self._done)

    def _done(self, _: concurrent.futures.Future[Any]) -> None:
        try:  # on the kernel's trio thread: must not raise
            self._submit_next()
        except Exception:  # pragma: no cover
            log.exception("ucm: layerwise load could not go on")

    def wait_layer(self, name: str) -> None:
        i = self.index.get(name)
        if i is not None and i not in self._waited:
            self._wait(i)

    def _wait(self, i: int) -> None:
        worker = self.worker
        if not self._submitted[i].wait(worker.settings.load_timeout):
            with self._lock:
                self._closed = True  # what is not submitted by now never will be
        pending = self.pendings[i] if self._submitted[i].is_set() else None
        states = worker.await_load(pending, direct=self.staging is None,
                                   what=f"load of layer {self.layers[i]}")
        self.states[i] = states
        self._waited.add(i)
        if self.staging is not None and states is not None:
            row = 0
            for t in self.transfers:
                n = len(t.block_ids)
                good = next((j for j in range(n) if states[row + j] is not LoadState.OK), n)
                if good:
                    self.layout.copy_in(t.block_ids[:good], self.staging,
                                          layer=self.layers[i], first_row=row)
                row += n

    def finish(self) -> None:
        """Waits for every layer, then counts the step's loads and marks the blocks that did
        not load whole (every layer) for recompute."""
        for i in range(len(self.layers)):
            if i not in self._waited:
                self._wait(i)
        rows: list[LoadState | None] = []
        for r in range(len(self.keys)):
            bad = next((s[r] if s is not None else None for s in self.states
                        if s is None or s[r] is not LoadState.OK), LoadState.OK)
            rows.append(bad)
        self.worker.account(self.transfers, rows)
