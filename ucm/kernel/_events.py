"""Events the kernel accepts, and their results.

Events are frozen dataclasses with slots: ids, keys, buffers, deadlines; never locks or loops.
Every event is a batch. Construction validates the batch, so a malformed event fails in the
caller's thread with InvalidRequest, before it reaches the kernel.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ucm.block import MAX_KEY_BYTES, Scatter, as_buffer_view, check_key
from ucm.config import Durability
from ucm.drivers import LoadState
from ucm.errors import InvalidRequest


class Priority(enum.IntEnum):
    """Lower runs first when a driver's concurrency limit is saturated."""

    LOAD = 0
    LOOKUP = 1
    STORE = 2
    PREFETCH = 3
    BACKGROUND = 4


def _check_keys(keys: Sequence[bytes]) -> tuple[bytes, ...]:
    if not keys:
        raise InvalidRequest("empty batch: an event needs at least one key")
    keys = tuple(keys)
    # One pass of cheap checks (10,000-key lookups are common); details only on failure.
    if not all(type(k) is bytes and 0 < len(k) <= MAX_KEY_BYTES for k in keys):
        for k in keys:
            check_key(k)
    return keys


def _check_buffers(keys: tuple[bytes, ...], buffers: Sequence[Any], *, writable: bool,
                   ) -> tuple[memoryview | Scatter, ...]:
    if len(buffers) != len(keys):
        raise InvalidRequest(f"{len(keys)} keys but {len(buffers)} buffers")
    try:  # a Scatter for a load (pieces to fill) or a store (pieces to write from)
        views = tuple(as_buffer_view(b) for b in buffers)
    except TypeError as exc:
        raise InvalidRequest(f"each buffer must be a buffer or a Scatter ({exc})") from None
    if writable:
        for v in views:
            if v.readonly:
                raise InvalidRequest("load buffers must be writable")
    return views


@dataclass(frozen=True, slots=True)
class _Event:
    keys: tuple[bytes, ...]
    deadline: float | None = field(default=None, kw_only=True)  # seconds after submission
    request_id: str | None = field(default=None, kw_only=True)  # carried into the trace

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", _check_keys(self.keys))
        if self.deadline is not None and not self.deadline > 0:
            raise InvalidRequest(f"deadline must be > 0 seconds, got {self.deadline}")


@dataclass(frozen=True, slots=True)
class Lookup(_Event):
    """Which keys are stored, and in which tier. With `prefix`, the result stops at the first
    miss. With `pin`, hits stay unevictable until loaded, unpinned, or `pin_ttl` passes."""

    prefix: bool = field(default=False, kw_only=True)
    pin: bool = field(default=False, kw_only=True)
    priority = Priority.LOOKUP


@dataclass(frozen=True, slots=True)
class Load(_Event):
    """Reads each block into its buffer: a writable buffer of exactly the block's size, or a
    `Scatter` of pieces that add up to it."""

    buffers: tuple[memoryview | Scatter, ...] = field(default=(), kw_only=True)
    priority = Priority.LOAD

    def __post_init__(self) -> None:
        _Event.__post_init__(self)
        object.__setattr__(self, "buffers", _check_buffers(self.keys, self.buffers,
                                                           writable=True))


@dataclass(frozen=True, slots=True)
class Store(_Event):
    """Writes each buffer as a block. Completes at `durability` (the config's when None); the
    buffers must stay unchanged until the event completes. A buffer may be a `Scatter` of
    pieces, stored in order as one block: a driver with `ScatterStores` writes from the
    pieces, for any other the kernel joins them once (`store_gathers`)."""

    buffers: tuple[memoryview | Scatter, ...] = field(default=(), kw_only=True)
    durability: Durability | None = field(default=None, kw_only=True)
    priority = Priority.STORE

    def __post_init__(self) -> None:
        _Event.__post_init__(self)
        object.__setattr__(self, "buffers", _check_buffers(self.keys, self.buffers,
                                                           writable=False))
        if self.durability not in (None, "memory", "local", "all"):
            raise InvalidRequest(f"durability must be memory, local or all, not "
                                 f"{self.durability!r}")


@dataclass(frozen=True, slots=True)
class Prefetch(_Event):
    """Copies blocks held only by slower tiers into the fastest tier. `block_bytes` is the
    block size to use for keys whose size this kernel has not seen (stored by another
    process)."""

    block_bytes: int | None = field(default=None, kw_only=True)
    priority = Priority.PREFETCH


@dataclass(frozen=True, slots=True)
class Delete(_Event):
    """Removes blocks from every tier."""

    priority = Priority.STORE


@dataclass(frozen=True, slots=True)
class Unpin(_Event):
    """Releases pins taken by `Lookup(pin=True)` for blocks that will not be loaded."""

    priority = Priority.LOOKUP


Event = Lookup | Load | Store | Prefetch | Delete | Unpin


@dataclass(frozen=True, slots=True)
class LookupResult:
    hits: tuple[bool, ...]
    tiers: tuple[str | None, ...]  # tier that holds each hit

    @property
    def prefix_len(self) -> int:
        """Number of leading hits."""
        n = 0
        for hit in self.hits:
            if not hit:
                break
            n += 1
        return n


@dataclass(frozen=True, slots=True)
class LoadResult:
    states: tuple[LoadState, ...]
    tiers: tuple[str | None, ...]  # tier each block came from
    errors: tuple[str, ...] = ()  # driver errors met on the way (other tiers may have served)

    @property
    def ok(self) -> bool:
        return all(s is LoadState.OK for s in self.states)


@dataclass(frozen=True, slots=True)
class StoreResult:
    stored: tuple[bool, ...]  # True only where the requested durability was reached
    errors: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return all(self.stored)


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    promoted: int  # blocks copied into the fastest tier
    resident: int  # blocks that were already there
    missing: int


@dataclass(frozen=True, slots=True)
class DoneResult:
    count: int
