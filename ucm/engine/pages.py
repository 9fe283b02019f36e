"""Lookup, load and store of whole pages through the kernel, for engine hooks whose calls must
never raise into the engine: every failure is a miss (or an unstored page), counted.

An engine hook names its pages with `ucm.engine.keys`, points at their bytes (a writable
buffer or a `Scatter` of pieces to load into, a buffer or a `Scatter` to store from) and calls
`PageIO`; it gets plain answers back (a prefix length, one bool per page) and never an
exception. `start_lookup` / `start_load` / `start_store` return at once with a `PendingPages`
(a hook that polls across engine steps, like vLLM's); `stored_prefix` / `load` / `store` are
the same calls waited for. A call whose answer is still missing after its wait (by default
`timeout` and a grace second) cancels its event and, unless told otherwise, waits until it has
stopped, since the engine reuses the pages' memory right after.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ucm.block import Scatter
from ucm.drivers import LoadState
from ucm.errors import UCMError
from ucm.kernel import Load, LoadResult, Lookup, LookupResult, Store, StoreResult

if TYPE_CHECKING:  # collections.abc.Buffer is new in Python 3.12; annotations only
    from typing_extensions import Buffer

log = logging.getLogger("ucm.engine")

# Everything a kernel call can fail with that a hook turns into a miss: ucm's own errors, a
# timeout, a cancelled event, and the buffer errors of a page the engine described wrongly.
FAILURES: tuple[type[BaseException], ...] = (UCMError, TimeoutError,
                                             concurrent.futures.CancelledError, ValueError,
                                             TypeError, OSError)

# `deadline=` left out: the PageIO's own (a sentinel, since None means "no kernel deadline").
DEFAULT: Any = object()


class Counters:
    """Thread-safe named counts (an engine calls a hook from several threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def add_all(self, counts: dict[str, int]) -> None:
        """Several counts under one lock (a call's counts on the hot path)."""
        with self._lock:
            self._counts.update(counts)

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


class PendingPages:
    """A lookup, load or store in flight. `result()` gives the plain answer (a prefix length
    for a lookup, one bool per page for a load or a store) and never raises; a failure (at
    submission, in the kernel, or no answer within the wait) is counted once, when the result
    is first taken, and `error` says what it was. `completion` is the kernel's handle (None
    when the call failed before reaching the kernel), for callers that need its callbacks."""

    __slots__ = ("_answer", "_io", "_lock", "_taken", "completion", "error", "op", "pages",
                 "request_id", "started", "timed_out", "value")

    def __init__(self, io: PageIO, op: str, pages: int, request_id: str | None,
                 completion: concurrent.futures.Future[Any] | None,
                 error: BaseException | None = None) -> None:
        self._io, self.op, self.pages, self.request_id = io, op, pages, request_id
        self.completion, self.error = completion, error
        self.started = time.monotonic()
        self.timed_out = False  # no answer within the caller's wait (the event was cancelled)
        self.value: LookupResult | LoadResult | StoreResult | None = None  # the kernel's answer
        self._taken = False
        self._answer: Any = None
        self._lock = threading.Lock()

    @property
    def submitted(self) -> bool:
        """Whether the event reached the kernel."""
        return self.completion is not None

    def done(self) -> bool:
        """Whether `result()` would answer without waiting."""
        return self.completion is None or self.completion.done()

    def wait(self, timeout: float | None) -> bool:
        """Whether it is done within `timeout` s; counts nothing (poll again later)."""
        if self.completion is None or self.completion.done():
            return True
        try:
            self.completion.exception(timeout=timeout)
        except concurrent.futures.CancelledError:
            return True
        except TimeoutError:
            return False
        return True

    def cancel(self) -> bool:
        """Asks the kernel to stop the event; wait with `stop` or `result` for it to have."""
        return self.completion.cancel() if self.completion is not None else False

    def stop(self, grace: float = 1.0) -> None:
        """Cancels the event and waits until it has stopped writing into the pages' memory:
        drivers never abandon their threads, so a cancelled event stops at its next page and
        the wait is short unless a disk hangs; then it is the only safe choice."""
        completion = self.completion
        if completion is None:
            return
        completion.cancel()
        done, _ = concurrent.futures.wait([completion], timeout=grace)
        if not done:
            log.error("ucm: a cancelled %s of %d pages has not stopped after %.0f s; waiting "
                      "for it, since its pages' memory must not be reused before", self.op,
                      self.pages, grace)
            concurrent.futures.wait([completion])

    def result(self, timeout: Any = DEFAULT, *, wait_stopped: bool = True) -> Any:
        """The plain answer, waiting up to `timeout` s (by default the PageIO's timeout and a
        grace second; None: as long as it takes). Past it the event is cancelled, a miss, and
        with `wait_stopped` waited for until it has stopped."""
        if self._taken:
            return self._answer
        completion = self.completion
        value = None
        if completion is not None and self.error is None:
            if timeout is DEFAULT:
                timeout = None if self._io.timeout is None else self._io.timeout + 1.0
            try:
                value = completion.result(timeout=timeout)
            except FAILURES:
                if completion.done():  # the event's own outcome (it may have just finished)
                    value, self.error = _outcome(completion)
                else:  # our wait ran out
                    self.timed_out = True
                    self.error = TimeoutError(f"no answer within {timeout} s")
                    if wait_stopped:
                        self.stop(max(1.0, timeout or 0.0))
                    else:
                        completion.cancel()
        with self._lock:  # counted once, however many threads take it
            if self._taken:
                return self._answer
            self._answer = self._io._answer(self, value)
            self._taken = True
        return self._answer

    @property
    def hits(self) -> tuple[bool, ...]:
        """A lookup's hit per key (every key a miss on failure); take `result()` first."""
        hits = self.value.hits if isinstance(self.value, LookupResult) else ()
        return tuple(hits) + (False,) * (self.pages - len(hits))

    @property
    def states(self) -> tuple[LoadState, ...] | None:
        """A load's state per page, None when the whole load failed; take `result()` first."""
        return self.value.states if isinstance(self.value, LoadResult) else None


class PageIO:
    """One engine's view of a kernel: pages in, plain answers out, failures counted.

    `timeout`: how long a blocking call waits (and `result()` by default, with a grace
    second); `deadline`: the kernel deadline each event carries (by default `timeout`; None:
    none, as vLLM's hook posts its events, waiting on its own terms)."""

    def __init__(self, kernel: Any, *, timeout: float | None,
                 deadline: float | None = DEFAULT, counters: Counters | None = None) -> None:
        self.kernel = kernel
        self.timeout = timeout
        self.deadline = timeout if deadline is DEFAULT else deadline
        self.counters = counters or Counters()

    def _start(self, op: str, make: Any, keys: Sequence[bytes], request_id: str | None,
               ) -> PendingPages:
        self.counters.add_all({f"{op}s": 1, f"{op}_pages": len(keys)})
        try:
            completion = self.kernel.submit(make())
        except FAILURES as exc:
            return PendingPages(self, op, len(keys), request_id, None, exc)
        return PendingPages(self, op, len(keys), request_id, completion)

    def _deadline(self, deadline: Any) -> float | None:
        return self.deadline if deadline is DEFAULT else deadline

    def start_lookup(self, keys: Sequence[bytes], *, prefix: bool = True, promote: bool = True,
                     request_id: str | None = None, deadline: Any = DEFAULT) -> PendingPages:
        """Starts looking up `keys`; its result is how many of them, from the first, are stored
        (its `hits`, each key's; with `prefix` the kernel stops at the first miss). `promote`
        False: hits in slower tiers stay where they are (a Load that follows promotes them)."""
        if not keys:
            return _nothing(self, "lookup", 0)
        return self._start("lookup", lambda: Lookup(
            tuple(keys), prefix=prefix, promote=promote, request_id=request_id,
            deadline=self._deadline(deadline)), keys, request_id)

    def start_load(self, keys: Sequence[bytes], buffers: Sequence[Buffer | Scatter], *,
                   promote: bool = True, request_id: str | None = None,
                   deadline: Any = DEFAULT) -> PendingPages:
        """Starts reading each page into its buffer; its result is True per page that arrived
        whole and verified (its `states`, each page's LoadState). `promote` False: pages read
        from slower tiers are not copied upwards afterwards."""
        if not keys:
            return _nothing(self, "load", [])
        return self._start("load", lambda: Load(
            tuple(keys), buffers=tuple(buffers), promote=promote, request_id=request_id,
            deadline=self._deadline(deadline)), keys, request_id)

    def start_store(self, keys: Sequence[bytes], buffers: Sequence[Any], *,
                    request_id: str | None = None, deadline: Any = DEFAULT) -> PendingPages:
        """Starts writing each buffer as a page; its result is True per page that reached the
        configured durability. The buffers must stay unchanged until it is done."""
        if not keys:
            return _nothing(self, "store", [])
        return self._start("store", lambda: Store(
            tuple(keys), buffers=tuple(buffers), request_id=request_id,
            deadline=self._deadline(deadline)), keys, request_id)

    def _answer(self, pending: PendingPages, value: Any) -> Any:
        """Counts a call's outcome (once) and turns it into its plain answer."""
        op, n = pending.op, pending.pages
        if pending.error is not None or value is None:
            self.counters.failure(op, pending.error or RuntimeError("no answer"), n,
                                  pending.request_id)
            return 0 if op == "lookup" else [False] * n
        pending.value = value
        if op == "lookup":
            hits = int(value.prefix_len)
            self.counters.add("lookup_hit_pages", hits)
            return hits
        if op == "load":
            ok = [state is LoadState.OK for state in value.states]
            counts = {"loaded_pages": sum(ok)}
            if counts["loaded_pages"] < n:
                for state in value.states:
                    if state is not LoadState.OK:
                        name = f"load_{state.name.lower()}_pages"
                        counts[name] = counts.get(name, 0) + 1
            self.counters.add_all(counts)
            return ok
        stored = [bool(s) for s in value.stored]
        counts = {"stored_pages": sum(stored)}
        if counts["stored_pages"] < n:  # refused page by page (a tier full or failing)
            counts["store_failed_pages"] = n - counts["stored_pages"]
        self.counters.add_all(counts)
        return stored

    # -- the same calls, waited for ------------------------------------------------------------
    def stored_prefix(self, keys: Sequence[bytes], *, request_id: str | None = None) -> int:
        """How many of `keys`, from the first, are stored (0 on any failure)."""
        return int(self.start_lookup(keys, request_id=request_id).result())

    def load(self, keys: Sequence[bytes], buffers: Sequence[Buffer | Scatter], *,
             request_id: str | None = None) -> list[bool]:
        """Reads each page into its buffer; True where the page arrived whole and verified."""
        return list(self.start_load(keys, buffers, request_id=request_id).result())

    def store(self, keys: Sequence[bytes], buffers: Sequence[Any], *,
              request_id: str | None = None) -> list[bool]:
        """Writes each buffer as a page; True where it reached the configured durability. The
        buffers must stay unchanged until this returns."""
        return list(self.start_store(keys, buffers, request_id=request_id).result())

    def statistics(self) -> dict[str, int]:
        """This engine's counters (the kernel's own are in `kernel.statistics()`)."""
        return self.counters.snapshot()


def _nothing(io: PageIO, op: str, answer: Any) -> PendingPages:
    """A call on no pages: done, answered, nothing counted."""
    pending = PendingPages(io, op, 0, None, None)
    pending._answer, pending._taken = answer, True
    return pending


def _outcome(completion: concurrent.futures.Future[Any]) -> tuple[Any, BaseException | None]:
    """A finished event's result, or its error."""
    if completion.cancelled():
        return None, concurrent.futures.CancelledError()
    exc = completion.exception()
    return (None, exc) if exc is not None else (completion.result(), None)
