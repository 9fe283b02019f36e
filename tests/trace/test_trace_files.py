"""Trace files: round trip, rotation, torn segments, ring overflow, live follow."""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import trio

from ucm.trace import (
    Follower,
    Tracer,
    TraceWarning,
    list_segments,
    read_segment,
    read_trace,
    trace_headers,
)


def test_round_trip(tmp_path):
    tracer = Tracer(tmp_path)
    tracer.emit("start", 1, {"type": "Load", "keys": 2, "request_id": "r1", "key": "ab"})
    tracer.emit("op", 1, {"tier": "memory", "op": "load", "keys": 2, "t0": 5, "bytes": 8192,
                          "hits": 2})
    tracer.emit("done", 1, {"outcome": "ok"})
    tracer.emit("weird", 2, {"raw": b"\x01\x02", "obj": object, "nested": {"a": [1, None]}})
    tracer.emit("after", 3, {})
    tracer.close()
    records = list(read_trace(tmp_path))
    assert [r.phase for r in records] == ["start", "op", "done", "weird", "after"]
    assert records[1].fields == {"tier": "memory", "op": "load", "keys": 2, "t0": 5,
                                 "bytes": 8192, "hits": 2}
    assert records[3].fields["raw"] == b"\x01\x02"
    assert records[3].fields["obj"] == str(object)  # not msgpack-able: written as str()
    assert records[3].fields["nested"] == {"a": [1, None]}
    assert all(r.pid == os.getpid() for r in records)
    ts = [r.t for r in records]
    assert ts == sorted(ts)
    header = trace_headers(tmp_path)[os.getpid()]
    assert header["format"] == 1 and header["wall_ns"] > 0
    # One segment file reads the same as its directory.
    [segment] = list_segments(tmp_path)
    assert segment.name == f"trace-{os.getpid()}-000000.ucmtrace"
    assert list(read_trace(segment)) == records


def test_rotation_keeps_within_max_bytes(tmp_path):
    tracer = Tracer(tmp_path, segment_bytes=4096, max_bytes=16384)
    for batch in range(60):
        for i in range(50):
            tracer.emit("op", batch * 50 + i, {"payload": os.urandom(16).hex()})
        tracer.flush()
    tracer.close()
    segments = list_segments(tmp_path)
    assert len(segments) > 1
    assert sum(p.stat().st_size for p in segments) <= 16384 + 4096
    # The oldest records went with the deleted segments; the rest are complete and ordered.
    ids = [r.event_id for r in read_trace(tmp_path)]
    assert ids == list(range(ids[0], 3000))


def test_truncated_last_segment_is_skipped_with_a_warning(tmp_path):
    tracer = Tracer(tmp_path, segment_bytes=2048, max_bytes=1 << 20)
    for batch in range(20):
        for i in range(20):
            tracer.emit("op", batch * 20 + i, {"payload": os.urandom(16).hex()})
        tracer.flush()
    tracer.close()
    segments = list_segments(tmp_path)
    assert len(segments) >= 3
    complete = [r.event_id for p in segments[:-1] for r in read_segment(p)[1]]
    last = segments[-1]
    data = last.read_bytes()
    last.write_bytes(data[: len(data) - 7])  # a crash tore the last frame
    with pytest.warns(TraceWarning, match="truncated"):
        ids = [r.event_id for r in read_trace(tmp_path)]
    assert ids[: len(complete)] == complete
    assert ids == list(range(len(ids)))
    assert len(ids) < 400


def test_foreign_file_is_skipped(tmp_path):
    Tracer(tmp_path).emit("x", 1, {})
    tracer = Tracer(tmp_path)
    tracer.emit("x", 1, {})
    tracer.close()
    (tmp_path / "trace-1-000000.ucmtrace").write_bytes(b"not a trace")
    with pytest.warns(TraceWarning, match="not a ucm trace"):
        records = list(read_trace(tmp_path))
    assert len(records) == 1


def test_ring_overflow_is_counted(tmp_path, caplog):
    tracer = Tracer(tmp_path, ring_events=64)
    for i in range(100):
        tracer.emit("op", i, {})
    with caplog.at_level(logging.WARNING, logger="ucm.trace"):
        tracer.close()
    assert tracer.dropped == 36
    assert "36 records dropped" in caplog.text
    records = list(read_trace(tmp_path))
    assert [r.event_id for r in records[:-1]] == list(range(36, 100))
    assert records[-1].phase == "dropped" and records[-1].fields["count"] == 36


async def test_serve_drains_periodically_and_closes(tmp_path):
    tracer = Tracer(tmp_path, interval=0.05)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tracer.serve)
        tracer.emit("a", 1, {})
        await trio.sleep(0.2)
        assert tracer.buffered == 0
        assert [r.phase for r in read_trace(tmp_path)] == ["a"]
        tracer.emit("b", 2, {})
        nursery.cancel_scope.cancel()
    assert [r.phase for r in read_trace(tmp_path)] == ["a", "b"]
    assert tracer.segment is None


def test_follower_sees_new_records(tmp_path):
    tracer = Tracer(tmp_path)
    tracer.emit("old", 1, {})
    tracer.flush()
    follower = Follower(tmp_path)
    assert follower.poll() == []
    tracer.emit("new", 2, {})
    tracer.flush()
    assert [r.phase for r in follower.poll()] == ["new"]
    assert follower.poll() == []
    tracer.close()
    assert [r.phase for r in Follower(tmp_path, from_start=True).poll()] == ["old", "new"]


def test_follower_waits_for_a_partly_written_frame(tmp_path):
    tracer = Tracer(tmp_path)
    tracer.emit("a", 1, {})
    tracer.close()
    [segment] = list_segments(tmp_path)
    data = segment.read_bytes()
    segment.write_bytes(data[:-3])
    follower = Follower(tmp_path, from_start=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert follower.poll() == []  # no warning: the writer may still be appending
    segment.write_bytes(data)
    assert [r.phase for r in follower.poll()] == ["a"]


def test_config_and_env_turn_tracing_on(tmp_path, monkeypatch):
    from ucm.config import load_config
    from ucm.trace import tracer_from_config

    config = load_config({"tiers": [{"driver": "memory"}]})
    monkeypatch.delenv("UCM_TRACE", raising=False)
    assert tracer_from_config(config) is None
    monkeypatch.setenv("UCM_TRACE", str(tmp_path / "env"))
    assert tracer_from_config(config).path == tmp_path / "env"
    config = load_config({"tiers": [{"driver": "memory"}],
                          "trace": {"path": str(tmp_path / "cfg"), "max_bytes": "1MiB",
                                    "segment_bytes": "64KiB", "ring_events": 128}})
    tracer = tracer_from_config(config)
    assert (tracer.path, tracer.max_bytes, tracer.segment_bytes, tracer.ring_events) == (
        tmp_path / "cfg", 1 << 20, 64 << 10, 128)
