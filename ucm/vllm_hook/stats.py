"""ucm's metrics in the vLLM server's own `/metrics`, through vLLM's connector-stats hooks.

Each kernel the connector starts feeds a `StatsSink` (ucm.trace.metrics) from its trace. Every
step, `get_kv_connector_stats` hands vLLM what a side counted since the last step: the worker
side its kernel's counts and latencies, the connector's block outcomes and (at most once a
second) its tiers' occupancy; the scheduler side its own lookup kernel's counts, where it has
one. vLLM sums the workers' and the scheduler's (`UCMConnectorStats.aggregate`), sends the
result to the API server, and there `UCMPromMetrics` adds it to `ucm_*` series named as
`ucm.trace.metrics` names them (the Grafana dashboard's), labelled with vLLM's `model_name`
and `engine` as well. The tiers' miss-ratio curves (`mrc:`) travel as "peaks": gauges merged
by their largest value, not summed, since every TP rank's tier sees the same keys (its own
shard of each block) and so estimates the same curve.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ucm.drivers import LoadState
from ucm.trace.metrics import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    LATENCY_BUCKETS,
    StatsSink,
    series_key,
    split_series,
)

# Beyond the trace's series: the connector's own block outcomes, and what Kernel.statistics()
# holds (KernelCollector's names).
CONNECTOR_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "connector_blocks": ("Blocks the connector loaded or stored, by outcome (ok, missing, "
                         "corrupt, failed; dropped: a save over max_store_bytes)",
                         ("op", "result")),
    "busy_rejections": ("Events refused: inbox full", ()),
    "connector_consumer_waits": ("kv_consumer requests whose prompt's full blocks were not "
                                 "all stored at their first lookup: complete (all came "
                                 "within consumer_wait), expired (the rest recomputed)",
                                 ("outcome",)),
    "connector_consumer_missing_blocks": ("Prompt blocks a kv_consumer recomputed: not stored "
                                          "when its wait expired", ()),
    "connector_session_hints": ("Session hints of finished requests (docs/vllm.md, Sessions), "
                                "by kind: hold, end, prefetch; malformed: ignored",
                                ("kind",)),
    "connector_next_turn_prefetches": ("Prefetches the live next-turn predictor issued "
                                       "(sessions.predict_next_turn), and the blocks they "
                                       "asked for", ("unit",)),
    "prefetch_blocks": ("Blocks a Prefetch brought into the fastest tier (promoted), and "
                        "what became of them: loaded from there (hit) or evicted before any "
                        "load (evicted_unused)", ("outcome",)),
    "connector_early_loads": ("Step loads started before start_load_kv (when the scheduler "
                              "planned the step, or when a worker process received it); "
                              "unused: the step did not ask for them", ("outcome",)),
}
TIER_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "tier_used_bytes": ("Bytes held by a tier", ("tier",)),
    "tier_capacity_bytes": ("A tier's capacity", ("tier",)),
    "tier_blocks": ("Blocks held by a tier", ("tier",)),
    "tier_pinned_blocks": ("Blocks pinned in a tier", ("tier",)),
    "tier_held_bytes": ("Bytes of a tier that session holds keep from eviction", ("tier",)),
}
# Each tier's sampled miss-ratio curve (Kernel.statistics()["tier.NAME.mrc"]), named as
# KernelCollector names it.
MRC_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "mrc_hit_ratio": ("Estimated hit ratio of a tier at a capacity, for its policy (sampled "
                      "miss-ratio curve)", ("tier", "policy", "capacity_bytes")),
    "mrc_sample_rate": ("Share of keys the curve samples", ("tier",)),
    "mrc_block_bytes": ("Mean size of the sampled blocks", ("tier",)),
    "mrc_sampled_references": ("References the curve has sampled", ("tier",)),
}
_TIER_STATS = {"bytes": "tier_used_bytes", "capacity": "tier_capacity_bytes",
               "blocks": "tier_blocks", "pinned": "tier_pinned_blocks",
               "held_bytes": "tier_held_bytes"}
# WorkerSide.stats counters -> (op, result) of connector_blocks
_OUTCOMES: dict[str, tuple[str, ...]] = {
    "loaded_blocks": ("load", "ok"), "saved_blocks": ("store", "ok"),
    "save_failed_blocks": ("store", "failed"),
    "save_dropped_blocks": ("store", "dropped"),
    **{f"load_{s.name.lower()}": ("load", s.name.lower())
       for s in LoadState if s is not LoadState.OK}}
_EARLY: dict[str, tuple[str, ...]] = {"early_loads": ("started",),
                                      "early_loads_unused": ("unused",)}
# SchedulerSide.stats counters -> (series, labels)
_SCHEDULER: dict[str, tuple[str, tuple[str, ...]]] = {
    "consumer_waits_complete": ("connector_consumer_waits", ("complete",)),
    "consumer_waits_expired": ("connector_consumer_waits", ("expired",)),
    "consumer_missing_blocks": ("connector_consumer_missing_blocks", ()),
    "session_hints.hold": ("connector_session_hints", ("hold",)),
    "session_hints.end": ("connector_session_hints", ("end",)),
    "session_hints.prefetch": ("connector_session_hints", ("prefetch",)),
    "session_hints_malformed": ("connector_session_hints", ("malformed",)),
    "next_turn.prefetches": ("connector_next_turn_prefetches", ("prefetches",)),
    "next_turn.blocks": ("connector_next_turn_prefetches", ("blocks",)),
}
# Kernel.statistics() counters of prefetched blocks -> outcome of prefetch_blocks ("tier.*."
# ones summed over the tiers: only the fastest receives prefetches)
_PREFETCH = {"prefetched": "promoted", "prefetch_hits": "hit",
             "prefetch_evicted": "evicted_unused"}
_PARTS = ("counters", "histograms", "gauges", "peaks")


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two sides' stats in one: counts and gauges add up (each worker holds its own shard),
    latencies are pooled, peaks (the miss-ratio curves) take the larger."""
    out: dict[str, Any] = {part: dict(a.get(part) or {}) for part in _PARTS}
    for part in ("counters", "gauges"):
        for key, value in (b.get(part) or {}).items():
            out[part][key] = out[part].get(key, 0) + value
    for key, value in (b.get("peaks") or {}).items():
        out["peaks"][key] = max(out["peaks"].get(key, value), value)
    for key, values in (b.get("histograms") or {}).items():
        out["histograms"][key] = [*out["histograms"].get(key, ()), *values]
    return out


