"""The kernel's logic, on the trio thread: tiers, dispatch, single-flight, promotion.

`KernelCore` runs inside any trio nursery, so tests drive it on virtual time and benchmarks
call it without the host thread. `Kernel` (in `_kernel.py`) hosts one in its own thread.

The trio thread only orchestrates: payload copies, checksums and codecs run inside the
drivers' worker-thread calls, or in `trio.to_thread` here (single-flight copies).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import trio

from ucm.config import TierConfig, UCMConfig
from ucm.drivers import Listing, LoadState, get_driver_class
from ucm.errors import (
    DeadlineExceeded,
    DriverError,
    InvalidRequest,
    KernelClosed,
    NoCapacity,
    UCMError,
)
from ucm.kernel._events import (
    Delete,
    DoneResult,
    Event,
    Load,
    LoadResult,
    Lookup,
    LookupResult,
    Prefetch,
    PrefetchResult,
    Priority,
    Store,
    StoreResult,
    Unpin,
)
from ucm.kernel._policy import make_policy
from ucm.kernel._tier import Tier, keys_of

log = logging.getLogger("ucm.kernel")

_COPY_IN_THREAD_BYTES = 1 << 20  # smaller single-flight copies stay on the trio thread
_BACKGROUND_QUEUE_LIMIT = 1024  # background copies beyond this are dropped (a future miss)


@contextmanager
def _unwrap_single():
    """Re-raises a nursery's one-exception group as that exception, so callers see the
    ucm error (with its message) rather than a group around it."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup):
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


class _Flight:
    """One key being loaded; later loads of the key wait for it instead of reading storage."""

    __slots__ = ("done", "followers", "frozen", "state", "tier")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.followers: list[memoryview] = []
        self.frozen = False  # followers list is closed: the leader is copying into them
        self.state = LoadState.FAILED
        self.tier: str | None = None


