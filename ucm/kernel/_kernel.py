"""The Kernel: a `KernelCore` hosted by `trio.run` in its own thread.

Host threads (a vLLM scheduler step, a worker's forward pass) call `submit(event)`, which never
blocks: it counts the event against the inbox bound, hands it to the trio thread with
`TrioToken.run_sync_soon`, and returns a `Completion`. A full inbox fails the handle at once
with KernelBusy, which callers treat as a cache miss.

Two kinds of event skip the trio thread. A Lookup whose every key the fastest tier's index
holds is answered on the caller's thread (`_lookup_from_index`): its answer is the one the trio
thread would give without any I/O, and the two thread hand-offs it saves are most of a lookup's
cost. A Load of such keys whose blocks the tier's driver holds in memory (mapped block files,
the shm arena) is copied by the driver's copy threads and the waiting caller, and resolved by
whichever finishes (`_load_in_memory`); blocks that do not load that way go through the trio
thread after all.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import trio

from ucm.config import TierConfig, UCMConfig, load_config
from ucm.drivers import LoadState
from ucm.errors import InvalidRequest, KernelBusy, KernelClosed, KernelError, UCMError
from ucm.kernel._completion import Completion
from ucm.kernel._core import KernelCore, _configured_tracer, trace_fields
from ucm.kernel._events import Load, LoadResult, Lookup, LookupResult, _Event
from ucm.kernel._tier import Tier

log = logging.getLogger("ucm.kernel")


class Kernel:
    """One per process. Starts lazily on the first `submit` (or `start()`), after any fork."""

    def __init__(self, config: UCMConfig | dict | str | os.PathLike | None = None, *,
                 tracer: Any = None, drain_timeout: float = 30.0) -> None:
        self.config = load_config(config)
        self.drain_timeout = drain_timeout
        if tracer is None:  # config.trace or UCM_TRACE; the core runs its writer task
            tracer = _configured_tracer(self.config)
        self._tracer = tracer
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._core: KernelCore | None = None
        self._events: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._pid: int | None = None
        self._ids = itertools.count(1)
        self._outstanding = 0  # submitted and not yet finished: the inbox bound
        self._queued = 0  # submitted and not yet started on the trio thread
        self._busy = 0
        # Counts of the events served off the trio thread (_lookup_from_index,
        # _load_in_memory), added to the core's in statistics().
        self._from_index: Counter[str] = Counter()
        # (tier, keys, sizes) of blocks loaded off the trio thread: the trio thread marks them
        # used in the tier's eviction policy before it starts its next event.
        self._touched: deque[tuple[Tier, list[bytes], list[int]]] = deque()
        self._closing = False
        self._start_error: BaseException | None = None
        self._ready = threading.Event()

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Opens every tier in the kernel thread. Raises what opening a driver raised. Safe to
        call from several threads: the others wait until the first start has finished."""
        with self._lock:
            if self._closing:
                raise KernelClosed("the kernel was closed")
            first = self._thread is None
            if first:
                self._ready = threading.Event()
                self._pid = os.getpid()
                self._thread = threading.Thread(target=trio.run, args=(self._main, self._ready),
                                                name="ucm-kernel", daemon=True)
                self._thread.start()
        self._check_process()
        self._ready.wait()
        if not first:
            if self._token is None:
                raise KernelClosed("the kernel failed to start")
            return
        if self._start_error is not None:
            self._thread.join()
            error, self._start_error = self._start_error, None
            with self._lock:
                self._thread = None
            raise error

    def _check_process(self) -> None:
        if self._pid != os.getpid():
            raise KernelError("this Kernel was started in another process; create one Kernel "
                              "per process, after fork")

    async def _main(self, ready: threading.Event) -> None:
        try:
            async with KernelCore.open(self.config, tracer=self._tracer,
                                       drain_timeout=self.drain_timeout) as core:
                with trio.move_on_after(float("inf")) as drain:
                    async with trio.open_nursery() as events:
                        self._core, self._events = core, events
                        self._stop = trio.Event()
                        self._token = trio.lowlevel.current_trio_token()
                        ready.set()
                        await self._stop.wait()
                        # Stop accepting; let in-flight events finish, up to drain_timeout.
                        drain.deadline = trio.current_time() + self.drain_timeout
                self._events = None
        except BaseException as exc:
            if not ready.is_set():
                self._start_error = exc
                ready.set()
                return
            log.exception("ucm kernel thread failed")
            raise

    def close(self, timeout: float | None = None) -> None:
        """Stops accepting events, lets in-flight ones finish (up to `drain_timeout`; the
        rest fail with KernelClosed), closes the drivers and joins the thread."""
        with self._lock:
            if self._closing:
                thread = self._thread
            else:
                self._closing = True
                thread = self._thread
                if thread is not None and self._token is not None:
                    try:
                        self._token.run_sync_soon(self._stop.set)
                    except trio.RunFinishedError:
                        pass
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise KernelError("the kernel thread did not stop in time")

    def __enter__(self) -> Kernel:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- submission ------------------------------------------------------------------------------
    def submit(self, event: _Event) -> Completion:
        """Hands an event to the kernel; never blocks once the kernel runs. The returned
        Completion resolves to the event's result or raises its error."""
        if not isinstance(event, _Event):
            raise InvalidRequest(f"submit takes a ucm event, not {type(event).__name__}")
        if self._token is None:
            self.start()
        kind = type(event)
        if kind is Lookup and not event.pin:
            completion = self._lookup_from_index(event)
            if completion is not None:
                return completion
        elif kind is Load:
            completion = self._load_in_memory(event)
            if completion is not None:
                return completion
        return self._submit(event, lambda core, eid: core.run(event, event_id=eid))

    def _fastest_tier(self) -> Tier | None:
        """Tier 0, for the events served off the trio thread; None while the kernel is not
        running, is closing, or tier 0 is being detached."""
        core = self._core
        if core is None or self._closing:
            return None
        tiers = core.tiers
        tier = tiers[0] if tiers else None
        return None if tier is None or tier.detaching else tier

    def _lookup_from_index(self, event: Lookup) -> Completion | None:
        """A resolved Completion when the fastest tier's index holds every key of `event`,
        else None (the event then goes to the trio thread).

        The trio thread would answer such a lookup from the same index, with no I/O and
        nothing to promote, so the answer is the same; what it saves are the two thread
        hand-offs, 0.1-0.2 ms each on the 2-vCPU test VMs once the other thread's CPU has gone
        idle (a 32-key lookup: 64 us back to back, 434 us after 20 ms of quiet; in vLLM a
        4K-token hit's get_num_new_matched_tokens took 0.55 ms, 0.21 ms with this). A miss,
        a hit in a lower tier (to promote) and a pinning lookup still go through the trio
        thread. The index is a dict the trio thread updates; a membership test is atomic
        under the GIL, and a block evicted just after the probe is a load miss, as it is when
        eviction follows an event's lookup."""
        tier = self._fastest_tier()
        if tier is None:
            return None
        index, keys = tier.policy.index, event.keys
        for key in keys:
            if key not in index:
                return None
        n = len(keys)
        with self._lock:
            self._check_process()
            if self._closing:
                return None
            event_id = next(self._ids)
            self._from_index["lookups_from_index"] += 1
            self._from_index["lookup_keys"] += n
            self._from_index[f"lookup_hits.{tier.name}"] += n
        tracer = self._tracer
        if tracer is not None:  # the records the trio thread writes for a lookup
            tracer.emit("submit", event_id, trace_fields(event))
            tracer.emit("start", event_id, trace_fields(event, start=True))
            tracer.emit("result", event_id, {"op": "lookup", "keys": n, "hits": {tier.name: n},
                                             "from_index": True})
            tracer.emit("done", event_id, {"outcome": "ok"})
        completion = Completion(event, event_id)
        completion._resolve(LookupResult((True,) * n, (tier.name,) * n))
        return completion

    def _load_in_memory(self, event: Load) -> Completion | None:
        """A Completion for `event` running off the trio thread, when the fastest tier's index
        holds every key (none of them pinned) and its driver has every block in memory; else
        None (the event then goes to the trio thread).

        The driver's copy threads take the blocks (one fewer than a trio load uses), a thread
        that waits on the handle copies too (`_InMemoryLoad`), and whichever finishes the last
        block resolves the handle. The trio thread would do the same copies: what this saves
        is its two wake-ups and the event's task set-up. 64 MiB of mapped posix blocks, loads
        of both kinds in turn in one process: 4.0-4.3 ms against 4.6-5.0 (medians) after
        20 ms of quiet, 3.4 against 3.7 ms after 2 ms; in vLLM a 4K-token hit's load wait
        went from 3.9-4.9 ms to 3.6 ms (posix) and 2.9 ms (shm). The blocks
        that did not load (missing, corrupt, failed) then go through the trio thread as a
        Load of their own, which tries the other tiers and removes corrupt blocks, and the
        handle resolves once that is done. A tier being detached, or a driver closing, waits
        for these loads as for the others (the driver's close waits for them)."""
        tier = self._fastest_tier()
        if tier is None:
            return None
        prepare = getattr(tier.driver, "in_memory_load", None)
        if prepare is None:
            return None
        policy, keys = tier.policy, event.keys
        index = policy.index
        for key in keys:
            if key not in index or policy.has_pins(key):  # a load unpins: the trio thread's
                return None
        spread = prepare(list(keys), event.buffers)
        if spread is None:
            return None
        with self._lock:
            self._check_process()
            if self._closing:
                return None
            event_id = next(self._ids)
        completion = _InMemoryLoad(event, event_id, tier.driver, spread)
        tracer = self._tracer
        if tracer is not None:
            tracer.emit("submit", event_id, trace_fields(event))
            tracer.emit("start", event_id, trace_fields(event, start=True))
        t0 = time.monotonic_ns()
        completion._set_cancel_hook(spread.cancel)
        try:
            helped = tier.driver.start_in_memory_load(
                spread, lambda done: self._in_memory_done(completion, tier, done, t0))
        except UCMError:  # the driver closed since `prepare`
            helped = False
            self._load_rest(completion, [None] * len(keys), tier.name)
        if helped:
            with self._lock:
                self._from_index["loads_from_memory_helped"] += 1
        else:
            completion._spread = None
        return completion

    # Runs on the thread that finished the last block: must never raise.
    def _in_memory_done(self, completion: _InMemoryLoad, tier: Tier, spread: Any,
                        t0: int) -> None:
        try:
            event = completion.event
            n = len(event.keys)
            states = spread.outcome if spread.error is None else [LoadState.FAILED] * n
            ok = [i for i, s in enumerate(states) if s is LoadState.OK]
            sizes = [spread.views[i].nbytes for i in ok]
            with self._lock:
                counts = self._from_index
                counts["loads_from_memory"] += 1
                counts["load_keys"] += len(ok)
                counts[f"load_hits.{tier.name}"] += len(ok)
                counts["bytes_loaded"] += sum(sizes)
            if ok:
                self._touched.append((tier, [event.keys[i] for i in ok], sizes))
            if self._tracer is not None:
                self._tracer.emit("op", completion.event_id, {
                    "tier": tier.name, "op": "load", "keys": n, "t0": t0, "hits": len(ok),
                    "bytes": sum(sizes), "in_memory": True})
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
        """Hands the blocks of an in-memory load that did not load to the trio thread, as a
        Load of their own; `completion` resolves with both parts once that is done."""
        event = completion.event
        rest = [i for i, s in enumerate(states) if s is not LoadState.OK]
        follow = Load(tuple(event.keys[i] for i in rest),
                      buffers=tuple(event.buffers[i] for i in rest),
                      deadline=event.deadline, request_id=event.request_id)
        sub = self._submit(follow, lambda core, eid: core.run(follow, event_id=eid))
        completion._set_cancel_hook(sub.cancel)

        def merge(sub: concurrent.futures.Future) -> None:  # on the resolving thread
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
            merged = [LoadState.OK if s is LoadState.OK else None for s in states]
            sources = [tier_name if s is LoadState.OK else None for s in states]
            for j, i in enumerate(rest):
                merged[i], sources[i] = result.states[j], result.tiers[j]
            self._trace_done(completion, "ok")
            completion._resolve(LoadResult(tuple(merged), tuple(sources), result.errors))

        sub.add_done_callback(merge)

    def _trace_done(self, completion: Completion, outcome: str, **fields: Any) -> None:
        if self._tracer is not None:
            self._tracer.emit("done", completion.event_id, {"outcome": outcome, **fields})

    def _mark_touched(self) -> None:
        """On the trio thread: blocks loaded off it count as used in their tier's policy."""
        touched = self._touched
        while touched:
            tier, keys, sizes = touched.popleft()
            for key, size in zip(keys, sizes, strict=True):
                if key in tier:
                    tier.policy.touch(key)
                    tier.raw_sizes[key] = size

    def attach(self, tier: TierConfig | dict, *, position: int | None = None) -> Completion:
        """Adds a tier to the running kernel; resolves to its name."""
        if self._token is None:
            self.start()
        return self._submit(None, lambda core, _: core.attach(tier, position=position))

    def detach(self, name: str) -> Completion:
        """Removes a tier once the events that use it have finished; loses none of them."""
        if self._token is None:
            self.start()
        return self._submit(None, lambda core, _: core.detach(name))

    def _submit(self, event: Any, work: Callable[[KernelCore, int], Any]) -> Completion:
        event_id = next(self._ids)
        completion = Completion(event, event_id)
        with self._lock:
            self._check_process()
            if self._closing:
                completion._resolve(exc=KernelClosed("the kernel is closed"))
                return completion
            if self._outstanding >= self.config.inbox_size:
                self._busy += 1
                completion._resolve(exc=KernelBusy(
                    f"inbox full ({self.config.inbox_size} events outstanding)"))
                return completion
            self._outstanding += 1
            self._queued += 1
        tracer = self._tracer
        if tracer is not None and event is not None:
            tracer.emit("submit", event_id, trace_fields(event))
        try:
            self._token.run_sync_soon(self._accept, completion, work)
        except trio.RunFinishedError:
            self._finished(started=False)
            completion._resolve(exc=KernelClosed("the kernel has stopped"))
        return completion

    def _finished(self, *, started: bool) -> None:
        with self._lock:
            self._outstanding -= 1
            if not started:
                self._queued -= 1

    # Runs on the trio thread: must never raise.
    def _accept(self, completion: Completion, work: Callable) -> None:
        if self._touched:
            self._mark_touched()
        events = self._events
        if events is None:
            self._finished(started=False)
            completion._resolve(exc=KernelClosed("the kernel is closing"))
            return
        events.start_soon(self._run, completion, work)

    async def _run(self, completion: Completion, work: Callable) -> None:
        with self._lock:
            self._queued -= 1
        try:
            with trio.CancelScope() as scope:
                token = self._token

                def cancel_soon() -> None:
                    try:
                        token.run_sync_soon(scope.cancel)
                    except trio.RunFinishedError:
                        pass

                completion._set_cancel_hook(cancel_soon)
                try:
                    result = await work(self._core, completion.event_id)
                except trio.Cancelled:
                    if not (scope.cancel_called and completion.cancel_requested):
                        completion._resolve(exc=KernelClosed(
                            "the kernel closed before the event finished"))
                    raise
                except UCMError as exc:
                    completion._resolve(exc=exc)
                except Exception as exc:
                    log.exception("internal error while handling event %d", completion.event_id)
                    completion._resolve(exc=KernelError(f"internal error: {exc!r}"))
                else:
                    completion._resolve(result)
            if scope.cancelled_caught:
                completion._finish_cancelled()
        finally:
            self._finished(started=True)

    # -- introspection ---------------------------------------------------------------------------
    @property
    def tracer(self) -> Any:
        """The tracer (None when tracing is off): the vLLM hook emits its own records into
        it, e.g. `tracer.emit("hook", 0, {"request_id": ..., "step": ...})`."""
        return self._tracer

    @property
    def running(self) -> bool:
        return self._token is not None and not self._closing

    def wait_indexed(self, timeout: float | None = None) -> bool:
        """Waits up to `timeout` s for the tiers' listings: the blocks a persistent tier already
        held when the kernel started are indexed (and the posix tier's mapped ahead), so that
        lookups and loads from then on run at full speed. True once they are; False on
        timeout, or when the kernel is not running."""
        core = self._core
        if core is None or not self.running:
            return False
        return core.indexed.wait(timeout)

    def statistics(self) -> dict[str, Any]:
        """Counters and per-tier occupancy (a snapshot taken on the kernel thread)."""
        with self._lock:
            base = {"inbox_queued": self._queued, "in_flight": self._outstanding - self._queued,
                    "busy_rejections": self._busy}
            from_index = dict(self._from_index)
        if self._token is None or self._core is None:
            return {**from_index, **base}
        try:
            snap = trio.from_thread.run_sync(self._core.snapshot, trio_token=self._token)
        except trio.RunFinishedError:
            return {**from_index, **base}
        for name, count in from_index.items():
            snap[name] = snap.get(name, 0) + count
        return {**snap, **base}

    def tier_names(self) -> list[str]:
        core = self._core
        return [t.name for t in core.tiers] if core is not None else []


class _InMemoryLoad(Completion):
    """The handle of a Load run off the trio thread (`Kernel._load_in_memory`). Where the
    driver asks for help (the caller is bound to one CPU), a thread that waits on it (`result`,
    `exception`) first copies the blocks no copy thread has taken yet: it would only sleep
    otherwise, and it saves a copy thread's wake-up at the start and its own at the end when it
    finishes last."""

    def __init__(self, event: Load, event_id: int, driver: Any, spread: Any) -> None:
        super().__init__(event, event_id)
        self._driver = driver
        self._spread = spread

    def result(self, timeout: float | None = None) -> Any:
        self._help()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._help()
        return super().exception(timeout)

    def _help(self) -> None:
        spread = self._spread
        if spread is not None and not self.done():
            self._driver.help_load(spread)