@dataclass
class UCMConnectorStats(KVConnectorStats):
    """One step's stats of every side (plain data: it crosses vLLM's processes)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        """vLLM's periodic log line: blocks loaded and stored, bytes, errors."""
        totals: dict[str, float] = {}
        for key, value in (self.data.get("counters") or {}).items():
            name, labels = split_series(key)
            if name == "connector_blocks":
                name = f"{labels[0]}_{labels[1]}_blocks"
            totals[name] = totals.get(name, 0) + value
        keep = ("load_ok_blocks", "store_ok_blocks", "loaded_bytes", "stored_bytes",
                "load_corrupt_blocks", "load_failed_blocks", "errors", "evictions")
        return {name: totals[name] for name in keep if name in totals}

    def is_empty(self) -> bool:
        return not any(self.data.get(part) for part in _PARTS)


class SideStats:
    """What one side of the connector counts between two of vLLM's stats calls."""

    OCCUPANCY_EVERY = 1.0  # seconds between two reads of the tiers' occupancy (a kernel hop)

    def __init__(self) -> None:
        self.sink = StatsSink()
        self._last: dict[str, float] = {}
        self._occupancy_at = 0.0

    def take(self, *, side_stats: Any = None, kernel: Any = None,
             scheduler_stats: Any = None) -> UCMConnectorStats:
        """The kernel's counts since the last take; with `side_stats` (WorkerSide.stats) the
        connector's block outcomes; with `kernel` its occupancy (at most once a second); with
        `scheduler_stats` (SchedulerSide.stats) a consumer's waits."""
        data = self.sink.take()
        counters = data["counters"]
        if scheduler_stats is not None:
            for stat, (series, labels) in _SCHEDULER.items():
                self._delta(counters, series, labels, stat, scheduler_stats.get(stat, 0))
        if side_stats is not None:
            for stat, labels in _OUTCOMES.items():
                self._delta(counters, "connector_blocks", labels, stat, side_stats.get(stat, 0))
            for stat, labels in _EARLY.items():
                self._delta(counters, "connector_early_loads", labels, stat,
                            side_stats.get(stat, 0))
        else:
            data["gauges"] = {}  # the scheduler's lookup kernel holds no occupancy of its own
        data["peaks"] = {}
        now = time.monotonic()
        if kernel is not None and kernel.running and now - self._occupancy_at >= \
                self.OCCUPANCY_EVERY:
            self._occupancy_at = now
            try:
                stats = kernel.statistics()
            except Exception:  # a kernel closing: no occupancy this time
                stats = {}
            for key, value in stats.items():
                tier, _, what = key[5:].rpartition(".")
                name = _TIER_STATS.get(what)
                if key.startswith("tier.") and name and isinstance(value, int | float):
                    data["gauges"][series_key(name, (tier,))] = value
                elif key.startswith("tier.") and what == "mrc" and isinstance(value, dict):
                    data["peaks"].update(mrc_peaks(tier, value))
            self._delta(counters, "busy_rejections", (), "busy_rejections",
                        stats.get("busy_rejections", self._last.get("busy_rejections", 0)))
            if stats:
                for stat, outcome in _PREFETCH.items():
                    total = stats.get(stat, 0) + sum(
                        v for k, v in stats.items() if k.startswith("tier.")
                        and k.endswith(f".{stat}") and isinstance(v, int | float))
                    self._delta(counters, "prefetch_blocks", (outcome,), stat, total)
        return UCMConnectorStats(data=data)

    def _delta(self, counters: dict[str, float], name: str, labels: tuple[str, ...], stat: str,
               total: float) -> None:
        delta = total - self._last.get(stat, 0)
        self._last[stat] = total
        if delta > 0:
            key = series_key(name, labels)
            counters[key] = counters.get(key, 0) + delta


