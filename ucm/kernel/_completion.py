"""The handle `Kernel.submit` returns: the one place where futures meet the trio loop.

A `Completion` is a `concurrent.futures.Future` (poll with `done()`, wait with
`result(timeout)`, `exception()`, callbacks). `cancel()` asks the trio side to cancel the
event; the handle reads as cancelled only once the event has really stopped, so a caller never
reuses a buffer that a driver may still be writing.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any


class Completion(concurrent.futures.Future[Any]):
    def __init__(self, event: Any, event_id: int) -> None:
        super().__init__()
        self.event = event
        self.event_id = event_id
        self._cancel_hook: Callable[[], object] | None = None
        self._cancel_requested = False

    def cancel(self) -> bool:
        """Requests cancellation; True unless the event already finished. Wait on the handle
        (result() raises CancelledError) to know it has stopped."""
        with self._condition:
            if self.done():
                return self.cancelled()
            self._cancel_requested = True
            hook = self._cancel_hook
        if hook is not None:
            hook()
        return True

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    # Called on the trio thread only.
    def _set_cancel_hook(self, hook: Callable[[], object]) -> None:
        with self._condition:
            self._cancel_hook = hook
            requested = self._cancel_requested
        if requested:
            hook()

    def _finish_cancelled(self) -> None:
        super().cancel()
        self.set_running_or_notify_cancel()

    def _resolve(self, result: Any = None, exc: BaseException | None = None) -> None:
        """Sets the outcome unless already set; never raises (it runs on the trio thread)."""
        try:
            if exc is None:
                self.set_result(result)
            else:
                self.set_exception(exc)
        except concurrent.futures.InvalidStateError:
            pass
