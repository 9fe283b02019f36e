"""Moving blocks between the caller and the tiers: stores at a durability level, room made by
eviction, promotion and prefetch into faster tiers, and the background work behind them.

`Movement` is one part of a `KernelCore`, which it reaches through `Owner` (the config,
counters, error counts, trace records and lookups it uses); `Background` runs the work nobody
waits for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ucm.block import Scatter
from ucm.drivers import LoadState
from ucm.errors import DriverError, NoCapacity
from ucm.kernel._events import (
    Lookup,
    LookupResult,
    Prefetch,
    PrefetchResult,
    Priority,
    Store,
    StoreResult,
)
from ucm.kernel._groups import unwrap_single
from ucm.kernel._tier import Tier, keys_of

if TYPE_CHECKING:
    from collections import Counter

    from ucm.config import UCMConfig

log = logging.getLogger("ucm.kernel")

_BACKGROUND_QUEUE_LIMIT = 1024  # background copies beyond this are dropped (a future miss)


class Background:
    """Work nobody waits for (promotion, propagation, cleanup, listings), at most two at a
    time, in the core's nursery. A dropped piece of work is a future cache miss."""

    def __init__(self, nursery: trio.Nursery, stats: Counter[str]) -> None:
        self._nursery = nursery
        self._stats = stats
        self._limiter = trio.CapacityLimiter(2)
        self.pending = 0
        self._idle = trio.Event()
        self._idle.set()
        self.closing = False

    def spawn(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Runs `fn(*args)` in the background. Never raises; False when the work was
        dropped (closing, or too much queued)."""
        if self.closing or self.pending >= _BACKGROUND_QUEUE_LIMIT:
            self._stats["background_dropped"] += 1
            return False
        if self.pending == 0:
            self._idle = trio.Event()
        self.pending += 1
        self._nursery.start_soon(self._run, fn, args)
        return True

    async def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            async with self._limiter:
                await fn(*args)
        except Exception as exc:  # background work must not take the kernel down
            self._stats["background_errors"] += 1
            log.warning("background %s failed: %r", getattr(fn, "__name__", fn), exc)
        finally:
            self.pending -= 1
            if self.pending == 0:
                self._idle.set()

    async def wait_idle(self) -> None:
        """Waits until the work spawned so far (and what it spawned) has finished."""
        while self.pending:
            await self._idle.wait()


class Owner(Protocol):
    """What `Movement` uses of the core that holds it (`KernelCore`)."""

    @property
    def config(self) -> UCMConfig: ...
    @property
    def stats(self) -> Counter[str]: ...

    def count_error(self, tier: Tier, op: str, exc: BaseException | None, *,
                    kind: str | None = None) -> None: ...

    def emit(self, phase: str, event_id: int, **fields: Any) -> None: ...

    async def lookup_in(self, event: Lookup, tiers: list[Tier],
                        event_id: int) -> LookupResult: ...


class Movement:
    def __init__(self, core: Owner, background: Background) -> None:
        self._core = core
        self.stats = core.stats
        self._spawn = background.spawn

    # -- store -----------------------------------------------------------------------------------
    def _required_tiers(self, tiers: list[Tier], durability: str) -> int:
        if durability == "memory":
            return 1
        if durability == "local":
            for depth, tier in enumerate(tiers):
                if tier.persistent:
                    return depth + 1
        return len(tiers)

    async def store(self, event: Store, tiers: list[Tier], event_id: int) -> StoreResult:
        keys, buffers = event.keys, event.buffers
        durability = event.durability or self._core.config.durability
        required = tiers[: self._required_tiers(tiers, durability)]
        results: dict[str, list[bool]] = {}
        errors: list[str] = []
        indices = list(range(len(keys)))
        joined: Sequence[memoryview | Scatter] = buffers
        if any(t.scatter_storer is None for t in required) and any(
                type(b) is Scatter for b in buffers):
            joined = await self._gather(buffers)

        async def store_one(tier: Tier) -> None:
            mine = buffers if tier.scatter_storer is not None else joined
            results[tier.name] = await self._store_into(tier, keys, mine, indices, errors,
                                                        Priority.STORE, event_id)

        with unwrap_single():
            async with trio.open_nursery() as nursery:
                for tier in required:
                    nursery.start_soon(store_one, tier)
        stored = tuple(all(results[t.name][i] for t in required) for i in indices)
        self.stats["store_keys"] += len(keys)
        self.stats["store_failed"] += stored.count(False)
        self.stats["bytes_stored"] += sum(
            b.nbytes for b, ok in zip(buffers, stored, strict=True) if ok)
        rest = tiers[len(required):]
        if rest:
            done = [i for i in indices if stored[i]]
            if done:
                # The caller may reuse its buffers once we return: copy from the first tier.
                self._spawn(self._copy, [keys[i] for i in done],
                            [buffers[i].nbytes for i in done], required[0], rest)
        return StoreResult(stored, tuple(errors))

    async def _gather(self, buffers: Sequence[memoryview | Scatter]) -> list[memoryview]:
        """A Scatter's pieces joined into one buffer (a copy, off the trio thread), once per
        store, for the tiers whose driver cannot write from pieces."""
        out: list[Any] = list(buffers)
        scatters = [i for i, b in enumerate(buffers) if type(b) is Scatter]

        def join() -> None:
            for i in scatters:
                out[i] = memoryview(out[i].gather())

        await trio.to_thread.run_sync(join)
        self.stats["store_gathers"] += len(scatters)
        return out

    async def _store_into(self, tier: Tier, keys: Sequence[bytes],
                          buffers: Sequence[memoryview | Scatter], indices: list[int],
                          errors: list[str], priority: int, event_id: int) -> list[bool]:
        """Stores keys[indices] into one tier, making room first. Returns stored flags by
        position in `keys` (False outside `indices`)."""
        ok = [False] * len(keys)
        chosen: list[int] = []
        reserved = 0
        victims: list[bytes] = []
        for i in indices:
            need = tier.estimate(buffers[i].nbytes)
            more = tier.reserve(need)
            if more is None:
                errors.append(str(NoCapacity("no room: the rest of the tier is pinned",
                                             driver=tier.name)))
                self._core.count_error(tier, "store", None, kind="no_capacity")
                continue
            victims.extend(more)
            reserved += need
            chosen.append(i)
        try:
            if victims:
                await self.delete_victims(tier, victims)
            if not chosen:
                return ok
            t0 = time.monotonic_ns()
            batch = keys_of(keys, chosen), [buffers[i] for i in chosen]
            store = tier.driver.store
            if tier.scatter_storer is not None and any(type(b) is Scatter for b in batch[1]):
                store = tier.scatter_storer.store_scatter
            try:
                try:
                    sizes = await tier.call(priority, store, *batch)
                except NoCapacity:
                    if not await self._shrink_to_fit(tier):
                        raise
                    sizes = await tier.call(priority, store, *batch)
            except DriverError as exc:
                self._core.count_error(tier, "store", exc)
                self._core.emit("op", event_id, tier=tier.name, op="store", keys=len(chosen),
                                t0=t0, error=type(exc).__name__)
                errors.append(str(exc))
                return ok
            nbytes = 0
            for i, size in zip(chosen, sizes, strict=True):
                if size > 0:
                    tier.add(keys[i], size, buffers[i].nbytes, first=i == 0)
                    ok[i] = True
                    nbytes += buffers[i].nbytes
                else:
                    self._core.count_error(tier, "store", None, kind="failed")
            self._core.emit("op", event_id, tier=tier.name, op="store", keys=len(chosen),
                            t0=t0, bytes=nbytes, stored=sum(1 for s in sizes if s > 0))
            return ok
        finally:
            tier.unreserve(reserved)

    async def _shrink_to_fit(self, tier: Tier) -> bool:
        """Storage is fuller than the tier's capacity says (other files share the device, or
        the capacity exceeds its size): the capacity drops to what the tier holds and blocks
        are evicted to make room for the stores in flight. False when nothing could be."""
        before = tier.policy.capacity
        victims = tier.shrink_to_fit()
        if victims is None:
            return False
        log.warning("tier %s: storage is full; capacity lowered from %s to %d bytes",
                    tier.name, "unbounded" if before is None else before, tier.policy.capacity)
        self.stats[f"capacity_shrunk.{tier.name}"] += 1
        await self.delete_victims(tier, victims)
        return True

    async def delete_victims(self, tier: Tier, keys: list[bytes]) -> None:
        # The policy never names a pinned victim; checking again here keeps a promised block
        # on storage even if a race put one on this list (it is counted, to be seen).
        pinned = [k for k in keys if tier.policy.is_pinned(k)]
        if pinned:
            self.stats[f"pinned_victims_kept.{tier.name}"] += len(pinned)
            keys = [k for k in keys if k not in set(pinned)]
            if not keys:
                return
        for key in keys:
            tier.discard(key)
        try:
            await tier.call(Priority.STORE, tier.driver.delete, keys)
        except DriverError as exc:
            self._core.count_error(tier, "delete", exc)
            return
        self.stats[f"evictions.{tier.name}"] += len(keys)
        self._core.emit("evict", 0, tier=tier.name, keys=len(keys))

    # -- prefetch, promotion and background copies ------------------------------------------------
    async def prefetch(self, event: Prefetch, tiers: list[Tier], event_id: int,
                        ) -> PrefetchResult:
        keys = event.keys
        top = tiers[0]
        absent = [k for k in keys if k not in top]
        if len(tiers) == 1 or not absent:
            return PrefetchResult(0, len(keys) - len(absent), 0)
        found = await self._core.lookup_in(Lookup(tuple(absent)), tiers[1:], event_id)
        promoted = 0
        for tier in tiers[1:]:
            batch = [k for k, name in zip(absent, found.tiers, strict=True) if name == tier.name]
            raw = [(k, self._raw_size(k, tiers, event.block_bytes)) for k in batch]
            sized = [(k, s) for k, s in raw if s is not None]
            if sized:
                promoted += await self._copy([k for k, _ in sized], [s for _, s in sized],
                                             tier, [top], priority=Priority.PREFETCH)
        missing = found.hits.count(False)
        if promoted:  # what becomes of them is counted (Tier.prefetched)
            top.prefetched.update(k for k in absent if k in top)
            self.stats["prefetched"] += promoted
        return PrefetchResult(promoted, len(keys) - len(absent), missing)

    def _raw_size(self, key: bytes, tiers: list[Tier], default: int | None) -> int | None:
        for tier in tiers:
            size = tier.raw_sizes.get(key)
            if size is not None:
                return size
        return default

    def promote(self, keys: Sequence[bytes], sources: Sequence[Tier | None],
                 tiers: list[Tier], raw: Sequence[int] | None = None) -> None:
        """Schedules copies of blocks found below the top tier into the tiers above."""
        by_source: dict[int, list[int]] = {}
        for i, tier in enumerate(sources):
            if tier is not None and tier is not tiers[0]:
                by_source.setdefault(tiers.index(tier), []).append(i)
        for depth, indices in by_source.items():
            sized = []
            for i in indices:
                size = raw[i] if raw is not None else self._raw_size(keys[i], tiers, None)
                if size is not None:
                    sized.append((keys[i], size))
            if sized:
                self._spawn(self._copy, [k for k, _ in sized], [s for _, s in sized],
                            tiers[depth], tiers[:depth])

    async def _copy(self, keys: list[bytes], sizes: list[int], source: Tier,
                    targets: list[Tier], *, priority: int = Priority.BACKGROUND) -> int:
        """Copies blocks from one tier into others through staging buffers. Returns how many
        blocks reached every target."""
        buffers = [memoryview(bytearray(size)) for size in sizes]
        try:
            states = await source.call(priority, source.driver.load, keys, buffers)
        except DriverError as exc:
            self._core.count_error(source, "load", exc)
            return 0
        good = [i for i, s in enumerate(states) if s is LoadState.OK]
        if not good:
            return 0
        errors: list[str] = []
        reached = [True] * len(keys)
        for target in targets:
            ok = await self._store_into(target, keys, buffers, good, errors, priority, 0)
            reached = [a and b for a, b in zip(reached, ok, strict=True)]
        count = sum(1 for i in good if reached[i])
        self.stats["promoted"] += count
        return count
