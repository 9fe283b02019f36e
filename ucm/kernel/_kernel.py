"""The Kernel: a `KernelCore` hosted by `trio.run` in its own thread.

Host threads (a vLLM scheduler step, a worker's forward pass) call `submit(event)`, which never
blocks: it counts the event against the inbox bound, hands it to the trio thread with
`TrioToken.run_sync_soon`, and returns a `Completion`. A full inbox fails the handle at once
with KernelBusy, which callers treat as a cache miss.

Events the fastest tier can serve at once (lookups answered from its index, loads of blocks
its driver holds in memory) skip the trio thread: `_fastpath.FastPath`.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from ucm.codecs import KVLayout, KVLayouts
from ucm.config import TierConfig, UCMConfig, load_config
from ucm.errors import InvalidRequest, KernelBusy, KernelClosed, KernelError, UCMError
from ucm.kernel._accounting import trace_fields
from ucm.kernel._completion import Completion
from ucm.kernel._core import KernelCore, _configured_tracer
from ucm.kernel._events import Event, _check_keys, _Event
from ucm.kernel._fastpath import FastPath
from ucm.kernel._tier import Tier

if TYPE_CHECKING:
    from ucm.trace import Tracer

log = logging.getLogger("ucm.kernel")

_Work = Callable[[KernelCore, int], Awaitable[Any]]  # what the trio thread runs for an event


class Kernel:
    """One per process. Starts lazily on the first `submit` (or `start()`), after any fork."""

    def __init__(self, config: UCMConfig | dict[str, Any] | str | os.PathLike[str] | None = None,
                 *, tracer: Tracer | None = None, drain_timeout: float = 30.0,
                 layouts: Iterable[KVLayout] | None = None) -> None:
        self.config = load_config(config)
        self.drain_timeout = drain_timeout
        # the KV layouts of this namespace's blocks (an engine hook's): what its quantizing
        # tiers quantize with; two of one size are a ConfigError naming both
        self.layouts = KVLayouts(layouts or (), namespace=self.config.namespace) or None
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
        self._fast = FastPath(  # events served off the trio thread
            tracer=tracer, fastest_tier=self._fastest_tier, new_event_id=self._new_event_id,
            to_trio=self._submit_to_core, tiers=self._serving_tiers)
        self._closing = False
        self._start_error: BaseException | None = None
        self._ready = threading.Event()
        self._alive = False  # the trio run is up; the kernel thread clears it as it ends

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Opens every tier in the kernel thread. Raises what opening a driver raised. Safe to
        call from several threads: the others wait until the first start has finished."""
        with self._lock:
            if self._closing:
                raise KernelClosed("the kernel was closed")
            thread = self._thread
            first = thread is None
            if thread is None:
                self._ready = threading.Event()
                self._pid = os.getpid()
                thread = self._thread = threading.Thread(
                    target=self._thread_main, args=(self._ready,), name="ucm-kernel",
                    daemon=True)
                thread.start()
        self._check_process()
        self._ready.wait()
        if not first:
            if self._token is None:
                raise KernelClosed("the kernel failed to start")
            return
        if self._start_error is not None:
            thread.join()
            error, self._start_error = self._start_error, None
            with self._lock:
                self._thread = None
            raise error

    def _check_process(self) -> None:
        if self._pid != os.getpid():
            raise KernelError("this Kernel was started in another process; create one Kernel "
                              "per process, after fork")

    def _thread_main(self, ready: threading.Event) -> None:
        self._alive = True
        try:
            trio.run(self._main, ready)
        finally:
            self._alive = False  # a crashed or finished run: `running` turns False

    async def _main(self, ready: threading.Event) -> None:
        try:
            async with KernelCore.open(self.config, tracer=self._tracer,
                                       drain_timeout=self.drain_timeout,
                                       layouts=self.layouts) as core:
                with trio.move_on_after(float("inf")) as drain:
                    async with trio.open_nursery() as events:
                        self._core, self._events = core, events
                        stop = trio.Event()
                        with self._lock:  # close() either sees the token or we see it closing
                            self._stop = stop
                            self._token = trio.lowlevel.current_trio_token()
                            if self._closing:
                                stop.set()
                        ready.set()
                        await stop.wait()
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
                thread, token, stop = self._thread, self._token, self._stop
                if thread is not None and token is not None and stop is not None:
                    try:
                        token.run_sync_soon(stop.set)
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
    def submit(self, event: Event) -> Completion:
        """Hands an event to the kernel; never blocks once the kernel runs. The returned
        Completion resolves to the event's result or raises its error."""
        if not isinstance(event, _Event):
            raise InvalidRequest(f"submit takes a ucm event, not {type(event).__name__}")
        if self._token is None:
            self.start()
        completion = self._fast.submit(event)
        if completion is not None:
            return completion
        return self._submit_to_core(event)

    def _submit_to_core(self, event: Event) -> Completion:
        """Hands `event` to the trio thread."""
        return self._submit(event, lambda core, eid: core.run(event, event_id=eid))

    def _new_event_id(self) -> int | None:
        """An id for an event served off the trio thread; None once closing."""
        with self._lock:
            self._check_process()
            if self._closing:
                return None
            return next(self._ids)

    def _fastest_tier(self) -> Tier | None:
        """Tier 0, for the events served off the trio thread; None while the kernel is not
        running, is closing, or tier 0 is being detached."""
        core = self._core
        if core is None or self._closing or not self._alive:
            return None
        tiers = core.tiers
        tier = tiers[0] if tiers else None
        return None if tier is None or tier.detaching else tier

    def _serving_tiers(self) -> list[Tier]:
        """Every tier, fastest first, for lookups answered off the trio thread; none while
        one of them is being detached (the trio thread answers then)."""
        core = self._core
        if core is None or self._closing or not self._alive:
            return []
        tiers = list(core.tiers)
        return [] if any(t.detaching for t in tiers) else tiers

    def attach(self, tier: TierConfig | dict[str, Any], *, position: int | None = None,
               ) -> Completion:
        """Adds a tier to the running kernel; resolves to its name."""
        if self._token is None:
            self.start()
        return self._submit(None, lambda core, _: core.attach(tier, position=position))

    def detach(self, name: str) -> Completion:
        """Removes a tier once the events that use it have finished; loses none of them."""
        if self._token is None:
            self.start()
        return self._submit(None, lambda core, _: core.detach(name))

    # -- session holds -----------------------------------------------------------------------
    def hold(self, session: str, keys: Sequence[bytes], retain_s: float) -> Completion:
        """Keeps `keys` from eviction in the fastest tier for `retain_s` seconds, for
        `session` (within `sessions.max_pinned`); resolves to the keys the session holds."""
        if not isinstance(session, str) or not session or not retain_s > 0:
            raise InvalidRequest("a hold needs a session name and retain_s > 0")
        keys = list(_check_keys(keys))
        if self._token is None:
            self.start()
        return self._submit(None, lambda core, _: _sync(core.hold, session, keys, retain_s))

    def release(self, session: str) -> Completion:
        """Ends `session`'s hold; resolves to whether it held anything."""
        if self._token is None:
            self.start()
        return self._submit(None, lambda core, _: _sync(core.release, session))

    def _submit(self, event: Any, work: _Work) -> Completion:
        event_id = next(self._ids)
        completion = Completion(event, event_id)
        with self._lock:
            self._check_process()
            token = self._token  # set by start(), which every caller has run
            if self._closing or token is None:
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
            token.run_sync_soon(self._accept, completion, work)
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
    def _accept(self, completion: Completion, work: _Work) -> None:
        if self._fast.touches_pending:
            self._fast.apply_touches()
        events = self._events
        if events is None:
            self._finished(started=False)
            completion._resolve(exc=KernelClosed("the kernel is closing"))
            return
        events.start_soon(self._run, completion, work)

    async def _run(self, completion: Completion, work: _Work) -> None:
        with self._lock:
            self._queued -= 1
        try:
            core, token = self._core, self._token
            assert core is not None and token is not None  # set before events are accepted
            with trio.CancelScope() as scope:

                def cancel_soon() -> None:
                    try:
                        token.run_sync_soon(scope.cancel)
                    except trio.RunFinishedError:
                        pass

                completion._set_cancel_hook(cancel_soon)
                try:
                    result = await work(core, completion.event_id)
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
    def tracer(self) -> Tracer | None:
        """The tracer (None when tracing is off): the vLLM hook emits its own records into
        it, e.g. `tracer.emit("hook", 0, {"request_id": ..., "step": ...})`."""
        return self._tracer

    @property
    def running(self) -> bool:
        """True while the kernel thread serves events: started, not closing, not ended."""
        return self._token is not None and not self._closing and self._alive

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
        if self._tracer is not None:  # trace_write_errors, trace_disabled, ...
            base.update(self._tracer.statistics())
        from_index = self._fast.statistics()
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


async def _sync(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs a plain call of the core's on the trio thread, as the events' work runs."""
    return fn(*args)
