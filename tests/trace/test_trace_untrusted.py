"""The trace reader and `ucm-trace` on files nobody should trust: garbage, forged headers,
records of the wrong shape, zstd bombs, a FIFO; plus fuzzing of the reader with hypothesis."""

from __future__ import annotations

import json
import os
import struct
import threading
import tracemalloc
import warnings
from collections import Counter
from pathlib import Path

import msgpack
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ucm.tools import trace_cli
from ucm.tools._trace_model import build, load, summarize
from ucm.tools._trace_perfetto import to_chrome

from ucm.trace import Follower, Tracer, TraceWarning, read_segment, read_trace
from ucm.trace._format import MAGIC, MAX_FRAME_RAW

NAME = "trace-4242-000000.ucmtrace"
HEADER = {"format": 1, "pid": 4242, "host": "h", "segment": 0, "wall_ns": 1, "mono_ns": 1}


def _frame(payload: bytes, *, compressed: bytes | None = None) -> bytes:
    data = zstandard.ZstdCompressor().compress(payload) if compressed is None else compressed
    return struct.pack("<I", len(data)) + data


def _segment(*frames: bytes, header: object = HEADER) -> bytes:
    return MAGIC + _frame(msgpack.packb(header)) + b"".join(frames)


def _records(*records: object) -> bytes:
    return b"".join(msgpack.packb(r) for r in records)


GOOD = [0, 100, "start", 1, {"type": "Load", "keys": 1}]


def _read(path: Path) -> tuple[dict | None, list, Counter, list[str]]:
    counts: Counter[str] = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        header, records = read_segment(path, counts=counts)
    messages = [str(w.message) for w in caught if issubclass(w.category, TraceWarning)]
    return header, records, counts, messages


def test_records_of_the_wrong_shape_are_skipped_and_counted(tmp_path):
    path = tmp_path / NAME
    path.write_bytes(_segment(_frame(_records(
        GOOD,
        [1, 2, 3],  # wrong arity
        [0, "late", "start", 1, {}],  # a string for the time
        [0, 101, 7, 1, {}],  # a number for the phase
        [0, 102, "op", 1, ["not", "a", "map"]],  # fields not a map
        "just a string",
        [0, 103, "done", 1, {"outcome": "ok"}],
    ) + b"\xc1")))  # 0xc1: a byte msgpack never uses
    header, records, counts, messages = _read(path)
    assert header == HEADER
    assert [(r.phase, r.t) for r in records] == [("start", 100), ("done", 103)]
    assert counts == Counter({"records": 6})
    assert len(messages) == 1 and "6 malformed records" in messages[0]


@pytest.mark.parametrize("header", [[1, 2, 3], "header", 7])
def test_a_header_that_is_not_a_map_skips_the_segment(tmp_path, header):
    path = tmp_path / NAME
    path.write_bytes(_segment(_frame(_records(GOOD)), header=header))
    got, records, counts, messages = _read(path)
    assert got is None and records == [] and counts == Counter({"segments": 1})
    assert "unreadable segment header" in messages[0]


def test_garbage_header_and_corrupt_frames_are_skipped(tmp_path):
    garbage_header = tmp_path / "trace-1-000000.ucmtrace"
    garbage_header.write_bytes(MAGIC + _frame(b"\xc1\xc1\xc1"))
    assert _read(garbage_header)[2] == Counter({"segments": 1})
    # A frame whose bytes are not zstd is skipped; the frames after it still count.
    path = tmp_path / NAME
    path.write_bytes(_segment(_frame(b"", compressed=b"not zstd at all"),
                              _frame(_records(GOOD))))
    _, records, counts, _ = _read(path)
    assert [r.phase for r in records] == ["start"] and counts == Counter({"frames": 1})


