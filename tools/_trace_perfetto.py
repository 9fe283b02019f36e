"""Chrome trace-event JSON (opened by ui.perfetto.dev and chrome://tracing).

Two synthetic processes per traced process: "ucm drivers <pid>" with one thread track per
tier (more lanes where calls overlap), and "ucm requests <pid>" with one track per request id
(events without one share the "events" track). Slices are complete ("X") events; within a
track they never overlap, so every viewer draws them as given. Evictions and counted errors
are instant ("i") events on their tier's track.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from ._trace_model import Event, Trace


class _Lanes:
    """Assigns non-overlapping lanes (thread ids) to the intervals of one track."""

    def __init__(self, next_tid: list[int], name: str, pid: int,
                 meta: list[dict[str, Any]]) -> None:
        self.ends: list[int] = []
        self.tids: list[int] = []
        self.next_tid, self.name, self.pid, self.meta = next_tid, name, pid, meta

    def place(self, t0: int, t1: int) -> int:
        for i, end in enumerate(self.ends):
            if end <= t0:
                self.ends[i] = t1
                return self.tids[i]
        tid = self.next_tid[0]
        self.next_tid[0] += 1
        suffix = f" #{len(self.tids) + 1}" if self.tids else ""
        self.meta.append({"ph": "M", "name": "thread_name", "pid": self.pid, "tid": tid,
                          "args": {"name": self.name + suffix}})
        self.meta.append({"ph": "M", "name": "thread_sort_index", "pid": self.pid,
                          "tid": tid, "args": {"sort_index": tid}})
        self.ends.append(t1)
        self.tids.append(tid)
        return tid


def _jsonable(fields: dict[Any, Any]) -> dict[str, Any]:
    """A record's fields as JSON can hold them (keys and unknown values as strings)."""
    text = json.dumps({str(k): v for k, v in fields.items()}, default=str, skipkeys=True)
    held: dict[str, Any] = json.loads(text)
    return held


def to_chrome(trace: Trace) -> dict[str, Any]:
    base = trace.t_min
    meta: list[dict[str, Any]] = []
    out: list[dict[str, Any]] = []
    pids = sorted({e.pid for e in trace.events} | {o.pid for o in trace.ops}
                  | {r.pid for r in trace.errors + trace.evictions})
    drivers_pid = {pid: 2 * i + 1 for i, pid in enumerate(pids)}
    requests_pid = {pid: 2 * i + 2 for i, pid in enumerate(pids)}
    for pid in pids:
        meta.append({"ph": "M", "name": "process_name", "pid": drivers_pid[pid], "tid": 0,
                     "args": {"name": f"ucm drivers {pid}"}})
        meta.append({"ph": "M", "name": "process_name", "pid": requests_pid[pid], "tid": 0,
                     "args": {"name": f"ucm requests {pid}"}})
    next_tid = [1]
    tracks: dict[tuple[int, str], _Lanes] = {}

    def lanes(pid: int, name: str) -> _Lanes:
        lane = tracks.get((pid, name))
        if lane is None:
            lane = tracks[(pid, name)] = _Lanes(next_tid, name, pid, meta)
        return lane

    def us(t: int) -> float:
        return (t - base) / 1000.0

    for op in sorted(trace.ops, key=lambda o: o.t0):
        pid = drivers_pid[op.pid]
        tid = lanes(pid, f"tier {op.tier}").place(op.t0, op.t1)
        args: dict[str, Any] = {"event_id": op.event_id, "keys": op.keys, "bytes": op.nbytes}
        if op.hits is not None:
            args["hits"] = op.hits
        if op.error:
            args["error"] = op.error
        out.append({"ph": "X", "name": op.op + (" (error)" if op.error else ""),
                    "cat": "driver", "pid": pid, "tid": tid, "ts": us(op.t0),
                    "dur": max(us(op.t1) - us(op.t0), 0.0), "args": args})
    # (start, end, event) of the events that have both
    by_track: dict[tuple[int, str], list[tuple[int, int, Event]]] = defaultdict(list)
    for ev in trace.events:
        if ev.start is None or ev.end is None:
            continue
        track = f"request {ev.request_id}" if ev.request_id is not None else "events"
        by_track[(ev.pid, track)].append((ev.start, ev.end, ev))
    for (pid, track), evs in sorted(by_track.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        for start, end, ev in sorted(evs, key=lambda s: s[0]):
            rpid = requests_pid[pid]
            t0 = ev.submit if ev.submit is not None else start
            tid = lanes(rpid, track).place(t0, end)
            args = {"event_id": ev.event_id, "keys": ev.keys, "outcome": ev.outcome,
                    "bytes": ev.nbytes, "tiers": ev.tiers,
                    "queue_us": (start - t0) / 1000.0}
            if ev.request_id is not None:
                args["request_id"] = ev.request_id
            if ev.key:
                args["key"] = ev.key
            if ev.error:
                args["error"] = ev.error
            out.append({"ph": "X", "name": ev.type, "cat": "event", "pid": rpid, "tid": tid,
                        "ts": us(t0), "dur": max(us(end) - us(t0), 0.0), "args": args})
    for r in trace.evictions + trace.errors:
        pid = drivers_pid[r.pid]
        tier = r.fields.get("tier")
        lane = lanes(pid, f"tier {tier}")
        tid = lane.tids[0] if lane.tids else lane.place(r.t, r.t)
        name = "evict" if r.phase == "evict" else f"error {r.fields.get('kind')}"
        out.append({"ph": "i", "s": "t", "name": name, "cat": r.phase, "pid": pid, "tid": tid,
                    "ts": us(r.t), "args": _jsonable(r.fields)})
    return {"traceEvents": meta + out, "displayTimeUnit": "ms",
            "otherData": {"source": "ucm-trace", "dropped_records": trace.dropped}}
