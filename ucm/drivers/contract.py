"""The driver contract: what a storage driver implements, and the capabilities it may add.

A driver imports only this module (or `ucm.drivers`, which re-exports it), `ucm.drivers.kit`
(validation, framing, threaded base), `ucm.errors` and `ucm.block`; never the kernel. The kit
builds on this module; this module imports nothing of the kit. The kernel owns deadlines
(cancel scopes), concurrency limits, capacity, eviction and pins.

All calls are batched. Keys are validated bytes (see `ucm.block.check_key`); buffers are flat
byte memoryviews, one per key, and a load writes straight into them. A driver reports per-key
outcomes in its return value and raises a `DriverError` (usually `StorageUnavailable`) only when
the whole batch failed. A driver never writes into a caller's buffer after its call has returned
or been cancelled.

Threads: blocking calls run on worker threads, never on the trio thread. The kernel owns the
copy threads and idle-priority store threads (`ucm.drivers.kit.Workers`) and hands them to each
driver it opens; a driver built on the kit runs its loads and stores there, and other blocking
calls on trio's thread cache (`trio.to_thread.run_sync`, abandoned on cancel only where the
call writes into no caller's buffer). A driver starts no threads of its own except a client
library's connection pool, no timers, and never retries forever: deadlines are the kernel's.

Capabilities beyond `Driver` are separate protocols, checked by the kernel with `isinstance`
once, when a tier is attached:

    Listing        list_blocks(): the kernel rebuilds its index from storage at start
    FreeSpace      free_bytes(): the kernel warns when a tier's capacity exceeds its room
    ScatterLoads   load_scatter(): loads straight into a block's pieces (`ucm.block.Scatter`)
    ScatterStores  store_scatter(): stores straight from a block's pieces (no joining copy)
    InMemoryLoads  loads of blocks held in memory, run off the kernel's thread
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypedDict, cast, runtime_checkable

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from ucm.block import KVLayouts, Scatter
    from ucm.drivers._workers import Workers


class LoadState(enum.IntEnum):
    """Per-key outcome of a load."""

    OK = 0  # the buffer holds the block, checksum verified
    MISSING = 1  # no such block
    CORRUPT = 2  # the block failed its checksum or header check: a miss plus a counted error
    FAILED = 3  # the read itself failed (I/O error); the buffer content is undefined


class DriverOptions(BaseModel):
    """Base of each driver's own options model. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class DriverStatistics(TypedDict):
    """The counters every driver reports (`Driver.statistics`); a driver may add its own.
    Counts are of blocks unless named bytes."""

    lookups: int  # keys looked up
    hits: int  # of them found
    loads: int  # keys asked for by loads
    loaded: int  # blocks loaded and verified
    missing: int  # loads of absent blocks
    corrupt: int  # blocks that failed their checksum or header check
    failed: int  # loads whose read failed
    bytes_read: int  # raw bytes delivered by loads
    stores: int  # blocks asked to be stored
    stored: int  # blocks published
    bytes_written: int  # bytes those blocks occupy on storage
    store_failed: int  # blocks not stored
    deletes: int  # keys deleted


STATISTICS: tuple[str, ...] = tuple(DriverStatistics.__annotations__)


def new_statistics() -> DriverStatistics:
    """A DriverStatistics with every counter at zero."""
    return cast(DriverStatistics, dict.fromkeys(STATISTICS, 0))


@runtime_checkable
class Driver(Protocol):
    """A storage driver. `name` is the tier's name; `persistent` says if blocks outlive the
    process (it decides what durability `local` waits for)."""

    name: str
    persistent: bool

    async def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are stored. Cheap: no payload is read or verified."""
        ...

    async def load(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[LoadState]:
        """Reads each block into its buffer and verifies it."""
        ...

    async def store(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        """Publishes each block atomically. Returns the bytes each block occupies on storage,
        or 0 for a block that was not stored. A stored key may be overwritten."""
        ...

    async def delete(self, keys: Sequence[bytes]) -> None:
        """Removes the blocks; missing keys are ignored."""
        ...

    async def aclose(self) -> None:
        """Releases resources. In-flight calls have been drained by the kernel before this."""
        ...

    def statistics(self) -> DriverStatistics:
        """Counters for metrics and traces: at least those of `DriverStatistics`."""
        ...


@runtime_checkable
class Listing(Protocol):
    """Capability: the driver can enumerate what it holds (the kernel rebuilds its index from
    it after a restart)."""

    def list_blocks(self) -> AsyncIterator[tuple[bytes, int]]:
        """Yields (key, bytes on storage) for every stored block."""
        ...


@runtime_checkable
class FreeSpace(Protocol):
    """Capability: the driver knows how much more its storage can take (a filesystem's free
    space); the kernel warns when a tier's capacity is more than it holds plus that."""

    def free_bytes(self) -> int | None:
        """Bytes still free for new blocks, or None when unknown. Cheap, non-blocking."""
        ...


