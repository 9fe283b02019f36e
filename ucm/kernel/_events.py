"""Events the kernel accepts, and their results.

Events are frozen dataclasses with slots: ids, keys, buffers, deadlines; never locks or loops.
Every event is a batch. Construction validates the batch, so a malformed event fails in the
caller's thread with InvalidRequest, before it reaches the kernel.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ucm.block import MAX_KEY_BYTES, Scatter, as_buffer_view, check_key
from ucm.config import Durability
from ucm.drivers import LoadState
from ucm.errors import InvalidRequest

if TYPE_CHECKING:  # collections.abc.Buffer is new in Python 3.12; annotations only
    from typing_extensions import Buffer


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


# The constructors take what callers have (lists, bytes, bytearrays, Scatters); the fields
# hold the checked, normalized tuples. `init=False` keeps dataclass from writing an __init__
# that would type each argument as its field; kw_only keeps `__match_args__` to the keys.
@dataclass(frozen=True, slots=True, init=False)
class _Event:
    keys: tuple[bytes, ...]
    deadline: float | None = field(kw_only=True)  # seconds after submission
    request_id: str | None = field(kw_only=True)  # carried into the trace

    def __init__(self, keys: Sequence[bytes], *, deadline: float | None = None,
                 request_id: str | None = None) -> None:
        _set_common(self, keys, deadline, request_id)


def _set_common(event: _Event, keys: Sequence[bytes], deadline: float | None,
                request_id: str | None) -> None:
    object.__setattr__(event, "keys", _check_keys(keys))
    if deadline is not None and not deadline > 0:
        raise InvalidRequest(f"deadline must be > 0 seconds, got {deadline}")
    object.__setattr__(event, "deadline", deadline)
    object.__setattr__(event, "request_id", request_id)


@dataclass(frozen=True, slots=True, init=False)
class Lookup(_Event):
    """Which keys are stored, and in which tier. With `prefix`, the result stops at the first
    miss. With `pin`, hits stay unevictable until loaded, unpinned, or `pin_ttl` passes. With
    `promote` False, hits in slower tiers are not copied upwards (the config's `promote`
    applies otherwise): a caller that loads them right after leaves the promotion to the Load,
    which would otherwise read them a second time while the first copy is still running."""

    prefix: bool = field(kw_only=True)
    pin: bool = field(kw_only=True)
    promote: bool = field(kw_only=True)
    priority = Priority.LOOKUP

    def __init__(self, keys: Sequence[bytes], *, prefix: bool = False, pin: bool = False,
                 promote: bool = True, deadline: float | None = None,
                 request_id: str | None = None) -> None:
        _set_common(self, keys, deadline, request_id)
        object.__setattr__(self, "prefix", prefix)
        object.__setattr__(self, "pin", pin)
        object.__setattr__(self, "promote", promote)


@dataclass(frozen=True, slots=True, init=False)
class Load(_Event):
    """Reads each block into its buffer: a writable buffer of exactly the block's size, or a
    `Scatter` of pieces that add up to it. With `promote` False, blocks read from slower tiers
    are not copied upwards afterwards (the config's `promote` applies otherwise)."""

    buffers: tuple[memoryview | Scatter, ...] = field(kw_only=True)
    promote: bool = field(kw_only=True)
    priority = Priority.LOAD

    def __init__(self, keys: Sequence[bytes], *, buffers: Sequence[Buffer | Scatter] = (),
                 promote: bool = True, deadline: float | None = None,
                 request_id: str | None = None) -> None:
        _set_common(self, keys, deadline, request_id)
        object.__setattr__(self, "buffers", _check_buffers(self.keys, buffers, writable=True))
        object.__setattr__(self, "promote", promote)


@dataclass(frozen=True, slots=True, init=False)
class Store(_Event):
    """Writes each buffer as a block. Completes at `durability` (the config's when None); the
    buffers must stay unchanged until the event completes. A buffer may be a `Scatter` of
    pieces, stored in order as one block: a driver with `ScatterStores` writes from the
    pieces, for any other the kernel joins them once (`store_gathers`)."""

    buffers: tuple[memoryview | Scatter, ...] = field(kw_only=True)
    durability: Durability | None = field(kw_only=True)
    priority = Priority.STORE

    def __init__(self, keys: Sequence[bytes], *, buffers: Sequence[Buffer | Scatter] = (),
                 durability: Durability | None = None, deadline: float | None = None,
                 request_id: str | None = None) -> None:
        _set_common(self, keys, deadline, request_id)
        object.__setattr__(self, "buffers", _check_buffers(self.keys, buffers, writable=False))
        if durability not in (None, "memory", "local", "all"):
            raise InvalidRequest(f"durability must be memory, local or all, not "
                                 f"{durability!r}")
        object.__setattr__(self, "durability", durability)


@dataclass(frozen=True, slots=True, init=False)
class Prefetch(_Event):
    """Copies blocks held only by slower tiers into the fastest tier. `block_bytes` is the
    block size to use for keys whose size this kernel has not seen (stored by another
    process)."""

    block_bytes: int | None = field(kw_only=True)
    priority = Priority.PREFETCH

    def __init__(self, keys: Sequence[bytes], *, block_bytes: int | None = None,
                 deadline: float | None = None, request_id: str | None = None) -> None:
        _set_common(self, keys, deadline, request_id)
        object.__setattr__(self, "block_bytes", block_bytes)


@dataclass(frozen=True, slots=True, init=False)
class Delete(_Event):
    """Removes blocks from every tier."""

    priority = Priority.STORE


@dataclass(frozen=True, slots=True, init=False)
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
