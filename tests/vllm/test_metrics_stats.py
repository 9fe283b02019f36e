"""The connector's stats (ucm.vllm_hook.stats): a kernel's trace counted between two of vLLM's
stats calls, summed over sides, and turned into the `ucm_*` series of the API server."""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

prom = pytest.importorskip("prometheus_client")
pytest.importorskip("vllm")

from ucm.kernel import Load, Lookup, Store  # noqa: E402
from ucm.trace.metrics import series_key  # noqa: E402
from ucm.vllm_hook.settings import start_kernel, wait_running  # noqa: E402
from ucm.vllm_hook.stats import SideStats, UCMConnectorStats, UCMPromMetrics  # noqa: E402

BLOCK = 4096
DASHBOARD = Path(__file__).resolve().parents[2] / "tools" / "grafana" / "ucm.json"


def _keys(prefix: int, n: int) -> list[bytes]:
    return [bytes([prefix]) + i.to_bytes(2, "big") + b"s" * 13 for i in range(n)]


def _prom_metrics(registry) -> UCMPromMetrics:
    types = {prom.Counter: functools.partial(prom.Counter, registry=registry),
             prom.Gauge: functools.partial(prom.Gauge, registry=registry),
             prom.Histogram: functools.partial(prom.Histogram, registry=registry)}
    config = SimpleNamespace(kv_transfer_config=None)
    return UCMPromMetrics(config, types, ["model_name", "engine"], {0: ["m", 0]})


def _samples(registry) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples}


def test_a_kernels_counts_reach_the_servers_series(tmp_path):
    side = SideStats()
    config = {"tiers": [{"driver": "memory", "capacity": f"{2 * BLOCK}B"},
                        {"driver": "posix", "path": str(tmp_path / "blocks")}]}
    kernel = start_kernel(config, (side.sink,))
    try:
        assert wait_running(kernel, 30)
        stored, absent = _keys(1, 4), _keys(2, 2)
        kernel.submit(Store(stored, buffers=[bytes(BLOCK)] * 4)).result(10)
        kernel.submit(Lookup(stored + absent)).result(10)
        kernel.submit(Load(stored, buffers=[bytearray(BLOCK) for _ in stored])).result(10)
        kernel.tracer.flush()
        worker = Counter({"loaded_blocks": 3, "load_corrupt": 1, "saved_blocks": 4})
        first = side.take(side_stats=worker, kernel=kernel)
        worker["loaded_blocks"] += 2
        second = side.take(side_stats=worker, kernel=None)  # counts since the first only
    finally:
        kernel.close(timeout=10)

    counters = first.data["counters"]
    assert counters[series_key("events", ("store", "ok"))] == 1
    assert counters[series_key("stored_blocks", ("posix",))] == 4
    assert counters[series_key("connector_blocks", ("load", "corrupt"))] == 1
    assert first.data["gauges"][series_key("tier_capacity_bytes", ("memory",))] == 2 * BLOCK
    assert second.data["counters"] == {series_key("connector_blocks", ("load", "ok")): 2}
    assert first.data["histograms"][series_key("event_duration_seconds", ("load",))]

    both = UCMConnectorStats(data=json.loads(json.dumps(first.data)))  # crosses processes
    both.aggregate(UCMConnectorStats(data=first.data))  # a second TP rank, say
    assert both.data["counters"][series_key("stored_blocks", ("posix",))] == 8
    assert both.reduce()["load_ok_blocks"] == 6 and not both.is_empty()

    registry = prom.CollectorRegistry()
    metrics = _prom_metrics(registry)
    assert _samples(registry)[("ucm_busy_rejections_total",
                               (("engine", "0"), ("model_name", "m")))] == 0
    metrics.observe(both.data, 0)
    metrics.observe(second.data, 0)
    m = _samples(registry)
    labels = (("engine", "0"), ("model_name", "m"))
    assert m[("ucm_stored_blocks_total", (*labels, ("tier", "posix")))] == 8
    assert m[("ucm_connector_blocks_total",
              (*labels, ("op", "load"), ("result", "ok")))] == 8
    assert m[("ucm_tier_capacity_bytes", (*labels, ("tier", "memory")))] == 4 * BLOCK
    assert m[("ucm_event_duration_seconds_count", (*labels, ("type", "load")))] == 2


