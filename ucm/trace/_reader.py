"""Reading trace files: whole traces (`read_trace`) and live ones (`Follower`).

Nothing in a trace directory is trusted: only regular files are read (opened non-blocking,
so a FIFO never hangs a reader), a frame is decompressed only up to its declared size and at
most `MAX_FRAME_RAW` bytes, and malformed frames and records are skipped with one
TraceWarning per segment and counted (`counts=` of `read_trace`, `Follower.skipped`).
"""

from __future__ import annotations

import os
import stat
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

import msgpack
import zstandard

from ucm.trace._format import (
    FRAME_HEADER,
    MAGIC,
    MAX_FRAME_RAW,
    frame_length,
    list_segments,
    parse_segment_name,
)

# The most a zstd frame of MAX_FRAME_RAW bytes takes (ZSTD_compressBound, rounded up).
MAX_FRAME_STORED = MAX_FRAME_RAW + (MAX_FRAME_RAW >> 7) + (1 << 16)
_CHUNK = 1 << 20


class TraceWarning(UserWarning):
    """A segment could not be read completely (torn by a crash, malformed, or not a trace)."""


class Record(NamedTuple):
    t: int  # monotonic ns in the writing process
    phase: str
    event_id: int
    fields: dict
    pid: int


@dataclass
class _Segment:
    path: Path
    pid: int
    offset: int = 0  # bytes consumed
    header: dict[str, Any] | None = None
    bad: bool = False


def _warn(message: str) -> None:
    warnings.warn(message, TraceWarning, stacklevel=4)


def decompress_frame(frame: bytes, dctx: zstandard.ZstdDecompressor | None = None,
                     ) -> bytes | None:
    """The payload of one zstd frame; None when it is corrupt or would exceed its declared
    size or MAX_FRAME_RAW (checked before anything is allocated)."""
    dctx = dctx or zstandard.ZstdDecompressor()
    try:
        declared = zstandard.frame_content_size(frame)
        if declared > MAX_FRAME_RAW:
            return None
        if declared >= 0:  # decompress allocates the declared size: checked above
            return dctx.decompress(frame)
        reader = dctx.stream_reader(frame, read_across_frames=False)
        parts, total = [], 0
        while chunk := reader.read(_CHUNK):
            total += len(chunk)
            if total > MAX_FRAME_RAW:
                return None
            parts.append(chunk)
        return b"".join(parts)
    except zstandard.ZstdError:
        return None


def _record(item: Any, pid: int) -> Record | None:
    """A record `[seq, t_ns, phase, event_id, fields]` of the right types, else None."""
    if type(item) is not list or len(item) != 5:
        return None
    seq, t, phase, event_id, fields = item
    if (type(seq) is not int or type(t) is not int or type(phase) is not str
            or type(event_id) is not int or type(fields) is not dict):
        return None
    return Record(t, phase, event_id, fields, pid)


def _records(payload: bytes, pid: int, out: list[Record]) -> int:
    """Appends the payload's well-formed records to `out`; returns how many were not."""
    # Limits at the payload's size: no declared length can make the unpacker allocate more.
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False,
                                max_buffer_size=max(len(payload), 1))
    unpacker.feed(payload)
    bad = 0
    try:
        for item in unpacker:
            record = _record(item, pid)
            if record is None:
                bad += 1
            else:
                out.append(record)
    except Exception:  # garbage msgpack: the rest of this payload is lost
        bad += 1
    else:
        if unpacker.tell() < len(payload):  # a record cut off inside the payload
            bad += 1
    return bad


def _header(payload: bytes) -> dict[str, Any] | None:
    try:
        header = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:
        return None
    return header if type(header) is dict else None


def _parse(seg: _Segment, f: IO[bytes], size: int, *, final: bool,
           counts: Counter[str]) -> list[Record]:
    """Parses the complete frames of segment file `f` (`size` bytes) past `seg.offset`."""
    out: list[Record] = []
    if seg.offset == 0:
        if size < len(MAGIC):
            if final:
                _warn(f"{seg.path}: truncated before its header; skipped")
                counts["segments"] += 1
            return out
        f.seek(0)
        if f.read(len(MAGIC)) != MAGIC:
            _warn(f"{seg.path}: not a ucm trace segment; skipped")
            seg.bad = True
            counts["segments"] += 1
            return out
        seg.offset = len(MAGIC)
    dctx = zstandard.ZstdDecompressor()
    bad_frames = bad_records = 0
    while True:
        f.seek(seg.offset)
        head = f.read(FRAME_HEADER) if size - seg.offset >= FRAME_HEADER else b""
        length = frame_length(head) if len(head) == FRAME_HEADER else None
        if length is not None and length > MAX_FRAME_STORED:
            _warn(f"{seg.path}: implausible frame length {length} at byte {seg.offset}; the "
                  "rest of the segment is skipped")
            seg.bad = True
            counts["segments"] += 1
            break
        end = seg.offset + FRAME_HEADER + (length or 0)
        frame = f.read(length) if length is not None and end <= size else b""
        if length is None or len(frame) < length:
            if final and seg.offset < size:
                _warn(f"{seg.path}: truncated at byte {seg.offset} of {size} (a torn last "
                      "frame); the rest of the segment is skipped")
                counts["frames"] += 1
            break
        payload = decompress_frame(frame, dctx)
        if seg.header is None:
            header = _header(payload) if payload is not None else None
            if header is None:
                _warn(f"{seg.path}: unreadable segment header; skipped")
                seg.bad = True
                counts["segments"] += 1
                break
            seg.offset, seg.header = end, header
            continue
        seg.offset = end
        if payload is None:
            bad_frames += 1
            continue
        bad_records += _records(payload, seg.pid, out)
    if bad_frames or bad_records:
        what = [f"{n} {noun}" for n, noun in ((bad_frames, "malformed or oversized frames"),
                                              (bad_records, "malformed records")) if n]
        _warn(f"{seg.path}: skipped {' and '.join(what)}")
        counts["frames"] += bad_frames
        counts["records"] += bad_records
    return out


