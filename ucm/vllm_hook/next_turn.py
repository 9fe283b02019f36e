"""The history-based next-turn prefetch, live (`sessions.predict_next_turn`, off by default;
docs/autotune.md, History-based prefetch).

Requests without a session hint feed `ucm.autotune._prefetch.NextTurnPrefetch` as they finish
(their stored full blocks' digests and the time): a request whose blocks extend an earlier
one's is that conversation's next turn, and once a conversation has returned, its last
turn's blocks are prefetched into the fastest tier at the arrival the predictor expects for
the next turn (its last gap). A timer thread wakes at those times and hands the due blocks to
`issue` (the scheduler side: a prefetch SessionOp, applied at once where the worker side is in
this process, else sent with the next step). In the simulator this did not pay on the
Mooncake conversation trace; it is here to be measured on a deployment's own traffic, with
what it did counted: prefetches issued and blocks asked for here, blocks promoted, later hit
and evicted unused in the kernel (`tier.NAME.prefetch_hits`, `prefetch_evicted`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger("ucm.vllm_hook")


class NextTurnTimer:
    """The predictor behind a lock, and a daemon thread that issues what falls due."""

    def __init__(self, issue: Callable[[list[bytes]], None], *,
                 clock: Callable[[], float] = time.monotonic, remember: int = 65536) -> None:
        from ucm.autotune._prefetch import NextTurnPrefetch  # only when switched on

        self._issue = issue
        self._clock = clock
        self._predictor = NextTurnPrefetch(skip_last=False, remember=remember)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.fed = 0  # requests fed
        self.issued = 0  # prefetches handed to `issue`
        self.blocks = 0  # blocks they asked for

    def after(self, digests: Sequence[bytes]) -> None:
        """A finished request's stored full blocks (digests, in order)."""
        from ucm.autotune._traces import Request

        if not digests:
            return
        with self._lock:
            self._predictor.after(Request(tuple(digests), timestamp=self._clock()))
            self.fed += 1
            start = self._thread is None and self._predictor.next_at() is not None
        if start:
            self._thread = threading.Thread(target=self._run, name="ucm-next-turn",
                                            daemon=True)
            self._thread.start()
        self._wake.set()

    def due(self) -> list[bytes]:
        """The blocks whose predicted time has come (none twice)."""
        with self._lock:
            return list(self._predictor.due(self._clock()))

    def _next_at(self) -> float | None:
        with self._lock:
            return self._predictor.next_at()

    def _run(self) -> None:
        while not self._stopped:
            at = self._next_at()
            wait = None if at is None else max(0.0, at - self._clock())
            if wait is None or wait > 0:
                self._wake.wait(wait)
                self._wake.clear()
                continue
            blocks = self.due()
            if blocks:
                self.issued += 1
                self.blocks += len(blocks)
                try:
                    self._issue(blocks)
                except Exception as exc:  # never into the engine
                    log.warning("ucm: next-turn prefetch not issued: %s", exc)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
