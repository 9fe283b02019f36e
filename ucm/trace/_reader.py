"""Reading trace files: whole traces (`read_trace`) and live ones (`Follower`).

Nothing in a trace directory is trusted: only regular files are read (opened non-blocking,
so a FIFO never hangs a reader), a frame is decompressed only up to its declared size and at
most `MAX_FRAME_RAW` bytes, and malformed frames and records are skipped with one
TraceWarning per segment and counted (`counts=` of `read_trace`, `Follower.skipped`).

Records stream: a segment is never held whole. What one reader takes in is bounded
(`ReadLimits`): records and decompressed bytes per segment and in all (per command, through a
`ReadBudget`), and malformed frames per segment. A segment past its limits, or past its
`bad_frames`-th malformed frame, is cut there with a TraceWarning naming the file; a reader
past its overall limits stops, with one warning. Every frame costs a record or a malformed
frame (an empty or zero-length frame is malformed: the writer writes neither), so the frames
one segment makes a reader look at are bounded too, whatever its size on disk.
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
MAX_HEADER_RAW = 64 << 10  # a segment header is ~100 bytes; a bigger one is forged
_CHUNK = 1 << 20


class TraceWarning(UserWarning):
    """A segment could not be read completely (torn by a crash, malformed, or not a trace)."""


@dataclass(frozen=True)
class ReadLimits:
    """What one reader takes in. Records count well-formed and malformed ones; bytes are
    payload bytes after decompression. The defaults read a full default trace directory
    (`trace.max_bytes` 256 MiB of segments of 8 MiB, ~10-30 compressed bytes a record)."""

    segment_records: int = 1 << 21  # per segment (~2.1 M)
    segment_bytes: int = 256 << 20  # per segment
    records: int = 1 << 25  # in all (~33.5 M)
    bytes: int = 4 << 30  # in all
    bad_frames: int = 8  # malformed frames before the rest of a segment is skipped

    def __post_init__(self) -> None:
        for name in ("segment_records", "segment_bytes", "records", "bytes", "bad_frames"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"trace read limit {name} must be an integer >= 1, "
                                 f"not {value!r}")


class ReadBudget:
    """The records and decompressed bytes a reader has taken in, against `limits`; one per
    command (pass the same budget to every read it makes). `exhausted` once a limit in all
    was reached: nothing more is read."""

    def __init__(self, limits: ReadLimits | None = None) -> None:
        self.limits = limits if limits is not None else ReadLimits()
        self.records = 0
        self.bytes = 0
        self.frames = 0  # frames looked at past the headers, malformed ones included
        self.exhausted = False


class Record(NamedTuple):
    t: int  # monotonic ns in the writing process
    phase: str
    event_id: int
    fields: dict[str, Any]  # an event's fields as msgpack decodes them
    pid: int


@dataclass
class _Segment:
    path: Path
    pid: int
    offset: int = 0  # bytes consumed
    header: dict[str, Any] | None = None
    bad: bool = False  # nothing more is read from it
    records: int = 0  # records taken in from it (a follower's, over all its polls)
    bytes: int = 0
    bad_frames: int = 0


def _warn(message: str) -> None:
    warnings.warn(message, TraceWarning, stacklevel=4)


def decompress_frame(frame: bytes, dctx: zstandard.ZstdDecompressor | None = None, *,
                     limit: int = MAX_FRAME_RAW) -> bytes | None:
    """The payload of one zstd frame; None when it is corrupt or would exceed its declared
    size or `limit` (at most MAX_FRAME_RAW; checked before anything is allocated)."""
    dctx = dctx or zstandard.ZstdDecompressor()
    limit = min(limit, MAX_FRAME_RAW)
    try:
        declared = zstandard.frame_content_size(frame)
        if declared > limit:
            return None
        if declared >= 0:  # decompress allocates the declared size: checked above
            return dctx.decompress(frame)
        reader = dctx.stream_reader(frame, read_across_frames=False)
        parts, total = [], 0
        while chunk := reader.read(_CHUNK):
            total += len(chunk)
            if total > limit:
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


# Containers and their entries one record may build: a record is a few dozen, a batch's keys_hex
# one per key. An empty array or map is one byte of msgpack but ~60 bytes of Python: without a
# bound, one forged 64 MiB frame would build gigabytes.
MAX_RECORD_CELLS = 1 << 20


class _TooBig(Exception):
    pass


def _items(payload: bytes, pid: int) -> Iterator[Record | None]:
    """The payload's records one at a time; None for each that is malformed."""
    cells = 0

    def counted(container: Any) -> Any:  # msgpack builds inner containers first
        nonlocal cells
        cells += len(container) + 1
        if cells > MAX_RECORD_CELLS:
            raise _TooBig
        return container

    # Limits at the payload's size: no declared length can make the unpacker allocate more.
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False,
                                max_buffer_size=max(len(payload), 1),
                                max_array_len=MAX_RECORD_CELLS, max_map_len=MAX_RECORD_CELLS,
                                list_hook=counted, object_hook=counted)
    unpacker.feed(payload)
    try:
        for item in unpacker:
            cells = 0
            yield _record(item, pid)
    except Exception:  # garbage msgpack, or a record past its cells: the rest is lost
        yield None
        return
    if unpacker.tell() < len(payload):  # a record cut off inside the payload
        yield None


