"""Reading trace files: whole traces (`read_trace`) and live ones (`Follower`)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import zstandard

from ucm.trace._format import (
    FRAME_HEADER,
    MAGIC,
    list_segments,
    parse_segment_name,
    read_frame_length,
)


class TraceWarning(UserWarning):
    """A segment could not be read completely (torn by a crash, or not a trace)."""


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
    records: list[Record] = field(default_factory=list)


def _parse(seg: _Segment, data: bytes, *, final: bool) -> list[Record]:
    """Parses complete frames of `data` (the segment from its start) past `seg.offset`."""
    out: list[Record] = []
    dctx = zstandard.ZstdDecompressor()
    if seg.offset == 0:
        if len(data) < len(MAGIC):
            if final:
                warnings.warn(f"{seg.path}: truncated before its header; skipped",
                              TraceWarning, stacklevel=3)
            return out
        if data[: len(MAGIC)] != MAGIC:
            warnings.warn(f"{seg.path}: not a ucm trace segment; skipped", TraceWarning,
                          stacklevel=3)
            seg.bad = True
            return out
        seg.offset = len(MAGIC)
    pid = seg.pid
    while True:
        length = read_frame_length(data, seg.offset)
        end = seg.offset + FRAME_HEADER + (length or 0)
        if length is None or end > len(data):
            if final and seg.offset < len(data):
                warnings.warn(f"{seg.path}: truncated at byte {seg.offset} of {len(data)} "
                              "(a torn last frame); the rest of the segment is skipped",
                              TraceWarning, stacklevel=3)
            return out
        try:
            payload = dctx.decompress(data[seg.offset + FRAME_HEADER: end])
        except zstandard.ZstdError as exc:
            warnings.warn(f"{seg.path}: corrupt frame at byte {seg.offset} ({exc}); the rest "
                          "of the segment is skipped", TraceWarning, stacklevel=3)
            seg.bad = True
            return out
        seg.offset = end
        if seg.header is None:
            seg.header = msgpack.unpackb(payload)
            continue
        out.extend(Record(t, phase, event_id, fields, pid)
                   for _seq, t, phase, event_id, fields in _unpack(payload))


def _unpack(payload: bytes) -> Iterator[list]:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(payload)
    return unpacker


def trace_files(source: str | os.PathLike) -> list[Path]:
    """The segments of a trace: a segment file itself, or every segment in a directory."""
    path = Path(source)
    if path.is_dir():
        return list_segments(path)
    if not path.exists():
        raise FileNotFoundError(f"no trace at {path}")
    return [path]


def read_segment(path: str | os.PathLike) -> tuple[dict[str, Any] | None, list[Record]]:
    """(header, records) of one segment; a torn tail is skipped with a TraceWarning."""
    path = Path(path)
    parsed = parse_segment_name(path.name)
    seg = _Segment(path, parsed[0] if parsed else 0)
    records = _parse(seg, path.read_bytes(), final=True)
    return seg.header, records


def read_trace(source: str | os.PathLike) -> Iterator[Record]:
    """Every record of a trace file or directory, segment by segment (per process, in
    order). Torn or foreign segments are skipped with a TraceWarning."""
    for path in trace_files(source):
        _, records = read_segment(path)
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
            headers.setdefault(int(header.get("pid", parsed[0] if parsed else 0)), header)
    return headers


class Follower:
    """Reads the records that a running process appends to a trace directory. `poll()`
    returns the records written since the last call (complete frames only)."""

    def __init__(self, directory: str | os.PathLike, *, from_start: bool = False) -> None:
        self.directory = Path(directory)
        self._segments: dict[Path, _Segment] = {}
        if not from_start and self.directory.is_dir():
            for path in list_segments(self.directory):  # skip what is there already
                seg = self._segment(path)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", TraceWarning)
                    _parse(seg, path.read_bytes(), final=False)

    def _segment(self, path: Path) -> _Segment:
        seg = self._segments.get(path)
        if seg is None:
            parsed = parse_segment_name(path.name)
            seg = self._segments[path] = _Segment(path, parsed[0] if parsed else 0)
        return seg

    def poll(self) -> list[Record]:
        if not self.directory.is_dir():
            return []
        out: list[Record] = []
        present = set()
        for path in list_segments(self.directory):
            present.add(path)
            seg = self._segment(path)
            if seg.bad:
                continue
            try:
                size = path.stat().st_size
                if size <= seg.offset:
                    continue
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:  # rotated away meanwhile
                continue
            out.extend(_parse(seg, data, final=False))
        for gone in set(self._segments) - present:
            del self._segments[gone]
        out.sort(key=lambda r: (r.pid, r.t))
        return out
