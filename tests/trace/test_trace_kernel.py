"""A real Kernel (memory over posix) traced to files; `ucm-trace` figures match what it did."""

from __future__ import annotations

import itertools
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ucm.tools import trace_cli
from ucm.tools._trace_model import load, summarize

from ucm.kernel import Kernel, Load, Lookup, Store
from ucm.trace import read_trace

BLOCK = 4096


def _keys(prefix: int, n: int) -> list[bytes]:
    return [bytes([prefix]) + i.to_bytes(2, "big") + b"k" * 13 for i in range(n)]


def _config(tmp: Path, trace: str) -> dict:
    return {"tiers": [{"driver": "memory", "capacity": "16MiB"},
                      {"driver": "posix", "path": str(tmp / "blocks")}],
            "trace": {"path": str(tmp / trace)}}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Trace A: a fresh kernel stores 8 blocks, looks up 12 (8 in memory), loads the 8, loads
    2 absent ones. Trace B: a second kernel over the same posix directory (memory empty)
    looks up the 8 (posix hits) and loads them from posix."""
    tmp = tmp_path_factory.mktemp("kernel")
    stored, absent = _keys(1, 8), _keys(2, 4)
    with Kernel(_config(tmp, "a")) as kernel:
        kernel.submit(Store(stored, buffers=[bytes([i]) * BLOCK for i in range(8)],
                            request_id="req-store")).result(10)
        kernel.submit(Lookup(stored + absent, request_id="req-lookup")).result(10)
        buffers = [bytearray(BLOCK) for _ in stored]
        assert kernel.submit(Load(stored, buffers=buffers, request_id="req-load")).result(10).ok
        kernel.submit(Load(absent[:2], buffers=[bytearray(BLOCK) for _ in range(2)])).result(10)
    with Kernel(_config(tmp, "b")) as kernel:
        kernel.submit(Lookup(stored, request_id="req-lookup")).result(10)
        buffers = [bytearray(BLOCK) for _ in stored]
        assert kernel.submit(Load(stored, buffers=buffers, request_id="req-load")).result(10).ok
        assert kernel.statistics()["load_hits.posix"] == 8
    return tmp / "a", tmp / "b"


def test_summary_matches_the_events(traces):
    a, b = traces
    s = summarize(load(a))
    types = s["types"]
    assert {k: v["count"] for k, v in types.items()} == {"Load": 2, "Lookup": 1, "Store": 1}
    assert types["Store"]["keys"] == 8 and types["Store"]["outcomes"] == {"ok": 1}
    assert types["Store"]["bytes"] == 2 * 8 * BLOCK  # memory and posix (durability local)
    assert types["Load"]["bytes"] == 8 * BLOCK
    assert types["Load"]["keys"] == 10
    assert all(v["latency_s"]["p50"] > 0 for v in types.values())
    drivers = s["drivers"]
    assert drivers["memory/store"]["keys"] == 8 and drivers["posix/store"]["keys"] == 8
    assert drivers["memory/store"]["bytes"] == drivers["posix/store"]["bytes"] == 8 * BLOCK
    assert drivers["memory/load"]["bytes"] == 8 * BLOCK
    hr = s["hit_rate"]
    assert (hr["memory"]["lookup_keys"], hr["memory"]["lookup_hits"]) == (12, 8)
    assert (hr["posix"]["lookup_keys"], hr["posix"]["lookup_hits"]) == (4, 0)
    assert (hr["memory"]["load_keys"], hr["memory"]["load_hits"]) == (10, 8)
    assert hr["memory"]["lookup_rate"] == pytest.approx(8 / 12)
    assert s["errors"] == {}
    assert len(s["slowest"]) == 4

    sb = summarize(load(b))
    hb = sb["hit_rate"]
    assert (hb["memory"]["lookup_keys"], hb["memory"]["lookup_hits"]) == (8, 0)
    assert (hb["posix"]["lookup_keys"], hb["posix"]["lookup_hits"]) == (8, 8)
    assert (hb["posix"]["load_keys"], hb["posix"]["load_hits"]) == (8, 8)
    assert sb["drivers"]["posix/load"]["bytes"] == 8 * BLOCK


def test_records_carry_ids_and_key_prefix(traces):
    a, _ = traces
    records = list(read_trace(a))
    starts = [r for r in records if r.phase == "start"]
    assert [r.fields["request_id"] for r in starts] == [
        "req-store", "req-lookup", "req-load", None]
    assert starts[0].fields["key"] == _keys(1, 1)[0][:8].hex()
    submits = {r.event_id: r.t for r in records if r.phase == "submit"}
    assert all(submits[r.event_id] <= r.t for r in starts)  # queued before dispatch


def test_summary_and_show_commands(traces, capsys):
    a, _ = traces
    assert trace_cli.main(["summary", str(a)]) == 0
    out = capsys.readouterr().out
    assert "memory/load" in out and "66.7%" in out and "slowest events" in out
    assert trace_cli.main(["show", str(a), "--request-id", "req-load"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "Load" in lines[0] and "memory.load[8/8" in lines[0]
    assert trace_cli.main(["show", str(a), "--key-prefix", _keys(2, 1)[0][:3].hex()]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "keys=2" in lines[0]
    assert trace_cli.main(["show", str(a), "--tier", "posix", "--type", "store"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert trace_cli.main(["show", str(a), "--since", "1000"]) == 0
    assert capsys.readouterr().out == ""
    assert trace_cli.main(["summary", str(a), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["types"]["Store"]["count"] == 1


def test_diff_reports_hit_rate_change(traces, capsys):
    a, b = traces
    assert trace_cli.main(["diff", str(a), str(b), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    lookup = d["hit_rate"]["posix"]["lookup_rate"]
    assert lookup[0] == 0 and lookup[1] == 1 and lookup[2] == 1
    assert trace_cli.main(["diff", str(a), str(b)]) == 0
    assert "+100.0 pt" in capsys.readouterr().out


def test_perfetto_export_is_valid_trace_event_json(traces, tmp_path):
    a, _ = traces
    out = tmp_path / "out.json"
    assert trace_cli.main(["export", "--format", "perfetto", str(a), "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    names: dict[tuple[int, int], str] = {}
    processes = {}
    for e in events:
        assert e["ph"] in {"X", "M", "i"}
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "M":
            if e["name"] == "thread_name":
                names[(e["pid"], e["tid"])] = e["args"]["name"]
            elif e["name"] == "process_name":
                processes[e["pid"]] = e["args"]["name"]
            continue
        assert isinstance(e["ts"], int | float) and e["ts"] >= 0
        assert isinstance(e["name"], str)
        if e["ph"] == "X":
            assert e["dur"] >= 0
            assert (e["pid"], e["tid"]) in names
    assert any(n.startswith("ucm drivers") for n in processes.values())
    tracks = set(names.values())
    assert {"tier memory", "tier posix", "request req-load", "events"} <= tracks
    # Slices on one track never overlap (viewers need nesting).
    by_track: dict = {}
    for e in events:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_track.values():
        spans.sort()
        assert all(s[1] <= t[0] + 1e-6 for s, t in itertools.pairwise(spans))
    loads = [e for e in events if e["ph"] == "X" and e["name"] == "load" and
             e["args"]["bytes"] == 8 * BLOCK]
    assert len(loads) == 1


def test_plot_writes_a_png(traces, tmp_path):
    a, _ = traces
    out = tmp_path / "out.png"
    assert trace_cli.main(["plot", str(a), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 800 and height >= 600 and len(data) > 10_000


def test_errors_by_kind_and_failed_ops(tmp_path):
    config = {"tiers": [{"driver": "faulty", "name": "flaky", "error_rate": 1.0,
                         "ops": ["lookup", "store"], "inner": {"driver": "memory"}}],
              "trace": {"path": str(tmp_path / "t")}}
    with Kernel(config) as kernel:
        assert kernel.submit(Lookup(_keys(3, 2))).result(10).hits == (False, False)
        result = kernel.submit(Store(_keys(3, 2), buffers=[bytes(64)] * 2)).result(10)
        assert not result.ok
    s = summarize(load(tmp_path / "t"))
    assert s["errors"] == {"flaky/lookup/StorageUnavailable": 1,
                           "flaky/store/StorageUnavailable": 1}
    assert s["drivers"]["flaky/lookup"]["errors"] == 1
    assert s["drivers"]["flaky/store"]["errors"] == 1


def test_env_var_turns_tracing_on(tmp_path, monkeypatch):
    monkeypatch.setenv("UCM_TRACE", str(tmp_path / "env"))
    with Kernel({"tiers": [{"driver": "memory"}]}) as kernel:
        assert kernel.tracer is not None
        kernel.submit(Lookup(_keys(4, 1))).result(10)
    assert [r.phase for r in read_trace(tmp_path / "env")
            if r.event_id == 1] == ["submit", "start", "op", "result", "done"]
    monkeypatch.delenv("UCM_TRACE")
    assert Kernel({"tiers": [{"driver": "memory"}]}).tracer is None


def test_follow_shows_new_records_of_a_running_process(tmp_path):
    trace_dir = tmp_path / "live"
    script = (
        "import time, sys\n"
        "from ucm.kernel import Kernel, Lookup\n"
        f"cfg = {{'tiers': [{{'driver': 'memory'}}], 'trace': {{'path': {str(trace_dir)!r}}}}}\n"
        "with Kernel(cfg) as k:\n"
        "    for i in range(30):\n"
        "        k.submit(Lookup([b'key%d' % i], request_id='live-%d' % i)).result(10)\n"
        "        time.sleep(0.05)\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 20
        while not trace_dir.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        follow = subprocess.run(
            [sys.executable, "-m", "ucm.tools.trace_cli", "follow", str(trace_dir),
             "--duration", "1.0", "--interval", "0.1"],
            capture_output=True, text=True, timeout=30, env={**os.environ})
    finally:
        writer.wait(30)
    assert follow.returncode == 0, follow.stderr
    lines = follow.stdout.splitlines()
    assert any(" start " in line and "request_id=live-" in line for line in lines), lines
