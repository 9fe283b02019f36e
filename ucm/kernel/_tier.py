"""One tier of the stack: a driver plus what the kernel keeps about it (index, capacity,
pins, concurrency limit, and a count of the events that may still use it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio

from ucm.block import PAYLOAD_OFFSET
from ucm.config import TierConfig
from ucm.drivers import Driver, InMemoryLoads, ScatterLoads, ScatterStores
from ucm.kernel._holds import Holds
from ucm.kernel._limiter import PriorityLimiter
from ucm.kernel._mrc import MissRatioCurve
from ucm.kernel._policy import Policy

T = TypeVar("T")


class Tier:
    def __init__(self, config: TierConfig, driver: Driver, policy: Policy,
                 mrc: MissRatioCurve | None = None) -> None:
        self.config = config
        self.name = config.name or config.driver
        self.driver = driver
        self.persistent = bool(driver.persistent)
        # Loads into a Scatter itself; others get a contiguous stand-in (_core).
        self.scatter_loader: ScatterLoads | None = (
            driver if isinstance(driver, ScatterLoads) else None)
        # Stores from a Scatter itself; others get its pieces joined once (_movement).
        self.scatter_storer: ScatterStores | None = (
            driver if isinstance(driver, ScatterStores) else None)
        # Loads of blocks it holds in memory may run off the trio thread (_fastpath).
        self.in_memory: InMemoryLoads | None = (
            driver if isinstance(driver, InMemoryLoads) else None)
        self.policy = policy
        self.mrc = mrc  # the tier's sampled miss-ratio curve, where configured
        self.holds: Holds | None = None  # session holds (the kernel sets them up)
        # blocks a Prefetch brought into this tier and no load has used yet; what became of
        # them (a load hit, or evicted unused) is counted
        self.prefetched: set[bytes] = set()
        self.prefetch_hits = 0
        self.prefetch_evicted = 0
        self.limiter = PriorityLimiter(config.concurrency)
        self.raw_sizes: dict[bytes, int] = {}  # bytes a loader needs, where this kernel knows
        self.reserved = 0  # bytes promised to stores in flight
        self.users = 0  # events holding this tier in their snapshot
        self.detaching = False
        self._idle = trio.Event()
        # While the index is rebuilt from a listing (a snapshot of the past), keys removed
        # meanwhile are remembered, so the listing does not bring them back.
        self.indexing = False
        self.removed_while_indexing: set[bytes] = set()

    async def call(self, priority: int, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        async with self.limiter.slot(priority):
            return await fn(*args)

    # -- index -------------------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self.policy

    def add(self, key: bytes, stored_bytes: int, raw_bytes: int | None, *,
            reference: bool = True, first: bool = False) -> None:
        """Indexes a stored block; `reference`: a store the workload made (not a listing);
        `first`: the first key of its batch (for the miss-ratio curve's hot keys)."""
        old = self.policy.size_of(key) if self.holds is not None else None
        self.policy.insert(key, stored_bytes)
        if raw_bytes is not None:
            self.raw_sizes[key] = raw_bytes
        if reference and self.mrc is not None:
            self.mrc.access(key, stored_bytes, first)
        if self.holds is not None:
            self.holds.added(key, old)

    def touch(self, key: bytes, depth: int | None = None, *, first: bool = False) -> None:
        """A held block was used (loaded); `depth` its index in the batch, if known."""
        self.policy.touch(key, depth)
        if self.prefetched and key in self.prefetched:
            self.prefetched.discard(key)
            self.prefetch_hits += 1
        if self.mrc is not None:
            self.mrc.access(key, self.policy.size_of(key) or 0, first or depth == 0)

    def discard(self, key: bytes) -> None:
        size = self.policy.remove(key)
        if self.holds is not None and size:
            self.holds.removed(key, size)
        self.raw_sizes.pop(key, None)
        self.prefetched.discard(key)
        if self.indexing:
            self.removed_while_indexing.add(key)

    @staticmethod
    def estimate(raw_bytes: int) -> int:
        """Bytes a block will take before the driver says (codecs only shrink it)."""
        return PAYLOAD_OFFSET + raw_bytes

    def reserve(self, needed: int) -> list[bytes] | None:
        """Makes room for `needed` more bytes: returns the victims (already out of the index)
        or None if pinned blocks leave too little room. The caller deletes the victims and
        calls `unreserve(needed)` once the store is accounted."""
        if self.policy.capacity is not None:
            if self.holds is not None:
                self.holds.expire()
            victims = self.policy.make_room(needed + self.reserved)
            if victims is None:
                return None
            self._evicted(victims)
        else:
            victims = []
        self.reserved += needed
        return victims

    def shrink_to_fit(self) -> list[bytes] | None:
        """After storage said it is full: the capacity becomes what the tier holds now, and
        room is made in it for the stores in flight. Returns the victims (out of the index,
        for the caller to delete), or None when nothing can be evicted (an empty tier, or
        pinned blocks in the way): then the capacity is left as it was."""
        policy = self.policy
        if self.holds is not None:
            self.holds.expire()
        held = policy.used
        if held == 0:
            return None
        before = policy.capacity
        policy.capacity = held if before is None else min(before, held)
        victims = policy.make_room(self.reserved)
        if not victims:
            policy.capacity = before
            return None
        self._evicted(victims)
        return victims

    def _evicted(self, victims: list[bytes]) -> None:
        for key in victims:
            self.raw_sizes.pop(key, None)
            if self.prefetched and key in self.prefetched:
                self.prefetched.discard(key)
                self.prefetch_evicted += 1
            if self.indexing:
                self.removed_while_indexing.add(key)

    def unreserve(self, needed: int) -> None:
        self.reserved -= needed

    # -- users (for detach) ------------------------------------------------------------------
    def enter(self) -> None:
        self.users += 1

    def leave(self) -> None:
        self.users -= 1
        if self.users == 0 and self.detaching:
            self._idle.set()

    async def wait_idle(self) -> None:
        if self.users:
            await self._idle.wait()


def keys_of(keys: Sequence[bytes], indices: Sequence[int]) -> list[bytes]:
    return [keys[i] for i in indices]
