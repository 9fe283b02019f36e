"""Single-flight loads: concurrent loads of one key read storage once.

The first load of a key leads; later loads of the same key, while it is in flight, follow: they
hand over their buffers and wait. Before the leader's own event completes, it copies the block
into every follower's buffer, so no buffer is written after its event has completed.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from typing import Final

import trio

from ucm.block import Scatter, copy_bytes
from ucm.drivers import LoadState
from ucm.errors import InvalidRequest

log = logging.getLogger("ucm.kernel")

_COPY_IN_THREAD_BYTES = 1 << 20  # smaller copies stay on the trio thread


class Flight:
    """One key being loaded."""

    __slots__ = ("done", "followers", "frozen", "state", "tier")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.followers: list[memoryview | Scatter] = []
        self.frozen = False  # the followers list is closed: the leader is copying into them
        self.state = LoadState.FAILED
        self.tier: str | None = None


class _Absent(enum.Enum):
    ABSENT = 0


_ABSENT: Final = _Absent.ABSENT  # no flight for the key (None: one without followers yet)


class FlightTable:
    def __init__(self) -> None:
        self._flights: dict[bytes, Flight | None] = {}

    def __len__(self) -> int:
        return len(self._flights)

    def join(self, keys: Sequence[bytes], buffers: Sequence[memoryview | Scatter],
             ) -> tuple[list[int], list[tuple[int, Flight]]]:
        """Splits a batch into the indices this event leads and the flights it follows.
        A led key holds a bare marker until a follower arrives: most loads have none, and
        they pay no Event for it."""
        leaders: list[int] = []
        followers: list[tuple[int, Flight]] = []
        flights = self._flights
        for i, key in enumerate(keys):
            flight = flights.get(key, _ABSENT)
            if flight is _ABSENT:
                flights[key] = None
                leaders.append(i)
                continue
            if flight is None:
                flight = flights[key] = Flight()
            flight.followers.append(buffers[i])
            followers.append((i, flight))
        return leaders, followers

    async def land(self, keys: Sequence[bytes], buffers: Sequence[memoryview | Scatter],
                   leaders: list[int], states: Sequence[LoadState],
                   tiers: Sequence[str | None]) -> None:
        """Ends the leader's flights: copies good blocks to followers, then wakes them.
        Call it shielded: followers wait on it."""
        copies: list[tuple[memoryview | Scatter, memoryview | Scatter]] = []
        landed: list[Flight] = []
        for i in leaders:
            flight = self._flights.pop(keys[i])
            if flight is None:  # nobody followed
                continue
            flight.frozen = True
            flight.state = states[i]
            flight.tier = tiers[i]
            if states[i] is LoadState.OK:
                copies.extend((dst, buffers[i]) for dst in flight.followers)
            landed.append(flight)
        try:
            if copies:
                if sum(src.nbytes for _, src in copies) >= _COPY_IN_THREAD_BYTES:
                    await trio.to_thread.run_sync(_copy_all, copies)
                else:
                    _copy_all(copies)
        except InvalidRequest as exc:  # a follower's buffer had the wrong size
            log.warning("single-flight copy failed: %s", exc)
            for flight in landed:
                flight.state = LoadState.FAILED
        finally:
            for flight in landed:
                flight.done.set()

    @staticmethod
    async def follow(flight: Flight, buffer: memoryview | Scatter) -> None:
        """Waits for the leader. If cancelled after the leader has started copying into this
        buffer, waits (shielded) for the copy to end, so the buffer is quiet on return."""
        try:
            await flight.done.wait()
        except trio.Cancelled:
            if not flight.frozen:
                flight.followers.remove(buffer)
            else:
                with trio.CancelScope(shield=True):
                    await flight.done.wait()
            raise


def _copy_all(copies: list[tuple[memoryview | Scatter, memoryview | Scatter]]) -> None:
    for dst, src in copies:
        copy_bytes(dst, src)