def _header(payload: bytes) -> dict[str, Any] | None:
    if len(payload) > MAX_HEADER_RAW:
        return None
    try:
        header = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:
        return None
    return header if type(header) is dict else None


def _cut(seg: _Segment, counts: Counter[str], why: str) -> None:
    """Skips the rest of a segment (counted as one segment not read whole)."""
    _warn(f"{seg.path}: {why}; the rest of the segment is skipped")
    seg.bad = True
    counts["segments"] += 1


def _parse(seg: _Segment, f: IO[bytes], size: int, *, final: bool, counts: Counter[str],
           budget: ReadBudget, defer: bool = False, skip: bool = False,
           header_only: bool = False) -> Iterator[Record]:
    """The records of the complete frames of segment file `f` (`size` bytes) past
    `seg.offset`, one at a time. `final`: the file is complete (a torn tail is a fault).
    `defer` (a follower): the budget is checked between frames only, and a spent one leaves
    the rest for the next read instead of skipping it. `skip`: frames past the header are
    passed over unread (a follower starting at the end). `header_only`: stops after the
    header."""
    if seg.offset == 0:
        if size < len(MAGIC):
            if final:
                _warn(f"{seg.path}: truncated before its header; skipped")
                counts["segments"] += 1
            return
        f.seek(0)
        if f.read(len(MAGIC)) != MAGIC:
            _warn(f"{seg.path}: not a ucm trace segment; skipped")
            seg.bad = True
            counts["segments"] += 1
            return
        seg.offset = len(MAGIC)
    limits = budget.limits
    dctx = zstandard.ZstdDecompressor()
    bad_frames = bad_records = 0  # this read's, for its warning
    while not seg.bad:
        if seg.header is not None and (budget.exhausted or (defer and (
                budget.records >= limits.records or budget.bytes >= limits.bytes))):
            break
        f.seek(seg.offset)
        head = f.read(FRAME_HEADER) if size - seg.offset >= FRAME_HEADER else b""
        length = frame_length(head) if len(head) == FRAME_HEADER else None
        if length is not None and length > MAX_FRAME_STORED:
            _cut(seg, counts, f"implausible frame length {length} at byte {seg.offset}")
            break
        end = seg.offset + FRAME_HEADER + (length or 0)
        if length is None or end > size:
            if final and seg.offset < size:
                _warn(f"{seg.path}: truncated at byte {seg.offset} of {size} (a torn last "
                      "frame); the rest of the segment is skipped")
                counts["frames"] += 1
            break
        if seg.header is None:
            payload = decompress_frame(f.read(length), dctx) if length else None
            header = _header(payload) if payload is not None else None
            if header is None:
                _warn(f"{seg.path}: unreadable segment header; skipped")
                seg.bad = True
                counts["segments"] += 1
                break
            seg.offset, seg.header = end, header
            if header_only:
                break
            continue
        seg.offset = end
        if skip:  # passed over unread, still counted: each written frame holds a record
            seg.records += 1
            if length == 0:
                seg.bad_frames += 1
                counts["frames"] += 1
            if seg.bad_frames >= limits.bad_frames:
                _cut(seg, counts, f"{seg.bad_frames} malformed frames, the most a reader "
                     "skips in one segment")
            elif seg.records > limits.segment_records:
                _cut(seg, counts, f"more than {limits.segment_records} frames in one segment")
            continue
        budget.frames += 1
        payload = decompress_frame(f.read(length), dctx) if length else None
        if not payload:  # corrupt, oversized, zero-length or empty: the writer writes none
            bad_frames += 1
            seg.bad_frames += 1
            counts["frames"] += 1
            if seg.bad_frames >= limits.bad_frames:
                _cut(seg, counts, f"{seg.bad_frames} malformed frames, the most a reader "
                     "skips in one segment")
            continue
        if seg.bytes + len(payload) > limits.segment_bytes:
            _cut(seg, counts, f"more than {limits.segment_bytes} decompressed bytes in one "
                 "segment (ucm-trace --max-segment-bytes raises the limit)")
            break
        if not defer and budget.bytes + len(payload) > limits.bytes:
            budget.exhausted = True
            _cut(seg, counts, f"the reader's limit of {limits.bytes} decompressed bytes in "
                 "all was reached (ucm-trace --max-bytes raises it)")
            break
        seg.bytes += len(payload)
        budget.bytes += len(payload)
        for record in _items(payload, seg.pid):
            if seg.records >= limits.segment_records:
                _cut(seg, counts, f"more than {limits.segment_records} records in one "
                     "segment (ucm-trace --max-segment-records raises the limit)")
                break
            if not defer and budget.records >= limits.records:
                budget.exhausted = True
                _cut(seg, counts, f"the reader's limit of {limits.records} records in all "
                     "was reached (ucm-trace --max-records raises it)")
                break
            seg.records += 1
            budget.records += 1
            if record is None:
                bad_records += 1
                counts["records"] += 1
            else:
                yield record
    if bad_frames or bad_records:
        what = [f"{n} {noun}" for n, noun in ((bad_frames, "malformed or oversized frames"),
                                              (bad_records, "malformed records")) if n]
        _warn(f"{seg.path}: skipped {' and '.join(what)}")


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


