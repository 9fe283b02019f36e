"""The kernel's logic, on the trio thread: tiers, dispatch, lookup and load.

Stores, promotion, prefetch and background work are its `Movement` and `Background` parts
(`_movement.py`); single-flight loads its `FlightTable` (`_flight.py`); counters and trace
records common to this path and the off-thread one come from `_accounting.py`.

`KernelCore` runs inside any trio nursery, so tests drive it on virtual time and benchmarks
call it without the host thread. `Kernel` (in `_kernel.py`) hosts one in its own thread.

The trio thread only orchestrates: payload copies, checksums and codecs run inside the
drivers' worker-thread calls, or in `trio.to_thread` here (single-flight copies).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import trio

from ucm.block import Scatter, copy_bytes
from ucm.codecs import Codec, KVLayouts
from ucm.config import TierConfig, UCMConfig
from ucm.drivers import FreeSpace, Listing, LoadState, get_driver_class
from ucm.drivers.kit import Workers
from ucm.errors import (
    DeadlineExceeded,
    DriverError,
    InvalidRequest,
    KernelClosed,
    UCMError,
)
from ucm.kernel._accounting import count_load, count_lookup, load_op, lookup_result, trace_fields
from ucm.kernel._events import (
    Delete,
    DoneResult,
    Event,
    Load,
    LoadResult,
    Lookup,
    LookupResult,
    Prefetch,
    Priority,
    Store,
    Unpin,
)
from ucm.kernel._flight import FlightTable
from ucm.kernel._groups import unwrap_single
from ucm.kernel._holds import Holds
from ucm.kernel._movement import Background, Movement
from ucm.kernel._mrc import MissRatioCurve, default_min_blocks
from ucm.kernel._policy import make_policy
from ucm.kernel._tier import Tier, keys_of

if TYPE_CHECKING:
    from ucm.trace import Tracer

log = logging.getLogger("ucm.kernel")


class KernelCore:
    def __init__(self, config: UCMConfig, nursery: trio.Nursery, *,
                 tracer: Tracer | None = None, layouts: KVLayouts | None = None) -> None:
        self.config = config
        self.layouts = layouts  # the namespace's KV layouts, for the tiers that quantize
        self.tiers: list[Tier] = []
        self.stats: Counter[str] = Counter()
        self.tracer = tracer
        self._nursery = nursery
        threads = config.threads
        # The threads of this kernel's drivers: lent to each at open, closed after the last.
        self.workers = Workers(copy_threads=threads.copy_threads, pin_copy=threads.pin_copy,
                               store_threads=threads.store_threads)
        self._flights = FlightTable()
        self.background = Background(nursery, self.stats)
        self.movement = Movement(self, self.background)
        self._listings = 0  # tiers whose stored blocks are still being indexed
        # Set while no listing runs; read from other threads (Kernel.wait_indexed).
        self.indexed = threading.Event()
        self.indexed.set()
        self._closing = False

    # -- life cycle ----------------------------------------------------------------------------
    @classmethod
    @asynccontextmanager
    async def open(cls, config: UCMConfig, *, tracer: Tracer | None = None,
                   drain_timeout: float = 30.0, layouts: KVLayouts | None = None,
                   ) -> AsyncIterator[KernelCore]:
        """Opens every tier; on exit drains background work (up to `drain_timeout`), then
        closes the drivers."""
        if tracer is None:
            tracer = _configured_tracer(config)
        with unwrap_single():
            async with trio.open_nursery() as nursery:
                core = cls(config, nursery, tracer=tracer, layouts=layouts)
                if tracer is not None:  # writes the trace; flushes and closes on cancel
                    nursery.start_soon(tracer.serve)
                try:
                    for tier_config in config.tiers:
                        await core.attach(tier_config)
                    yield core
                    core._closing = core.background.closing = True
                    with trio.move_on_after(drain_timeout):
                        await core.wait_background_idle()
                finally:
                    core._closing = core.background.closing = True
                    nursery.cancel_scope.cancel()
                    with trio.CancelScope(shield=True):
                        for tier in core.tiers:
                            await core._close_driver(tier)
                        core.tiers = []
                        await trio.to_thread.run_sync(core.workers.close)

    async def attach(self, tier_config: TierConfig | dict[str, Any], *,
                     position: int | None = None) -> str:
        """Opens a driver and adds it as a tier (at `position`, default last)."""
        if isinstance(tier_config, dict):
            tier_config = TierConfig.model_validate(tier_config)
        name = tier_config.name or tier_config.driver
        if any(t.name == name for t in self.tiers):
            raise InvalidRequest(f"a tier named {name!r} is attached already")
        factory = get_driver_class(tier_config.driver)
        codec = tier_config.codec or self.config.codec  # a tier without one: the default
        extra = ({"layouts": self.layouts} if self.layouts is not None
                 and Codec.parse(codec).quantizes else {})
        driver = await factory.open(tier_config.options, name=name,
                                    namespace=self.config.namespace, codec=codec,
                                    workers=self.workers, **extra)
        policy = make_policy(self.config.eviction,
                             int(tier_config.capacity) if tier_config.capacity else None,
                             clock=trio.current_time)
        tier = Tier(tier_config, driver, policy, _mrc_of(self.config, policy.capacity))
        tier.holds = Holds(policy, self.config.sessions.cap_bytes(policy.capacity), self.stats,
                           clock=trio.current_time)
        self.tiers.insert(len(self.tiers) if position is None else position, tier)
        if isinstance(driver, Listing):
            # Blocks already in storage (a restart) enter the index in the background: a tier
            # of many blocks must not hold up start-up, and until a key is indexed a lookup
            # asks the driver, which finds it.
            self._listings += 1
            self.indexed.clear()
            if not self.background.spawn(self._index_stored_blocks, tier, driver):
                self._listing_done()
        else:
            _check_room(tier)
        self.emit("attach", 0, tier=name)
        return name

    async def _index_stored_blocks(self, tier: Tier, lister: Listing) -> None:
        try:
            with self._using([tier]):
                tier.indexing = True
                try:
                    async for key, size in lister.list_blocks():
                        if key not in tier and key not in tier.removed_while_indexing:
                            tier.add(key, size, None, reference=False)
                finally:
                    tier.indexing = False
                    tier.removed_while_indexing.clear()
                policy = tier.policy
                if policy.capacity is not None and policy.used > policy.capacity:
                    await self.movement.delete_victims(tier, policy.make_room(0) or [])
                _check_room(tier)
        finally:
            self._listing_done()
        self.emit("indexed", 0, tier=tier.name, blocks=len(policy), bytes=policy.used)

    def _listing_done(self) -> None:
        self._listings -= 1
        if not self._listings:
            self.indexed.set()

    async def detach(self, name: str) -> None:
        """Removes a tier: new events stop using it at once; events that already hold it
        finish first; then its driver closes."""
        tier = self._tier(name)
        tier.detaching = True
        self.tiers = [t for t in self.tiers if t is not tier]
        await tier.wait_idle()
        await self._close_driver(tier)
        self.emit("detach", 0, tier=name)

    async def _close_driver(self, tier: Tier) -> None:
        try:
            await tier.driver.aclose()
        except Exception as exc:  # closing must go on for the other tiers
            log.warning("tier %s: driver close failed: %s", tier.name, exc)

    def _tier(self, name: str) -> Tier:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise InvalidRequest(f"no tier named {name!r}")

    @contextmanager
    def _using(self, tiers: list[Tier]) -> Iterator[list[Tier]]:
        for tier in tiers:
            tier.enter()
        try:
            yield tiers
        finally:
            for tier in tiers:
                tier.leave()

    # -- dispatch ------------------------------------------------------------------------------
    async def run(self, event: Event, *, event_id: int = 0) -> Any:
        """Runs one event to completion under its deadline."""
        if self._closing:
            raise KernelClosed("the kernel is closing")
        deadline = event.deadline if event.deadline is not None else self.config.deadline
        tracer = self.tracer
        if tracer is not None:
            tracer.emit("start", event_id, trace_fields(event, start=True))
        try:
            if deadline is None:
                result = await self._dispatch(event, event_id)
            else:
                with trio.fail_after(deadline):
                    result = await self._dispatch(event, event_id)
        except trio.TooSlowError:
            self.stats["deadline_exceeded"] += 1
            self.emit("done", event_id, outcome="deadline")
            raise DeadlineExceeded(
                f"{type(event).__name__} of {len(event.keys)} blocks did not finish within "
                f"{deadline:g} s") from None
        except UCMError as exc:
            self.emit("done", event_id, outcome="error", kind=type(exc).__name__,
                       error=str(exc))
            raise
        except BaseException as exc:  # cancelled, or an internal error: the trace still ends
            if self.tracer is not None:
                self.emit("done", event_id, kind=type(exc).__name__,
                           outcome="cancelled" if isinstance(exc, trio.Cancelled) else "error")
            raise
        self.emit("done", event_id, outcome="ok")
        return result

    async def _dispatch(self, event: Event, event_id: int) -> Any:
        with self._using(list(self.tiers)) as tiers:
            if not tiers:
                raise KernelClosed("no tiers are attached")
            if isinstance(event, Load):
                return await self._load(event, tiers, event_id)
            if isinstance(event, Lookup):
                return await self.lookup_in(event, tiers, event_id)
            if isinstance(event, Store):
                return await self.movement.store(event, tiers, event_id)
            if isinstance(event, Prefetch):
                return await self.movement.prefetch(event, tiers, event_id)
            if isinstance(event, Delete):
                return await self._delete(event, tiers)
            if isinstance(event, Unpin):
                for key in event.keys:
                    for tier in tiers:
                        tier.policy.unpin(key)
                return DoneResult(len(event.keys))
        raise InvalidRequest(f"not a ucm event: {type(event).__name__}")

    # -- lookup ----------------------------------------------------------------------------------
    async def lookup_in(self, event: Lookup, tiers: list[Tier], event_id: int) -> LookupResult:
        """Where each key of `event` is, looked for in `tiers` (fastest first)."""
        keys = event.keys
        found: list[Tier | None] = [None] * len(keys)
        pending: Sequence[int] = range(len(keys))
        for tier in tiers:
            ask = []
            index = tier.policy.index
            for i in pending:
                if keys[i] in index:
                    found[i] = tier
                else:
                    ask.append(i)
            if ask:
                asked = await self._driver_lookup(tier, keys_of(keys, ask), event_id)
                for i, hit in zip(ask, asked, strict=True):
                    if hit:
                        found[i] = tier
            pending = [i for i in ask if found[i] is None]
            if not pending:
                break
        if event.prefix:
            for i, where in enumerate(found):
                if where is None:
                    found[i:] = [None] * (len(found) - i)
                    break
        hits = tuple(t is not None for t in found)
        if event.pin:
            for key, where in zip(keys, found, strict=True):
                if where is not None:
                    where.policy.pin(key, self.config.pin_ttl)
        by_tier = {tier.name: sum(1 for t in found if t is tier) for tier in tiers}
        count_lookup(self.stats, len(keys), by_tier)
        self.emit("result", event_id, **lookup_result(len(keys), by_tier))
        if self.config.promote and event.promote:
            self.movement.promote(keys, found, tiers)
        return LookupResult(hits, tuple(t.name if t else None for t in found))

    async def _driver_lookup(self, tier: Tier, keys: list[bytes], event_id: int) -> list[bool]:
        t0 = time.monotonic_ns()
        try:
            hits = await tier.call(Priority.LOOKUP, tier.driver.lookup, keys)
        except DriverError as exc:
            self.count_error(tier, "lookup", exc)
            self.emit("op", event_id, tier=tier.name, op="lookup", keys=len(keys), t0=t0,
                       error=type(exc).__name__)
            return [False] * len(keys)
        self.emit("op", event_id, tier=tier.name, op="lookup", keys=len(keys), t0=t0,
                   hits=sum(hits))
        return hits

    # -- load ------------------------------------------------------------------------------------
    async def _load(self, event: Load, tiers: list[Tier], event_id: int) -> LoadResult:
        keys, buffers = event.keys, event.buffers
        n = len(keys)
        states = [LoadState.MISSING] * n
        sources: list[Tier | None] = [None] * n
        errors: list[str] = []
        leaders, followers = self._flights.join(keys, buffers)
        try:
            if leaders:
                await self._load_from_tiers(event, leaders, tiers, states, sources, errors,
                                            event_id)
        finally:
            with trio.CancelScope(shield=True):
                await self._flights.land(keys, buffers, leaders, states,
                                         [t.name if t else None for t in sources])
        for i, flight in followers:
            await self._flights.follow(flight, buffers[i])
            states[i] = flight.state
            sources[i] = next((t for t in tiers if t.name == flight.tier), None)
            self.stats["load_single_flight"] += 1
        for key in keys:
            for tier in tiers:
                tier.policy.unpin(key)
        count_load(self.stats, states, [t.name if t else None for t in sources],
                   [b.nbytes for b in buffers])
        if self.config.promote and event.promote:
            self.movement.promote(keys, sources, tiers, raw=[b.nbytes for b in buffers])
        return LoadResult(tuple(states), tuple(t.name if t else None for t in sources),
                          tuple(errors))

    async def _load_from_tiers(self, event: Load, pending: list[int], tiers: list[Tier],
                               states: list[LoadState], sources: list[Tier | None],
                               errors: list[str], event_id: int) -> None:
        keys, buffers = event.keys, event.buffers
        corrupt: set[int] = set()
        failed: set[int] = set()
        for tier in tiers:
            if not pending:
                return
            t0 = time.monotonic_ns()
            targets = [buffers[i] for i in pending]
            scatter_loader = tier.scatter_loader
            load: Callable[..., Awaitable[list[LoadState]]]
            if scatter_loader is not None:
                staged, load = None, scatter_loader.load_scatter
            else:
                staged, load = _stage_scatters(targets), tier.driver.load
            try:
                result = await tier.call(Priority.LOAD, load, keys_of(keys, pending),
                                         staged or targets)
                if staged:
                    await _unstage(staged, targets, result)
            except InvalidRequest:
                raise
            except DriverError as exc:
                self.count_error(tier, "load", exc)
                self.emit("op", event_id, tier=tier.name, op="load", keys=len(pending), t0=t0,
                           error=type(exc).__name__)
                errors.append(str(exc))
                failed.update(pending)
                continue
            still: list[int] = []
            nbytes = 0
            for i, state in zip(pending, result, strict=True):
                if state is LoadState.OK:
                    states[i] = LoadState.OK
                    sources[i] = tier
                    tier.touch(keys[i], i)  # its index: the depth hint
                    tier.raw_sizes[keys[i]] = buffers[i].nbytes
                    nbytes += buffers[i].nbytes
                    continue
                if state is LoadState.CORRUPT:
                    corrupt.add(i)
                    self.count_error(tier, "load", None, kind="corrupt")
                    self.background.spawn(self.movement.delete_victims, tier, [keys[i]])
                elif state is LoadState.FAILED:
                    failed.add(i)
                    self.count_error(tier, "load", None, kind="failed")
                elif keys[i] in tier:
                    tier.discard(keys[i])  # the index was stale (another process removed it)
                still.append(i)
            self.emit("op", event_id, **load_op(tier.name, len(pending), t0,
                                                len(pending) - len(still), nbytes))
            pending = still
        for i in pending:
            states[i] = (LoadState.CORRUPT if i in corrupt
                         else LoadState.FAILED if i in failed else LoadState.MISSING)

    # -- delete ----------------------------------------------------------------------------------
    async def _delete(self, event: Delete, tiers: list[Tier]) -> DoneResult:
        with unwrap_single():
            async with trio.open_nursery() as nursery:
                for tier in tiers:
                    for key in event.keys:
                        tier.discard(key)
                    nursery.start_soon(tier.call, Priority.STORE, tier.driver.delete,
                                       list(event.keys))
        return DoneResult(len(event.keys))

    # -- session holds ---------------------------------------------------------------------------
    def hold(self, session: str, keys: Sequence[bytes], retain_s: float) -> int:
        """Holds `keys` in the fastest tier for `session` (`_holds.Holds.hold`)."""
        if not self.tiers or self.tiers[0].holds is None:
            raise KernelClosed("no tiers are attached")
        return self.tiers[0].holds.hold(session, keys, retain_s)

    def release(self, session: str) -> bool:
        """Ends `session`'s holds in every tier (the fastest may have changed since)."""
        released = False
        for tier in self.tiers:
            if tier.holds is not None and tier.holds.release(session, "end"):
                released = True
        return released

    def session_keys(self, session: str) -> set[bytes]:
        """The keys `session` holds (in any tier)."""
        return set().union(*(t.holds.keys_of(session) for t in self.tiers
                             if t.holds is not None))

    async def wait_background_idle(self) -> None:
        """Waits until promotions, propagations and cleanups have finished."""
        await self.background.wait_idle()

    # -- accounting ------------------------------------------------------------------------------
    def count_error(self, tier: Tier, op: str, exc: BaseException | None, *,
                     kind: str | None = None) -> None:
        kind = kind or type(exc).__name__
        self.stats[f"errors.{tier.name}.{op}.{kind}"] += 1
        self.stats["errors"] += 1
        self.emit("error", 0, tier=tier.name, op=op, kind=kind)
        if exc is not None:
            log.debug("tier %s: %s failed: %s", tier.name, op, exc)

    def emit(self, phase: str, event_id: int, **fields: Any) -> None:
        tracer = self.tracer
        if tracer is not None:
            tracer.emit(phase, event_id, fields)

    def snapshot(self) -> dict[str, Any]:
        """Counters plus per-tier occupancy, for statistics() and metrics."""
        out: dict[str, Any] = dict(self.stats)
        for tier in self.tiers:
            out[f"tier.{tier.name}.blocks"] = len(tier.policy)
            out[f"tier.{tier.name}.bytes"] = tier.policy.used
            out[f"tier.{tier.name}.capacity"] = tier.policy.capacity
            out[f"tier.{tier.name}.pinned"] = tier.policy.pinned_count
            out[f"tier.{tier.name}.prefetch_hits"] = tier.prefetch_hits
            out[f"tier.{tier.name}.prefetch_evicted"] = tier.prefetch_evicted
            if tier.holds is not None:
                tier.holds.expire()
                out[f"tier.{tier.name}.held_bytes"] = tier.holds.held_bytes
                out[f"tier.{tier.name}.held_sessions"] = len(tier.holds)
            out[f"tier.{tier.name}.driver"] = tier.driver.statistics()
            if tier.mrc is not None:
                out[f"tier.{tier.name}.mrc"] = tier.mrc.snapshot()
        out["background_pending"] = self.background.pending
        out["single_flight_keys"] = len(self._flights)
        return out


