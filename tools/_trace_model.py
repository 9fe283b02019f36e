"""Trace records grouped into events and driver operations, plus the figures `summary` and
`diff` print. A record whose fields have the wrong types is skipped and counted (`skipped`)."""

from __future__ import annotations

import math
import os
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ucm.trace import ReadBudget, Record, TraceWarning, read_trace


@dataclass
class Op:
    pid: int
    event_id: int  # 0: background work (promotion, propagation)
    tier: str
    op: str
    t0: int
    t1: int
    keys: int = 0
    hits: int | None = None
    nbytes: int = 0
    error: str | None = None

    @property
    def seconds(self) -> float:
        return (self.t1 - self.t0) / 1e9


@dataclass
class Event:
    pid: int
    event_id: int
    type: str = "?"
    request_id: str | int | None = None  # as the engine's hook gave it
    key: str | None = None
    keys: int = 0
    submit: int | None = None
    start: int | None = None
    end: int | None = None
    outcome: str | None = None  # None: not finished in this trace
    error: str | None = None
    kind: str | None = None
    ops: list[Op] = field(default_factory=list)
    hits: dict[str, int] | None = None  # lookup result: hits per tier

    @property
    def seconds(self) -> float | None:
        if self.start is None or self.end is None:
            return None
        return (self.end - self.start) / 1e9

    @property
    def queue_seconds(self) -> float | None:
        if self.submit is None or self.start is None:
            return None
        return (self.start - self.submit) / 1e9

    @property
    def nbytes(self) -> int:
        return sum(op.nbytes for op in self.ops)

    @property
    def tiers(self) -> list[str]:
        return sorted({op.tier for op in self.ops})


@dataclass
class Trace:
    events: list[Event]
    ops: list[Op]
    errors: list[Record]
    evictions: list[Record]
    other: list[Record]
    dropped: int
    t_min: int
    t_max: int
    skipped: dict[str, int] = field(default_factory=dict)  # unreadable: segments, frames, records

    @property
    def seconds(self) -> float:
        return max(self.t_max - self.t_min, 0) / 1e9


class _Malformed(ValueError):
    """A record's field of the wrong type."""