@runtime_checkable
class ScatterLoads(Protocol):
    """Capability: loads straight into a block's pieces. The kernel gives a driver without it
    a contiguous stand-in and copies that over."""

    async def load_scatter(self, keys: Sequence[bytes],
                           buffers: Sequence[memoryview | Scatter]) -> list[LoadState]:
        """As `load`, where a buffer may also be a `Scatter` (filled piece by piece, in
        order). Never writes into a buffer after the call has returned or been cancelled."""
        ...


@runtime_checkable
class ScatterStores(Protocol):
    """Capability: stores straight from a block's pieces. The kernel joins a Scatter's pieces
    into one buffer (a copy, counted as `store_gathers`) for a driver without it."""

    async def store_scatter(self, keys: Sequence[bytes],
                            buffers: Sequence[memoryview | Scatter]) -> list[int]:
        """As `store`, where a buffer may also be a `Scatter` (its pieces stored in order as
        one block; the header's checksum covers them as stored)."""
        ...


class MemoryLoad(Protocol):
    """A prepared in-memory load (`InMemoryLoads.in_memory_load`), as the kernel sees it."""

    views: Sequence[memoryview | Scatter]  # the load's buffers, in key order
    outcome: list[LoadState | None] | None  # once done: per key (None: skipped after cancel)
    error: BaseException | None  # once done: what failed the whole load, if anything

    def cancel(self) -> None:
        """Skips the blocks no thread has begun."""
        ...


@runtime_checkable
class InMemoryLoads(Protocol):
    """Capability: a load of blocks the driver holds in memory (mapped files, a shared arena)
    runs on the driver's copy threads without the kernel's trio thread: the kernel starts it
    on the submitting thread and the thread that copies the last block resolves it."""

    def in_memory_load(self, keys: list[bytes],
                       buffers: Sequence[memoryview | Scatter]) -> MemoryLoad | None:
        """The load prepared, when every block is held in memory; else None (load the usual
        way). Nothing runs yet."""
        ...

    def start_in_memory_load(self, load: Any, done: Callable[[Any], None]) -> bool:
        """Starts a prepared load; `done(load)` runs on the thread that finishes it and must
        not raise. True when the calling thread should help (`help_load`) while it waits.
        Raises StorageUnavailable once the driver is closed."""
        ...

    def help_load(self, load: Any) -> None:
        """Copies, on the calling thread, the blocks of a started load no thread has taken."""
        ...


class DriverFactory(Protocol):
    """What the registry holds: a driver class with an options model and an async opener."""

    Options: ClassVar[type[DriverOptions]]

    @classmethod
    async def open(cls, options: Any, *, name: str, namespace: str, codec: str = "none",
                   layouts: KVLayouts | None = None, workers: Workers | None = None) -> Driver:
        """Opens the driver for one tier. `codec` is the tier's codec, one of `ucm.block.Codec`
        by name (none, zstd, shuffle_zstd, int8, int4; see docs/compression.md): how the driver
        encodes payloads it stores; loads decode whatever codec a header names. `layouts`: the
        KV layouts of the namespace's blocks, given with a quantizing codec (int8, int4) where
        the kernel has them; the driver passes them to `frame_block` (or
        `ucm.block.encode_payload`), which quantizes a block only when they hold a layout of
        its size.
        `workers`: the kernel's threads (`ucm.drivers.kit.Workers`) for the driver's blocking
        work; None when opened outside a kernel (the kit then uses the process's default)."""
        ...
