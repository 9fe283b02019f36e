"""Prometheus metrics (`ucm_*`) fed from the trace, plus tier occupancy from the kernel.

    from ucm.trace import Tracer
    from ucm.trace.metrics import MetricsSink, serve_metrics

    sink = MetricsSink()                       # registers in prometheus_client.REGISTRY
    kernel = Kernel(config, tracer=Tracer(trace_dir_or_None, sinks=[sink]))
    sink.watch(kernel)                         # tier bytes/blocks/capacity (one process)
    serve_metrics(9400)                        # http://127.0.0.1:9400/metrics

With tracing configured (`trace:` or `UCM_TRACE`), add the sink to `kernel.tracer.sinks`
before the first event instead of building a Tracer.

**Inside vLLM** the connector reports the same series through vLLM's connector-stats hooks
(`ucm.vllm_hook.stats`): each kernel it starts feeds a `StatsSink`, vLLM sums the workers' and
the scheduler's counts every step and the API server's `/metrics` shows them as `ucm_*` series
(with vLLM's `model_name` and `engine` labels), tier occupancy included: nothing to set up, and
no `MetricsSink` or `serve_metrics` in vLLM's processes (their series would carry the same
names). For a standalone multiprocess set-up (`PROMETHEUS_MULTIPROC_DIR` exported before the
processes start), each process's `MetricsSink` writes its counters, histograms and gauges (as
`livesum`) there and `serve_metrics(port, multiprocess=True)` serves the aggregate; `watch` (a
custom collector) is per process and is not aggregated.

Counters and histograms are updated in the tracer's drain (every ~100 ms, off the kernel
thread), so they lag the kernel by at most one drain interval.
"""

from __future__ import annotations

import threading
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


# The `ucm_*` series the trace feeds (name without the namespace: help, labels). Counters are
# exposed with `_total`; the connector's stats (ucm.vllm_hook.stats) export the same names.
COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "events": ("Events finished, by type and outcome", ("type", "outcome")),
    "lookup_keys": ("Keys looked up that reached a tier", ("tier",)),
    "lookup_hits": ("Keys a lookup found in a tier", ("tier",)),
    "load_keys": ("Keys a load asked a tier for", ("tier",)),
    "load_hits": ("Keys a tier loaded", ("tier",)),
    "loaded_bytes": ("Block bytes loaded", ("tier",)),
    "stored_bytes": ("Block bytes stored", ("tier",)),
    "stored_blocks": ("Blocks stored", ("tier",)),
    "errors": ("Driver errors and failed blocks", ("tier", "op", "kind")),
    "evictions": ("Blocks evicted", ("tier",)),
    "trace_dropped_records": ("Trace records lost to ring overflow", ()),
}
HISTOGRAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "event_duration_seconds": ("Event latency from dispatch to completion", ("type",)),
    "event_queue_seconds": ("Time from submit (host thread) to dispatch", ("type",)),
    "driver_op_duration_seconds": ("Driver call latency, waiting for the tier's concurrency "
                                   "limit included", ("tier", "op")),
}
GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "inbox_depth": ("Events submitted and not yet dispatched", ()),
    "in_flight_events": ("Events dispatched and not finished", ()),
}