def test_implausible_frame_length_and_torn_tail(tmp_path):
    path = tmp_path / NAME
    path.write_bytes(_segment(_frame(_records(GOOD)), struct.pack("<I", 0xFFFFFFFF) + b"x"))
    _, records, counts, messages = _read(path)
    assert len(records) == 1 and counts == Counter({"segments": 1})
    assert "implausible frame length" in messages[0]
    path.write_bytes(_segment(_frame(_records(GOOD)))[:-3])
    _, records, counts, messages = _read(path)
    assert records == [] and counts == Counter({"frames": 1}) and "truncated" in messages[0]


def _zeros_frame(total: int, *, declared: bool) -> bytes:
    """A zstd frame of `total` zero bytes, compressed a few MiB at a time."""
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=declared)
    obj = cctx.compressobj(size=total if declared else -1)
    chunk = bytes(8 << 20)
    parts = [obj.compress(chunk) for _ in range(total // len(chunk))]
    parts.append(obj.flush())
    return b"".join(parts)


@pytest.mark.parametrize("declared", [True, False], ids=["declared-2GiB", "undeclared-1GiB"])
def test_zstd_bomb_is_rejected_without_allocating_it(tmp_path, declared):
    bomb = _zeros_frame((2 << 30) if declared else (1 << 30), declared=declared)
    assert len(bomb) < 1 << 20  # a tiny frame
    path = tmp_path / NAME
    path.write_bytes(_segment(_frame(b"", compressed=bomb), _frame(_records(GOOD))))
    tracemalloc.start()
    try:
        _, records, counts, _ = _read(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [r.phase for r in records] == ["start"]  # the frame after the bomb still reads
    assert counts == Counter({"frames": 1})
    assert peak < MAX_FRAME_RAW + (16 << 20)


def test_a_fifo_or_directory_named_like_a_segment_is_skipped(tmp_path):
    os.mkfifo(tmp_path / "trace-1-000000.ucmtrace")
    (tmp_path / "trace-2-000000.ucmtrace").mkdir()
    (tmp_path / NAME).write_bytes(_segment(_frame(_records(GOOD))))
    result: list = []
    reader = threading.Thread(target=lambda: result.append(_read_dir(tmp_path)), daemon=True)
    reader.start()
    reader.join(20)
    assert not reader.is_alive(), "the reader hung on a FIFO"
    records, counts = result[0]
    assert [r.pid for r in records] == [4242] and counts == Counter({"segments": 2})
    follower = Follower(tmp_path, from_start=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        assert [r.phase for r in follower.poll()] == ["start"]
        assert follower.poll() == []


def _read_dir(path: Path) -> tuple[list, Counter]:
    counts: Counter[str] = Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        return list(read_trace(path, counts=counts)), counts


def test_ucm_trace_survives_fields_of_the_wrong_type(tmp_path, capsys):
    (tmp_path / NAME).write_bytes(_segment(_frame(_records(
        [0, 10, "submit", 1, {"type": "Load", "keys": 2, "request_id": "r1"}],
        [0, 11, "start", 1, {"type": "Load", "keys": "two", "key": 5}],  # wrong types
        [0, 12, "op", 1, {"tier": "memory", "op": "load", "keys": [1], "t0": "x"}],
        [0, 13, "result", 1, {"hits": {"memory": "all"}}],
        [0, 14, "evict", 0, {"tier": b"\xff", "keys": {"a": 1}}],
        [0, 15, "error", 0, {"tier": b"\xff", 3: b"\x00", "kind": ["x"]}],
        [0, 16, "dropped", 0, {"count": "many"}],
        [0, 17, "done", 1, {"outcome": 3}],
        [0, 18, "done", 1, {"outcome": "ok"}],
    )), _frame(_records(  # a map key msgpack cannot hash: the rest of the frame is lost
        [0, 19, "error", 0, {(1, 2): 0}],
        [0, 20, "done", 1, {"outcome": "error"}],
    ))))
    with pytest.warns(TraceWarning) as caught:
        trace = load(tmp_path)
    assert sorted(str(w.message).split(": ")[-1] for w in caught) == [
        "skipped 1 malformed records", "skipped 6 trace records with fields of the wrong type"]
    assert trace.skipped == {"records": 7}
    assert [(e.event_id, e.outcome, e.keys) for e in trace.events] == [(1, "ok", 2)]
    with pytest.warns(TraceWarning):
        assert trace_cli.main(["summary", str(tmp_path)]) == 0
        assert trace_cli.main(["show", str(tmp_path)]) == 0
        assert trace_cli.main(["export", str(tmp_path), "-o", str(tmp_path / "t.json")]) == 0
    assert "unreadable and skipped: 7 records" in capsys.readouterr().out
    json.loads((tmp_path / "t.json").read_text())


# -- fuzzing -------------------------------------------------------------------------------------

FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def valid_segment(tmp_path_factory) -> bytes:
    """A real segment: a header and three frames of varied records."""
    directory = tmp_path_factory.mktemp("valid")
    tracer = Tracer(directory)
    for batch in range(3):
        for i in range(5):
            eid = batch * 5 + i + 1
            tracer.emit("submit", eid, {"type": "Load", "keys": 2, "request_id": f"r{eid}"})
            tracer.emit("op", eid, {"tier": "memory", "op": "load", "keys": 2, "t0": 1,
                                    "hits": 1, "bytes": 4096})
            tracer.emit("result", eid, {"hits": {"memory": 1}})
            tracer.emit("done", eid, {"outcome": "ok"})
        tracer.flush()
    tracer.close()
    [path] = directory.iterdir()
    return path.read_bytes()


def _read_bytes_anyhow(directory: Path, data: bytes) -> list:
    """Reads `data` as a segment every way the tools do; nothing may raise."""
    path = directory / NAME
    path.write_bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        _, records = read_segment(path)
        for r in records:  # only well-formed records come out
            assert type(r.t) is int and type(r.phase) is str and type(r.fields) is dict
        trace = build(records)
        json.dumps(summarize(trace), default=str)
        json.dumps(to_chrome(trace), default=str)
        Follower(directory, from_start=True).poll()
    return records


@FUZZ
@given(data=st.binary(max_size=4096))
def test_fuzz_random_bytes(tmp_path_factory, data):
    directory = tmp_path_factory.getbasetemp() / "fuzz-random"
    directory.mkdir(exist_ok=True)
    _read_bytes_anyhow(directory, data)
    _read_bytes_anyhow(directory, MAGIC + data)
    _read_bytes_anyhow(directory, _segment() + data)


@FUZZ
@given(mutations=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)),
                          min_size=1, max_size=8),
       cut=st.none() | st.integers(min_value=0))
def test_fuzz_mutated_valid_segments(tmp_path_factory, valid_segment, mutations, cut):
    directory = tmp_path_factory.getbasetemp() / "fuzz-mutated"
    directory.mkdir(exist_ok=True)
    data = bytearray(valid_segment)
    for position, value in mutations:
        data[position % len(data)] = value
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    _read_bytes_anyhow(directory, bytes(data))


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=6) | st.integers(0, 9), children, max_size=3),
    max_leaves=8)
_fields = st.dictionaries(
    st.sampled_from(["type", "keys", "request_id", "key", "tier", "op", "t0", "hits", "bytes",
                     "error", "outcome", "kind", "count"]), _values, max_size=6)
_record = st.tuples(st.integers(-1, 9), st.integers(0, 2**40), st.sampled_from(
    ["submit", "start", "op", "result", "done", "error", "evict", "dropped", "attach"]),
    st.integers(0, 3), _fields).map(list)


@FUZZ
@given(records=st.lists(_record | _values, max_size=12))
def test_fuzz_records_of_any_shape(tmp_path_factory, records):
    directory = tmp_path_factory.getbasetemp() / "fuzz-records"
    directory.mkdir(exist_ok=True)
    payload = b"".join(msgpack.packb(r) for r in records)
    _read_bytes_anyhow(directory, _segment(_frame(payload)) if payload else _segment())
