"""BlockFetcher: turns each step's block set into the kernel's Prefetch and Load events.

Runs on the worker's host thread. It never blocks in `fetch`: `submit` is the kernel's
non-blocking `Kernel.submit`, and it returns a future-like handle. The fetcher keeps its own
view of which blocks are resident, so it loads only the blocks that changed since the previous
step and prefetches only blocks that are neither resident nor already announced. A load whose
per-key state is not OK leaves that block non-resident, so the next step asks for it again
(vLLM recomputes what it cannot load).

Events are built as `Load(keys=[...], buffers=[...])` and `Prefetch(keys=[...])` from
`ucm.kernel`, imported when the first event is built; tests inject stand-ins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

Submit = Callable[[Any], Any]


def _kernel_events() -> tuple[Callable[..., Any], Callable[..., Any]]:
    from ucm.kernel import Load, Prefetch

    return Load, Prefetch


@dataclass
class FetchStats:
    loads: int = 0  # Load events submitted
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    prefetches: int = 0  # Prefetch events submitted
    blocks_prefetched: int = 0
    failed: int = 0  # blocks whose load state was not OK


@dataclass
class PendingLoad:
    """A submitted Load: the kernel's handle and the block ids in key order."""

    handle: Any
    blocks: list[int]


class BlockFetcher:
    """Loads the blocks a step needs and prefetches predicted ones, through `submit`."""

    def __init__(
        self,
        submit: Submit,
        key_of: Callable[[int], bytes],
        buffer_of: Callable[[int], memoryview],
        *,
        load_event: Callable[..., Any] | None = None,
        prefetch_event: Callable[..., Any] | None = None,
    ) -> None:
        self._submit = submit
        self._key_of = key_of
        self._buffer_of = buffer_of
        self._load_event = load_event
        self._prefetch_event = prefetch_event
        self._resident: set[int] = set()
        self._announced: set[int] = set()
        self.stats = FetchStats()

    @property
    def resident(self) -> frozenset[int]:
        return frozenset(self._resident)

    def _events(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        if self._load_event is None or self._prefetch_event is None:
            load, prefetch = _kernel_events()
            self._load_event = self._load_event or load
            self._prefetch_event = self._prefetch_event or prefetch
        return self._load_event, self._prefetch_event

    def mark_resident(self, blocks: Iterable[int]) -> None:
        """Blocks that are already in the cache without a load (computed on the device)."""
        self._resident.update(blocks)

    def prefetch(self, blocks: Iterable[int]) -> Any | None:
        """Announce blocks that will be needed soon; returns the handle, or None if none new."""
        new = sorted(set(blocks) - self._resident - self._announced)
        if not new:
            return None
        _, prefetch_event = self._events()
        handle = self._submit(prefetch_event(keys=[self._key_of(b) for b in new]))
        self._announced.update(new)
        self.stats.prefetches += 1
        self.stats.blocks_prefetched += len(new)
        return handle

    def fetch(self, selected: Iterable[int], prefetch: Iterable[int] = ()) -> PendingLoad | None:
        """Make `selected` the resident set: Load what is missing, drop the rest, then
        Prefetch `prefetch`. Returns the pending load, or None when nothing changed."""
        wanted = set(selected)
        missing = sorted(wanted - self._resident)
        self._resident &= wanted
        pending = None
        if missing:
            load_event, _ = self._events()
            buffers = [self._buffer_of(b) for b in missing]
            handle = self._submit(
                load_event(keys=[self._key_of(b) for b in missing], buffers=buffers)
            )
            self._resident.update(missing)
            self._announced.difference_update(missing)
            self.stats.loads += 1
            self.stats.blocks_loaded += len(missing)
            self.stats.bytes_loaded += sum(memoryview(buf).nbytes for buf in buffers)
            pending = PendingLoad(handle, missing)
        self.prefetch(prefetch)
        return pending

    def complete(self, pending: PendingLoad, timeout: float | None = None) -> list[int]:
        """Wait for a load; returns the blocks that did not load (they become non-resident).

        A handle that fails with KernelError (KernelBusy, KernelClosed), DeadlineExceeded or
        DriverError is a miss of every block in it, as the design asks; InvalidRequest and
        any other exception propagate."""
        from ucm.drivers import LoadState
        from ucm.errors import DeadlineExceeded, DriverError, KernelError

        try:
            states = pending.handle.result(timeout=timeout).states
        except (KernelError, DeadlineExceeded, DriverError):
            states = [LoadState.FAILED] * len(pending.blocks)
        pairs = zip(pending.blocks, states, strict=True)
        failed = [block for block, state in pairs if state != LoadState.OK]
        self._resident.difference_update(failed)
        self.stats.failed += len(failed)
        return failed
