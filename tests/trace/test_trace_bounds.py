"""What one read of a hostile trace may cost: records and decompressed bytes per segment and
per command, malformed frames per segment, and records streamed rather than collected.

The segments are built as an attacker would: a 5.7 KB segment whose one frame decompresses
to 9.6 M tiny records (a record bomb), and a segment followed by a sparse hole of zeros
(zero-length frames, one every four bytes). Nothing here times anything: the tests count the
records, frames and bytes the reader took in."""

from __future__ import annotations

import json
import struct
import warnings
from collections import Counter
from pathlib import Path

import msgpack
import pytest
import zstandard
from ucm.tools import trace_cli

from ucm.trace import (
    Follower,
    ReadBudget,
    ReadLimits,
    TraceWarning,
    _reader,
    read_segment,
    read_trace,
    trace_headers,
)
from ucm.trace._format import MAGIC, MAX_FRAME_RAW

HEADER = {"format": 1, "pid": 4242, "host": "h", "segment": 0, "wall_ns": 1, "mono_ns": 1}
TINY = msgpack.packb([0, 1, "a", 0, {}])  # 7 bytes: a well-formed record
GOOD = [0, 100, "start", 1, {"type": "Load", "keys": 1}]


def _frame(payload: bytes, *, level: int = 3) -> bytes:
    data = zstandard.ZstdCompressor(level=level).compress(payload)
    return struct.pack("<I", len(data)) + data


def _segment(*frames: bytes, header: object = HEADER) -> bytes:
    return MAGIC + _frame(msgpack.packb(header)) + b"".join(frames)


def _name(pid: int = 4242, n: int = 0) -> str:
    return f"trace-{pid}-{n:06d}.ucmtrace"


@pytest.fixture(scope="module")
def bomb_frame() -> bytes:
    """One frame holding MAX_FRAME_RAW bytes of 7-byte records: 9,586,980 of them."""
    return _frame(TINY * (MAX_FRAME_RAW // len(TINY)), level=19)


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught if issubclass(w.category, TraceWarning)]


def test_the_record_bomb_reads_at_most_a_segments_records(tmp_path, bomb_frame):
    path = tmp_path / _name()
    path.write_bytes(_segment(bomb_frame))
    assert path.stat().st_size < 8 << 10  # 9.6 M records in a few KiB
    counts: Counter[str] = Counter()
    budget = ReadBudget()
    (header, records), messages = _caught(
        lambda: read_segment(path, counts=counts, budget=budget))
    limit = ReadLimits().segment_records
    assert header == HEADER
    assert len(records) == limit == budget.records
    assert budget.bytes == MAX_FRAME_RAW // len(TINY) * len(TINY)  # the one frame, once
    assert counts == Counter({"segments": 1})  # cut: its rest is skipped
    assert messages == [f"{path}: more than {limit} records in one segment (ucm-trace "
                        "--max-segment-records raises the limit); the rest of the segment "
                        "is skipped"]


def test_records_stream_one_at_a_time(tmp_path, bomb_frame):
    (tmp_path / _name()).write_bytes(_segment(bomb_frame))
    budget = ReadBudget(ReadLimits(segment_records=5000))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        records = read_trace(tmp_path, budget=budget)
        first = next(records)
        assert (first.t, first.phase) == (1, "a")
        assert budget.records == 1  # nothing collected ahead of the caller
        assert sum(1 for _ in records) == 4999
    assert budget.records == 5000


def test_a_command_is_bounded_in_all_whatever_the_segments(tmp_path):
    for n in range(6):  # 6 segments of 3000 records, each within the per-segment limits
        (tmp_path / _name(n=n)).write_bytes(_segment(_frame(TINY * 3000)))
    counts: Counter[str] = Counter()
    budget = ReadBudget(ReadLimits(records=7000))
    got, messages = _caught(lambda: sum(1 for _ in read_trace(tmp_path, counts=counts,
                                                               budget=budget)))
    assert got == budget.records == 7000 and budget.exhausted
    # the third segment is cut, the last three are not opened
    assert counts == Counter({"segments": 4})
    assert messages == [
        f"{tmp_path / _name(n=2)}: the reader's limit of 7000 records in all was reached "
        "(ucm-trace --max-records raises it); the rest of the segment is skipped",
        f"{tmp_path}: 3 segments not read: the reader's limits were reached"]

    budget = ReadBudget(ReadLimits(bytes=2 * 3000 * len(TINY) + 1))
    got, _ = _caught(lambda: sum(1 for _ in read_trace(tmp_path, budget=budget)))
    assert got == 6000 and budget.bytes == 6000 * len(TINY) and budget.exhausted


def test_decompressed_bytes_per_segment_are_bounded(tmp_path):
    path = tmp_path / _name()
    path.write_bytes(_segment(*[_frame(TINY * 1000) for _ in range(5)]))
    counts: Counter[str] = Counter()
    budget = ReadBudget(ReadLimits(segment_bytes=3 * 1000 * len(TINY)))
    (_, records), messages = _caught(lambda: read_segment(path, counts=counts, budget=budget))
    assert len(records) == 3000 and budget.bytes == 3000 * len(TINY)
    assert counts == Counter({"segments": 1})
    assert "decompressed bytes in one segment" in messages[0] and str(path) in messages[0]


def _holed(path: Path, hole: int) -> None:
    """A real segment, then `hole` bytes of zeros that take no disk (a sparse file)."""
    path.write_bytes(_segment(_frame(msgpack.packb(GOOD))))
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size + hole)


