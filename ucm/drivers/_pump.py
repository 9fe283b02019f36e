"""Copy threads for loads: `Pump` (one per `kit.Workers`, shared by the drivers of a kernel)
and `Spread` (one batch's blocks, handed out to them in runs).

A batch's blocks are handed out in runs of about 2 MiB to up to PARALLEL copy threads, which
take runs until none are left (a caller that waits for the batch may take runs too: `help`):
a thread slowed down by another process on its core leaves the rest to the other one, where a
fixed split into one part per thread waits for the slower part. The thread that finishes the
last run wakes the waiting task: one trip back into trio per batch.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from ucm.block import Scatter


def chunks(views: Sequence[memoryview | Scatter], limit: int) -> list[slice]:
    """Contiguous parts of at most `limit` bytes (or one block, when a block is larger)."""
    parts, start, acc = [], 0, 0
    for i, view in enumerate(views):
        if acc and acc + view.nbytes > limit:
            parts.append(slice(start, i))
            start, acc = i, 0
        acc += view.nbytes
    parts.append(slice(start, len(views)))
    return parts


GRAB_BYTES = 2 * 2**20  # a thread takes a run of blocks of at most this many bytes (or one)
WIDE_BLOCK_BYTES = 256 * 2**10  # blocks at least this large (on average) use PARALLEL threads


class Pump:
    """Copy threads: up to `limit` threads of its own take runs from the batches waiting here,
    oldest batch first. One per `kit.Workers`, shared by every driver it serves.

    Batches in flight at once are served in turn rather than side by side, so the first one
    finishes while the next is copied: its trips back into trio and out to its caller overlap
    the next batch's copying instead of leaving the cores idle. A thread keeps taking runs while
    any are left, so a busy pump wakes no threads at all.

    With `pin`, each thread is bound to a CPU of its own for its whole life (the last `limit`
    CPUs the process may use), so Linux wakes it there: unbound, it often woke on the core of
    the thread that woke it and waited there for the scheduler to move it (figures:
    docs/performance.md, "Copy threads"). Threads start on first use and stop at `close`."""

    def __init__(self, limit: int, *, pin: bool = True) -> None:
        self._lock = threading.Lock()
        self._queue: deque[Spread] = deque()
        self._limit = limit
        self._cpus = _pin_cpus(limit) if pin else []
        self._wakes = [threading.Semaphore(0) for _ in range(limit)]
        self._threads: list[threading.Thread | None] = [None] * limit
        self._busy = [False] * limit  # which threads are taking runs (or woken to)
        self._closed = False

    def submit(self, spread: Spread, threads: int, *, avoid_cpu: int = -1) -> None:
        """Queues `spread` and wakes threads for it, up to `threads` taking runs in all; those
        bound to `avoid_cpu` (where a helping caller runs) only when no other is free."""
        wake = []
        with self._lock:
            if self._closed:
                raise RuntimeError("the pump is closed")
            self._queue.append(spread)
            want = min(threads, self._limit) - sum(self._busy)
            if want > 0:
                free = [i for i, busy in enumerate(self._busy) if not busy]
                if self._cpus:
                    free.sort(key=lambda i: self._cpus[i] == avoid_cpu)
                wake = free[:want]
                for i in wake:
                    self._busy[i] = True
        for i in wake:
            if self._threads[i] is None:
                thread = threading.Thread(target=self._serve, args=(i,), daemon=True,
                                          name=f"ucm-copy-{i}")
                self._threads[i] = thread
                thread.start()
            self._wakes[i].release()

    def close(self, timeout: float = 5.0) -> None:
        """Stops the threads and joins them (they finish the runs they took first); blocks
        for as long as that takes, up to `timeout` per thread."""
        with self._lock:
            self._closed = True
        for wake in self._wakes:
            wake.release()
        for thread in self._threads:
            if thread is not None:
                thread.join(timeout)

    @property
    def started(self) -> bool:
        """Whether any thread was started (and `close` has threads to join)."""
        return any(t is not None for t in self._threads)

    def helper_cpu(self) -> int:
        """The CPU the calling thread is bound to, if it may help (`help`) on a CPU other than
        the copy threads' first one; else -1. A copy thread never helps: it submits the next
        layer's load from the last one's callback, say, and will not wait for it."""
        if not self._cpus or getattr(_copy_thread, "pump", None) is not None:
            return -1
        cpu = bound_cpu()
        return cpu if cpu >= 0 and any(c != cpu for c in self._cpus) else -1

    def _serve(self, slot: int) -> None:
        _copy_thread.pump = self
        if self._cpus:
            _pin(self._cpus[slot])
        wake = self._wakes[slot]
        while True:
            wake.acquire()
            if self._closed:
                return
            self._take_runs(slot)

    def _take_runs(self, slot: int) -> None:
        lock, queue = self._lock, self._queue
        while True:
            with lock:
                while queue and queue[0].next >= len(queue[0].runs):
                    queue.popleft()  # every run taken (some may still be running)
                if not queue:
                    self._busy[slot] = False
                    return
                spread = queue[0]
                run = spread.runs[spread.next]
                spread.next += 1
                spread.taken += 1
            self._run(spread, run)

    def help(self, spread: Spread) -> None:
        """Takes runs of `spread` on the calling thread until none are left: a caller that
        would only wait for the batch copies part of it instead, and saves a thread's wake-up
        at the start and, when it finishes the last run, its own at the end."""
        lock = self._lock
        while True:
            with lock:
                if spread.next >= len(spread.runs):
                    return
                run = spread.runs[spread.next]
                spread.next += 1
                spread.taken += 1
            self._run(spread, run)

    def _run(self, spread: Spread, run: slice) -> None:
        spread.run_blocks(run)
        with self._lock:
            spread.taken -= 1
            last = spread.next >= len(spread.runs) and not spread.taken
        if last:  # the thread that finished the batch's last run
            spread.finish()


class Spread:
    """fn(keys[i], views[i]) for every i, in runs taken by the driver's Pump threads.

    A run is one 2 MiB block, or eight of 256 KiB (fewer lock round trips, less trading of
    the GIL). The thread that finishes the last run calls `then` (if any) and wakes the
    waiting task: one wake-up back into trio, however many threads shared the work. A large
    block is nearly all memcpy + xxh3 (both release the GIL), so two threads overlap one
    block's copy with another's checksum."""

    # `fn` takes a view or, for a driver with ScatterLoads, a Scatter.
    def __init__(self, fn: Callable[[bytes, Any], Any], keys: list[bytes],
                 views: Sequence[memoryview | Scatter],
                 then: Callable[[Spread], Any] | None = None) -> None:
        self.keys, self.views = keys, views
        self._fn, self._then = fn, then
        self.runs = chunks(views, GRAB_BYTES)
        self.next = 0  # the next run to take; `next` and `taken` are guarded by the pump lock
        self.taken = 0  # runs being copied now
        self._wake: Callable[[], None] = lambda: None
        self.results: list[Any] = [None] * len(keys)
        self.errors: list[BaseException | None] = [None] * len(keys)
        self.outcome: Any = None  # what `then` returned
        self.error: BaseException | None = None  # what `then` raised
        self.cancelled = False  # set by a canceller: blocks not begun yet are left undone

    def run_blocks(self, run: slice) -> None:
        fn, keys, views, results = self._fn, self.keys, self.views, self.results
        for i in range(run.start, run.stop):
            if self.cancelled:  # its result stays None
                return
            try:
                results[i] = fn(keys[i], views[i])
            except BaseException as exc:
                self.errors[i] = exc

    def cancel(self) -> None:
        """Leaves the blocks not begun yet undone (those being copied finish)."""
        self.cancelled = True

    def finish(self) -> None:
        try:
            if self._then is not None:
                self.outcome = self._then(self)
        except BaseException as exc:
            self.error = exc
        finally:
            self._wake()

    async def run(self, pump: Pump, threads: int) -> Spread:
        """Runs the blocks on up to `threads` pump threads and returns when all are done. A
        cancel lands before they start or after they are done, never while they write into
        the caller's buffers (as with trio.to_thread.run_sync without abandon_on_cancel)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        token, task = trio.lowlevel.current_trio_token(), trio.lowlevel.current_task()
        self._wake = lambda: token.run_sync_soon(trio.lowlevel.reschedule, task)
        pump.submit(self, max(1, threads))
        await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        return self


_copy_thread = threading.local()  # .pump on a Pump's own threads


def _pin_cpus(threads: int) -> list[int]:
    """One CPU per copy thread: the last `threads` CPUs this process may run on (engines bind
    their own threads from the first one up), or none with fewer than two."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return []
    if len(allowed) < max(2, threads):
        return []
    return allowed[-threads:][::-1]


def bound_cpu() -> int:
    """The one CPU the calling thread may run on, or -1 when it may run on several (or where
    that is unknown)."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        return -1
    return next(iter(allowed)) if len(allowed) == 1 else -1


def _pin(cpu: int) -> None:
    """Runs this thread on `cpu` alone (or where it may, if that CPU has gone)."""
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:  # the CPU went offline, or a cgroup took it away
        pass


def wide(views: Sequence[memoryview | Scatter], split_bytes: int) -> bool:
    """Whether a batch is worth more than one thread: large enough in all, and of blocks large
    enough on average (small blocks cost more Python than copying: one thread is faster)."""
    nbytes = sum(v.nbytes for v in views)
    return nbytes >= split_bytes and nbytes >= WIDE_BLOCK_BYTES * len(views) > 0