def trace_files(source: str | os.PathLike[str]) -> list[Path]:
    """The segments of a trace: a segment file itself, or every segment in a directory."""
    path = Path(source)
    if path.is_dir():
        return list_segments(path)
    if not path.exists():
        raise FileNotFoundError(f"no trace at {path}")
    return [path]


def _new_segment(path: Path) -> _Segment:
    parsed = parse_segment_name(path.name)
    return _Segment(path, parsed[0] if parsed else 0)


def iter_segment(path: str | os.PathLike[str], *, counts: Counter[str] | None = None,
                 budget: ReadBudget | None = None, header: list[dict[str, Any]] | None = None,
                 ) -> Iterator[Record]:
    """The records of one segment, one at a time, within `budget` (default limits when
    None). A torn tail, malformed frames and records are skipped with a TraceWarning and
    added to `counts` (segments, frames, records). `header`, a list, gets the segment's
    header appended once it is read."""
    seg = _new_segment(Path(path))
    counts = Counter() if counts is None else counts
    budget = ReadBudget() if budget is None else budget
    opened = _open_regular(seg.path, counts)
    if opened is None:
        return
    f, size = opened
    with f:
        records = _parse(seg, f, size, final=True, counts=counts, budget=budget)
        first = next(records, None)
        if header is not None and seg.header is not None:
            header.append(seg.header)
        if first is not None:
            yield first
            yield from records


