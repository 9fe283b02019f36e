"""The `memory` driver: blocks in host DRAM.

    - driver: memory
      capacity: 2GiB          # enforced by the kernel, not here
      shared: false           # true: blocks in one arena file in /dev/shm, every process's
      shm_dir: null           # shared mode's directory; default /dev/shm/ucm-<uid>
      size: 1GiB              # shared mode: the arena's size (sparse: stored blocks use memory)
      group: null             # shared mode: a group whose members share the arena
      mode: null              # shared mode: the arena's file mode; default 0600 (0660: group)
      lock_wait: null         # shared mode: seconds a call with no deadline waits for the lock

Process-local mode keeps a dict of records (a private copy of the stored bytes plus the
block header); a store copies the caller's bytes and a load copies them back and verifies the
checksum of what it copied, so a flipped bit in memory is a corrupt miss, never data.

Shared mode keeps blocks in the ucm block format in one arena file on tmpfs,
`<shm_dir>/<namespace>.arena`, that every process on the host maps (see `_shm_arena`): any of
them stores, loads and deletes, a load is a checked copy out of the mapping, a writer killed
mid-block leaves nothing half-visible, and a full arena evicts its oldest blocks. The kernel's
`capacity` for the tier should not exceed `size`. Neither mode outlives a reboot: not
persistent.

The arena is private to its user: the default directory is per user and mode 0700, the
files 0600, and a directory or file that another user owns or can write is refused, not
adopted (`_shm_trust`). To share an arena between users on purpose, name their `group`: the
directory (default `/dev/shm/ucm-group-<gid>`) and files then belong to it and are writable
by its members, and by nobody else. Any of them can hold the arena's lock: a store, delete or
open waits for it until the event's deadline (`lock_wait` seconds for work with none, and for
open), then fails; docs/trust.md says what members can do to each other.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self

import trio
from pydantic import ByteSize, Field, field_validator, model_validator

from ucm.block import (
    BlockHeader,
    Codec,
    KVLayouts,
    Scatter,
    checksum,
    copy_hashed,
    decode_payload_into,
    encode_payload,
    stored_codec,
)
from ucm.drivers._shm_arena import DEFAULT_LOCK_WAIT, ShmArena
from ucm.drivers._shm_trust import (
    DEFAULT_GROUP_MODE,
    DEFAULT_MODE,
    Sharing,
    default_shm_dir,
    group_id,
)
from ucm.drivers.contract import DriverOptions
from ucm.drivers.kit import (
    Backend,
    DriverStatistics,
    LoadState,
    ScatterLoading,
    ScatterStoring,
    ThreadedDriver,
    Workers,
    check_keys,
    os_error,
    parse_codec,
    safe_dir_name,
    size_mismatch,
)
from ucm.drivers.kit._threaded import with_counters
from ucm.errors import BlockCorrupt, ConfigError

SHM_ROOT = default_shm_dir()  # this user's; a group's is default_shm_dir(gid)
DEFAULT_ARENA_BYTES = 2**30


@dataclass(frozen=True, slots=True)
class _Record:
    header: BlockHeader
    payload: bytearray  # the stored bytes (after the codec); private to the driver


class LocalBlocks(Backend):
    """The process-local store. Records are replaced whole, never edited, so a load that
    picked a record up reads one consistent block while a store of the same key runs."""

    def __init__(self, *, namespace: str, codec: Codec, layouts: KVLayouts | None = None,
                 ) -> None:
        self.namespace = namespace
        self.codec = codec
        self.layouts = layouts
        self.records: dict[bytes, _Record] = {}

    def lookup(self, keys: list[bytes]) -> list[bool]:
        return [key in self.records for key in keys]

    def load(self, keys: list[bytes], views: list[memoryview]) -> list[LoadState]:
        states = []
        for key, out in zip(keys, views, strict=True):
            record = self.records.get(key)
            if record is None:
                states.append(LoadState.MISSING)
                continue
            header = record.header
            if header.raw_len != out.nbytes:
                raise size_mismatch(out, header)
            try:
                decode_payload_into(header, record.payload, out)  # NONE: copy_verified
            except BlockCorrupt:
                states.append(LoadState.CORRUPT)
            else:
                states.append(LoadState.OK)
        return states

    def store(self, keys: list[bytes], views: Sequence[memoryview | Scatter]) -> list[int]:
        sizes = []
        for key, view in zip(keys, views, strict=True):
            codec, params = self.codec, b""
            if codec is Codec.NONE:  # copied and hashed in one pass (a Scatter: piece by piece)
                payload = bytearray(view.nbytes)
                digest = copy_hashed(memoryview(payload), view)
            else:
                encoded = encode_payload(codec, view, self.layouts)
                assert type(encoded) is not Scatter  # codecs other than NONE join a Scatter
                codec, params = stored_codec(codec, encoded)  # shuffle_zstd, int8, int4
                payload = bytearray(encoded)
                digest = checksum(payload)
            header = BlockHeader(key, self.namespace, codec, len(payload), view.nbytes,
                                 digest, params)
            self.records[key] = _Record(header, payload)
            sizes.append(max(len(payload), 1))  # 0 would mean "not stored"
        return sizes

    def delete(self, keys: list[bytes]) -> None:
        for key in keys:
            self.records.pop(key, None)

    def list_units(self) -> list[list[tuple[bytes, int]]]:
        return [[(key, len(r.payload)) for key, r in list(self.records.items())]]

    def list_unit(self, unit: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        return unit

    def close(self) -> None:
        self.records.clear()


class MemoryDriver(ScatterLoading, ScatterStoring, ThreadedDriver):
    """Host DRAM, process-local or shared through /dev/shm."""

    persistent = False

    class Options(DriverOptions):
        shared: bool = False
        shm_dir: str | None = None
        size: ByteSize | None = Field(default=None, ge=2**20)  # shared mode's arena
        group: str | int | None = Field(
            default=None, description="shared mode: a group (name or gid) whose members may "
            "use the arena too; null: this user alone")
        mode: int | None = Field(
            default=None, description="shared mode: the arena files' mode (e.g. 0o640 or "
            "\"0660\"); default 0600, or 0660 with a group; never writable by others")
        lock_wait: float | None = Field(
            default=None, gt=0, description="shared mode: seconds a store or delete with no "
            "event deadline (background copies), and open, wait for the arena's lock, which "
            f"any process sharing it can hold; then the call fails. Default {DEFAULT_LOCK_WAIT:g}")

        @field_validator("mode", mode="before")
        @classmethod
        def _octal(cls, mode: object) -> object:
            return int(mode, 8) if isinstance(mode, str) else mode

        @model_validator(mode="after")
        def _private_mode(self) -> Self:
            mode = self.mode
            if mode is None:
                return self
            if mode & ~0o777 or mode & 0o600 != 0o600:
                raise ValueError(f"mode: {mode:o} must be permission bits that include 0600")
            if mode & 0o002:
                raise ValueError(f"mode: {mode:o} lets every user write the arena; name a group")
            if mode & 0o020 and self.group is None:
                raise ValueError(f"mode: {mode:o} lets a group write the arena: name it (group)")
            return self

        def sharing(self) -> Sharing:
            if self.group is None:
                return Sharing(self.mode if self.mode is not None else DEFAULT_MODE)
            return Sharing(self.mode if self.mode is not None else DEFAULT_GROUP_MODE,
                           group_id(self.group))

    def __init__(self, backend: LocalBlocks | ShmArena, *, name: str,
                 workers: Workers | None = None) -> None:
        super().__init__(backend, name=name, workers=workers)
        self.backend = backend
        self.shared = isinstance(backend, ShmArena)
        # Dict operations, arena index probes and KiB copies cost less than a thread hop.
        self.inline_meta = True
        if not self.shared:
            self.inline_bytes = 64 * 1024
        else:
            self.pump_loads = True  # block by block over the copy threads (_pump)

    @classmethod
    async def open(cls, options: Options | dict[str, Any], *, name: str = "memory",
                   namespace: str, codec: str = "none", layouts: KVLayouts | None = None,
                   workers: Workers | None = None) -> Self:
        if not isinstance(options, cls.Options):
            options = cls.Options.model_validate(options)
        codec_value = parse_codec(codec)
        if not options.shared:
            for key in ("shm_dir", "size", "group", "mode", "lock_wait"):
                if getattr(options, key) is not None:
                    raise ConfigError(f"{key}: applies to shared mode only (shared: true)")
            await trio.lowlevel.checkpoint()
            return cls(LocalBlocks(namespace=namespace, codec=codec_value, layouts=layouts),
                       name=name, workers=workers)
        sharing = options.sharing()
        root = os.path.abspath(options.shm_dir or default_shm_dir(sharing.gid))
        path = os.path.join(root, safe_dir_name(namespace) + ".arena")
        size = int(options.size or DEFAULT_ARENA_BYTES)
        lock_wait = options.lock_wait or DEFAULT_LOCK_WAIT
        deadline = _call_deadline()
        try:
            arena = await trio.to_thread.run_sync(lambda: ShmArena.open(
                path, size=size, namespace=namespace, codec=codec_value, layouts=layouts,
                sharing=sharing, lock_wait=lock_wait, deadline=deadline))
        except OSError as exc:
            raise os_error(exc, name) from exc
        return cls(arena, name=name, workers=workers)

    async def _run(self, fn: Callable[..., Any], *args: Any, inline: bool = False,
                   idle: bool = False) -> Any:
        if self.shared:  # the arena's lock is waited for until the event's deadline at most
            fn = self.arena.until(_call_deadline(), fn)
        return await super()._run(fn, *args, inline=inline, idle=idle)

    async def delete(self, keys: Sequence[bytes]) -> None:
        if not self.shared:
            return await super().delete(keys)
        keys = check_keys(keys)
        # Off the trio thread: a wait for the arena's lock must not stop every other event.
        await self._run(self.backend.delete, keys)
        self._stats["deletes"] += len(keys)
        return None

    async def list_blocks(self) -> AsyncIterator[tuple[bytes, int]]:
        if not self.shared:
            async for item in super().list_blocks():
                yield item
            return
        # A scan of the arena's whole table: off the trio thread, unlike lookups.
        for unit in await self._run(self.backend.list_units):
            for item in unit:
                yield item

    @property
    def arena(self) -> ShmArena:
        """Shared mode's arena."""
        if not isinstance(self.backend, ShmArena):
            raise TypeError("the arena exists in shared mode only")
        return self.backend

    def statistics(self) -> DriverStatistics:
        stats = super().statistics()
        if isinstance(self.backend, ShmArena):
            return with_counters(stats, self.backend.statistics())
        return stats


def _call_deadline() -> float | None:
    """The current trio deadline as a time.monotonic() instant (for threads); None if none."""
    deadline = trio.current_effective_deadline()
    if math.isinf(deadline):
        return None
    return time.monotonic() + max(0.0, deadline - trio.current_time())
