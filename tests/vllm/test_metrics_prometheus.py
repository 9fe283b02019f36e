"""ucm's metrics in the vLLM server's own /metrics, as operators read them: a real Prometheus
server (Debian's `prometheus`; `bash scripts/backends/install.sh prometheus`) scrapes a `ucm
serve` server through a workload that hits, misses, evicts and meets a corrupt block, and every
query of the shipped Grafana dashboard (tools/grafana/ucm.json) returns data. The servers are
the session's `restarted` pair (tests/vllm/conftest.py), which serve test_server.py's restart
workload first: the counts here are what the warm server's counters grew by since."""

from __future__ import annotations

import shutil

import pytest
from serving_support import BLOCK, MEMORY_BLOCKS, metric_sum

from ucm.kernel._core import MRC_FRACTIONS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def observed(restarted):
    """The warm server's answers to the Prometheus workload, its /metrics after them, the
    dashboard's query results, and its /metrics before them (the restart workload's)."""
    if shutil.which("prometheus") is None:
        pytest.skip("no prometheus binary: bash scripts/backends/install.sh prometheus")
    return restarted["prometheus"]


def test_every_dashboard_query_returns_data(observed):
    empty = [(title, expr) for title, expr, result in observed["results"] if not result]
    assert observed["results"] and not empty, empty


def test_ucm_series_in_the_servers_metrics(observed):
    m, before = observed["samples"], observed["before"]

    def grown(name: str, **labels: str) -> float:  # this workload's share of a counter
        return metric_sum(m, name, **labels) - metric_sum(before, name, **labels)

    cached = [r["cached"] for r in observed["warm"]]
    print("warm cached tokens:", cached)
    print("\n".join(f"{n} {dict(ls)} {v}" for (n, ls), v in sorted(m.items())
                    if n.startswith("ucm_") and not n.endswith(("_bucket", "_created"))))
    first = (observed["warm"][0]["prompt_tokens"] - 1) // BLOCK
    assert grown("ucm_errors_total", tier="posix", op="load", kind="corrupt") == first
    assert grown("ucm_connector_blocks_total", op="load", result="corrupt") == first
    # vLLM counts the first document's tokens as cached (claimed), though they recomputed
    loaded = grown("ucm_connector_blocks_total", op="load", result="ok")
    assert loaded == sum(cached[1:]) // BLOCK and loaded > 0
    assert grown("ucm_loaded_bytes_total", tier="posix") > 0
    assert grown("ucm_stored_blocks_total") > 0
    assert grown("ucm_lookup_hits_total", tier="posix") > 0
    assert grown("ucm_lookup_keys_total", tier="posix") > \
        grown("ucm_lookup_hits_total", tier="posix")  # the new prompts missed
    assert grown("ucm_evictions_total", tier="memory") > 0
    assert grown("ucm_event_duration_seconds_count", type="load") >= 2
    assert grown("ucm_event_duration_seconds_count", type="store") >= 1
    assert metric_sum(m, "ucm_tier_capacity_bytes", tier="memory") == MEMORY_BLOCKS * 32 * 1024
    curve = [dict(labels) for (name, labels) in m if name == "ucm_mrc_hit_ratio"]
    assert {c["capacity_bytes"] for c in curve if c["tier"] == "memory"} == {
        str(max(1, int(MEMORY_BLOCKS * 32 * 1024 * f))) for f in MRC_FRACTIONS}
    assert metric_sum(m, "ucm_mrc_sample_rate", tier="memory") == 0.01  # one series: a max
    inbox = [dict(labels) for (name, labels) in m if name == "ucm_inbox_depth"]
    assert inbox and {"engine", "model_name"} <= set(inbox[0])  # vLLM's labels too
