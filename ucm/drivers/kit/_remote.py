"""`RemoteDriver`: the threaded base for drivers whose backend is a server that can stall
(nfs, mooncake, redis).

A client library blocked on a paused or dead server may not return for its own timeout
(30 s for a Mooncake master RPC), far past an event's deadline. `RemoteDriver` therefore runs
its backend calls with `abandon_on_cancel=True` on a limiter of its own: a cancelled call
returns at once, the worker thread finishes in the background, and other tiers' threads are
not starved by this driver's stuck ones. An abandoned thread must not write into the caller's
buffer afterwards: backends deliver blocks with `unframe_into`, under the call's `Gate` (see
`_framing`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from ucm.block import Scatter
from ucm.drivers._workers import Workers
from ucm.drivers.kit._checks import os_error
from ucm.drivers.kit._framing import Gate, call_gated
from ucm.drivers.kit._threaded import Backend, ThreadedDriver
from ucm.errors import StorageUnavailable


class RemoteDriver(ThreadedDriver):
    """A ThreadedDriver whose calls a deadline can abandon (see the module docstring)."""

    def __init__(self, backend: Backend, *, name: str, threads: int,
                 workers: Workers | None = None) -> None:
        super().__init__(backend, name=name, workers=workers)
        self._limiter = trio.CapacityLimiter(threads)

    async def _map(self, fn: Callable[..., list[Any]], keys: list[bytes],
                   views: list[memoryview | Scatter], *, store: bool = False) -> list[Any]:
        # One thread hop per batch, not parts in parallel: the client libraries spread a call
        # over their own threads or concurrent RPCs, and two concurrent parts are slower than
        # one call (docs/performance.md, "Remote drivers"). Calls are abandonable anyway.
        results: list[Any] = await self._run(fn, keys, views)
        return results

    async def _run(self, fn: Callable[..., Any], *args: Any, inline: bool = False,
                   idle: bool = False) -> Any:
        if self._closed:
            raise StorageUnavailable("driver is closed", driver=self.name)
        call_gate = Gate()
        try:
            return await trio.to_thread.run_sync(call_gated, call_gate, fn, *args,
                                                 abandon_on_cancel=True, limiter=self._limiter)
        except trio.Cancelled:
            call_gate.shut()
            raise
        except OSError as exc:
            raise os_error(exc, self.name) from exc