def _int(value: Any, default: int = 0) -> int:
    if value is None:
        return default
    if type(value) is int or (type(value) is float and math.isfinite(value)):
        return int(value)
    raise _Malformed(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else _int(value)


def _opt_str(value: Any) -> str | None:
    if value is None or type(value) is str:
        return value
    raise _Malformed(value)


def _request_id(value: Any) -> str | int | None:
    if value is None or type(value) is str or type(value) is int:
        return value
    raise _Malformed(value)


def _hits(value: Any) -> dict[str, int]:
    if not value:
        return {}
    if type(value) is not dict or any(type(k) is not str for k in value):
        raise _Malformed(value)
    return {k: _int(v) for k, v in value.items()}


def build(records: Iterable[Record]) -> Trace:
    events: dict[tuple[int, int], Event] = {}
    ops: list[Op] = []
    errors, evictions, other = [], [], []
    dropped = malformed = 0
    t_min, t_max = None, None

    def event(r: Record) -> Event:
        ev = events.get((r.pid, r.event_id))
        if ev is None:
            ev = events[(r.pid, r.event_id)] = Event(r.pid, r.event_id)
        return ev

    for r in records:
        f = r.fields
        try:  # every field is checked before anything is recorded
            if r.phase == "op":
                op = Op(r.pid, r.event_id, str(f.get("tier")), str(f.get("op")),
                        _int(f.get("t0"), r.t), r.t, _int(f.get("keys")),
                        _opt_int(f.get("hits")), _int(f.get("bytes")),
                        _opt_str(f.get("error")))
                ops.append(op)
                if r.event_id:
                    event(r).ops.append(op)
                t_min = op.t0 if t_min is None else min(t_min, op.t0)
            elif r.phase in ("submit", "start"):
                type_, keys = f.get("type"), _opt_int(f.get("keys"))
                request_id, key = _request_id(f.get("request_id")), _opt_str(f.get("key"))
                ev = event(r)
                ev.type = ev.type if type_ is None else str(type_)
                ev.keys = ev.keys if keys is None else keys
                ev.request_id = request_id if "request_id" in f else ev.request_id
                ev.key = key if "key" in f else ev.key
                setattr(ev, r.phase, r.t)
            elif r.phase == "done":
                outcome, error = _opt_str(f.get("outcome")), _opt_str(f.get("error"))
                kind = _opt_str(f.get("kind"))
                ev = event(r)
                ev.end, ev.outcome, ev.error, ev.kind = r.t, outcome, error, kind
            elif r.phase == "result" and r.event_id:
                event(r).hits = _hits(f.get("hits"))
            elif r.phase == "error":
                errors.append(r)
            elif r.phase == "evict":
                _int(f.get("keys"))
                evictions.append(r)
            elif r.phase == "dropped":
                dropped += _int(f.get("count"))
            else:
                other.append(r)
        except _Malformed:
            malformed += 1
            continue
        t_min = r.t if t_min is None or r.t < t_min else t_min
        t_max = r.t if t_max is None or r.t > t_max else t_max
    if malformed:
        warnings.warn(f"skipped {malformed} trace records with fields of the wrong type",
                      TraceWarning, stacklevel=2)
    ordered = sorted(events.values(), key=lambda e: (e.start or e.submit or e.end or 0))
    skipped = {"records": malformed} if malformed else {}
    return Trace(ordered, ops, errors, evictions, other, dropped, t_min or 0, t_max or 0,
                 skipped)


def load(source: str | os.PathLike[str], budget: ReadBudget | None = None) -> Trace:
    """The trace at `source`, its records streamed within `budget` (one per command: default
    limits when None); what cannot be read is skipped, warned about and counted."""
    counts: Counter[str] = Counter()
    trace = build(read_trace(source, counts=counts, budget=budget))
    counts.update(trace.skipped)
    trace.skipped = {k: v for k, v in sorted(counts.items()) if v}
    return trace


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of sorted `values`."""
    if not values:
        return None
    rank = max(1, -(-len(values) * q // 100))
    return values[int(rank) - 1]


def _latency(values: Iterable[float | None]) -> dict[str, Any]:
    vals = sorted(v for v in values if v is not None)
    return {"p50": percentile(vals, 50), "p90": percentile(vals, 90),
            "p99": percentile(vals, 99), "max": vals[-1] if vals else None}


def _span(ts: list[tuple[int, int]]) -> float:
    if not ts:
        return 0.0
    return max(b for _, b in ts) / 1e9 - min(a for a, _ in ts) / 1e9


def summarize(trace: Trace, *, slowest: int = 10) -> dict[str, Any]:
    """Figures per event type, per tier and operation, hit rates, errors, slowest events."""
    by_type: dict[str, list[Event]] = defaultdict(list)
    for ev in trace.events:
        by_type[ev.type].append(ev)
    types = {}
    for name, evs in sorted(by_type.items()):
        done = [e for e in evs if e.outcome is not None]
        nbytes = sum(e.nbytes for e in done)
        span = _span([(e.start, e.end) for e in done if e.start and e.end])
        types[name] = {
            "count": len(evs),
            "outcomes": dict(Counter(e.outcome or "unfinished" for e in evs)),
            "keys": sum(e.keys for e in evs),
            "bytes": nbytes,
            "throughput_bps": nbytes / span if span > 0 else None,
            "latency_s": _latency(e.seconds for e in done),
            "queue_s": _latency(e.queue_seconds for e in done),
        }
    by_op: dict[tuple[str, str], list[Op]] = defaultdict(list)
    for op in trace.ops:
        by_op[(op.tier, op.op)].append(op)
    drivers = {}
    for (tier, name), ops in sorted(by_op.items()):
        nbytes = sum(o.nbytes for o in ops)
        span = _span([(o.t0, o.t1) for o in ops])
        ok = [o for o in ops if o.error is None]
        drivers[f"{tier}/{name}"] = {
            "tier": tier, "op": name, "count": len(ops), "errors": len(ops) - len(ok),
            "keys": sum(o.keys for o in ops), "bytes": nbytes,
            "throughput_bps": nbytes / span if span > 0 else None,
            "latency_s": _latency(o.seconds for o in ops),
        }
    return {
        "duration_s": trace.seconds,
        "processes": sorted({e.pid for e in trace.events} | {o.pid for o in trace.ops}),
        "events": len(trace.events),
        "dropped_records": trace.dropped,
        "skipped": dict(trace.skipped),
        "types": types,
        "drivers": drivers,
        "hit_rate": hit_rates(trace),
        "errors": errors_by_kind(trace),
        "evictions": evictions_by_tier(trace),
        "slowest": [_event_row(e) for e in sorted(
            (e for e in trace.events if e.seconds is not None),
            key=lambda e: e.seconds or 0.0, reverse=True)[:slowest]],  # never None here
    }


def hit_rates(trace: Trace) -> dict[str, dict[str, Any]]:
    """Per tier: lookups (keys that reached the tier, hits there) and loads (keys asked of
    the tier's driver, blocks it returned)."""
    out: dict[str, dict[str, Any]] = {}

    def row(tier: str) -> dict[str, Any]:
        return out.setdefault(tier, {"lookup_keys": 0, "lookup_hits": 0, "load_keys": 0,
                                     "load_hits": 0})

    for ev in trace.events:
        if ev.hits is None:
            continue
        remaining = ev.keys
        for tier, hits in ev.hits.items():
            if remaining <= 0:
                break
            r = row(tier)
            r["lookup_keys"] += remaining
            r["lookup_hits"] += hits
            remaining -= hits
    for op in trace.ops:
        if op.op == "load" and op.error is None and op.event_id:
            r = row(op.tier)
            r["load_keys"] += op.keys
            r["load_hits"] += op.hits or 0
    for r in out.values():
        r["lookup_rate"] = r["lookup_hits"] / r["lookup_keys"] if r["lookup_keys"] else None
        r["load_rate"] = r["load_hits"] / r["load_keys"] if r["load_keys"] else None
    return out


def evictions_by_tier(trace: Trace) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for r in trace.evictions:
        counts[str(r.fields.get("tier"))] += _int(r.fields.get("keys"))
    return dict(counts)


def errors_by_kind(trace: Trace) -> dict[str, int]:
    """Counted driver errors as `tier/op/kind`, and failed events as `event/<type>/<kind>`."""
    counts: Counter[str] = Counter()
    for r in trace.errors:
        f = r.fields
        counts[f"{f.get('tier')}/{f.get('op')}/{f.get('kind')}"] += 1
    for ev in trace.events:
        if ev.outcome not in (None, "ok"):
            counts[f"event/{ev.type}/{ev.kind or ev.outcome}"] += 1
    return dict(sorted(counts.items()))


def _event_row(e: Event) -> dict[str, Any]:
    return {"pid": e.pid, "event_id": e.event_id, "type": e.type, "request_id": e.request_id,
            "keys": e.keys, "seconds": e.seconds, "outcome": e.outcome, "tiers": e.tiers,
            "bytes": e.nbytes}


def diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Latency and hit-rate changes from summary `a` to summary `b`."""
    out: dict[str, Any] = {"types": {}, "drivers": {}, "hit_rate": {}}
    for section in ("types", "drivers"):
        for name in sorted(set(a[section]) | set(b[section])):
            ra, rb = a[section].get(name), b[section].get(name)
            row: dict[str, Any] = {"count": ((ra or {}).get("count", 0),
                                             (rb or {}).get("count", 0))}
            for q in ("p50", "p90", "p99"):
                va = ra["latency_s"][q] if ra else None
                vb = rb["latency_s"][q] if rb else None
                row[q] = (va, vb, _ratio(va, vb))
            out[section][name] = row
    for tier in sorted(set(a["hit_rate"]) | set(b["hit_rate"])):
        ra, rb = a["hit_rate"].get(tier, {}), b["hit_rate"].get(tier, {})
        out["hit_rate"][tier] = {
            k: (ra.get(k), rb.get(k), None if ra.get(k) is None or rb.get(k) is None
                else rb[k] - ra[k])
            for k in ("lookup_rate", "load_rate")}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return b / a
