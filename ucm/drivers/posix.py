"""The `posix` driver: blocks as files on local filesystems (ext4, xfs, tmpfs, a mounted NFS).

    - driver: posix
      path: /var/cache/ucm            # or a list of roots: keys are striped over them by hash
      fsync: false                    # fsync each block and its directory before it counts
      direct: false                   # O_DIRECT (page-aligned I/O; not on old-kernel tmpfs)
      direct_writes: false            # O_DIRECT for stores only (see below)
      shard_depth: 2                  # <root>/<namespace>/<aa>/<bb>/<hex key>.blk
      map_bytes: auto                 # block files kept mapped (see below); 0: off
      mode: "0600"                    # block file mode; directories get the matching 07x0
      group: null                     # a group name or gid to share the store with

Blocks are private to the user by default: files 0600, directories 0700, whatever the umask.
To share a store between users on purpose, name their common `group` (files and directories
created are given to it; `mode` then defaults to 0660, directories 0770) and, for read-only
sharing, `mode: "0640"` (directories 0750). Nothing read from the store is trusted (see
`_blockfiles`): another user's planted files are corrupt blocks, never data.

Blocks are published by temp file + rename, so they survive restarts (`persistent`) and a
writer killed mid-block leaves nothing visible. The work happens in `_blockfiles.BlockFiles`.

Loads copy blocks out of mappings of their files, each checked and copied in one pass, at
memory speed, instead of through preadv and a checksum pass (see `_mapped`), up to `map_bytes`
of mapped files (auto: a quarter of the memory this process may use, the host's or its
cgroup's limit, and at most a quarter of vm.max_map_count mappings). When a kernel starts, its
listing maps the stored blocks it finds while the budget has room, and reads in what the page
cache lacks, so that a restarted engine's first loads are fast; a block not mapped then (stored
later, by this process or another, or past the budget) is mapped by its first load, which
costs no more than a read, and from then on loads from memory (and may go the kernel's fast
path). A full budget drops the mappings loaded least recently; the listing drops none. Not with
`direct: true`. Mapped blocks count in the process's RSS as shared file pages (the page
cache's, not copies, which the kernel may still reclaim), and cost 2 MiB of page tables per
GiB. The vLLM connector's scheduler side, which only looks blocks up, maps none.

`direct_writes: true` writes blocks with O_DIRECT and reads them as usual. A buffered store
first fills new page-cache pages, most of that work in the kernel, where the idle priority of
the store threads does not reach: CPU taken from the inference engine beside it (figures:
docs/performance.md, "Direct writes"). The price: a block stored this way is not in the page
cache, so its first read comes from the disk, in this process (its first load) or in the next
one (its listing reads in the blocks it maps). Worth it where the cores are busy computing
while blocks are stored, as with vLLM on CPU; a host with cores to spare keeps the default.
"""

from __future__ import annotations

import grp
import os
from typing import Any, Literal, Self

import trio
from pydantic import ByteSize, Field, field_validator

from ucm.drivers._blockfiles import FILE_MODE, BlockFiles, FileLayout
from ucm.drivers._mapped import auto_map_bytes
from ucm.drivers.contract import DriverOptions
from ucm.drivers.kit import (
    DriverStatistics,
    KVLayouts,
    ScatterLoading,
    ScatterStoring,
    ThreadedDriver,
    Workers,
    os_error,
    parse_codec,
    safe_dir_name,
)
from ucm.drivers.kit._threaded import with_counters
from ucm.errors import ConfigError


