"""The kernel's path off the trio thread: events the fastest tier can serve at once, run on
the thread that submits them (and the driver's copy threads). One entry point, `submit`.

A Lookup whose every key the fastest tier's index holds (one that promotes nothing: whose
every key some tier's index holds) is answered on the caller's thread: its answer is the one
the trio thread would give without any I/O, and the two thread hand-offs
it saves are most of a lookup's cost. A Load of such keys whose blocks the tier's driver holds
in memory (`InMemoryLoads`: mapped block files, the shm arena) is copied by the driver's copy
threads and the waiting caller, and resolved by whichever finishes, which saves the trio
thread's wake-ups; blocks that do not load that way go through the trio thread as a Load of
their own, which tries the lower tiers and removes corrupt blocks. Everything else goes to the
trio thread. (Figures: docs/performance.md, Lookups answered from the index; Loads of in-memory
blocks off the trio thread.)

Counters and trace records come from `_accounting`, as on the trio thread. Blocks loaded here
count as used in their tier's eviction policy: the trio thread applies those marks
(`apply_touches`) before it starts its next event.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ucm.drivers import InMemoryLoads, LoadState, MemoryLoad
from ucm.errors import KernelError, UCMError
from ucm.kernel._accounting import count_load, count_lookup, load_op, lookup_result, trace_fields
from ucm.kernel._completion import Completion
from ucm.kernel._events import Event, Load, LoadResult, Lookup, LookupResult

if TYPE_CHECKING:
    from ucm.kernel._tier import Tier
    from ucm.trace import Tracer

log = logging.getLogger("ucm.kernel")

# Loads served here whose "used" marks wait for the trio thread; beyond this the oldest marks
# are dropped (the eviction order gets a little less exact; nothing else changes).
_TOUCH_BACKLOG = 4096


class FastPath:
    """The off-thread path of one `Kernel`, which hands it what it uses of the kernel: its
    tracer, `fastest_tier()` (tier 0 while events may be served off the trio thread, else
    None), `tiers()` (every tier, fastest first, while none is being detached, else none),
    `new_event_id()` (None once closing) and `to_trio(event)` (the event handed to the trio
    thread)."""

    def __init__(self, *, tracer: Tracer | None, fastest_tier: Callable[[], Tier | None],
                 new_event_id: Callable[[], int | None],
                 to_trio: Callable[[Event], Completion],
                 tiers: Callable[[], list[Tier]] = list) -> None:
        self._tracer = tracer
        self._fastest_tier = fastest_tier
        self._tiers = tiers
        self._new_event_id = new_event_id
        self._to_trio = to_trio
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()  # added to the core's in Kernel.statistics
        self._touched: deque[tuple[Tier, list[bytes], list[int]]] = deque(
            maxlen=_TOUCH_BACKLOG)

    def submit(self, event: Event) -> Completion | None:
        """A Completion for `event` served off the trio thread, or None: then the caller
        hands it to the trio thread."""
        if type(event) is Load:
            return self._load(event)
        if type(event) is Lookup and not event.pin:
            return self._lookup(event)
        return None

    # -- lookups ---------------------------------------------------------------------------------
    def _lookup(self, event: Lookup) -> Completion | None:
        """Resolved at once when the fastest tier's index holds every key, or, for a lookup
        that promotes nothing (`promote` False), when every key is in some tier's index (each
        named by the fastest that holds it, as the trio thread would). The index is a dict the
        trio thread updates; a membership test is atomic under the GIL, and a block evicted
        just after the probe is a load miss, as it is when eviction follows a lookup."""
        tier = self._fastest_tier()
        if tier is None:
            return None
        keys = event.keys
        tiers = [tier] if event.promote else self._tiers()
        if not tiers or tiers[0] is not tier:
            return None
        indexes = [(t.name, t.policy.index) for t in tiers]
        names: list[str] = []
        for key in keys:
            name = next((name for name, index in indexes if key in index), None)
            if name is None:
                return None
            names.append(name)
        event_id = self._new_event_id()
        if event_id is None:
            return None
        n = len(keys)
        hits = dict(Counter(names))
        with self._lock:
            self.counts["lookups_from_index"] += 1
            count_lookup(self.counts, n, hits)
        tracer = self._tracer
        if tracer is not None:  # the records the trio thread writes for a lookup
            tracer.emit("submit", event_id, trace_fields(event))
            tracer.emit("start", event_id, trace_fields(event, start=True))
            tracer.emit("result", event_id, lookup_result(n, hits, from_index=True))
            tracer.emit("done", event_id, {"outcome": "ok"})
        completion = Completion(event, event_id)
        completion._resolve(LookupResult((True,) * n, tuple(names)))
        return completion

    # -- loads -----------------------------------------------------------------------------------
    def _load(self, event: Load) -> Completion | None:
        """Started on the driver's copy threads when the fastest tier's index holds every key
        (none of them pinned: a load unpins, which is the trio thread's) and its driver holds
        every block in memory."""
        tier = self._fastest_tier()
        if tier is None or tier.in_memory is None:
            return None
        driver: InMemoryLoads = tier.in_memory
        policy, keys = tier.policy, event.keys
        index = policy.index
        for key in keys:
            if key not in index or policy.has_pins(key):
                return None
        prepared = driver.in_memory_load(list(keys), event.buffers)
        if prepared is None:
            return None
        event_id = self._new_event_id()
        if event_id is None:
            return None
        completion = _InMemoryLoad(event, event_id, driver, prepared)
        tracer = self._tracer
        if tracer is not None:
            tracer.emit("submit", event_id, trace_fields(event))
            tracer.emit("start", event_id, trace_fields(event, start=True))
        t0 = time.monotonic_ns()
        completion._set_cancel_hook(prepared.cancel)
        try:
            helped = driver.start_in_memory_load(
                prepared, lambda done: self._loaded(completion, tier, done, t0))
        except UCMError:  # the driver closed since in_memory_load
            helped = False
            self._load_rest(completion, [None] * len(keys), tier.name)
        if helped:
            with self._lock:
                self.counts["loads_from_memory_helped"] += 1
        else:
            completion._prepared = None
        return completion

    # Runs on the thread that finished the last block: must never raise.
    def _loaded(self, completion: _InMemoryLoad, tier: Tier, done: MemoryLoad,
                t0: int) -> None:
        try:
            event = completion.event
            n = len(event.keys)
            states: list[LoadState | None] | None = (
                done.outcome if done.error is None else [LoadState.FAILED] * n)
            if states is None:  # a driver bug: resolved as an internal error below
                raise KernelError("an in-memory load finished without its outcome")
            ok = [i for i, s in enumerate(states) if s is LoadState.OK]
            sizes = [done.views[i].nbytes for i in ok]
            with self._lock:
                self.counts["loads_from_memory"] += 1
                count_load(self.counts, [LoadState.OK] * len(ok), [tier.name] * len(ok), sizes)
            if ok:
                self._touched.append((tier, [event.keys[i] for i in ok], sizes))
            tracer = self._tracer
            if tracer is not None:
                tracer.emit("op", completion.event_id,
                            load_op(tier.name, n, t0, len(ok), sum(sizes), in_memory=True))
            if completion.cancel_requested:
                self._trace_done(completion, "cancelled")
                completion._finish_cancelled()
            elif len(ok) == n:
                self._trace_done(completion, "ok")
                completion._resolve(LoadResult((LoadState.OK,) * n, (tier.name,) * n))
            else:
                self._load_rest(completion, states, tier.name)
        except Exception as exc:  # pragma: no cover - an internal error: the caller must wake
            log.exception("in-memory load %d failed", completion.event_id)
            completion._resolve(exc=KernelError(f"internal error: {exc!r}"))

    def _load_rest(self, completion: _InMemoryLoad, states: list[LoadState | None],
                   tier_name: str) -> None:
        """Hands the blocks that did not load to the trio thread, as a Load of their own;
        `completion` resolves with both parts once that is done."""
        event = completion.event
        rest = [i for i, s in enumerate(states) if s is not LoadState.OK]
        follow = Load(tuple(event.keys[i] for i in rest),
                      buffers=tuple(event.buffers[i] for i in rest), promote=event.promote,
                      deadline=event.deadline, request_id=event.request_id)
        sub = self._to_trio(follow)
        completion._set_cancel_hook(sub.cancel)

        def merge(sub: concurrent.futures.Future[Any]) -> None:  # on the resolving thread
            if sub.cancelled():
                self._trace_done(completion, "cancelled")
                completion._finish_cancelled()
                return
            exc = sub.exception()
            if exc is not None:
                self._trace_done(completion, "error", kind=type(exc).__name__)
                completion._resolve(exc=exc)
                return
            result = sub.result()
            merged = [LoadState.OK] * len(states)  # the rest is overwritten below
            sources = [tier_name if s is LoadState.OK else None for s in states]
            for j, i in enumerate(rest):
                merged[i], sources[i] = result.states[j], result.tiers[j]
            self._trace_done(completion, "ok")
            completion._resolve(LoadResult(tuple(merged), tuple(sources), result.errors))

        sub.add_done_callback(merge)

    def _trace_done(self, completion: Completion, outcome: str, **fields: Any) -> None:
        tracer = self._tracer
        if tracer is not None:
            tracer.emit("done", completion.event_id, {"outcome": outcome, **fields})

    def apply_touches(self) -> None:
        """On the trio thread: blocks loaded here count as used in their tier's policy."""
        touched = self._touched
        while touched:
            tier, keys, sizes = touched.popleft()
            for j, (key, size) in enumerate(zip(keys, sizes, strict=True)):
                if key in tier:
                    tier.touch(key, first=j == 0)
                    tier.raw_sizes[key] = size

    @property
    def touches_pending(self) -> bool:
        return bool(self._touched)

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class _InMemoryLoad(Completion):
    """The handle of a Load run off the trio thread. Where the driver asks for help (the
    caller is bound to one CPU), a thread that waits on it (`result`, `exception`) first copies
    the blocks no copy thread has taken yet: it would only sleep otherwise."""

    def __init__(self, event: Load, event_id: int, driver: InMemoryLoads,
                 prepared: MemoryLoad) -> None:
        super().__init__(event, event_id)
        self._driver = driver
        self._prepared: MemoryLoad | None = prepared

    def result(self, timeout: float | None = None) -> Any:
        self._help()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._help()
        return super().exception(timeout)

    def _help(self) -> None:
        prepared = self._prepared
        if prepared is not None and not self.done():
            self._driver.help_load(prepared)