def _check_room(tier: Tier) -> None:
    """Warns when a tier's capacity is more than it holds plus the free space its driver
    reports: it would fill the device first (stores then shrink the capacity to fit)."""
    capacity, driver = tier.policy.capacity, tier.driver
    if capacity is None or not isinstance(driver, FreeSpace):
        return
    free = driver.free_bytes()
    if free is not None and capacity > tier.policy.used + free:
        log.warning("tier %s: capacity %d bytes is more than its storage can take (%d held, "
                    "%d free)", tier.name, capacity, tier.policy.used, free)


def _configured_tracer(config: UCMConfig) -> Tracer | None:
    """The tracer that `config.trace` or `UCM_TRACE` asks for; None (and no import) when off."""
    if config.trace is None and not os.environ.get("UCM_TRACE"):
        return None
    from ucm.trace import tracer_from_config

    return tracer_from_config(config)


def _stage_scatters(targets: list[memoryview | Scatter]) -> list[memoryview] | None:
    """Contiguous stand-ins for the Scatter buffers, for a driver that reads into one buffer
    per key (None when there is no Scatter). A driver whose call was abandoned may still write
    into a stand-in later, never into the caller's pieces."""
    if not any(type(t) is Scatter for t in targets):
        return None
    return [memoryview(bytearray(t.nbytes)) if type(t) is Scatter else t for t in targets]


