"""Prometheus metrics (`ucm_*`) fed from the trace, plus tier occupancy from the kernel.

    from ucm.trace import Tracer
    from ucm.trace.metrics import MetricsSink, serve_metrics

    sink = MetricsSink()                       # registers in prometheus_client.REGISTRY
    kernel = Kernel(config, tracer=Tracer(trace_dir_or_None, sinks=[sink]))
    sink.watch(kernel)                         # tier bytes/blocks/capacity (one process)
    serve_metrics(9400)                        # http://127.0.0.1:9400/metrics

With tracing configured (`trace:` or `UCM_TRACE`), add the sink to `kernel.tracer.sinks`
before the first event instead of building a Tracer.

**Inside vLLM** (several processes, one `/metrics` on the API server): vLLM runs
prometheus_client in multiprocess mode when `PROMETHEUS_MULTIPROC_DIR` is set (it sets one
itself for multi-process API servers). Export the variable before vLLM starts so that the
scheduler and worker processes inherit it; then every process's `MetricsSink` writes its
counters, histograms and gauges (gauges as `livesum`) to that directory and vLLM's `/metrics`
aggregates them: nothing else to do, and no `serve_metrics`. `watch` (a custom collector) is
per process and does not reach vLLM's `/metrics`; tier occupancy is then read from
`Kernel.statistics()`. For a standalone multiprocess set-up, `serve_metrics(port,
multiprocess=True)` serves the aggregate of `PROMETHEUS_MULTIPROC_DIR`.

Counters and histograms are updated in the tracer's drain (every ~100 ms, off the kernel
thread), so they lag the kernel by at most one drain interval.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    import prometheus_client as prom
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ucm metrics need prometheus-client: pip install 'ucm[trace]'") from exc

LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
                   0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_PENDING_LIMIT = 200_000  # open events remembered; more means done records were lost


class MetricsSink:
    """A tracer sink that turns records into `ucm_*` metrics."""

    def __init__(self, registry: Any = None, *, namespace: str = "ucm") -> None:
        reg = prom.REGISTRY if registry is None else registry
        self.registry = reg
        ns = namespace

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Any:
            return prom.Counter(name, doc, list(labels), namespace=ns, registry=reg)

        self.events = counter("events", "Events finished, by type and outcome",
                              ("type", "outcome"))
        self.event_seconds = prom.Histogram(
            "event_duration_seconds", "Event latency from dispatch to completion",
            ["type"], namespace=ns, registry=reg, buckets=LATENCY_BUCKETS)
        self.queue_seconds = prom.Histogram(
            "event_queue_seconds", "Time from submit (host thread) to dispatch",
            ["type"], namespace=ns, registry=reg, buckets=LATENCY_BUCKETS)
        self.op_seconds = prom.Histogram(
            "driver_op_duration_seconds", "Driver call latency, waiting for the tier's "
            "concurrency limit included", ["tier", "op"], namespace=ns, registry=reg,
            buckets=LATENCY_BUCKETS)
        self.lookup_keys = counter("lookup_keys_total", "Keys looked up that reached a tier",
                                   ("tier",))
        self.lookup_hits = counter("lookup_hits_total", "Keys a lookup found in a tier",
                                   ("tier",))
        self.load_keys = counter("load_keys_total", "Keys a load asked a tier for", ("tier",))
        self.load_hits = counter("load_hits_total", "Keys a tier loaded", ("tier",))
        self.loaded_bytes = counter("loaded_bytes_total", "Block bytes loaded", ("tier",))
        self.stored_bytes = counter("stored_bytes_total", "Block bytes stored", ("tier",))
        self.stored_blocks = counter("stored_blocks_total", "Blocks stored", ("tier",))
        self.errors = counter("errors_total", "Driver errors and failed blocks",
                              ("tier", "op", "kind"))
        self.evictions = counter("evictions_total", "Blocks evicted", ("tier",))
        self.dropped = counter("trace_dropped_records_total",
                               "Trace records lost to ring overflow")
        self.inbox = prom.Gauge("inbox_depth", "Events submitted and not yet dispatched",
                                namespace=ns, registry=reg, multiprocess_mode="livesum")
        self.in_flight = prom.Gauge("in_flight_events", "Events dispatched and not finished",
                                    namespace=ns, registry=reg, multiprocess_mode="livesum")
        self._submitted: dict[int, int] = {}
        self._started: dict[int, tuple[int, str]] = {}

    # -- the sink ------------------------------------------------------------------------------
    def consume(self, records: Sequence[tuple]) -> None:
        submitted, started = self._submitted, self._started
        for _seq, t, phase, event_id, fields in records:
            if phase == "op":
                self._op(t, fields)
            elif phase == "start":
                kind = str(fields.get("type", "?")).lower()
                t_submit = submitted.pop(event_id, None)
                if t_submit is not None:
                    self.queue_seconds.labels(kind).observe((t - t_submit) / 1e9)
                started[event_id] = (t, kind)
            elif phase == "done":
                begun = started.pop(event_id, None)
                if begun is not None:
                    self.event_seconds.labels(begun[1]).observe((t - begun[0]) / 1e9)
                    self.events.labels(begun[1], fields.get("outcome", "?")).inc()
            elif phase == "submit":
                submitted[event_id] = t
            elif phase == "result":
                self._lookup_result(fields)
            elif phase == "error":
                self.errors.labels(fields.get("tier", "?"), fields.get("op", "?"),
                                   fields.get("kind", "?")).inc()
            elif phase == "evict":
                self.evictions.labels(fields.get("tier", "?")).inc(fields.get("keys", 0))
            elif phase == "dropped":
                self.dropped.inc(fields.get("count", 0))
        if len(submitted) > _PENDING_LIMIT:
            submitted.clear()
        if len(started) > _PENDING_LIMIT:
            started.clear()
        self.inbox.set(len(submitted))
        self.in_flight.set(len(started))

    def _op(self, t: int, fields: dict) -> None:
        tier, op = fields.get("tier", "?"), fields.get("op", "?")
        t0 = fields.get("t0")
        if t0 is not None:
            self.op_seconds.labels(tier, op).observe((t - t0) / 1e9)
        if "error" in fields:
            return
        if op == "load":
            self.load_keys.labels(tier).inc(fields.get("keys", 0))
            self.load_hits.labels(tier).inc(fields.get("hits", 0))
            self.loaded_bytes.labels(tier).inc(fields.get("bytes", 0))
        elif op == "store":
            self.stored_bytes.labels(tier).inc(fields.get("bytes", 0))
            self.stored_blocks.labels(tier).inc(fields.get("stored", 0))

    def _lookup_result(self, fields: dict) -> None:
        remaining = fields.get("keys", 0)
        for tier, hits in (fields.get("hits") or {}).items():
            if remaining <= 0:
                break
            self.lookup_keys.labels(tier).inc(remaining)
            self.lookup_hits.labels(tier).inc(hits)
            remaining -= hits

    # -- occupancy -----------------------------------------------------------------------------
    def watch(self, kernel: Any) -> KernelCollector:
        """Adds tier occupancy and busy rejections from `kernel.statistics()` to the
        registry (read at scrape time; one process only)."""
        collector = KernelCollector(kernel)
        self.registry.register(collector)
        return collector


class KernelCollector:
    """A custom collector over `Kernel.statistics()`."""

    def __init__(self, kernel: Any, *, namespace: str = "ucm") -> None:
        self.kernel = kernel
        self.ns = namespace

    def describe(self) -> list:
        return []  # no describe-time scrape of a kernel that may not be running

    def collect(self) -> Any:
        stats = self.kernel.statistics()
        ns = self.ns
        used = GaugeMetricFamily(f"{ns}_tier_used_bytes", "Bytes held by a tier", labels=["tier"])
        cap = GaugeMetricFamily(f"{ns}_tier_capacity_bytes", "A tier's capacity",
                                labels=["tier"])
        blocks = GaugeMetricFamily(f"{ns}_tier_blocks", "Blocks held by a tier",
                                   labels=["tier"])
        pinned = GaugeMetricFamily(f"{ns}_tier_pinned_blocks", "Blocks pinned in a tier",
                                   labels=["tier"])
        for key, value in stats.items():
            if not key.startswith("tier.") or not isinstance(value, int | float):
                continue
            tier, _, what = key[5:].rpartition(".")
            family = {"bytes": used, "capacity": cap, "blocks": blocks,
                      "pinned": pinned}.get(what)
            if family is not None:
                family.add_metric([tier], value)
        busy = CounterMetricFamily(f"{ns}_busy_rejections", "Events refused: inbox full",
                                   value=stats.get("busy_rejections", 0))
        dropped = CounterMetricFamily(f"{ns}_background_dropped", "Background copies dropped",
                                      value=stats.get("background_dropped", 0))
        trace_errors = CounterMetricFamily(
            f"{ns}_trace_write_errors", "Trace file writes that failed (the first turns trace "
            "files off)", value=stats.get("trace_write_errors", 0))
        return [used, cap, blocks, pinned, busy, dropped, trace_errors]


def serve_metrics(port: int, addr: str = "127.0.0.1", *, registry: Any = None,
                  multiprocess: bool = False) -> Any:
    """Serves `/metrics` on addr:port in a daemon thread; returns the server (`shutdown()`
    stops it). `multiprocess` serves the aggregate of PROMETHEUS_MULTIPROC_DIR."""
    if multiprocess:
        from prometheus_client import multiprocess as mp

        registry = prom.CollectorRegistry()
        mp.MultiProcessCollector(registry)
    server, _thread = prom.start_http_server(port, addr=addr,
                                             registry=registry or prom.REGISTRY)
    return server
