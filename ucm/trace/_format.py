"""The on-disk trace format: rolling segment files of zstd-compressed msgpack frames.

A trace directory holds `trace-<pid>-<n>.ucmtrace` segments. Each segment is

    MAGIC (8 bytes) | frame | frame | ...
    frame = payload length (4 bytes, little endian) | zstd frame of the payload

The first frame's payload is one msgpack map (the segment header: format, pid, host, the
wall and monotonic clocks at its start). Every later payload is a run of msgpack records
`[seq, t_ns, phase, event_id, fields]` (seq: the emit order in the process; -1 for records the
writer adds). The writer appends a frame with one `write`, so a process
that dies leaves every complete frame readable; a reader stops at a torn last frame.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import zstandard

MAGIC = b"UCMTRC1\n"
FORMAT_VERSION = 1
SUFFIX = ".ucmtrace"
_LEN = struct.Struct("<I")
_NAME = re.compile(r"^trace-(\d+)-(\d+)\.ucmtrace$")


def segment_name(pid: int, n: int) -> str:
    return f"trace-{pid}-{n:06d}{SUFFIX}"


def parse_segment_name(name: str) -> tuple[int, int] | None:
    """(pid, n) for a segment file name, else None."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def list_segments(directory: str | os.PathLike, pid: int | None = None) -> list[Path]:
    """Segments in `directory` ordered by (pid, n); only `pid`'s when given."""
    found = []
    for entry in os.scandir(directory):
        parsed = parse_segment_name(entry.name)
        if parsed and (pid is None or parsed[0] == pid):
            found.append((parsed, Path(entry.path)))
    return [p for _, p in sorted(found)]


def pack_default(obj: Any) -> Any:
    """For values msgpack cannot encode: hex for buffers, str() for the rest."""
    if isinstance(obj, bytes | bytearray | memoryview):
        return bytes(obj).hex()
    return str(obj)


class SegmentWriter:
    """Appends record batches to rolling segments; keeps this process's segments within
    `max_bytes` by deleting the oldest. Not thread-safe: one caller at a time."""

    def __init__(self, directory: str | os.PathLike, *, max_bytes: int, segment_bytes: int,
                 level: int = 1) -> None:
        if segment_bytes <= 0 or max_bytes < segment_bytes:
            raise ValueError("trace sizes must satisfy 0 < segment_bytes <= max_bytes")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.pid = os.getpid()
        self._compressor = zstandard.ZstdCompressor(level=level)
        self._packer = msgpack.Packer(default=pack_default)
        self._fd: int | None = None
        self._size = 0
        self._segments: list[tuple[Path, int]] = []  # closed segments of this writer, oldest first
        self._next = 0
        self.bytes_written = 0

    @property
    def current(self) -> Path | None:
        return self._path if self._fd is not None else None

    def _open_segment(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        existing = list_segments(self.directory, self.pid)
        if existing:  # a reused pid: never overwrite an older trace
            self._next = max(self._next, parse_segment_name(existing[-1].name)[1] + 1)
        while True:
            path = self.directory / segment_name(self.pid, self._next)
            self._next += 1
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            except FileExistsError:
                continue
            break
        self._fd, self._path, self._size = fd, path, 0
        header = {"format": FORMAT_VERSION, "pid": self.pid, "host": socket.gethostname(),
                  "segment": self._next - 1, "wall_ns": time.time_ns(),
                  "mono_ns": time.monotonic_ns()}
        self._write(MAGIC + self._frame(msgpack.packb(header)))

    def _frame(self, payload: bytes) -> bytes:
        data = self._compressor.compress(payload)
        return _LEN.pack(len(data)) + data

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self._size += len(data)
        self.bytes_written += len(data)

    def write(self, records: Sequence[tuple]) -> None:
        """Writes one frame of records `(seq, t_ns, phase, event_id, fields)`."""
        pack = self._packer.pack
        self.write_payload(b"".join([pack(r) for r in records]))

    def write_payload(self, payload: bytes) -> None:
        """Writes one frame of already packed records."""
        if not payload:
            return
        if self._fd is None:
            self._open_segment()
        self._write(self._frame(payload))
        if self._size >= self.segment_bytes:
            self._rotate()

    def _rotate(self) -> None:
        self._close_segment()
        total = sum(size for _, size in self._segments)
        while self._segments and total > self.max_bytes - self.segment_bytes:
            path, size = self._segments.pop(0)
            total -= size
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def _close_segment(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._segments.append((self._path, self._size))
            self._fd = None

    def close(self) -> None:
        self._close_segment()


def read_frame_length(data: bytes | memoryview, offset: int) -> int | None:
    if len(data) - offset < _LEN.size:
        return None
    return _LEN.unpack_from(data, offset)[0]


FRAME_HEADER = _LEN.size