class TraceCounts:
    """Reads trace records into counts; a subclass says where they go (`inc`, `observe`,
    `set`, each by a metric's name above and its label values)."""

    def __init__(self) -> None:
        self._submitted: dict[int, int] = {}
        self._started: dict[int, tuple[int, str]] = {}

    def inc(self, name: str, labels: tuple[str, ...], value: float) -> None:
        raise NotImplementedError

    def observe(self, name: str, labels: tuple[str, ...], seconds: float) -> None:
        raise NotImplementedError

    def set(self, name: str, value: float) -> None:
        raise NotImplementedError

    # -- the sink ------------------------------------------------------------------------------
    def consume(self, records: Sequence[Sequence[Any]]) -> None:
        submitted, started = self._submitted, self._started
        for _seq, t, phase, event_id, fields in records:
            if phase == "op":
                self._op(t, fields)
            elif phase == "start":
                kind = str(fields.get("type", "?")).lower()
                t_submit = submitted.pop(event_id, None)
                if t_submit is not None:
                    self.observe("event_queue_seconds", (kind,), (t - t_submit) / 1e9)
                started[event_id] = (t, kind)
            elif phase == "done":
                begun = started.pop(event_id, None)
                if begun is not None:
                    self.observe("event_duration_seconds", (begun[1],), (t - begun[0]) / 1e9)
                    self.inc("events", (begun[1], str(fields.get("outcome", "?"))), 1)
            elif phase == "submit":
                submitted[event_id] = t
            elif phase == "result":
                self._lookup_result(fields)
            elif phase == "error":
                self.inc("errors", (str(fields.get("tier", "?")), str(fields.get("op", "?")),
                                    str(fields.get("kind", "?"))), 1)
            elif phase == "evict":
                self.inc("evictions", (str(fields.get("tier", "?")),), fields.get("keys", 0))
            elif phase == "dropped":
                self.inc("trace_dropped_records", (), fields.get("count", 0))
        if len(submitted) > _PENDING_LIMIT:
            submitted.clear()
        if len(started) > _PENDING_LIMIT:
            started.clear()
        self.set("inbox_depth", len(submitted))
        self.set("in_flight_events", len(started))

    def _op(self, t: int, fields: dict[str, Any]) -> None:
        tier, op = str(fields.get("tier", "?")), str(fields.get("op", "?"))
        t0 = fields.get("t0")
        if t0 is not None:
            self.observe("driver_op_duration_seconds", (tier, op), (t - t0) / 1e9)
        if "error" in fields:
            return
        if op == "load":
            self.inc("load_keys", (tier,), fields.get("keys", 0))
            self.inc("load_hits", (tier,), fields.get("hits", 0))
            self.inc("loaded_bytes", (tier,), fields.get("bytes", 0))
        elif op == "store":
            self.inc("stored_bytes", (tier,), fields.get("bytes", 0))
            self.inc("stored_blocks", (tier,), fields.get("stored", 0))

    def _lookup_result(self, fields: dict[str, Any]) -> None:
        remaining = fields.get("keys", 0)
        for tier, hits in (fields.get("hits") or {}).items():
            if remaining <= 0:
                break
            self.inc("lookup_keys", (str(tier),), remaining)
            self.inc("lookup_hits", (str(tier),), hits)
            remaining -= hits


class MetricsSink(TraceCounts):
    """A tracer sink that turns records into `ucm_*` metrics."""

    def __init__(self, registry: Any = None, *, namespace: str = "ucm") -> None:
        super().__init__()
        reg = prom.REGISTRY if registry is None else registry
        self.registry = reg
        ns = namespace
        self._metrics: dict[str, Any] = {}
        for name, (doc, labels) in COUNTERS.items():
            self._metrics[name] = prom.Counter(name, doc, list(labels), namespace=ns,
                                               registry=reg)
        for name, (doc, labels) in HISTOGRAMS.items():
            self._metrics[name] = prom.Histogram(name, doc, list(labels), namespace=ns,
                                                 registry=reg, buckets=LATENCY_BUCKETS)
        for name, (doc, _labels) in GAUGES.items():
            self._metrics[name] = prom.Gauge(name, doc, namespace=ns, registry=reg,
                                             multiprocess_mode="livesum")

    def inc(self, name: str, labels: tuple[str, ...], value: float) -> None:
        metric = self._metrics[name]
        (metric.labels(*labels) if labels else metric).inc(value)

    def observe(self, name: str, labels: tuple[str, ...], seconds: float) -> None:
        self._metrics[name].labels(*labels).observe(seconds)

    def set(self, name: str, value: float) -> None:
        self._metrics[name].set(value)

    # -- occupancy -----------------------------------------------------------------------------
    def watch(self, kernel: Any) -> KernelCollector:
        """Adds tier occupancy and busy rejections from `kernel.statistics()` to the
        registry (read at scrape time; one process only)."""
        collector = KernelCollector(kernel)
        self.registry.register(collector)
        return collector


class StatsSink(TraceCounts):
    """A tracer sink that keeps the counts between two `take()`s as plain data, for a process
    that ships them elsewhere (the vLLM connector's stats, `ucm.vllm_hook.stats`)."""

    MAX_OBSERVATIONS = 4096  # per series between two takes; beyond, latencies are skipped

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._counts: dict[str, float] = {}
        self._observed: dict[str, list[float]] = {}
        self._gauges: dict[str, float] = {}

    def inc(self, name: str, labels: tuple[str, ...], value: float) -> None:
        key = series_key(name, labels)  # a zero too: the series then exists (a hit rate of 0)
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + value

    def observe(self, name: str, labels: tuple[str, ...], seconds: float) -> None:
        key = series_key(name, labels)
        with self._lock:
            values = self._observed.setdefault(key, [])
            if len(values) < self.MAX_OBSERVATIONS:
                values.append(seconds)

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._gauges[series_key(name, ())] = value

    def take(self) -> dict[str, dict[str, Any]]:
        """The counts since the last take, the observations, the gauges' last values:
        {"counters": {series: n}, "histograms": {series: [seconds]}, "gauges": {series: v}}
        (series: `series_key`)."""
        with self._lock:
            counts, self._counts = self._counts, {}
            observed, self._observed = self._observed, {}
            gauges = dict(self._gauges)
        return {"counters": counts, "histograms": observed, "gauges": gauges}


