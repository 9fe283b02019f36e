"""ucm's metrics in the vLLM server's own /metrics, as operators read them: a real Prometheus
server (Debian's `prometheus`; `bash scripts/backends/install.sh prometheus`) scrapes a `ucm
serve` server through a workload that hits, misses, evicts and meets a corrupt block, and every
query of the shipped Grafana dashboard (tools/grafana/ucm.json) returns data."""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from test_server import BLOCK, Server, free_port, metric_sum, stream, wait_stored, words

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[2] / "tools" / "grafana" / "ucm.json"
DOCS = [words(400, 21 + i) for i in range(3)]
NEW = words(300, 31)


def block_files(store: Path) -> list[str]:
    return glob.glob(str(store / "**" / "*.blk"), recursive=True)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, Grafana's variables filled in as its defaults
    would fill them ($instance: All)."""
    doc = json.loads(DASHBOARD.read_text())
    out = []
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            expr = (target["expr"].replace("$__rate_interval", "1m")
                    .replace('"$instance"', '".*"'))
            out.append((panel["title"], expr))
    return out


class Prometheus:
    def __init__(self, root: Path, target_port: int) -> None:
        self.port = free_port()
        config = root / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "vllm", "static_configs": [
                {"targets": [f"127.0.0.1:{target_port}"]}]}]}))
        self.log = open(root / "prometheus.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [shutil.which("prometheus") or "prometheus", f"--config.file={config}",
             f"--storage.tsdb.path={root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 60
        while not self._get("/-/ready", quiet=True):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"prometheus did not start: {(root / 'prometheus.log')}")
            time.sleep(0.5)

    def _get(self, path: str, *, quiet: bool = False) -> bytes | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
                return r.read()
        except OSError:
            if quiet:
                return None
            raise

    def query(self, expr: str) -> list:
        body = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        reply = json.loads(body or b"{}")
        assert reply.get("status") == "success", reply
        return reply["data"]["result"]

    def scraped(self) -> bool:
        targets = json.loads(self._get("/api/v1/targets") or b"{}")["data"]["activeTargets"]
        return bool(targets) and all(t["health"] == "up" for t in targets)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def observed(tiny_model, tmp_path_factory):
    if shutil.which("prometheus") is None:
        pytest.skip("no prometheus binary: bash scripts/backends/install.sh prometheus")
    root = tmp_path_factory.mktemp("metrics")
    store = root / "store"
    # A memory tier that holds a few blocks only: stores and promotions evict from it.
    config = {"tiers": [{"driver": "memory", "capacity": f"{8 * 32}KiB"},
                        {"driver": "posix", "path": str(store)}]}
    with Server(tiny_model, root, config, name="cold") as server:
        first = stream(server.client, server.model, "completion", DOCS[0])
        n_first = (first["prompt_tokens"] - 1) // BLOCK
        assert wait_stored(store, n_first) >= n_first
        first_files = block_files(store)
        rest = [stream(server.client, server.model, "completion", d) for d in DOCS[1:]]
        full = n_first + sum((r["prompt_tokens"] - 1) // BLOCK for r in rest)
        assert wait_stored(store, full) >= full
    for path in first_files:  # the first document's blocks: its load meets a corrupt block
        with open(path, "r+b") as f:
            f.seek(4096 + 64)  # inside the payload, after the block's 4 KiB header
            f.write(b"corrupt")
    with Server(tiny_model, root, config, name="warm") as server:
        prom = Prometheus(root, server.port)
        try:
            requests = [*DOCS, NEW, NEW + " " + words(50, 32)]  # hits, a corrupt one, misses
            warm = [stream(server.client, server.model, "completion", d) for d in requests]
            time.sleep(1.0)  # the last stores finish; the next step reports them
            stream(server.client, server.model, "completion", words(12, 33))
            end = time.monotonic() + 30
            while not prom.scraped() and time.monotonic() < end:
                time.sleep(0.5)
            time.sleep(3.0)  # a few scrapes after the last request
            samples = server.metrics()
            results = [(title, expr, prom.query(expr)) for title, expr in dashboard_queries()]
        finally:
            prom.stop()
    return {"warm": warm, "samples": samples, "results": results}


def test_every_dashboard_query_returns_data(observed):
    empty = [(title, expr) for title, expr, result in observed["results"] if not result]
    assert observed["results"] and not empty, empty


def test_ucm_series_in_the_servers_metrics(observed):
    m = observed["samples"]
    cached = [r["cached"] for r in observed["warm"]]
    print("warm cached tokens:", cached)
    print("\n".join(f"{n} {dict(ls)} {v}" for (n, ls), v in sorted(m.items())
                    if n.startswith("ucm_") and not n.endswith(("_bucket", "_created"))))
    first = (observed["warm"][0]["prompt_tokens"] - 1) // BLOCK
    assert metric_sum(m, "ucm_errors_total", tier="posix", op="load", kind="corrupt") == first
    assert metric_sum(m, "ucm_connector_blocks_total", op="load", result="corrupt") == first
    # vLLM counts the first document's tokens as cached (claimed), though they recomputed
    loaded = metric_sum(m, "ucm_connector_blocks_total", op="load", result="ok")
    assert loaded == sum(cached[1:]) // BLOCK and loaded > 0
    assert metric_sum(m, "ucm_loaded_bytes_total", tier="posix") > 0
    assert metric_sum(m, "ucm_stored_blocks_total") > 0
    assert metric_sum(m, "ucm_lookup_hits_total", tier="posix") > 0
    assert metric_sum(m, "ucm_lookup_keys_total", tier="posix") > \
        metric_sum(m, "ucm_lookup_hits_total", tier="posix")  # the new prompts missed
    assert metric_sum(m, "ucm_evictions_total", tier="memory") > 0
    assert metric_sum(m, "ucm_event_duration_seconds_count", type="load") >= 2
    assert metric_sum(m, "ucm_event_duration_seconds_count", type="store") >= 1
    assert metric_sum(m, "ucm_tier_capacity_bytes", tier="memory") == 8 * 32 * 1024
    inbox = [dict(labels) for (name, labels) in m if name == "ucm_inbox_depth"]
    assert inbox and {"engine", "model_name"} <= set(inbox[0])  # vLLM's labels too
