"""The event trace: what the kernel did, event by event.

The kernel calls `Tracer.emit(phase, event_id, fields)` at each step of an event's life
(`submit` on the host thread; `start`, `op` per driver call, `result`, `evict`, `error`,
`done` on the trio thread). The tracer keeps records in a bounded ring and its `serve` task
(started in the kernel's nursery) writes them to rolling zstd-compressed msgpack segments and
feeds the sinks (Prometheus metrics: `ucm.trace.metrics`). `ucm-trace` reads the files,
streaming their records within `ReadLimits` (nothing in a trace directory is trusted).

Turn it on with `trace: {path: DIR}` in the config or `UCM_TRACE=DIR` in the environment.
This package imports neither matplotlib nor prometheus_client.
"""

from __future__ import annotations

from ucm.trace._format import SegmentWriter, list_segments
from ucm.trace._reader import (
    Follower,
    ReadBudget,
    ReadLimits,
    Record,
    TraceWarning,
    iter_segment,
    read_header,
    read_segment,
    read_trace,
    trace_files,
    trace_headers,
)
from ucm.trace._recorder import Sink, Tracer, tracer_from_config

__all__ = [
    "Follower",
    "ReadBudget",
    "ReadLimits",
    "Record",
    "SegmentWriter",
    "Sink",
    "TraceWarning",
    "Tracer",
    "iter_segment",
    "list_segments",
    "read_header",
    "read_segment",
    "read_trace",
    "trace_files",
    "trace_headers",
    "tracer_from_config",
]