def mrc_peaks(tier: str, snapshot: dict[str, Any]) -> dict[str, float]:
    """A tier's miss-ratio curve (`MissRatioCurve.snapshot()`) as MRC_GAUGES series."""
    out = {series_key("mrc_hit_ratio", (tier, str(snapshot["policy"]), str(int(capacity)))):
           float(hit) for capacity, hit in snapshot["curve"]}
    for name, field in (("mrc_sample_rate", "rate"), ("mrc_block_bytes", "block_bytes"),
                        ("mrc_sampled_references", "sampled")):
        out[series_key(name, (tier,))] = float(snapshot[field])
    return out


class UCMPromMetrics(KVConnectorPromMetrics):
    """The `ucm_*` series in the API server's registry (vLLM's metric classes: its
    multiprocess mode and Ray wrappers apply), fed each step's aggregated stats."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[Any], type[Any]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        # prometheus_client's classes or vLLM's Ray wrappers of them; vLLM types each as
        # any of the three, so their own keywords (buckets, multiprocess_mode) need Any.
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls
        gauge: Any = self._gauge_cls
        for name, (doc, labels) in {**COUNTERS, **CONNECTOR_COUNTERS}.items():
            self._metrics[name] = counter(
                name=f"ucm_{name}", documentation=doc, labelnames=[*labelnames, *labels])
        for name, (doc, labels) in HISTOGRAMS.items():
            self._metrics[name] = histogram(
                name=f"ucm_{name}", documentation=doc, labelnames=[*labelnames, *labels],
                buckets=list(LATENCY_BUCKETS))
        for name, (doc, labels) in {**GAUGES, **TIER_GAUGES, **MRC_GAUGES}.items():
            self._metrics[name] = gauge(
                name=f"ucm_{name}", documentation=doc, labelnames=[*labelnames, *labels],
                multiprocess_mode="mostrecent")
        # The series with no labels of their own exist from the start (at 0): a dashboard
        # shows "none dropped" rather than "no data".
        for name, (_doc, labels) in {**COUNTERS, **CONNECTOR_COUNTERS, **GAUGES}.items():
            for values in per_engine_labelvalues.values():
                if not labels:
                    self._metrics[name].labels(*[str(v) for v in values])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for part in _PARTS:
            for key, value in (transfer_stats_data.get(part) or {}).items():
                name, labels = split_series(key)
                metric = self._metrics.get(name)
                if metric is None:
                    continue
                series = metric.labels(*engine, *labels)
                if part == "counters":
                    series.inc(value)
                elif part in ("gauges", "peaks"):
                    series.set(value)
                else:
                    for seconds in value:
                        series.observe(seconds)