def read_segment(path: str | os.PathLike[str], *, counts: Counter[str] | None = None,
                 budget: ReadBudget | None = None,
                 ) -> tuple[dict[str, Any] | None, list[Record]]:
    """(header, records) of one segment, at most `budget.limits.segment_records` of them;
    see `iter_segment`, which streams them instead."""
    header: list[dict[str, Any]] = []
    records = list(iter_segment(path, counts=counts, budget=budget, header=header))
    return (header[0] if header else None), records


def read_header(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The header of one segment (its first frame alone is read); None when unreadable."""
    seg = _new_segment(Path(path))
    counts: Counter[str] = Counter()
    opened = _open_regular(seg.path, counts)
    if opened is None:
        return None
    f, size = opened
    with f:
        for _ in _parse(seg, f, size, final=True, counts=counts, budget=ReadBudget(),
                        header_only=True):
            pass
    return seg.header


def read_trace(source: str | os.PathLike[str], *, counts: Counter[str] | None = None,
               budget: ReadBudget | None = None) -> Iterator[Record]:
    """Every record of a trace file or directory, segment by segment (per process, in
    order), streamed, within `budget` (default `ReadLimits` when None). What cannot be
    read is skipped with a TraceWarning and added to `counts`; segments left unread once
    the budget is spent count as skipped segments."""
    counts = Counter() if counts is None else counts
    budget = ReadBudget() if budget is None else budget
    paths = trace_files(source)
    for i, path in enumerate(paths):
        if budget.exhausted:
            _warn(f"{source}: {len(paths) - i} segments not read: the reader's limits were "
                  "reached")
            counts["segments"] += len(paths) - i
            return
        yield from iter_segment(path, counts=counts, budget=budget)


def trace_headers(source: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """The first segment header per pid (wall and monotonic clocks at its start)."""
    headers: dict[int, dict[str, Any]] = {}
    for path in trace_files(source):
        parsed = parse_segment_name(path.name)
        if parsed and parsed[0] in headers:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TraceWarning)
            header = read_header(path)
        if header is not None:
            pid = header.get("pid")
            if type(pid) is not int:
                pid = parsed[0] if parsed else 0
            headers.setdefault(pid, header)
    return headers


class Follower:
    """Reads the records that a running process appends to a trace directory. `poll()`
    returns the records written since the last call (complete frames only); `skipped`
    counts what could not be read. Each segment is held to `limits`' per-segment bounds
    over its life; each poll reads about `limits.records` and `limits.bytes` at most
    (whole frames: the rest waits for the next poll)."""

    def __init__(self, directory: str | os.PathLike[str], *, from_start: bool = False,
                 limits: ReadLimits | None = None) -> None:
        self.directory = Path(directory)
        self.limits = limits if limits is not None else ReadLimits()
        self._segments: dict[Path, _Segment] = {}
        self.skipped: Counter[str] = Counter()
        if not from_start and self.directory.is_dir():
            with warnings.catch_warnings():  # skip what is there already, unread
                warnings.simplefilter("ignore", TraceWarning)
                for path in list_segments(self.directory):
                    self._read(self._segment(path), ReadBudget(self.limits), skip=True)

    def _segment(self, path: Path) -> _Segment:
        seg = self._segments.get(path)
        if seg is None:
            seg = self._segments[path] = _new_segment(path)
        return seg

    def _read(self, seg: _Segment, budget: ReadBudget, *, skip: bool = False,
              ) -> list[Record]:
        opened = _open_regular(seg.path, self.skipped)
        if opened is None:
            seg.bad = seg.path.exists()  # not a regular file: never again
            return []
        f, size = opened
        with f:
            if size <= seg.offset:
                return []
            return list(_parse(seg, f, size, final=False, counts=self.skipped, budget=budget,
                               defer=True, skip=skip))

    def poll(self) -> list[Record]:
        if not self.directory.is_dir():
            return []
        out: list[Record] = []
        present = set()
        budget = ReadBudget(self.limits)
        for path in list_segments(self.directory):
            present.add(path)
            seg = self._segment(path)
            if not seg.bad:
                out.extend(self._read(seg, budget))
        for gone in set(self._segments) - present:
            del self._segments[gone]
        out.sort(key=lambda r: (r.pid, r.t))
        return out
