"""History-based prefetch for the simulator: promote a conversation's blocks to the fast tier
ahead of its next turn.

A conversation is recognised by its chain: a request whose blocks extend an earlier request's
full blocks is that request's next turn (the earlier request's last block is partial under
hash-id traces, so the next turn shares all but it). After each request the predictor
remembers the request's full blocks and, when the conversation has returned before, the gap
between its last two turns; it then schedules a promotion of those blocks at the arrival
time it predicts for the next turn (the last gap, times each of `scales`: several shots
re-promote what the fast tier dropped since the previous one). Asked with the clock only
(`due(now)`), it hands back the blocks whose time has come. A turn that arrives first cancels
its conversation's pending promotion. `OracleNextTurn` knows each next turn's true arrival
and promotes just before it: the most any timed prefetch of the previous turn's blocks earns.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from ucm.autotune._traces import Request


class NextTurnPrefetch:
    """Promotes a returning conversation's last full blocks at its predicted next arrival.

    `min_turns`: turns a conversation must have had before it is prefetched (1: every request,
    with `first_gap` as the guess); `max_blocks`: the leading blocks promoted at most;
    `remember`: conversations tracked (oldest forgotten first), which bounds the memory."""

    def __init__(self, *, scales: Sequence[float] = (1.0,), min_turns: int = 2,
                 first_gap: float = 120.0, max_blocks: int | None = None,
                 remember: int = 65536, skip_last: bool = True) -> None:
        if not scales or min(scales) <= 0 or min_turns < 1 or remember < 1:
            raise ValueError("scales > 0, min_turns >= 1 and remember >= 1")
        self.scales = tuple(sorted(scales))
        self.min_turns = min_turns
        self.first_gap = first_gap
        self.max_blocks = max_blocks
        self.remember = remember
        self.skip_last = skip_last
        # a request's last full block -> (its conversation's turns so far, its arrival)
        self._tails: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        # by tail key: the promotion times still to come and the blocks
        self._pending: dict[bytes, tuple[set[float], tuple[bytes, ...]]] = {}
        self._heap: list[tuple[float, bytes]] = []
        self.scheduled = 0
        self.cancelled = 0

    def _parent(self, full: Sequence[bytes]) -> bytes | None:
        # the deepest block past the first that ends an earlier request's full blocks
        for j in range(len(full) - 1, 0, -1):
            if full[j] in self._tails:
                return full[j]
        return None

    def after(self, request: Request) -> Iterable[bytes]:
        full = request.blocks[:-1] if self.skip_last else request.blocks
        if not full:
            return ()
        now = request.timestamp
        turns, gap = 1, self.first_gap
        parent = self._parent(full)
        if parent is not None:
            parent_turns, parent_time = self._tails.pop(parent)
            if self._pending.pop(parent, None) is not None:
                self.cancelled += 1  # the turn came before its promotion
            turns, gap = parent_turns + 1, now - parent_time
        tail = full[-1]
        self._tails[tail] = (turns, now)
        self._tails.move_to_end(tail)
        while len(self._tails) > self.remember:
            old, _ = self._tails.popitem(last=False)
            self._pending.pop(old, None)
        if turns >= self.min_turns:
            self._schedule(tail, [now + f * gap for f in self.scales], full)
        return ()

    def _schedule(self, tail: bytes, times: Sequence[float], full: Sequence[bytes]) -> None:
        blocks = tuple(full[: self.max_blocks] if self.max_blocks else full)
        self._pending[tail] = (set(times), blocks)
        for at in times:
            heapq.heappush(self._heap, (at, tail))
        self.scheduled += 1

    def next_at(self) -> float | None:
        """The earliest promotion time still queued (perhaps one cancelled since), if any."""
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> Iterable[bytes]:
        out: list[bytes] = []
        while self._heap and self._heap[0][0] <= now:
            at, tail = heapq.heappop(self._heap)
            pending = self._pending.get(tail)
            if pending is not None and at in pending[0]:  # not cancelled nor rescheduled
                pending[0].discard(at)
                if not pending[0]:
                    del self._pending[tail]
                out.extend(pending[1])
        return out


class OracleNextTurn(NextTurnPrefetch):
    """Knows when each request's next turn arrives (from the whole trace) and promotes the
    request's full blocks just before it: a bound, not a predictor."""

    def __init__(self, requests: Sequence[Request], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._next: dict[bytes, float] = {}  # a request's tail -> its next turn's arrival
        tails: dict[bytes, bytes] = {}
        for request in requests:
            full = request.blocks[:-1] if self.skip_last else request.blocks
            if not full:
                continue
            for j in range(len(full) - 1, 0, -1):
                if full[j] in tails:
                    self._next.setdefault(tails.pop(full[j]), request.timestamp)
                    break
            tails[full[-1]] = full[-1]

    def after(self, request: Request) -> Iterable[bytes]:
        full = request.blocks[:-1] if self.skip_last else request.blocks
        if full:
            tail = full[-1]
            at = self._next.pop(tail, None)
            if at is not None:
                self._schedule(tail, [at], full)
        return ()
