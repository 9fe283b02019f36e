"""Lookup, load and store of whole pages through the kernel, for engine hooks whose calls must
never raise into the engine: every failure is a miss (or an unstored page), counted.

An engine hook names its pages with `ucm.engine.keys`, points at their bytes (a writable
buffer or a `Scatter` of pieces to load into, a contiguous buffer to store from) and calls
`PageIO`; it gets plain answers back (a prefix length, one bool per page) and never an
exception. Each event carries `timeout` as its kernel deadline; a call whose answer is still
missing after that (and a grace second) cancels its event and waits until it has stopped, since
the engine reuses the pages' memory right after.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ucm.block import Scatter
from ucm.drivers import LoadState
from ucm.errors import UCMError
from ucm.kernel import Kernel, Load, LoadResult, Lookup, Store, StoreResult

log = logging.getLogger("ucm.engine")

# Everything a kernel call can fail with that a hook turns into a miss: ucm's own errors, a
# timeout, a cancelled event, and the buffer errors of a page the engine described wrongly.
FAILURES: tuple[type[BaseException], ...] = (UCMError, TimeoutError,
                                             concurrent.futures.CancelledError, ValueError,
                                             TypeError, OSError)


class Counters:
    """Thread-safe named counts (an engine calls a hook from several threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def failure(self, op: str, exc: BaseException, pages: int, request_id: str | None) -> None:
        """Counts a failed call as `pages` misses and logs why (at debug: a miss is normal)."""
        with self._lock:
            self._counts[f"{op}_failures"] += 1
            self._counts[f"{op}_failed_pages"] += pages
        log.debug("ucm %s of %d pages failed (request %s), a miss: %s: %s", op, pages,
                  request_id, type(exc).__name__, exc)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class PageIO:
    """One engine's view of a kernel: pages in, plain answers out, failures counted."""

    def __init__(self, kernel: Kernel, *, timeout: float, counters: Counters | None = None,
                 ) -> None:
        self.kernel = kernel
        self.timeout = timeout
        self.counters = counters or Counters()

    def _wait(self, event: Lookup | Load | Store) -> Any:
        """The event's result within `timeout`; raises what the kernel raised, or TimeoutError
        after cancelling the event and waiting until it has stopped."""
        completion = self.kernel.submit(event)
        try:
            return completion.result(timeout=self.timeout + 1.0)
        except concurrent.futures.TimeoutError:
            completion.cancel()
            # A driver never abandons its threads: a cancelled event stops at its next page.
            concurrent.futures.wait([completion])
            raise TimeoutError(f"no answer within {self.timeout} s") from None

    def stored_prefix(self, keys: Sequence[bytes], *, request_id: str | None = None) -> int:
        """How many of `keys`, from the first, are stored (0 on any failure)."""
        if not keys:
            return 0
        self.counters.add("lookups")
        self.counters.add("lookup_pages", len(keys))
        try:
            result = self._wait(Lookup(tuple(keys), prefix=True, request_id=request_id,
                                       deadline=self.timeout))
            hits = int(result.prefix_len)
        except FAILURES as exc:
            self.counters.failure("lookup", exc, len(keys), request_id)
            return 0
        self.counters.add("lookup_hit_pages", hits)
        return hits

    def load(self, keys: Sequence[bytes], buffers: Sequence[memoryview | Scatter], *,
             request_id: str | None = None) -> list[bool]:
        """Reads each page into its buffer; True where the page arrived whole and verified."""
        if not keys:
            return []
        self.counters.add("loads")
        self.counters.add("load_pages", len(keys))
        try:
            result: LoadResult = self._wait(Load(tuple(keys), buffers=tuple(buffers),
                                                 request_id=request_id, deadline=self.timeout))
        except FAILURES as exc:
            self.counters.failure("load", exc, len(keys), request_id)
            return [False] * len(keys)
        ok = [state is LoadState.OK for state in result.states]
        for state in result.states:
            if state is not LoadState.OK:
                self.counters.add(f"load_{state.name.lower()}_pages")
        self.counters.add("loaded_pages", sum(ok))
        return ok

    def store(self, keys: Sequence[bytes], buffers: Sequence[Any], *,
              request_id: str | None = None) -> list[bool]:
        """Writes each buffer as a page; True where it reached the configured durability. The
        buffers must stay unchanged until this returns."""
        if not keys:
            return []
        self.counters.add("stores")
        self.counters.add("store_pages", len(keys))
        try:
            result: StoreResult = self._wait(Store(tuple(keys), buffers=tuple(buffers),
                                                   request_id=request_id, deadline=self.timeout))
        except FAILURES as exc:
            self.counters.failure("store", exc, len(keys), request_id)
            return [False] * len(keys)
        stored = [bool(s) for s in result.stored]
        self.counters.add("stored_pages", sum(stored))
        if not all(stored):  # refused page by page (a tier full or failing): not a call failure
            self.counters.add("store_failed_pages", len(stored) - sum(stored))
        return stored

    def statistics(self) -> dict[str, int]:
        """This engine's counters (the kernel's own are in `kernel.statistics()`)."""
        return self.counters.snapshot()