class PosixDriver(ScatterLoading, ScatterStoring, ThreadedDriver):
    """Blocks as files under one or more directory roots."""

    persistent = True
    pump_loads = True  # block by block over the copy threads (_pump)

    class Options(DriverOptions):
        path: str | list[str]
        fsync: bool = False
        direct: bool = False
        direct_writes: bool = False
        shard_depth: int = Field(default=2, ge=0, le=4)
        map_bytes: ByteSize | Literal["auto"] = Field(
            default="auto", description="bytes of block files kept mapped, so that loads "
            "copy them from memory: those a kernel's listing finds at start (read in), and "
            "each block at its first load, the least recently loaded dropped for room; "
            "auto: a quarter of the memory this process may use (the host's, or its cgroup's "
            "limit); 0: off")
        mode: int | None = Field(
            default=None, description="block file mode, octal (\"0640\"): read and write for "
            "the owner, read or read and write for the group or others; directories get the "
            "matching mode (0750, 0770). Default 0600 (0660 with a group)")
        group: str | int | None = Field(
            default=None, description="a group name or gid to share the store with: files "
            "and directories created are given to it (the user must be a member)")

        @field_validator("mode", mode="before")
        @classmethod
        def _octal(cls, value: object) -> object:
            if isinstance(value, str):
                try:
                    return int(value.removeprefix("0o"), 8)
                except ValueError:
                    raise ValueError(f"mode {value!r} is not an octal file mode") from None
            return value

        @field_validator("mode")
        @classmethod
        def _mode_bits(cls, value: int | None) -> int | None:
            if value is not None and (value & ~0o666 or value & 0o600 != 0o600):
                raise ValueError(f"mode {value:#o}: block files need read and write for "
                                 "the owner, and take no execute or special bits")
            return value

        @field_validator("group")
        @classmethod
        def _gid(cls, value: str | int | None) -> int | None:
            if isinstance(value, str):
                try:
                    return grp.getgrnam(value).gr_gid
                except KeyError:
                    raise ValueError(f"group {value!r}: no such group") from None
            return value

        @property
        def file_mode(self) -> int:
            if self.mode is not None:
                return self.mode
            return FILE_MODE if self.group is None else 0o660

        @field_validator("path")
        @classmethod
        def _paths(cls, value: str | list[str]) -> str | list[str]:
            paths = [value] if isinstance(value, str) else value
            if not paths or not all(paths):
                raise ValueError("path must name at least one directory")
            if len(set(paths)) != len(paths):
                raise ValueError("path lists a directory twice")
            return value

        @field_validator("map_bytes")
        @classmethod
        def _map_bytes(cls, value: ByteSize | str) -> ByteSize | str:
            if not isinstance(value, str) and value < 0:
                raise ValueError("map_bytes must be 0 or more bytes, or auto")
            return value

        @property
        def map_limit(self) -> int:
            """`map_bytes` in bytes ("auto" resolved for this host)."""
            if self.map_bytes == "auto":
                return auto_map_bytes()
            return int(self.map_bytes)

        @property
        def paths(self) -> list[str]:
            paths = [self.path] if isinstance(self.path, str) else self.path
            return [os.path.abspath(os.path.expanduser(p)) for p in paths]

    def __init__(self, files: BlockFiles, *, name: str,
                 workers: Workers | None = None) -> None:
        super().__init__(files, name=name, workers=workers)
        self.files = files

    @classmethod
    async def open(cls, options: Options | dict[str, Any], *, name: str = "posix",
                   namespace: str, codec: str = "none", layouts: KVLayouts | None = None,
                   workers: Workers | None = None) -> Self:
        if not isinstance(options, cls.Options):
            options = cls.Options.model_validate(options)
        gid = options.group
        if gid is not None and os.geteuid() != 0 and gid not in (os.getegid(), *os.getgroups()):
            raise ConfigError(f"group: this user is not a member of group {gid}")
        ns_dir = safe_dir_name(namespace)
        layout = FileLayout(tuple(os.path.join(p, ns_dir) for p in options.paths),
                            options.shard_depth)
        try:
            files = await trio.to_thread.run_sync(
                lambda: BlockFiles.open(layout, namespace=namespace, codec=parse_codec(codec),
                                        layouts=layouts,
                                        fsync=options.fsync, direct=options.direct,
                                        direct_writes=options.direct_writes,
                                        map_bytes=options.map_limit,
                                        file_mode=options.file_mode,
                                        gid=None if gid is None else int(gid)))
        except OSError as exc:
            raise os_error(exc, name) from exc
        return cls(files, name=name, workers=workers)

    def free_bytes(self) -> int | None:
        """Free bytes for unprivileged writers on the roots' filesystems (FreeSpace), each
        filesystem counted once."""
        free: dict[int, int] = {}
        for root in self.files.layout.roots:
            try:
                st, vfs = os.stat(root), os.statvfs(root)
            except OSError:
                return None
            free[st.st_dev] = vfs.f_bavail * vfs.f_frsize
        return sum(free.values())

    def statistics(self) -> DriverStatistics:
        stats = super().statistics()
        maps = self.files.maps
        if maps is None:
            return stats
        return with_counters(stats, {"mapped_blocks": len(maps),
                                     "mapped_bytes": maps.mapped_bytes,
                                     "mapped_loads": maps.loads,
                                     "mapped_on_load": maps.mapped_on_load,
                                     "maps_dropped": maps.evicted})

    def block_path(self, key: bytes) -> str:
        """Where `key`'s block lives (tests and tools; the file may not exist)."""
        return self.files.path_for(key)
