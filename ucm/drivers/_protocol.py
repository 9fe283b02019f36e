"""The driver contract: what a storage driver implements, and nothing else.

A driver imports only this module, `ucm.errors` and `ucm.block`; never the kernel. The kernel
owns deadlines (cancel scopes), concurrency limits, capacity, eviction and pins, so a driver
starts no threads or timers of its own: blocking calls go through
`trio.to_thread.run_sync(..., limiter=...)`, and a driver never retries forever.

All calls are batched. Keys are validated bytes (see `ucm.block.check_key`); buffers are flat
byte memoryviews, one per key, and a load writes straight into them. A driver that sets
`scatter = True` also takes a `ucm.block.Scatter` as a load buffer (the block in pieces, to be
filled in order); the kernel gives other drivers a contiguous stand-in and copies it over. A
scatter driver must never write into a buffer after its call has returned or been cancelled
(its threads are never abandoned). A driver reports per-key
outcomes in its return value and raises a `DriverError` (usually `StorageUnavailable`) only when
the whole batch failed.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict


class LoadState(enum.IntEnum):
    """Per-key outcome of a load."""

    OK = 0  # the buffer holds the block, checksum verified
    MISSING = 1  # no such block
    CORRUPT = 2  # the block failed its checksum or header check: a miss plus a counted error
    FAILED = 3  # the read itself failed (I/O error); the buffer content is undefined


class DriverOptions(BaseModel):
    """Base of each driver's own options model. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@runtime_checkable
class Driver(Protocol):
    """A storage driver. `name` is the tier's name; `persistent` says if blocks outlive the
    process (it decides what durability `local` waits for)."""

    name: str
    persistent: bool
    # optional: scatter: bool = False (see the module docstring)

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

    def statistics(self) -> dict[str, int | float]:
        """Counters for metrics and traces (for example reads, bytes_read, corrupt)."""
        ...


@runtime_checkable
class Listing(Protocol):
    """Optional: the driver can enumerate what it holds (the kernel rebuilds its index from it
    after a restart)."""

    def list_blocks(self) -> AsyncIterator[tuple[bytes, int]]:
        """Yields (key, bytes on storage) for every stored block."""
        ...


class DriverFactory(Protocol):
    """What the registry holds: a driver class with an options model and an async opener."""

    Options: ClassVar[type[DriverOptions]]

    @classmethod
    async def open(cls, options: Any, *, name: str, namespace: str, codec: str = "none"
                   ) -> Driver:
        """Opens the driver for one tier. `codec` is the tier's codec ("none" or "zstd"): how
        the driver encodes payloads it stores; loads decode whatever codec a header names."""
        ...
