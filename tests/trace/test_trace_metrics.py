"""Prometheus metrics fed by the trace: a scrape after a known sequence of events."""

from __future__ import annotations

import urllib.request

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ucm.kernel import Kernel, Load, Lookup, Store  # noqa: E402
from ucm.trace import Tracer  # noqa: E402
from ucm.trace.metrics import MetricsSink, serve_metrics  # noqa: E402

BLOCK = 4096


def _keys(prefix: int, n: int) -> list[bytes]:
    return [bytes([prefix]) + i.to_bytes(2, "big") + b"m" * 13 for i in range(n)]


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_metrics_appear_in_a_scrape(tmp_path):
    registry = prometheus_client.CollectorRegistry()
    sink = MetricsSink(registry)
    tracer = Tracer(sinks=[sink])
    config = {"tiers": [{"driver": "memory", "capacity": "1MiB"},
                        {"driver": "posix", "path": str(tmp_path / "blocks")}]}
    server = serve_metrics(0, registry=registry)
    try:
        with Kernel(config, tracer=tracer) as kernel:
            sink.watch(kernel)
            stored, absent = _keys(1, 6), _keys(2, 2)
            kernel.submit(Store(stored, buffers=[bytes(BLOCK)] * 6)).result(10)
            kernel.submit(Lookup(stored + absent)).result(10)
            buffers = [bytearray(BLOCK) for _ in stored]
            kernel.submit(Load(stored, buffers=buffers)).result(10)
            tracer.flush()
            m = _scrape(server.server_port)
    finally:
        server.shutdown()

    def value(name: str, **labels: str) -> float:
        return m[(name, tuple(sorted(labels.items())))]

    assert value("ucm_events_total", type="store", outcome="ok") == 1
    assert value("ucm_events_total", type="lookup", outcome="ok") == 1
    assert value("ucm_events_total", type="load", outcome="ok") == 1
    assert value("ucm_lookup_keys_total", tier="memory") == 8
    assert value("ucm_lookup_hits_total", tier="memory") == 6
    assert value("ucm_lookup_keys_total", tier="posix") == 2
    assert value("ucm_lookup_hits_total", tier="posix") == 0
    assert value("ucm_load_keys_total", tier="memory") == 6
    assert value("ucm_load_hits_total", tier="memory") == 6
    assert value("ucm_loaded_bytes_total", tier="memory") == 6 * BLOCK
    assert value("ucm_stored_bytes_total", tier="memory") == 6 * BLOCK
    assert value("ucm_stored_bytes_total", tier="posix") == 6 * BLOCK
    assert value("ucm_stored_blocks_total", tier="posix") == 6
    assert value("ucm_event_duration_seconds_count", type="load") == 1
    assert value("ucm_event_duration_seconds_sum", type="load") > 0
    assert value("ucm_driver_op_duration_seconds_count", tier="posix", op="store") == 1
    assert value("ucm_inbox_depth") == 0
    assert value("ucm_in_flight_events") == 0
    assert value("ucm_trace_dropped_records_total") == 0
    assert value("ucm_tier_blocks", tier="memory") == 6
    assert value("ucm_tier_capacity_bytes", tier="memory") == 1 << 20
    assert value("ucm_tier_used_bytes", tier="posix") > 6 * BLOCK
    assert value("ucm_busy_rejections_total") == 0
    assert value("ucm_trace_write_errors_total") == 0


def test_errors_and_evictions_are_counted():
    registry = prometheus_client.CollectorRegistry()
    sink = MetricsSink(registry)
    sink.consume([
        (0, 10, "error", 0, {"tier": "s3", "op": "load", "kind": "StorageUnavailable"}),
        (0, 11, "error", 0, {"tier": "s3", "op": "load", "kind": "StorageUnavailable"}),
        (0, 12, "evict", 0, {"tier": "memory", "keys": 5}),
        (0, 13, "dropped", 0, {"count": 3, "total": 3}),
        (0, 14, "submit", 9, {"type": "Load"}),
        (0, 20, "submit", 10, {"type": "Load"}),
        (0, 25, "start", 10, {"type": "Load"}),
    ])
    get = registry.get_sample_value
    assert get("ucm_errors_total", {"tier": "s3", "op": "load",
                                    "kind": "StorageUnavailable"}) == 2
    assert get("ucm_evictions_total", {"tier": "memory"}) == 5
    assert get("ucm_trace_dropped_records_total") == 3
    assert get("ucm_inbox_depth") == 1 and get("ucm_in_flight_events") == 1
    assert get("ucm_event_queue_seconds_count", {"type": "load"}) == 1


def test_grafana_dashboard_uses_only_exported_metrics():
    import json
    import re
    from pathlib import Path

    import ucm.tools

    dashboard = Path(ucm.tools.__file__).parent / "grafana" / "ucm.json"
    doc = json.loads(dashboard.read_text())
    used = {re.sub(r"_bucket$", "", name) for panel in doc["panels"]
            for target in panel["targets"]
            for name in re.findall(r"\bucm_[a-z_]+", target["expr"])}

    class FakeKernel:
        def statistics(self):
            return {"tier.memory.bytes": 1, "tier.memory.capacity": 2, "tier.memory.blocks": 1,
                    "tier.memory.pinned": 0, "busy_rejections": 0}

    registry = prometheus_client.CollectorRegistry()
    MetricsSink(registry).watch(FakeKernel())
    exported = set()
    for family in registry.collect():
        exported |= {s.name for s in family.samples} | {family.name}
        if family.type == "counter":  # labelled counters have no samples until used
            exported.add(family.name + "_total")
    assert used and used <= exported, used - exported
