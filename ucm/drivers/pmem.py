"""The `pmem` driver: blocks in one memory-mapped pool file through libpmem (PMDK).

    - driver: pmem
      path: /mnt/pmem0/ucm      # a directory; the pool is <path>/<namespace>.pmem
      size: 8GiB                # the pool file's size when it is created (= the capacity)
      max_blocks: null          # index entries; default one per 64 KiB of the pool
      populate: true            # map the stored blocks into this process at open

libpmem (Debian libpmem1) is loaded through ctypes and maps the file with `pmem_map_file`.
On real persistent memory (`pmem_is_pmem` says so: DAX) a range is made durable with
`pmem_persist` (cache flushes); on any other file (ext4, tmpfs) with `pmem_msync`.

The pool's format (superblock, index, extents; crash-consistent without a log) is
`_pmem_pool`'s.

One process owns a pool at a time (an exclusive flock): the index lives in this process.

A batch runs as parts of up to 32 MiB (stores) or 64 MiB (loads); in a part, up to PARALLEL
threads of trio's thread cache take blocks one at a time (copy + xxh3, both outside the GIL),
and the thread that finishes the last one publishes a store part and wakes the caller: one
trip into and out of trio per part. On pmem the copies flush as they go
(pmem_memcpy_nodrain), so a store part drains once.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any, Self

import trio
from pydantic import ByteSize, Field

from ucm.block import KVLayouts
from ucm.drivers._pmem_pool import PmemPool
from ucm.drivers._pump import Spread, chunks, wide
from ucm.drivers.contract import DriverOptions
from ucm.drivers.kit import (
    DriverStatistics,
    LoadState,
    Scatter,
    ScatterLoading,
    ThreadedDriver,
    Workers,
    os_error,
    parse_codec,
    safe_dir_name,
)
from ucm.drivers.kit._threaded import CHUNK_BYTES, PARALLEL, SPLIT_BYTES, with_counters
from ucm.errors import StorageUnavailable


class PmemDriver(ScatterLoading, ThreadedDriver):
    """Blocks in a libpmem-mapped pool file; see the module docstring for the layout."""

    persistent = True

    class Options(DriverOptions):
        path: str = Field(min_length=1)
        size: ByteSize = Field(default=ByteSize(2**30), ge=2**20)
        max_blocks: int | None = Field(default=None, ge=1)
        # Map every stored block into this process at open (about 0.1 s and 2 MiB of page
        # tables per GiB), so first loads after a restart copy at memory speed.
        populate: bool = True

    def __init__(self, pool: PmemPool, *, name: str,
                 workers: Workers | None = None) -> None:
        super().__init__(pool, name=name, workers=workers)
        self.pool = pool
        self.inline_meta = True  # lookup and listing touch only the in-memory index

    async def _spread(self, fn: Callable[[bytes, memoryview], Any], keys: list[bytes],
                      views: list[memoryview | Scatter],
                      then: Callable[[Spread], Any] | None = None) -> Spread:
        if self._closed:
            raise StorageUnavailable("driver is closed", driver=self.name)
        # A part of large blocks may use all PARALLEL pump threads. Small blocks cost more
        # Python than copying: one thread.
        threads = PARALLEL if wide(views, SPLIT_BYTES) else 1
        return await Spread(fn, keys, views, then).run(self._pump, threads)

    async def _load_part(self, keys: list[bytes],
                         views: list[memoryview | Scatter]) -> list[LoadState]:
        spread = await self._spread(self.pool.load_one, keys, views)
        for error in spread.errors:
            if error is not None:
                raise error
        return spread.results

    def _publish(self, spread: Spread) -> list[int]:
        """Runs on the thread that placed the part's last block."""
        if any(e is not None for e in spread.errors):
            self.pool.unplace(spread.results)
            return []
        try:
            return self.pool.publish(spread.keys, spread.results)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return [0] * len(spread.keys)

    async def _store_part(self, keys: list[bytes],
                          views: list[memoryview | Scatter]) -> list[int]:
        """Copies the part's blocks on PARALLEL threads, then publishes them with one set of
        barriers (PmemPool.publish)."""
        spread = await self._spread(self.pool.place, keys, views, then=self._publish)
        error = next((e for e in spread.errors if e is not None), spread.error)
        if error is not None:
            raise error
        sizes: list[int] = spread.outcome  # what _publish returned
        return sizes

    async def _map(self, fn: Callable[..., list[Any]], keys: list[bytes],
                   views: list[memoryview | Scatter], *, store: bool = False) -> list[Any]:
        """Parts of at most CHUNK_BYTES (stores: every part costs three barriers, so parts are
        large) or PARALLEL * CHUNK_BYTES (loads), so a cancel lands within one part; inside a
        part PARALLEL threads share the blocks (Spread)."""
        part_fn = self._store_part if store else self._load_part
        results: list[Any] = []
        try:
            for part in chunks(views, CHUNK_BYTES if store else PARALLEL * CHUNK_BYTES):
                results.extend(await part_fn(keys[part], views[part]))
        except OSError as exc:
            raise os_error(exc, self.name) from exc
        if store and keys and not any(results):  # a full pool: the batch fails when none fit
            raise os_error(OSError(errno.ENOSPC, f"pool {self.pool.path} is full",
                                   self.pool.path), self.name)
        return results

    @classmethod
    async def open(cls, options: Options | dict[str, Any], *, name: str = "pmem",
                   namespace: str, codec: str = "none", layouts: KVLayouts | None = None,
                   workers: Workers | None = None) -> Self:
        if not isinstance(options, cls.Options):
            options = cls.Options.model_validate(options)
        codec_value = parse_codec(codec)
        path = os.path.join(os.path.abspath(os.path.expanduser(options.path)),
                            safe_dir_name(namespace) + ".pmem")
        try:
            pool = await trio.to_thread.run_sync(
                lambda: PmemPool.open(path, size=int(options.size),
                                      max_blocks=options.max_blocks, namespace=namespace,
                                      codec=codec_value, layouts=layouts,
                                      populate=options.populate))
        except OSError as exc:
            raise os_error(exc, name) from exc
        except StorageUnavailable as exc:
            raise StorageUnavailable(str(exc), driver=name) from None
        return cls(pool, name=name, workers=workers)

    def statistics(self) -> DriverStatistics:
        pool = self.pool
        return with_counters(super().statistics(), {
            "is_pmem": int(pool.is_pmem), "capacity_bytes": pool.capacity(),
            "blocks": len(pool.index), "recovered_dropped": pool.recovered_dropped})
