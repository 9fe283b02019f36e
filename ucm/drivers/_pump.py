"""Copy threads shared by a driver's blocks: `Pump` and `Spread` (from the pmem driver, where
they were measured; the posix and shared-memory loads use them too).

A batch's blocks are handed out in runs of about 2 MiB to up to PARALLEL threads of trio's
thread cache, which take runs until none are left: a thread slowed down by another process on
its core leaves the rest to the other one, where a fixed split into one part per thread waits
for the slower part. The thread that finishes the last run wakes the waiting task: one trip
back into trio per batch.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import trio


def chunks(views: list[memoryview], limit: int) -> list[slice]:
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
    """The driver's copy threads: up to PARALLEL threads of trio's thread cache take runs from
    the batches waiting here, oldest batch first.

    Batches in flight at once are served in turn rather than side by side, so the first one
    finishes while the next is copied: its trips back into trio and out to its caller overlap
    the next batch's copying instead of leaving the cores idle. (Side by side, batches of the
    same size finish together and their hand-offs, 100-200 us each on a 2-vCPU VM, leave both
    cores idle at once.) A thread keeps taking runs while any are left, so a busy pump starts
    no threads at all.

    Each thread is pinned to a CPU of its own while it takes runs (the last PARALLEL CPUs the
    process may use; UCM_PIN_COPY_THREADS=0 turns it off). Unpinned, Linux often woke both
    threads on the core of the trio thread that started them, and after the cores had idled the
    second thread waited there for 1-2 ms before the scheduler moved it: on the 2-vCPU test VMs
    a 64 MiB posix load that arrives after 50 ms of quiet took 7.5 ms (median) unpinned and
    5.4 ms pinned, and vLLM's start_load_kv for a 4K-token hit 8.9-11.6 ms against 6.2-6.8 ms.
    Back to back, with the cores awake, both took the same time."""

    def __init__(self, limit: int, *, pin: bool = True) -> None:
        self._lock = threading.Lock()
        self._queue: deque[Spread] = deque()
        self._threads = 0
        self._limit = limit
        self._slots = [False] * limit  # which CPU slots a running thread holds
        self._cpus = _pin_cpus(limit) if pin else []

    def submit(self, spread: Spread, threads: int) -> None:
        with self._lock:
            self._queue.append(spread)
            start = max(0, min(threads, self._limit) - self._threads)
            self._threads += start
        for _ in range(start):
            trio.lowlevel.start_thread_soon(self._drain, _ignore_outcome)  # no name: 2 syscalls

    def _drain(self) -> None:
        cpus = self._cpus
        if not cpus:
            return self._take_runs()
        with self._lock:
            slot = self._slots.index(False)
            self._slots[slot] = True
        allowed = _pin(cpus[slot])
        try:
            self._take_runs()
        finally:
            _unpin(allowed)
            with self._lock:
                self._slots[slot] = False

    def _take_runs(self) -> None:
        lock, queue = self._lock, self._queue
        while True:
            with lock:
                while queue and queue[0].next >= len(queue[0].runs):
                    queue.popleft()  # every run taken (some may still be running)
                if not queue:
                    self._threads -= 1
                    return
                spread = queue[0]
                run = spread.runs[spread.next]
                spread.next += 1
                spread.taken += 1
            spread.run_blocks(run)
            with lock:
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

    def __init__(self, fn: Callable[[bytes, memoryview], Any], keys: list[bytes],
                 views: list[memoryview], then: Callable[[Spread], Any] | None = None) -> None:
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

    def run_blocks(self, run: slice) -> None:
        fn, keys, views, results = self._fn, self.keys, self.views, self.results
        for i in range(run.start, run.stop):
            try:
                results[i] = fn(keys[i], views[i])
            except BaseException as exc:
                self.errors[i] = exc

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


def _pin_cpus(threads: int) -> list[int]:
    """One CPU per copy thread: the last `threads` CPUs this process may run on (engines bind
    their own threads from the first one up), or none with fewer than two."""
    if os.environ.get("UCM_PIN_COPY_THREADS", "1") == "0":
        return []
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return []
    if len(allowed) < max(2, threads):
        return []
    return allowed[-threads:][::-1]


def _pin(cpu: int) -> set[int] | None:
    """Runs this thread on `cpu` alone; returns the CPUs it ran on before (None: unchanged)."""
    try:
        allowed = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpu})
        return allowed
    except OSError:  # the CPU went offline, or a cgroup took it away
        return None


def _unpin(allowed: set[int] | None) -> None:
    if allowed is not None:
        try:
            os.sched_setaffinity(0, allowed)
        except OSError:
            pass


def _ignore_outcome(_: Any) -> None:
    pass  # _drain never raises: errors are kept per block




def wide(views: list[memoryview], split_bytes: int) -> bool:
    """Whether a batch is worth more than one thread: large enough in all, and of blocks large
    enough on average (small blocks cost more Python than copying: one thread is faster)."""
    nbytes = sum(v.nbytes for v in views)
    return nbytes >= split_bytes and nbytes >= WIDE_BLOCK_BYTES * len(views) > 0