def series_key(name: str, labels: tuple[str, ...]) -> str:
    """A series as one string (plain data crosses vLLM's processes): name and label values."""
    return "\t".join((name, *labels))


def split_series(key: str) -> tuple[str, tuple[str, ...]]:
    name, *labels = key.split("\t")
    return name, tuple(labels)


class KernelCollector:
    """A custom collector over `Kernel.statistics()`."""

    def __init__(self, kernel: Any, *, namespace: str = "ucm") -> None:
        self.kernel = kernel
        self.ns = namespace

    def describe(self) -> list[Any]:
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
        held = GaugeMetricFamily(f"{ns}_tier_held_bytes", "Bytes of a tier that session holds "
                                 "keep from eviction", labels=["tier"])
        releases = CounterMetricFamily(f"{ns}_session_releases", "Session holds released, by "
                                       "reason: end, expired, cap", labels=["reason"])
        for key, value in stats.items():
            if key.startswith("session_releases."):
                releases.add_metric([key.partition(".")[2]], value)
            if not key.startswith("tier.") or not isinstance(value, int | float):
                continue
            tier, _, what = key[5:].rpartition(".")
            family = {"bytes": used, "capacity": cap, "blocks": blocks,
                      "pinned": pinned, "held_bytes": held}.get(what)
            if family is not None:
                family.add_metric([tier], value)
        mrc = self._mrc(stats)
        holds = CounterMetricFamily(f"{ns}_session_holds", "Session holds placed",
                                    value=stats.get("session_holds", 0))
        busy = CounterMetricFamily(f"{ns}_busy_rejections", "Events refused: inbox full",
                                   value=stats.get("busy_rejections", 0))
        dropped = CounterMetricFamily(f"{ns}_background_dropped", "Background copies dropped",
                                      value=stats.get("background_dropped", 0))
        trace_errors = CounterMetricFamily(
            f"{ns}_trace_write_errors", "Trace file writes that failed (the first turns trace "
            "files off)", value=stats.get("trace_write_errors", 0))
        return [used, cap, blocks, pinned, held, holds, releases, busy, dropped, trace_errors,
                *mrc]

    def _mrc(self, stats: dict[str, Any]) -> list[Any]:
        """Each tier's sampled miss-ratio curve (`mrc:` in the config), one point a series."""
        ns = self.ns
        ratio = GaugeMetricFamily(f"{ns}_mrc_hit_ratio", "Estimated hit ratio of a tier at a "
                                  "capacity, for its policy (sampled miss-ratio curve)",
                                  labels=["tier", "policy", "capacity_bytes"])
        rate = GaugeMetricFamily(f"{ns}_mrc_sample_rate", "Share of keys the curve samples",
                                 labels=["tier"])
        size = GaugeMetricFamily(f"{ns}_mrc_block_bytes", "Mean size of the sampled blocks",
                                 labels=["tier"])
        refs = GaugeMetricFamily(f"{ns}_mrc_sampled_references", "References the curve has "
                                 "sampled", labels=["tier"])
        for key, value in stats.items():
            if not (key.startswith("tier.") and key.endswith(".mrc")) or not isinstance(
                    value, dict):
                continue
            tier = key[5:-4]
            for capacity, hit in value["curve"]:
                ratio.add_metric([tier, str(value["policy"]), str(int(capacity))], hit)
            rate.add_metric([tier], value["rate"])
            size.add_metric([tier], value["block_bytes"])
            refs.add_metric([tier], value["sampled"])
        return [ratio, rate, size, refs]


def serve_metrics(port: int, addr: str = "127.0.0.1", *, registry: Any = None,
                  multiprocess: bool = False) -> Any:
    """Serves `/metrics` on addr:port in a daemon thread; returns the server (`shutdown()`
    stops it). `multiprocess` serves the aggregate of PROMETHEUS_MULTIPROC_DIR."""
    if multiprocess:
        from prometheus_client import multiprocess as mp

        registry = prom.CollectorRegistry()
        # prometheus_client leaves MultiProcessCollector unannotated
        mp.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    server, _thread = prom.start_http_server(port, addr=addr,
                                             registry=registry or prom.REGISTRY)
    return server
