"""Threads at idle CPU priority for block stores: `run_idle(fn, *args)`.

A store is background work, but on a small host it competes with the inference engine for the
cores. On the 2-vCPU VMs ucm is tested on, writing 64 MiB of new block files costs 90-160 ms of
CPU (page-cache pages for new files are expensive there; rewriting cached pages costs 5 ms),
and two store threads at normal priority slowed a single-threaded torch workload beside them by
11.5%; on SCHED_IDLE threads the same stores slowed it by nothing measurable (a controlled run:
300 bf16 matmuls with and without a store of 32 blocks of 2 MiB every 0.4 s; with two torch
threads, both cores busy, +1.3% and +3.3%). An idle-class thread gets a core only when nothing
else wants it (and a sliver of time when every core is busy), but a system call it is in, such
as the write that allocates the new file's pages, runs on to its next preemption point. On a
saturated host stores wait, their snapshots pile up to the worker's `max_store_bytes`, and
further saves are dropped (misses, never a stall). `tests/test_threads.py` checks the policy.

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
    """A process's idle-priority worker threads, started on demand, kept for reuse."""

    def __init__(self, limit: int = MAX_THREADS) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._limit = limit
        self._threads = 0
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
            threading.Thread(target=self._serve, name="ucm-store", daemon=True).start()

    def _serve(self) -> None:
        _become_idle()
        while True:
            self._jobs.get()()
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


_pool: IdleThreads | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def idle_threads() -> IdleThreads:
    """This process's pool (a forked child starts its own: threads do not survive a fork)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = IdleThreads(), os.getpid()
        return _pool


async def run_idle(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on one of this process's idle-priority threads."""
    return await idle_threads().run(fn, *args)
