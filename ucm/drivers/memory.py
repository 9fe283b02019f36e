"""The `memory` driver: blocks in host DRAM.

    - driver: memory
      capacity: 2GiB          # enforced by the kernel, not here
      shared: false           # true: blocks are files in /dev/shm, seen by every process
      shm_dir: null           # shared mode's directory; default /dev/shm/ucm/<namespace>

Process-local mode keeps a dict of records (a private copy of the stored bytes plus the
block header); a store copies the caller's bytes and a load copies them back and verifies the
checksum of what it copied, so a flipped bit in memory is a corrupt miss, never data.

Shared mode keeps blocks as files on tmpfs in the ucm block format, published by temp file +
rename (see `_files.BlockFiles`): processes on one host see each other's blocks, and a writer
killed mid-block leaves nothing half-visible. Neither mode outlives a reboot: not persistent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Self

import trio

from ucm.block import (
    BlockHeader,
    Codec,
    checksum,
    copy_hashed,
    copy_verified,
    decode_payload_into,
    encode_payload,
)
from ucm.drivers._files import (
    Backend,
    BlockFiles,
    FileLayout,
    ThreadedDriver,
    os_error,
    parse_codec,
    safe_dir_name,
    size_mismatch,
)
from ucm.drivers._protocol import DriverOptions, LoadState
from ucm.errors import BlockCorrupt

SHM_ROOT = "/dev/shm/ucm"


@dataclass(frozen=True, slots=True)
class _Record:
    header: BlockHeader
    payload: bytearray  # the stored bytes (after the codec); private to the driver


class LocalBlocks(Backend):
    """The process-local store. Records are replaced whole, never edited, so a load that
    picked a record up reads one consistent block while a store of the same key runs."""

    def __init__(self, *, namespace: str, codec: Codec) -> None:
        self.namespace = namespace
        self.codec = codec
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
                if header.codec is Codec.NONE:
                    copy_verified(header, out, record.payload)
                else:
                    decode_payload_into(header, record.payload, out)
            except BlockCorrupt:
                states.append(LoadState.CORRUPT)
            else:
                states.append(LoadState.OK)
        return states

    def store(self, keys: list[bytes], views: list[memoryview]) -> list[int]:
        sizes = []
        for key, view in zip(keys, views, strict=True):
            if self.codec is Codec.NONE:  # copied and hashed in one pass
                payload = bytearray(view.nbytes)
                digest = copy_hashed(memoryview(payload), view)
            else:
                payload = bytearray(encode_payload(self.codec, view))
                digest = checksum(payload)
            header = BlockHeader(key, self.namespace, self.codec, len(payload), view.nbytes,
                                 digest)
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


class MemoryDriver(ThreadedDriver):
    """Host DRAM, process-local or shared through /dev/shm."""

    persistent = False
    scatter = True  # loads read straight into a Scatter's pieces

    class Options(DriverOptions):
        shared: bool = False
        shm_dir: str | None = None

    def __init__(self, backend: LocalBlocks | BlockFiles, *, name: str) -> None:
        super().__init__(backend, name=name)
        self.backend = backend
        self.shared = isinstance(backend, BlockFiles)
        if not self.shared:
            # Dict operations and KiB copies cost less than a thread hop.
            self.inline_bytes = 64 * 1024
            self.inline_meta = True

    @classmethod
    async def open(cls, options: Options | dict, *, name: str = "memory", namespace: str,
                   codec: str = "none") -> Self:
        if not isinstance(options, cls.Options):
            options = cls.Options.model_validate(options)
        codec_value = parse_codec(codec)
        if not options.shared:
            await trio.lowlevel.checkpoint()
            return cls(LocalBlocks(namespace=namespace, codec=codec_value), name=name)
        root = options.shm_dir or os.path.join(SHM_ROOT, safe_dir_name(namespace))
        layout = FileLayout((os.path.abspath(root),), shard_depth=1)
        try:
            files = await trio.to_thread.run_sync(
                lambda: BlockFiles.open(layout, namespace=namespace, codec=codec_value,
                                        fsync=False, direct=False))
        except OSError as exc:
            raise os_error(exc, name) from exc
        return cls(files, name=name)

    def block_path(self, key: bytes) -> str:
        """Shared mode: where `key`'s block file lives."""
        if not isinstance(self.backend, BlockFiles):
            raise TypeError("block_path exists in shared mode only")
        return self.backend.path_for(key)
