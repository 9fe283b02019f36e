"""Miss-ratio curves: the estimator against the simulator's exact curve, and the readers
(`ucm tune --mrc`, `ucm tune --live`, `ucm-trace mrc`)."""

from __future__ import annotations

import json
import random

import pytest

from ucm.autotune._cli import main as tune_main
from ucm.autotune._mrc import capacity_for, exact_curve, hit_at, sampled_curve
from ucm.autotune._traces import Request
from ucm.bench.policy import chat_trace, zipf_trace

CAPACITIES = (500, 2000, 5000, 10000)


def _synthetic(make, n: int = 60_000) -> list[Request]:
    return [Request((k.to_bytes(8, "little", signed=True),))
            for k in make(n, 20_000, random.Random(7))]


@pytest.mark.parametrize("policy", ["lru", "shadow"])
@pytest.mark.parametrize("make", [zipf_trace, chat_trace], ids=["zipf", "chat"])
def test_the_estimate_is_within_two_points_of_the_exact_curve(make, policy):
    requests = _synthetic(make)
    exact = exact_curve(requests, policy, CAPACITIES)
    estimate, mrc = sampled_curve(requests, policy, CAPACITIES, rate=0.1)
    assert mrc.sampled[-1] < mrc.accesses / 4  # the largest capacity sampled
    for (capacity, got), (_, want) in zip(estimate, exact, strict=True):
        assert abs(got - want) <= 0.02, (capacity, got, want)


def test_questions_interpolate_and_never_extrapolate():
    curve = [(100.0, 0.1), (200.0, 0.3), (400.0, 0.5)]
    assert capacity_for(curve, 0.2) == pytest.approx(150)
    assert capacity_for(curve, 0.05) == 100
    assert capacity_for(curve, 0.6) is None
    assert hit_at(curve, 300) == pytest.approx(0.4)
    assert hit_at(curve, 50) is None and hit_at(curve, 500) is None


def _jsonl(path, requests: int = 400) -> None:
    rng = random.Random(3)
    chains = [[0, *range(1000 * c + 1, 1000 * c + 6)] for c in range(40)]
    with open(path, "w") as fh:
        for _ in range(requests):
            chain = rng.choice(chains)
            chain.append(chain[-1] + 1)  # the next turn grows the conversation
            fh.write(json.dumps({"timestamp": 0, "hash_ids": chain}) + "\n")


def test_tune_mrc_answers_and_writes_the_curve(tmp_path, capsys):
    trace, out = tmp_path / "t.jsonl", tmp_path / "curve.json"
    _jsonl(trace)
    assert tune_main(["--mrc", "--trace", str(trace), "--policy", "lru", "--exact",
                      "--capacities", "50,100,400", "--hit", "0.5", "--at", "75",
                      "--block-bytes", "1024", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    from ucm.autotune._traces import read_jsonl

    exact = exact_curve(read_jsonl(trace), "lru", (50, 100, 400))
    assert doc == {"policy": "lru", "block_bytes": 1024,
                   "curve": [[int(c), round(h, 6)] for c, h in exact]}
    assert "capacity for hit ratio 0.5:" in text and "hit ratio at 75 blocks" in text


@pytest.mark.parametrize("argv, message", [
    (["--mrc", "--trace", "MISSING"], "No such file"),
    (["--mrc", "--trace", "EMPTY"], "no requests"),
    (["--mrc", "--trace", "NOTJSON"], "not JSON"),
    (["--live", "ftp://x"], "not an http"),
])
def test_bad_input_names_the_problem(tmp_path, capsys, argv, message):
    (tmp_path / "EMPTY").write_text("")
    (tmp_path / "NOTJSON").write_text("{nope\n")
    argv = [str(tmp_path / a) if a in ("MISSING", "EMPTY", "NOTJSON") else a for a in argv]
    assert tune_main(argv) == 2
    assert message in capsys.readouterr().err


def test_tune_live_reads_a_running_kernels_metrics(tmp_path, capsys):
    prometheus_client = pytest.importorskip("prometheus_client")
    from ucm.kernel import Kernel, Store
    from ucm.trace.metrics import MetricsSink, serve_metrics

    block = 4096
    config = {"tiers": [{"driver": "memory", "capacity": 64 * block}], "eviction": "lru",
              "mrc": {"sample_rate": 1.0, "capacities": [16 * block, 64 * block]}}
    registry = prometheus_client.CollectorRegistry()
    server = serve_metrics(0, registry=registry)
    out = tmp_path / "live.json"
    try:
        with Kernel(config) as kernel:
            MetricsSink(registry).watch(kernel)
            keys = [bytes([7, i]) * 8 for i in range(32)]
            for _ in range(2):  # 32 blocks twice: 16 blocks never hit, 64 hit every second
                kernel.submit(Store(keys, buffers=[bytes(block)] * 32)).result(10)
            snapshot = kernel.statistics()["tier.memory.mrc"]
            url = f"http://127.0.0.1:{server.server_port}"
            assert tune_main(["--live", url, "--hit", "0.4", "--json", str(out)]) == 0
    finally:
        server.shutdown()
    size = snapshot["block_bytes"]
    assert size >= block
    doc = json.loads(out.read_text())
    assert doc["policy"] == "lru" and doc["block_bytes"] == round(size)
    assert [h for _, h in doc["curve"]] == [0.0, 0.5]
    assert [c for c, _ in doc["curve"]] == pytest.approx([16 * block / size, 64 * block / size])
    assert "memory: lru, live /metrics" in capsys.readouterr().out


def test_ucm_trace_mrc_reads_a_trace_directory(tmp_path, capsys):
    from ucm.tools.trace_cli import main as trace_main

    from ucm.kernel import Kernel, Lookup

    config = {"tiers": [{"driver": "memory"}], "trace": {"path": str(tmp_path / "trace")}}
    chains = [[bytes([c, i]) * 8 for i in range(6)] for c in range(5)]
    requests = []
    with Kernel(config) as kernel:
        for turn in range(4):
            for chain in chains:
                keys = chain[:3 + turn]
                kernel.submit(Lookup(keys)).result(10)
                requests.append(Request(tuple(k[:8] for k in keys)))
    assert trace_main(["mrc", str(tmp_path / "trace"), "--exact", "--policy", "lru",
                       "--capacities", "4,100", "--json", str(tmp_path / "c.json")]) == 0
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["curve"] == [[c, round(h, 6)] for c, h in
                            ((int(c), h) for c, h in exact_curve(requests, "lru", (4, 100)))]
    assert doc["curve"][1][1] > 0.5
    assert trace_main(["mrc", str(tmp_path / "nothing")]) == 2
    assert "ucm-trace:" in capsys.readouterr().err


def test_bench_mrc_accuracy_takes_the_workloads_and_their_length(capsys):
    from ucm.bench.mrc import main as bench_mrc

    assert bench_mrc(["--accuracy", "--workloads", "zipf,chat", "--synthetic-refs", "3000",
                      "--policies", "lru", "--seeds", "1"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert [row.split()[0] for row in rows] == ["zipf", "chat"]  # no trace row
    assert "(3000 references)" in rows[0]
    assert 0 < int(rows[1].split("(")[1].split()[0]) <= 3000  # chat's count is its own
    with pytest.raises(SystemExit):
        bench_mrc(["--accuracy", "--workloads", "zipf,nope"])