async def _unstage(staged: list[memoryview], targets: list[memoryview | Scatter],
                   states: Sequence[LoadState]) -> None:
    copies = [(t, s) for t, s, state in zip(targets, staged, states, strict=True)
              if type(t) is Scatter and state is LoadState.OK]
    if copies:
        await trio.to_thread.run_sync(_copy_into, copies)


def _copy_into(copies: list[tuple[Scatter, memoryview]]) -> None:
    for dst, src in copies:
        copy_bytes(dst, src)


MRC_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1, 1.5, 2, 4)


def _mrc_of(config: UCMConfig, capacity: int | None) -> MissRatioCurve | None:
    """The tier's miss-ratio curve, if the config asks for one and it has sizes to use."""
    mrc = config.mrc
    if mrc is None:
        return None
    if mrc.capacities is not None:
        sizes = [int(c) for c in mrc.capacities]
    elif capacity is not None:
        sizes = [max(1, int(capacity * f)) for f in MRC_FRACTIONS]
    else:
        return None
    min_blocks = mrc.min_blocks
    if min_blocks is None:
        min_blocks = default_min_blocks(config.eviction)
    return MissRatioCurve(config.eviction, sizes, rate=mrc.sample_rate,
                          max_keys=mrc.max_keys, min_blocks=min_blocks)