def test_the_dashboard_names_only_series_the_server_exports():
    registry = prom.CollectorRegistry()
    _prom_metrics(registry)
    exported = {family.name for family in registry.collect()}
    exported |= {f"{name}_total" for name in exported} | {f"{name}_bucket" for name in exported}
    used = {name for panel in json.loads(DASHBOARD.read_text())["panels"]
            for target in panel["targets"]
            for name in re.findall(r"\bucm_[a-z_]+", target["expr"])}
    assert used and used <= exported, used - exported


def test_the_miss_ratio_curves_reach_the_servers_series_as_peaks():
    """A worker's `mrc:` curve goes through its stats and vLLM's aggregation as gauges taken
    at their largest over the ranks (each rank's tier sees the same keys), not summed."""
    side = SideStats()
    config = {"tiers": [{"driver": "memory", "capacity": f"{8 * BLOCK}B"}],
              "mrc": {"sample_rate": 1.0}}
    kernel = start_kernel(config, (side.sink,))
    try:
        assert wait_running(kernel, 30)
        keys = _keys(3, 4)
        kernel.submit(Store(keys, buffers=[bytes(BLOCK)] * 4)).result(10)
        kernel.submit(Load(keys, buffers=[bytearray(BLOCK) for _ in keys])).result(10)
        snapshot = kernel.statistics()["tier.memory.mrc"]
        rank0 = side.take(side_stats=Counter(), kernel=kernel)
        scheduler = SideStats().take(scheduler_stats=Counter())  # no kernel: no curve
    finally:
        kernel.close(timeout=10)

    curve = {int(c): h for c, h in snapshot["curve"]}
    assert len(curve) == 9 and curve[8 * BLOCK] == 0.5  # 4 stores missed, 4 loads hit
    peaks = rank0.data["peaks"]
    policy = snapshot["policy"]
    assert {k: v for k, v in peaks.items() if k.startswith("mrc_hit_ratio")} == {
        series_key("mrc_hit_ratio", ("memory", policy, str(c))): h for c, h in curve.items()}
    assert peaks[series_key("mrc_sampled_references", ("memory",))] == 8
    assert peaks[series_key("mrc_sample_rate", ("memory",))] == 1.0
    assert peaks[series_key("mrc_block_bytes", ("memory",))] == BLOCK
    assert not scheduler.data["peaks"]

    # a second rank whose curve is lower and whose sample is smaller: the larger is kept
    rank1 = {**rank0.data, "peaks": {k: v / 2 for k, v in peaks.items()}}
    both = UCMConnectorStats(data=json.loads(json.dumps(rank0.data)))  # crosses processes
    both.aggregate(UCMConnectorStats(data=rank1)).aggregate(scheduler)
    assert both.data["peaks"] == peaks

    registry = prom.CollectorRegistry()
    metrics = _prom_metrics(registry)
    metrics.observe(both.data, 0)
    metrics.observe(both.data, 0)  # a later step: set again, not added
    m = _samples(registry)
    labels = (("engine", "0"), ("model_name", "m"))
    got = {int(dict(ls)["capacity_bytes"]): v for (name, ls), v in m.items()
           if name == "ucm_mrc_hit_ratio"}
    assert got == curve
    key = (*labels, ("capacity_bytes", str(8 * BLOCK)), ("policy", policy), ("tier", "memory"))
    assert m[("ucm_mrc_hit_ratio", tuple(sorted(key)))] == 0.5
    assert m[("ucm_mrc_sampled_references", (*labels, ("tier", "memory")))] == 8
    # what `ucm tune --live` reads from such a server's /metrics
    from ucm.autotune._mrc import parse_metrics

    (report,) = parse_metrics(prom.generate_latest(registry).decode(), "vllm")
    assert (report.tier, report.policy, report.block_bytes) == ("memory", policy, BLOCK)
    assert report.curve == [(c / BLOCK, h) for c, h in sorted(curve.items())]
