"""The threads drivers run their blocking work on, with one owner: `Workers` (public as
`ucm.drivers.kit.Workers`; here, below the kit, so that the contract can name it in `open`
without importing the kit).

The kernel makes one `Workers` from its config's `threads` section, hands it to every driver it
opens (`DriverFactory.open(..., workers=)`), and closes it after it has closed the drivers. A
driver opened on its own (a test, a script) gets the process's default, which lives as long as
the process, like trio's thread cache.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from ucm.drivers._idle import MAX_THREADS, IdleThreads
from ucm.drivers._pump import Pump

COPY_THREADS = 2  # loads of large batches split over this many copy threads


class Workers:
    """Copy threads for loads (`copy`: a `Pump`, its threads bound to CPUs of their own when
    `pin_copy`) and idle-priority threads for stores (`run_store`). Threads start on first
    use."""

    def __init__(self, *, copy_threads: int = COPY_THREADS, pin_copy: bool = True,
                 store_threads: int = MAX_THREADS) -> None:
        if copy_threads < 1 or store_threads < 1:
            raise ValueError("copy_threads and store_threads must be >= 1")
        self.copy_threads = copy_threads
        self.copy = Pump(copy_threads, pin=pin_copy)
        self._store = IdleThreads(store_threads)

    async def run_store(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on an idle-priority store thread; returns or raises what it did."""
        return await self._store.run(fn, *args)

    def close(self) -> None:
        """Stops and joins every thread (blocking); the drivers it served are closed."""
        self.copy.close()
        self._store.close()

    @classmethod
    def default(cls) -> Workers:
        """This process's default Workers (a forked child gets its own: threads do not
        survive a fork)."""
        global _default, _default_pid
        with _default_lock:
            if _default is None or _default_pid != os.getpid():
                _default, _default_pid = cls(), os.getpid()
            return _default


_default: Workers | None = None
_default_pid = 0
_default_lock = threading.Lock()
