"""The on-disk trace format: rolling segment files of zstd-compressed msgpack frames.

A trace directory holds `trace-<pid>-<n>.ucmtrace` segments. Each segment is

    MAGIC (8 bytes) | frame | frame | ...
    frame = payload length (4 bytes, little endian) | zstd frame of the payload

The first frame's payload is one msgpack map (the segment header: format, pid, host, the
wall and monotonic clocks at its start). Every later payload is a run of msgpack records
`[seq, t_ns, phase, event_id, fields]` (seq: the emit order in the process; -1 for records the
writer adds). The writer appends a frame with one `write`, so a process
that dies leaves every complete frame readable; a reader stops at a torn last frame.

Segments are 0600 and a directory the writer creates is 0700 (whatever the umask): records
carry request ids and key prefixes. A directory that another user owns or may write is
refused. A frame's payload is at most `MAX_FRAME_RAW` bytes; readers refuse larger ones.
"""

from __future__ import annotations

import os
import re
import socket
import stat
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
FRAME_PAYLOAD = 4 << 20  # the writer starts a new frame past this many payload bytes
MAX_FRAME_RAW = 64 << 20  # the most a reader decompresses from one frame


def segment_name(pid: int, n: int) -> str:
    return f"trace-{pid}-{n:06d}{SUFFIX}"


def parse_segment_name(name: str) -> tuple[int, int] | None:
    """(pid, n) for a segment file name, else None."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def list_segments(directory: str | os.PathLike[str], pid: int | None = None) -> list[Path]:
    """Segments in `directory` ordered by (pid, n); only `pid`'s when given."""
    found: list[tuple[tuple[int, int], Path]] = []
    for entry in os.scandir(os.fspath(directory)):
        parsed = parse_segment_name(entry.name)
        if parsed and (pid is None or parsed[0] == pid):
            found.append((parsed, Path(entry.path)))
    return [p for _, p in sorted(found)]


def pack_default(obj: Any) -> Any:
    """For values msgpack cannot encode: hex for buffers, str() for the rest."""
    if isinstance(obj, bytes | bytearray | memoryview):
        return bytes(obj).hex()
    return str(obj)


def private_dir(directory: Path) -> None:
    """Creates `directory` 0700 if missing; raises PermissionError if it is not a directory
    that this user owns and that no one else may write."""
    if not os.path.lexists(directory):
        directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(directory, 0o700)
            os.chmod(directory, 0o700)  # the umask may have taken bits away
        except FileExistsError:  # made meanwhile: checked below like any other
            pass
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"trace path {directory} is not a directory")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"trace directory {directory} belongs to uid {st.st_uid}, not "
                              f"to this user ({os.geteuid()}); refusing to write there")
    if st.st_mode & 0o022:
        raise PermissionError(f"trace directory {directory} is writable by others (mode "
                              f"{stat.S_IMODE(st.st_mode):o}); refusing to write there")


class SegmentWriter:
    """Appends record batches to rolling segments; keeps this process's segments within
    `max_bytes` by deleting the oldest. Not thread-safe: one caller at a time."""

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int, segment_bytes: int,
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
        self._path: Path | None = None  # the open segment's
        self._size = 0
        self._segments: list[tuple[Path, int]] = []  # closed segments of this writer, oldest first
        self._next = 0
        self.bytes_written = 0

    @property
    def current(self) -> Path | None:
        return self._path if self._fd is not None else None

    def _open_segment(self) -> None:
        private_dir(self.directory)
        existing = list_segments(self.directory, self.pid)
        parsed = parse_segment_name(existing[-1].name) if existing else None
        if parsed is not None:  # a reused pid: never overwrite an older trace
            self._next = max(self._next, parsed[1] + 1)
        while True:
            path = self.directory / segment_name(self.pid, self._next)
            self._next += 1
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
                             | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue
            try:
                os.fchmod(fd, 0o600)  # the umask may have taken bits away
            except BaseException:
                os.close(fd)
                raise
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
        fd = self._fd
        assert fd is not None, "no segment open"
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        self._size += len(data)
        self.bytes_written += len(data)

    def write(self, records: Sequence[Sequence[Any]]) -> None:
        """Writes records `(seq, t_ns, phase, event_id, fields)`: one frame per
        `FRAME_PAYLOAD` bytes."""
        pack = self._packer.pack
        for payload in frame_payloads([pack(r) for r in records]):
            self.write_payload(payload)

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
        if self._fd is not None and self._path is not None:
            os.close(self._fd)
            self._segments.append((self._path, self._size))
            self._fd = None

    def close(self) -> None:
        self._close_segment()


def frame_payloads(chunks: Sequence[bytes]) -> list[bytes]:
    """Packed records joined into payloads of about `FRAME_PAYLOAD` bytes (never splitting a
    record), so that every frame stays well under what readers accept."""
    if sum(map(len, chunks)) <= FRAME_PAYLOAD:
        return [b"".join(chunks)]
    out: list[bytes] = []
    run: list[bytes] = []
    size = 0
    for chunk in chunks:
        if run and size + len(chunk) > FRAME_PAYLOAD:
            out.append(b"".join(run))
            run, size = [], 0
        run.append(chunk)
        size += len(chunk)
    if run:
        out.append(b"".join(run))
    return out


def frame_length(head: bytes) -> int:
    """The stored length of the frame whose FRAME_HEADER bytes are `head`."""
    length: int = _LEN.unpack(head)[0]
    return length


FRAME_HEADER = _LEN.size