class KernelCore:
    def __init__(self, config: UCMConfig, nursery: trio.Nursery, *, tracer: Any = None) -> None:
        self.config = config
        self.tiers: list[Tier] = []
        self.stats: Counter[str] = Counter()
        self.tracer = tracer
        self._nursery = nursery
        self._loading: dict[bytes, _Flight] = {}
        self._background_limiter = trio.CapacityLimiter(2)
        self._background_pending = 0
        self._background_idle = trio.Event()
        self._background_idle.set()
        self._closing = False

    # -- life cycle ----------------------------------------------------------------------------
    @classmethod
    @asynccontextmanager
    async def open(cls, config: UCMConfig, *, tracer: Any = None,
                   drain_timeout: float = 30.0) -> AsyncIterator[KernelCore]:
        """Opens every tier; on exit drains background work (up to `drain_timeout`), then
        closes the drivers."""
        if tracer is None:
            tracer = _configured_tracer(config)
        with _unwrap_single():
            async with trio.open_nursery() as nursery:
                core = cls(config, nursery, tracer=tracer)
                if hasattr(tracer, "serve"):  # writes the trace; flushes and closes on cancel
                    nursery.start_soon(tracer.serve)
                try:
                    for tier_config in config.tiers:
                        await core.attach(tier_config)
                    yield core
                    core._closing = True
                    with trio.move_on_after(drain_timeout):
                        await core.wait_background_idle()
                finally:
                    core._closing = True
                    nursery.cancel_scope.cancel()
                    with trio.CancelScope(shield=True):
                        for tier in core.tiers:
                            await core._close_driver(tier)
                        core.tiers = []

    async def attach(self, tier_config: TierConfig | dict, *, position: int | None = None,
                     ) -> str:
        """Opens a driver and adds it as a tier (at `position`, default last)."""
        if isinstance(tier_config, dict):
            tier_config = TierConfig.model_validate(tier_config)
        name = tier_config.name or tier_config.driver
        if any(t.name == name for t in self.tiers):
            raise InvalidRequest(f"a tier named {name!r} is attached already")
        factory = get_driver_class(tier_config.driver)
        driver = await factory.open(tier_config.options, name=name,
                                    namespace=self.config.namespace, codec=tier_config.codec)
        policy = make_policy(self.config.eviction,
                             int(tier_config.capacity) if tier_config.capacity else None,
                             clock=trio.current_time)
        tier = Tier(tier_config, driver, policy)
        if isinstance(driver, Listing):
            async for key, size in driver.list_blocks():
                tier.add(key, size, None)
        self.tiers.insert(len(self.tiers) if position is None else position, tier)
        if policy.capacity is not None and policy.used > policy.capacity:
            victims = policy.make_room(0) or []
            self._spawn(self._delete_victims, tier, victims)
        self._emit("attach", 0, tier=name, blocks=len(policy), bytes=policy.used)
        return name

    async def detach(self, name: str) -> None:
        """Removes a tier: new events stop using it at once; events that already hold it
        finish first; then its driver closes."""
        tier = self._tier(name)
        tier.detaching = True
        self.tiers = [t for t in self.tiers if t is not tier]
        await tier.wait_idle()
        await self._close_driver(tier)
        self._emit("detach", 0, tier=name)

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
    def _using(self, tiers: list[Tier]):
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
            tracer.emit("start", event_id, {"type": type(event).__name__, "keys": len(event.keys),
                                            "request_id": event.request_id,
                                            "key": event.keys[0][:8].hex()})
        try:
            if deadline is None:
                result = await self._dispatch(event, event_id)
            else:
                with trio.fail_after(deadline):
                    result = await self._dispatch(event, event_id)
        except trio.TooSlowError:
            self.stats["deadline_exceeded"] += 1
            self._emit("done", event_id, outcome="deadline")
            raise DeadlineExceeded(
                f"{type(event).__name__} of {len(event.keys)} blocks did not finish within "
                f"{deadline:g} s") from None
        except UCMError as exc:
            self._emit("done", event_id, outcome="error", kind=type(exc).__name__,
                       error=str(exc))
            raise
        except BaseException as exc:  # cancelled, or an internal error: the trace still ends
            if self.tracer is not None:
                self._emit("done", event_id, kind=type(exc).__name__,
                           outcome="cancelled" if isinstance(exc, trio.Cancelled) else "error")
            raise
        self._emit("done", event_id, outcome="ok")
        return result

    async def _dispatch(self, event: Event, event_id: int) -> Any:
        with self._using(list(self.tiers)) as tiers:
            if not tiers:
                raise KernelClosed("no tiers are attached")
            if isinstance(event, Load):
                return await self._load(event, tiers, event_id)
            if isinstance(event, Lookup):
                return await self._lookup(event, tiers, event_id)
            if isinstance(event, Store):
                return await self._store(event, tiers, event_id)
            if isinstance(event, Prefetch):
                return await self._prefetch(event, tiers, event_id)
            if isinstance(event, Delete):
                return await self._delete(event, tiers)
            if isinstance(event, Unpin):
                for key in event.keys:
                    for tier in tiers:
                        tier.policy.unpin(key)
                return DoneResult(len(event.keys))
        raise InvalidRequest(f"not a ucm event: {type(event).__name__}")

    # -- lookup ----------------------------------------------------------------------------------
    async def _lookup(self, event: Lookup, tiers: list[Tier], event_id: int) -> LookupResult:
        keys = event.keys
        found: list[Tier | None] = [None] * len(keys)
        pending = range(len(keys))
        for tier in tiers:
            ask = []
            index = tier.policy.index
            for i in pending:
                if keys[i] in index:
                    found[i] = tier
                else:
                    ask.append(i)
            if ask:
                hits = await self._driver_lookup(tier, keys_of(keys, ask), event_id)
                for i, hit in zip(ask, hits, strict=True):
                    if hit:
                        found[i] = tier
            pending = [i for i in ask if found[i] is None]
            if not pending:
                break
        if event.prefix:
            for i, tier in enumerate(found):
                if tier is None:
                    found[i:] = [None] * (len(found) - i)
                    break
        hits = tuple(t is not None for t in found)
        if event.pin:
            for key, tier in zip(keys, found, strict=True):
                if tier is not None:
                    tier.policy.pin(key, self.config.pin_ttl)
        self.stats["lookup_keys"] += len(keys)
        by_tier = {tier.name: sum(1 for t in found if t is tier) for tier in tiers}
        for name, count in by_tier.items():
            self.stats[f"lookup_hits.{name}"] += count
        self._emit("result", event_id, op="lookup", keys=len(keys), hits=by_tier)
        if self.config.promote:
            self._promote(keys, found, tiers)
        return LookupResult(hits, tuple(t.name if t else None for t in found))

    async def _driver_lookup(self, tier: Tier, keys: list[bytes], event_id: int) -> list[bool]:
        t0 = time.monotonic_ns()
        try:
            hits = await tier.call(Priority.LOOKUP, tier.driver.lookup, keys)
        except DriverError as exc:
            self._count_error(tier, "lookup", exc)
            self._emit("op", event_id, tier=tier.name, op="lookup", keys=len(keys), t0=t0,
                       error=type(exc).__name__)
            return [False] * len(keys)
        self._emit("op", event_id, tier=tier.name, op="lookup", keys=len(keys), t0=t0,
                   hits=sum(hits))
        return hits

    # -- load ------------------------------------------------------------------------------------
    async def _load(self, event: Load, tiers: list[Tier], event_id: int) -> LoadResult:
        keys, buffers = event.keys, event.buffers
        n = len(keys)
        states = [LoadState.MISSING] * n
        sources: list[Tier | None] = [None] * n
        errors: list[str] = []
        leaders: list[int] = []
        followers: list[tuple[int, _Flight]] = []
        for i, key in enumerate(keys):
            flight = self._loading.get(key)
            if flight is None:
                self._loading[key] = _Flight()
                leaders.append(i)
            else:
                flight.followers.append(buffers[i])
                followers.append((i, flight))
        try:
            if leaders:
                await self._load_from_tiers(event, leaders, tiers, states, sources, errors,
                                            event_id)
        finally:
            with trio.CancelScope(shield=True):
                await self._finish_flights(event, leaders, states, sources)
        for i, flight in followers:
            await self._follow(flight, buffers[i])
            states[i] = flight.state
            sources[i] = next((t for t in tiers if t.name == flight.tier), None)
            self.stats["load_single_flight"] += 1
        for key in keys:
            for tier in tiers:
                tier.policy.unpin(key)
        self._account_load(keys, buffers, states, sources, tiers)
        if self.config.promote:
            self._promote(keys, sources, tiers, raw=[b.nbytes for b in buffers])
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
            try:
                result = await tier.call(Priority.LOAD, tier.driver.load, keys_of(keys, pending),
                                         [buffers[i] for i in pending])
            except InvalidRequest:
                raise
            except DriverError as exc:
                self._count_error(tier, "load", exc)
                self._emit("op", event_id, tier=tier.name, op="load", keys=len(pending), t0=t0,
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
                    tier.policy.touch(keys[i])
                    tier.raw_sizes[keys[i]] = buffers[i].nbytes
                    nbytes += buffers[i].nbytes
                    continue
                if state is LoadState.CORRUPT:
                    corrupt.add(i)
                    self._count_error(tier, "load", None, kind="corrupt")
                    self._spawn(self._delete_victims, tier, [keys[i]])
                elif state is LoadState.FAILED:
                    failed.add(i)
                    self._count_error(tier, "load", None, kind="failed")
                elif keys[i] in tier:
                    tier.discard(keys[i])  # the index was stale (another process removed it)
                still.append(i)
            self._emit("op", event_id, tier=tier.name, op="load", keys=len(pending), t0=t0,
                       hits=len(pending) - len(still), bytes=nbytes)
            pending = still
        for i in pending:
            states[i] = (LoadState.CORRUPT if i in corrupt
                         else LoadState.FAILED if i in failed else LoadState.MISSING)

    async def _finish_flights(self, event: Load, leaders: list[int], states: list[LoadState],
                              sources: list[Tier | None]) -> None:
        copies: list[tuple[memoryview, memoryview]] = []
        flights = []
        for i in leaders:
            flight = self._loading.pop(event.keys[i])
            flight.frozen = True
            flight.state = states[i]
            flight.tier = sources[i].name if sources[i] else None
            if states[i] is LoadState.OK:
                copies.extend((dst, event.buffers[i]) for dst in flight.followers)
            flights.append(flight)
        try:
            if copies:
                total = sum(src.nbytes for _, src in copies)
                if total >= _COPY_IN_THREAD_BYTES:
                    await trio.to_thread.run_sync(_copy_all, copies)
                else:
                    _copy_all(copies)
        except Exception as exc:  # a wrong-sized follower buffer
            log.warning("single-flight copy failed: %s", exc)
            for flight in flights:
                flight.state = LoadState.FAILED
        finally:
            for flight in flights:
                flight.done.set()

    async def _follow(self, flight: _Flight, buffer: memoryview) -> None:
        try:
            await flight.done.wait()
        except trio.Cancelled:
            if not flight.frozen:
                flight.followers.remove(buffer)
            else:  # the leader is writing into our buffer: wait until it is done
                with trio.CancelScope(shield=True):
                    await flight.done.wait()
            raise

    def _account_load(self, keys: Sequence[bytes], buffers: Sequence[memoryview],
                      states: list[LoadState], sources: list[Tier | None],
                      tiers: list[Tier]) -> None:
        stats = self.stats
        stats["load_keys"] += len(keys)
        for i, state in enumerate(states):
            if state is LoadState.OK:
                stats[f"load_hits.{sources[i].name}"] += 1
                stats["bytes_loaded"] += buffers[i].nbytes
            else:
                stats[f"load_{state.name.lower()}"] += 1

    # -- store -----------------------------------------------------------------------------------
    def _required_tiers(self, tiers: list[Tier], durability: str) -> int:
        if durability == "memory":
            return 1
        if durability == "local":
            for depth, tier in enumerate(tiers):
                if tier.persistent:
                    return depth + 1
        return len(tiers)

    async def _store(self, event: Store, tiers: list[Tier], event_id: int) -> StoreResult:
        keys, buffers = event.keys, event.buffers
        durability = event.durability or self.config.durability
        required = tiers[: self._required_tiers(tiers, durability)]
        results: dict[str, list[bool]] = {}
        errors: list[str] = []
        indices = list(range(len(keys)))

        async def store_one(tier: Tier) -> None:
            results[tier.name] = await self._store_into(tier, keys, buffers, indices, errors,
                                                        Priority.STORE, event_id)

        with _unwrap_single():
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

    async def _store_into(self, tier: Tier, keys: Sequence[bytes],
                          buffers: Sequence[memoryview], indices: list[int], errors: list[str],
                          priority: int, event_id: int) -> list[bool]:
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
                self._count_error(tier, "store", None, kind="no_capacity")
                continue
            victims.extend(more)
            reserved += need
            chosen.append(i)
        try:
            if victims:
                await self._delete_victims(tier, victims)
            if not chosen:
                return ok
            t0 = time.monotonic_ns()
            try:
                sizes = await tier.call(priority, tier.driver.store, keys_of(keys, chosen),
                                        [buffers[i] for i in chosen])
            except DriverError as exc:
                self._count_error(tier, "store", exc)
                self._emit("op", event_id, tier=tier.name, op="store", keys=len(chosen), t0=t0,
                           error=type(exc).__name__)
                errors.append(str(exc))
                return ok
            nbytes = 0
            for i, size in zip(chosen, sizes, strict=True):
                if size > 0:
                    tier.add(keys[i], size, buffers[i].nbytes)
                    ok[i] = True
                    nbytes += buffers[i].nbytes
                else:
                    self._count_error(tier, "store", None, kind="failed")
            self._emit("op", event_id, tier=tier.name, op="store", keys=len(chosen), t0=t0,
                       bytes=nbytes, stored=sum(1 for s in sizes if s > 0))
            return ok
        finally:
            tier.unreserve(reserved)

    async def _delete_victims(self, tier: Tier, keys: list[bytes]) -> None:
        for key in keys:
            tier.discard(key)
        try:
            await tier.call(Priority.STORE, tier.driver.delete, keys)
        except DriverError as exc:
            self._count_error(tier, "delete", exc)
            return
        self.stats[f"evictions.{tier.name}"] += len(keys)
        self._emit("evict", 0, tier=tier.name, keys=len(keys))

    # -- prefetch, promotion and background copies ------------------------------------------------
    async def _prefetch(self, event: Prefetch, tiers: list[Tier], event_id: int,
                        ) -> PrefetchResult:
        keys = event.keys
        top = tiers[0]
        absent = [k for k in keys if k not in top]
        if len(tiers) == 1 or not absent:
            return PrefetchResult(0, len(keys) - len(absent), 0)
        found = await self._lookup(Lookup(absent), tiers[1:], event_id)
        promoted = 0
        for tier in tiers[1:]:
            batch = [k for k, name in zip(absent, found.tiers, strict=True) if name == tier.name]
            sized = [(k, self._raw_size(k, tiers, event.block_bytes)) for k in batch]
            sized = [(k, s) for k, s in sized if s is not None]
            if sized:
                promoted += await self._copy([k for k, _ in sized], [s for _, s in sized],
                                             tier, [top], priority=Priority.PREFETCH)
        missing = found.hits.count(False)
        return PrefetchResult(promoted, len(keys) - len(absent), missing)

    def _raw_size(self, key: bytes, tiers: list[Tier], default: int | None) -> int | None:
        for tier in tiers:
            size = tier.raw_sizes.get(key)
            if size is not None:
                return size
        return default

    def _promote(self, keys: Sequence[bytes], sources: Sequence[Tier | None],
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
            self._count_error(source, "load", exc)
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

    def _spawn(self, fn: Any, *args: Any) -> None:
        """Runs background work (promotion, propagation, cleanup). Never raises: a dropped
        background copy is a future cache miss."""
        if self._closing or self._background_pending >= _BACKGROUND_QUEUE_LIMIT:
            self.stats["background_dropped"] += 1
            return
        if self._background_pending == 0:
            self._background_idle = trio.Event()
        self._background_pending += 1
        self._nursery.start_soon(self._background, fn, args)

    async def _background(self, fn: Any, args: tuple) -> None:
        try:
            async with self._background_limiter:
                await fn(*args)
        except Exception as exc:  # background work must not take the kernel down
            self.stats["background_errors"] += 1
            log.warning("background %s failed: %r", getattr(fn, "__name__", fn), exc)
        finally:
            self._background_pending -= 1
            if self._background_pending == 0:
                self._background_idle.set()

    async def wait_background_idle(self) -> None:
        """Waits until promotions, propagations and cleanups have finished."""
        while self._background_pending:
            await self._background_idle.wait()

    # -- delete ----------------------------------------------------------------------------------
    async def _delete(self, event: Delete, tiers: list[Tier]) -> DoneResult:
        with _unwrap_single():
            async with trio.open_nursery() as nursery:
                for tier in tiers:
                    for key in event.keys:
                        tier.discard(key)
                    nursery.start_soon(tier.call, Priority.STORE, tier.driver.delete,
                                       list(event.keys))
        return DoneResult(len(event.keys))

    # -- accounting ------------------------------------------------------------------------------
    def _count_error(self, tier: Tier, op: str, exc: BaseException | None, *,
                     kind: str | None = None) -> None:
        kind = kind or type(exc).__name__
        self.stats[f"errors.{tier.name}.{op}.{kind}"] += 1
        self.stats["errors"] += 1
        self._emit("error", 0, tier=tier.name, op=op, kind=kind)
        if exc is not None:
            log.debug("tier %s: %s failed: %s", tier.name, op, exc)

    def _emit(self, phase: str, event_id: int, **fields: Any) -> None:
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
            out[f"tier.{tier.name}.driver"] = tier.driver.statistics()
        out["background_pending"] = self._background_pending
        out["single_flight_keys"] = len(self._loading)
        return out


def _configured_tracer(config: UCMConfig) -> Any:
    """The tracer that `config.trace` or `UCM_TRACE` asks for; None (and no import) when off."""
    if config.trace is None and not os.environ.get("UCM_TRACE"):
        return None
    from ucm.trace import tracer_from_config

    return tracer_from_config(config)


def _copy_all(copies: list[tuple[memoryview, memoryview]]) -> None:
    for dst, src in copies:
        if dst.nbytes != src.nbytes:
            raise InvalidRequest(f"buffer is {dst.nbytes} bytes; the block holds {src.nbytes}")
        dst[:] = src