@pytest.mark.parametrize("hole", [2 << 20, 1 << 40], ids=["2MiB", "1TiB"])
def test_zero_length_frames_stop_the_reader_after_a_few(tmp_path, hole):
    path = tmp_path / _name()
    try:
        _holed(path, hole)
    except OSError as exc:  # a file system without files this large
        pytest.skip(f"cannot make a {hole}-byte sparse file here: {exc}")
    assert path.stat().st_blocks * 512 < 1 << 20  # the hole takes no disk
    counts: Counter[str] = Counter()
    budget = ReadBudget()
    (_, records), messages = _caught(lambda: read_segment(path, counts=counts, budget=budget))
    bad = ReadLimits().bad_frames
    assert [r.phase for r in records] == ["start"]
    # one good frame, then `bad` zero-length ones: the rest of the hole is never looked at
    assert budget.frames == 1 + bad
    assert counts == Counter({"frames": bad, "segments": 1})
    assert f"{path}: {bad} malformed frames, the most a reader skips in one segment" in \
        messages[0]
    # a follower, from the start or from the end, stops there too
    for from_start in (True, False):
        follower, _ = _caught(lambda: Follower(tmp_path, from_start=from_start))  # noqa: B023
        polled, _ = _caught(follower.poll)
        assert [r.phase for r in polled] == (["start"] if from_start else [])
        assert follower.skipped == Counter({"frames": bad, "segments": 1})
        assert _caught(follower.poll)[0] == []


def test_garbage_frames_stop_the_reader_after_a_few(tmp_path):
    garbage = struct.pack("<I", 9) + b"not zstd!"
    path = tmp_path / _name()
    path.write_bytes(_segment(*[garbage] * 50, _frame(msgpack.packb(GOOD))))
    counts: Counter[str] = Counter()
    budget = ReadBudget(ReadLimits(bad_frames=3))
    (_, records), messages = _caught(lambda: read_segment(path, counts=counts, budget=budget))
    assert records == [] and budget.frames == 3
    assert counts == Counter({"frames": 3, "segments": 1})
    assert messages == [
        f"{path}: 3 malformed frames, the most a reader skips in one segment; the rest of the "
        "segment is skipped", f"{path}: skipped 3 malformed or oversized frames"]
    # an empty frame is malformed too: the writer never writes one
    path.write_bytes(_segment(*[_frame(b"")] * 20))
    counts.clear()
    budget = ReadBudget()
    _caught(lambda: read_segment(path, counts=counts, budget=budget))
    assert budget.frames == ReadLimits().bad_frames and counts["segments"] == 1


def test_a_forged_large_header_is_unreadable(tmp_path):
    path = tmp_path / _name()
    path.write_bytes(_segment(_frame(msgpack.packb(GOOD)),
                              header={f"k{i}": i for i in range(20000)}))
    counts: Counter[str] = Counter()
    (header, records), messages = _caught(lambda: read_segment(path, counts=counts))
    assert header is None and records == [] and counts == Counter({"segments": 1})
    assert "unreadable segment header" in messages[0]


def test_trace_headers_read_only_the_first_frame(tmp_path, bomb_frame, monkeypatch):
    (tmp_path / _name()).write_bytes(_segment(bomb_frame))
    frames: list[int] = []
    real = _reader.decompress_frame

    def counted(frame, dctx=None, **kw):
        frames.append(len(frame))
        return real(frame, dctx, **kw)

    monkeypatch.setattr(_reader, "decompress_frame", counted)
    assert trace_headers(tmp_path) == {4242: HEADER}
    assert len(frames) == 1


