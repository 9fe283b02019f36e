"""A capacity limiter whose waiters are served by priority (then arrival order).

`trio.CapacityLimiter` is FIFO; the kernel needs loads to overtake queued prefetches when a
driver's concurrency limit is saturated.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


class _Waiter:
    __slots__ = ("abandoned", "event", "granted")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.granted = False
        self.abandoned = False


class PriorityLimiter:
    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("total must be >= 1")
        self.total = total
        self.in_use = 0
        self._heap: list[tuple[int, int, _Waiter]] = []
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, w in self._heap if not w.abandoned)

    async def acquire(self, priority: int) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.in_use < self.total and not self._heap:
            self.in_use += 1
            return
        waiter = _Waiter()
        heapq.heappush(self._heap, (priority, next(self._seq), waiter))
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.release()  # granted in the same tick we were cancelled: pass it on
            else:
                waiter.abandoned = True
            raise

    def release(self) -> None:
        while self._heap:
            _, _, waiter = heapq.heappop(self._heap)
            if not waiter.abandoned:
                waiter.granted = True
                waiter.event.set()
                return  # the slot moves to the waiter; in_use is unchanged
        self.in_use -= 1

    @asynccontextmanager
    async def slot(self, priority: int) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()
