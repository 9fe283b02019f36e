"""Threads at idle CPU priority for block stores (`IdleThreads`, owned by `kit.Workers`).

A store is background work, but on a small host it competes with the inference engine for the
cores: an idle-class (SCHED_IDLE) thread gets a core only when nothing else wants it, so stores
never slow the engine down (figures: docs/performance.md, "Stores at idle priority"). A
system call it is in, such as the write that allocates a new file's pages, still runs on to its
next preemption point. On a saturated host stores wait, their snapshots pile up to the vLLM
worker's `max_store_bytes`, and further saves are dropped (misses, never a stall).
`tests/test_threads.py` checks the policy.

The threads are ucm's own, not trio's thread cache: an unprivileged thread may lower its
priority but not raise it back (RLIMIT_NICE, CAP_SYS_NICE), so a cached thread made idle for a
store would stay idle for the loads it runs later. Where SCHED_IDLE does not exist (not Linux)
the threads run at normal priority. Like `trio.to_thread.run_sync` without abandon_on_cancel, a
cancelled caller waits for its call to return: the call reads the caller's buffers.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import outcome
import trio

MAX_THREADS = 8  # at most this many stores run at once in a process; more wait in the queue


class IdleThreads:
    """Idle-priority worker threads, started on demand, kept for reuse until `close`."""

    def __init__(self, limit: int = MAX_THREADS) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._limit = limit
        self._threads = 0
        self._started: list[threading.Thread] = []
        self._closed = False
        self._free = 0  # threads waiting for a job that no submitted job has claimed
        self._backlog = 0  # jobs queued while every thread was busy

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on an idle-priority thread; returns or raises what it did."""
        await trio.lowlevel.checkpoint_if_cancelled()
        token, task = trio.lowlevel.current_trio_token(), trio.lowlevel.current_task()

        def job() -> None:
            result = outcome.capture(fn, *args)
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:  # the kernel's loop ended meanwhile
                pass

        self._submit(job)
        return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)

    def _submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the store threads are closed")
            start = False
            if self._free:
                self._free -= 1
            elif self._threads < self._limit:
                self._threads += 1
                start = True
            else:
                self._backlog += 1
        self._jobs.put(job)
        if start:
            thread = threading.Thread(target=self._serve, name="ucm-store", daemon=True)
            with self._lock:
                self._started.append(thread)
            thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stops the threads once the queued jobs have run, and joins them (up to `timeout`
        each); blocks for as long as that takes."""
        with self._lock:
            self._closed = True
            threads = list(self._started)
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join(timeout)

    def _serve(self) -> None:
        _become_idle()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()
            with self._lock:
                if self._backlog:
                    self._backlog -= 1
                else:
                    self._free += 1


def _become_idle() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or a seccomp filter says no: normal priority
        pass
