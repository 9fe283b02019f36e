"""The threaded base of a driver: a synchronous, batched `Backend` run on worker threads by
`ThreadedDriver`, which validates every call, keeps the counters on the trio thread (no locks
needed) and translates errors.

A small batch is one thread hop; a batch of several MiB is split into a few parts that run in
PARALLEL worker threads at a time (xxh3 and the copies release the GIL, so verifying one part
overlaps reading the next), each part at most CHUNK_BYTES so a cancel lands within
milliseconds. Stores run on idle-priority threads (`_idle`), so they never take a core from
the inference engine. A driver whose backend has `load_one(key, view)` may set `pump_loads`:
its loads are then handed out block by block to the copy threads of a `_pump.Pump`.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol, cast

import trio

from ucm.block import Scatter
from ucm.drivers._pump import Spread, chunks, wide
from ucm.drivers._workers import Workers
from ucm.drivers.contract import DriverStatistics, LoadState, new_statistics
from ucm.drivers.kit._checks import check_batch, check_keys, os_error
from ucm.errors import StorageUnavailable

# A thread hop per part of at most this many bytes: big enough that the hop costs nothing
# next to the copy, small enough that a cancelled batch stops within a few milliseconds.
CHUNK_BYTES = 32 * 2**20
# Batches of at least this many bytes are split over PARALLEL worker threads: xxh3 and the
# copies release the GIL, so checksumming one part overlaps the I/O of another.
SPLIT_BYTES = 4 * 2**20
PARALLEL = 2

class Backend:
    """What a ThreadedDriver runs in worker threads. Methods are synchronous and batched.

    load writes each block into its view and returns one LoadState per key: OK (header and
    checksum verified), MISSING, CORRUPT (a header or checksum that fails, or a block read from
    storage that holds another size than its view: `wrong_size`; `unframe_into` checks both)
    or FAILED (that key's read failed). An OSError it raises fails the whole batch, and so does
    every key FAILED. (Only a block that never left the process, the memory tier's, raises
    `size_mismatch`'s InvalidRequest for a view of another size: the caller's mistake.)

    store returns the stored bytes per key (0 = not stored) and raises OSError only when no key
    was stored.
    """

    def lookup(self, keys: list[bytes]) -> list[bool]:
        raise NotImplementedError

    def load(self, keys: list[bytes], views: list[memoryview]) -> list[LoadState]:
        raise NotImplementedError

    def store(self, keys: list[bytes], views: list[memoryview]) -> list[int]:
        raise NotImplementedError

    def delete(self, keys: list[bytes]) -> None:
        raise NotImplementedError

    def load_one(self, key: bytes, view: memoryview) -> LoadState:
        """One block of a `pump_loads` driver's load (see ThreadedDriver.pump_loads)."""
        raise NotImplementedError

    def list_units(self) -> list[Any]:
        """Opaque units of listing work (for example directories), each one thread hop."""
        raise NotImplementedError

    def list_unit(self, unit: Any) -> list[tuple[bytes, int]]:
        raise NotImplementedError

    def in_memory(self, keys: list[bytes]) -> bool:
        """Whether `load_one` would read every one of these blocks from memory (a mapping, an
        arena) rather than from a device: such a load may run outside trio (see
        `ThreadedDriver.in_memory_load`). A backend says True only where it knows."""
        return False

    def close(self) -> None:
        pass


def _partition(views: Sequence[memoryview | Scatter]) -> list[slice]:
    """Contiguous parts of about equal bytes: one for a small batch, else at least PARALLEL
    (as keys allow) and none much over CHUNK_BYTES."""
    total = sum(v.nbytes for v in views)
    if total < SPLIT_BYTES or len(views) == 1:
        return [slice(0, len(views))]
    count = min(len(views), max(PARALLEL, -(-total // CHUNK_BYTES)))
    target = total / count
    parts: list[slice] = []
    start, acc = 0, 0
    for i, view in enumerate(views):
        acc += view.nbytes
        if acc >= target * (len(parts) + 1) and len(parts) < count - 1:
            parts.append(slice(start, i + 1))
            start = i + 1
    parts.append(slice(start, len(views)))
    return [p for p in parts if p.start < p.stop]


def count_loads(stats: DriverStatistics, states: Sequence[LoadState],
                views: Sequence[memoryview | Scatter]) -> None:
    """Adds one load batch's outcomes to a driver's counters."""
    stats["loads"] += len(states)
    for state, view in zip(states, views, strict=True):
        if state is LoadState.OK:
            stats["loaded"] += 1
            stats["bytes_read"] += view.nbytes
        else:
            stats[state.name.lower()] += 1  # type: ignore[literal-required]


def count_stores(stats: DriverStatistics, sizes: Sequence[int]) -> None:
    """Adds one store batch's outcomes (bytes per block, 0 = not stored) to the counters."""
    stats["stores"] += len(sizes)
    for size in sizes:
        if size:
            stats["stored"] += 1
            stats["bytes_written"] += size
        else:
            stats["store_failed"] += 1


def with_counters(stats: DriverStatistics, counters: Mapping[str, float]) -> DriverStatistics:
    """`stats` and a driver's own counters in one dict (the contract's keys are a minimum:
    a driver may add its own)."""
    merged: dict[str, object] = {**stats, **counters}
    return cast(DriverStatistics, merged)


class _Loads(Protocol):
    """What ScatterLoading needs of the ThreadedDriver it is mixed into."""

    async def load(self, keys: Sequence[bytes],
                   buffers: Sequence[memoryview | Scatter]) -> list[LoadState]: ...


class _Stores(Protocol):
    """What ScatterStoring needs of the ThreadedDriver it is mixed into."""

    async def _store(self, keys: Sequence[bytes], buffers: Sequence[memoryview | Scatter], *,
                     scatter: bool = False) -> list[int]: ...


class ScatterLoading:
    """Mixin of a ThreadedDriver whose backend reads straight into a Scatter's pieces (the
    `ScatterLoads` capability)."""

    async def load_scatter(self: _Loads, keys: Sequence[bytes],
                           buffers: Sequence[memoryview | Scatter]) -> list[LoadState]:
        return await self.load(keys, buffers)


class ScatterStoring:
    """Mixin of a ThreadedDriver whose backend's `store` writes straight from a Scatter's
    pieces (the `ScatterStores` capability)."""

    async def store_scatter(self: _Stores, keys: Sequence[bytes],
                            buffers: Sequence[memoryview | Scatter]) -> list[int]:
        return await self._store(keys, buffers, scatter=True)


class ThreadedDriver:
    """Validation, thread hops, counters and error translation around a Backend."""

    name: str
    persistent: bool
    # Batches of at most this many bytes run on the trio thread (a memcpy of a few KiB costs
    # less than a thread hop), and so do lookup, delete and listing when `inline_meta` is set.
    # Both stay off for backends that make syscalls.
    inline_bytes = 0
    inline_meta = False
    # Loads handed out block by block to the copy threads of a `_pump.Pump` (the backend has
    # `load_one(key, view)`), instead of one fixed part per thread.
    pump_loads = False

    def __init__(self, backend: Backend, *, name: str, workers: Workers | None = None) -> None:
        self._backend = backend
        self.name = name
        self._closed = False
        # Threads are the kernel's (it passes `workers` at open), else the process's default.
        self._workers = workers if workers is not None else Workers.default()
        self._pump = self._workers.copy
        self._stats = new_statistics()
        # In-memory loads run on the pump's threads and the caller's, outside trio: their
        # counters and the count of those running (close waits for them) take a lock.
        self._in_memory = threading.Condition()
        self._in_memory_running = 0
        self._in_memory_stats = new_statistics()

    async def _run(self, fn: Callable[..., Any], *args: Any, inline: bool = False,
                   idle: bool = False) -> Any:
        """fn(*args) on the trio thread (`inline`), on an idle-priority thread (`idle`: stores,
        see _idle) or on trio's thread cache."""
        if self._closed:
            raise StorageUnavailable("driver is closed", driver=self.name)
        try:
            if inline:
                await trio.lowlevel.checkpoint()
                return fn(*args)
            if idle:
                return await self._workers.run_store(fn, *args)
            # Not abandon_on_cancel: the thread may still be writing into the caller's buffer.
            return await trio.to_thread.run_sync(fn, *args)
        except OSError as exc:
            raise os_error(exc, self.name) from exc

    async def _map(self, fn: Callable[..., list[Any]], keys: list[bytes],
                   views: list[memoryview | Scatter], *, store: bool = False) -> list[Any]:
        """Runs `fn` over the batch's parts, PARALLEL at a time, results in key order; a
        `store` on idle-priority threads, so it never takes a core from the inference engine."""
        parts = _partition(views)
        if len(parts) == 1:
            inline = sum(v.nbytes for v in views) <= self.inline_bytes
            whole: list[Any] = await self._run(fn, keys, views, inline=inline, idle=store)
            return whole
        results: list[list[Any]] = [[] for _ in parts]
        limiter = trio.CapacityLimiter(PARALLEL)

        async def run_part(i: int, part: slice) -> None:
            async with limiter:
                results[i] = await self._run(fn, keys[part], views[part], idle=store)

        async with trio.open_nursery() as nursery:
            for i, part in enumerate(parts):
                nursery.start_soon(run_part, i, part)
        return [r for rs in results for r in rs]

    async def _pumped(self, fn: Callable[[bytes, Any], Any], keys: list[bytes],
                      views: list[memoryview | Scatter]) -> list[Any]:
        """fn(key, view) for every block, on the pump's threads, in parts of at most
        PARALLEL * CHUNK_BYTES (a cancel lands between parts, never while a thread writes
        into a caller's buffer)."""
        results: list[Any] = []
        for part in chunks(views, PARALLEL * CHUNK_BYTES):
            if self._closed:
                raise StorageUnavailable("driver is closed", driver=self.name)
            threads = PARALLEL if wide(views[part], SPLIT_BYTES) else 1
            spread = await Spread(fn, keys[part], views[part]).run(self._pump, threads)
            error = next((e for e in spread.errors if e is not None), None)
            if isinstance(error, OSError):
                raise os_error(error, self.name) from error
            if error is not None:
                raise error
            results.extend(spread.results)
        return results

    async def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        keys = check_keys(keys)
        found: list[bool] = await self._run(self._backend.lookup, keys, inline=self.inline_meta)
        self._stats["lookups"] += len(keys)
        self._stats["hits"] += sum(found)
        return found

    async def load(self, keys: Sequence[bytes],
                   buffers: Sequence[memoryview | Scatter]) -> list[LoadState]:
        keys, views = check_batch(keys, buffers, writable=True)
        if self.pump_loads and sum(v.nbytes for v in views) > self.inline_bytes:
            states: list[LoadState] = await self._pumped(self._backend.load_one, keys, views)
        else:
            states = await self._map(self._backend.load, keys, views)
        count_loads(self._stats, states, views)
        if all(s is LoadState.FAILED for s in states):
            raise StorageUnavailable(f"all {len(keys)} reads failed", driver=self.name)
        return states

    # A load of blocks in memory, outside trio: for the kernel's loads of indexed blocks.
    def in_memory_load(self, keys: list[bytes],
                       buffers: Sequence[memoryview | Scatter]) -> Spread | None:
        """The load of `keys` into `buffers` (a Load event's, already checked) as a Spread to
        run with `start_in_memory_load`, when the backend holds every block in memory and its
        loads go over the pump; else None (load the usual way). Nothing runs yet.

        Such a load needs no trio: the kernel starts it on the submitting thread, the pump's
        threads copy, the one that finishes resolves the caller's handle, and a caller that
        waits helps copy (`help_load`). A 64 MiB batch's two trips through the trio thread
        and its task set-up are what that saves."""
        if not self.pump_loads or self._closed:
            return None
        views = list(buffers)
        if sum(v.nbytes for v in views) <= self.inline_bytes:
            return None
        if not self._backend.in_memory(keys):
            return None
        return Spread(self._backend.load_one, keys, views, then=self._count_in_memory)

    def start_in_memory_load(self, spread: Spread, done: Callable[[Spread], Any]) -> bool:
        """Starts an `in_memory_load` on the pump's threads. `done(spread)` runs on the thread
        that finishes it; `spread.outcome` is then the states (None for blocks skipped after a
        cancel), or `spread.error` what failed. Raises StorageUnavailable once closed.

        True when the caller should help (`help_load`): it is bound to one CPU and a copy
        thread to another, so one copy thread fewer is woken, on another CPU. An unbound
        caller does not help: the scheduler moves it onto the copy thread's core, and the load
        takes longer than with no help (docs/performance.md, "Loads of in-memory blocks")."""
        with self._in_memory:
            if self._closed:
                raise StorageUnavailable("driver is closed", driver=self.name)
            self._in_memory_running += 1

        def finished() -> None:
            try:
                done(spread)
            finally:
                with self._in_memory:
                    self._in_memory_running -= 1
                    self._in_memory.notify_all()

        spread._wake = finished
        threads = PARALLEL if wide(spread.views, SPLIT_BYTES) else 1
        caller = self._pump.helper_cpu()
        helped = caller >= 0
        if helped:
            self._pump.submit(spread, max(1, threads - 1), avoid_cpu=caller)
        else:
            self._pump.submit(spread, threads)
        return helped

    def help_load(self, spread: Spread) -> None:
        """Copies the runs of a started `in_memory_load` that no thread has taken yet."""
        self._pump.help(spread)

    def _count_in_memory(self, spread: Spread) -> list[LoadState | None]:
        states: list[LoadState | None] = []
        for result, error in zip(spread.results, spread.errors, strict=True):
            states.append(LoadState.FAILED if error is not None else result)
        counted = [(s, v) for s, v in zip(states, spread.views, strict=True) if s is not None]
        with self._in_memory:
            count_loads(self._in_memory_stats, [s for s, _ in counted], [v for _, v in counted])
        return states

    async def store(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        return await self._store(keys, buffers)

    async def _store(self, keys: Sequence[bytes], buffers: Sequence[Any], *,
                     scatter: bool = False) -> list[int]:
        keys, views = check_batch(keys, buffers, writable=False, scatter=scatter)
        sizes: list[int] = await self._map(self._backend.store, keys, views, store=True)
        count_stores(self._stats, sizes)
        return sizes

    async def delete(self, keys: Sequence[bytes]) -> None:
        keys = check_keys(keys)
        await self._run(self._backend.delete, keys, inline=self.inline_meta)
        self._stats["deletes"] += len(keys)

    async def list_blocks(self) -> AsyncIterator[tuple[bytes, int]]:
        units = await self._run(self._backend.list_units, inline=self.inline_meta)
        for unit in units:
            for item in await self._run(self._backend.list_unit, unit, inline=self.inline_meta):
                yield item

    async def aclose(self) -> None:
        if not self._closed:
            with self._in_memory:
                self._closed = True
                running = self._in_memory_running
            if running:  # memory copies: milliseconds
                await trio.to_thread.run_sync(self._wait_in_memory_loads)
            self._backend.close()  # the threads are the Workers', which outlive a driver
        await trio.lowlevel.checkpoint()

    def _wait_in_memory_loads(self) -> None:
        with self._in_memory:
            self._in_memory.wait_for(lambda: not self._in_memory_running)

    def statistics(self) -> DriverStatistics:
        stats = self._stats.copy()
        with self._in_memory:
            for name, count in self._in_memory_stats.items():
                stats[name] += count  # type: ignore[literal-required]
        return stats