def test_the_follower_reads_a_poll_at_a_time_and_cuts_a_bomb(tmp_path, bomb_frame):
    path = tmp_path / _name()
    path.write_bytes(_segment(*[_frame(TINY * 10) for _ in range(3)]))
    follower = Follower(tmp_path, from_start=True, limits=ReadLimits(records=10))
    # whole frames, a poll's worth at a time: nothing is lost, nothing cut
    assert [len(follower.poll()) for _ in range(4)] == [10, 10, 10, 0]
    assert follower.skipped == Counter()
    with open(path, "ab") as f:  # the bomb, appended to the live segment
        f.write(bomb_frame)
    follower.limits = ReadLimits(segment_records=1000)
    got, messages = _caught(follower.poll)
    assert len(got) == 1000 - 30 and follower.skipped == Counter({"segments": 1})
    assert "records in one segment" in messages[0]
    assert _caught(follower.poll)[0] == []


def test_ucm_trace_takes_the_limits_as_options(tmp_path, bomb_frame, capsys):
    (tmp_path / _name()).write_bytes(_segment(bomb_frame))
    (tmp_path / _name(n=1)).write_bytes(_segment(_frame(msgpack.packb(
        [0, 5, "submit", 7, {"type": "Load", "keys": 1}]))))

    def run(*argv: str) -> tuple[int, list[str]]:
        return _caught(lambda: trace_cli.main([*argv, str(tmp_path)]))

    code, messages = run("summary", "--json", "--max-segment-records", "1000")
    assert code == 0 and "more than 1000 records in one segment" in messages[0]
    summary = json.loads(capsys.readouterr().out)
    assert summary["skipped"] == {"segments": 1} and summary["events"] == 1
    code, messages = run("summary", "--json", "--max-records", "200")
    assert code == 0 and "limit of 200 records in all" in messages[0]
    assert "1 segments not read" in messages[1]
    assert json.loads(capsys.readouterr().out)["skipped"] == {"segments": 2}
    code, messages = run("show", "--max-bytes", "4KiB")
    assert code == 0 and "limit of 4096 decompressed bytes in all" in messages[0]
    with pytest.raises(SystemExit):
        trace_cli.main(["summary", "--max-records", "0", str(tmp_path)])
    assert "must be at least 1" in capsys.readouterr().err
    help_text = trace_cli.build_parser().format_help()
    for option in ("--max-records", "--max-bytes", "--max-segment-records",
                   "--max-segment-bytes", "malformed frames per segment"):
        assert option in help_text


def test_limits_must_be_positive_integers():
    for bad in ({"records": 0}, {"segment_bytes": -1}, {"bad_frames": 1.5}):
        with pytest.raises(ValueError, match="trace read limit"):
            ReadLimits(**bad)


def test_a_record_of_empty_containers_is_malformed_not_gigabytes(tmp_path):
    """An empty msgpack array is one byte and ~60 bytes of Python: a record holding 4 M of
    them (a 4 MiB frame that compresses to a few KiB) would build ~250 MB. The reader stops
    it at MAX_RECORD_CELLS containers and entries: a malformed record, and the rest of its
    frame is lost. A large legitimate record (a batch's keys_hex) reads."""
    import tracemalloc

    keys = [0, 5, "start", 2, {"type": "Load", "keys_hex": ["ab" * 8] * 100_000}]
    bomb = [0, 9, "start", 3, {"x": [[]] * (4 << 20)}]
    payload = b"".join(msgpack.packb(r) for r in (GOOD, keys, bomb, GOOD))
    path = tmp_path / _name()
    path.write_bytes(_segment(_frame(payload)))
    assert path.stat().st_size < 64 << 10
    counts: Counter[str] = Counter()
    tracemalloc.start()
    try:
        (_, records), messages = _caught(lambda: read_segment(path, counts=counts))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(r.t, r.phase) for r in records] == [(100, "start"), (5, "start")]
    assert len(records[1].fields["keys_hex"]) == 100_000
    assert counts == Counter({"records": 1})
    assert messages == [f"{path}: skipped 1 malformed records"]
    # the 1 M cells the bound allows, not the 4 M containers the record holds
    assert peak < (_reader.MAX_RECORD_CELLS * 64 + len(payload)) * 3 // 2