def _open_regular(path: Path, counts: Counter[str]) -> tuple[IO[bytes], int] | None:
    """(file, size) of a regular file; None (with a warning) for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:  # rotated away meanwhile
        return None
    except OSError as exc:
        _warn(f"{path}: cannot open ({exc.strerror}); skipped")
        counts["segments"] += 1
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        _warn(f"{path}: not a regular file; skipped")
        counts["segments"] += 1
        return None
    return os.fdopen(fd, "rb"), st.st_size


def trace_files(source: str | os.PathLike) -> list[Path]:
    """The segments of a trace: a segment file itself, or every segment in a directory."""
    path = Path(source)
    if path.is_dir():
        return list_segments(path)
    if not path.exists():
        raise FileNotFoundError(f"no trace at {path}")
    return [path]


def read_segment(path: str | os.PathLike, *, counts: Counter[str] | None = None,
                 ) -> tuple[dict[str, Any] | None, list[Record]]:
    """(header, records) of one segment; a torn tail, malformed frames and records are
    skipped with a TraceWarning and added to `counts` (segments, frames, records)."""
    path = Path(path)
    counts = Counter() if counts is None else counts
    parsed = parse_segment_name(path.name)
    seg = _Segment(path, parsed[0] if parsed else 0)
    opened = _open_regular(path, counts)
    if opened is None:
        return None, []
    f, size = opened
    with f:
        records = _parse(seg, f, size, final=True, counts=counts)
    return seg.header, records


def read_trace(source: str | os.PathLike, *, counts: Counter[str] | None = None,
               ) -> Iterator[Record]:
    """Every record of a trace file or directory, segment by segment (per process, in
    order). What cannot be read is skipped with a TraceWarning and added to `counts`."""
    for path in trace_files(source):
        _, records = read_segment(path, counts=counts)
        yield from records


def trace_headers(source: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """The first segment header per pid (wall and monotonic clocks at its start)."""
    headers: dict[int, dict[str, Any]] = {}
    for path in trace_files(source):
        parsed = parse_segment_name(path.name)
        if parsed and parsed[0] in headers:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TraceWarning)
            header, _ = read_segment(path)
        if header is not None:
            pid = header.get("pid")
            if type(pid) is not int:
                pid = parsed[0] if parsed else 0
            headers.setdefault(pid, header)
    return headers


class Follower:
    """Reads the records that a running process appends to a trace directory. `poll()`
    returns the records written since the last call (complete frames only); `skipped`
    counts what could not be read."""

    def __init__(self, directory: str | os.PathLike, *, from_start: bool = False) -> None:
        self.directory = Path(directory)
        self._segments: dict[Path, _Segment] = {}
        self.skipped: Counter[str] = Counter()
        if not from_start and self.directory.is_dir():
            with warnings.catch_warnings():  # skip what is there already
                warnings.simplefilter("ignore", TraceWarning)
                for path in list_segments(self.directory):
                    self._read(self._segment(path))

    def _segment(self, path: Path) -> _Segment:
        seg = self._segments.get(path)
        if seg is None:
            parsed = parse_segment_name(path.name)
            seg = self._segments[path] = _Segment(path, parsed[0] if parsed else 0)
        return seg

    def _read(self, seg: _Segment) -> list[Record]:
        opened = _open_regular(seg.path, self.skipped)
        if opened is None:
            seg.bad = seg.path.exists()  # not a regular file: never again
            return []
        f, size = opened
        with f:
            if size <= seg.offset:
                return []
            return _parse(seg, f, size, final=False, counts=self.skipped)

    def poll(self) -> list[Record]:
        if not self.directory.is_dir():
            return []
        out: list[Record] = []
        present = set()
        for path in list_segments(self.directory):
            present.add(path)
            seg = self._segment(path)
            if not seg.bad:
                out.extend(self._read(seg))
        for gone in set(self._segments) - present:
            del self._segments[gone]
        out.sort(key=lambda r: (r.pid, r.t))
        return out
