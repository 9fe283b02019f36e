"""The AutoTuner: model sizes, measured bandwidths, and a config never worse than a grid."""

from __future__ import annotations

import json

import pytest

from ucm.autotune import AutoTuner, kv_bytes_per_token
from ucm.autotune._tuner import GB, Candidate
from ucm.config import load_config


def bench_file(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps([
        {"driver": "memory", "op": "load", "block_bytes": 1 << 20, "concurrency": 8,
         "gbps": 10.0, "baseline_gbps": 10.0, "baseline": "x"},
        {"driver": "posix", "op": "load", "block_bytes": 1 << 20, "concurrency": 8,
         "gbps": 1.0, "baseline_gbps": 1.0, "baseline": "x"},
        {"driver": "posix", "op": "store", "block_bytes": 1 << 20, "concurrency": 8,
         "gbps": 0.5, "baseline_gbps": 0.5, "baseline": "x"}]))
    return path


def chat_tokens(n: int) -> list[list[int]]:
    import random

    rng = random.Random(1)
    sessions = [[s * 100_000 + i for i in range(32)] for s in range(10)]
    out = []
    fresh = 10**7
    for _ in range(n):
        if rng.random() < 0.3:
            out.append(list(range(fresh, fresh + 96)))
            fresh += 96
            continue
        s = rng.choice(sessions)
        s.extend(range(fresh, fresh + 32))
        fresh += 32
        out.append(list(s))
    return out


def test_kv_bytes_from_a_name_and_a_config_json(tmp_path):
    assert kv_bytes_per_token("llama-2-7b") == 2 * 32 * 32 * 128 * 2
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 8,
                               "num_key_value_heads": 2, "hidden_size": 512,
                               "torch_dtype": "bfloat16"}))
    assert kv_bytes_per_token(str(cfg)) == 2 * 4 * 2 * 64 * 2
    assert kv_bytes_per_token(str(cfg), tp=2) == 2 * 4 * 1 * 64 * 2
    with pytest.raises(ValueError, match="unknown model"):
        kv_bytes_per_token("no-such-model")


def test_the_one_line_call_probes_this_machine_and_caches_the_figures(tmp_path, capsys):
    from ucm.autotune._probe import cache_file

    def tuner() -> AutoTuner:  # the one line, with a tiny probe and a private cache
        return AutoTuner(workload="chat", constraints={"max_latency_ms": 100,
                                                       "max_memory_gb": 16},
                         cache_dir=tmp_path, probe_block_bytes=4096, probe_blocks=4)

    # A small model: the tiny probe's figures (per-call costs dominate 4 KiB blocks) must
    # leave every candidate within the latency bound whatever the machine's load.
    model = tmp_path / "config.json"
    model.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2,
                                 "hidden_size": 128, "torch_dtype": "float16"}))
    first = tuner()
    config = first.tune(model=str(model), sample_requests=chat_tokens(40))
    load_config(config)
    err = capsys.readouterr().err
    assert "probing memory load bandwidth (1/2" in err and "probing posix" in err
    assert first.bandwidth_source.startswith("measured this machine's load bandwidths")
    cached = json.loads(cache_file(tmp_path).read_text())
    assert set(cached["bandwidths"]) == {"memory", "posix"}
    assert min(cached["bandwidths"].values()) > 0
    assert not list((tmp_path / "autotune").glob("probe-*"))  # the scratch blocks are gone

    second = tuner()
    assert second.tune(model=str(model), sample_requests=chat_tokens(40)) == config
    assert "read from" in second.bandwidth_source and "probing" not in capsys.readouterr().err

    cache_file(tmp_path).write_text("{half")  # a damaged cache is measured again
    third = tuner()
    third.tune(model=str(model), sample_requests=chat_tokens(40))
    assert third.bandwidth_source.startswith("measured")


def test_the_tuned_config_beats_every_config_of_a_grid(tmp_path):
    sample = chat_tokens(300)
    constraints = {"max_memory_gb": 2.0, "max_latency_ms": 1000.0, "tiers": ["memory"]}
    tuner = AutoTuner(workload="chat", constraints=constraints, bench_json=bench_file(tmp_path),
                      progress=False)
    config = tuner.tune(model="llama-2-7b", sample_requests=sample)
    load_config(config)  # a valid ucm config
    assert tuner.best is not None and tuner.best.memory_gb <= 2.0
    assert config["tiers"][0]["capacity"] == tuner.best.candidate.memory_bytes
    # The grid: hand-picked memory sizes and every policy, replayed the same way.
    from ucm.autotune import from_token_lists

    requests = from_token_lists(sample, 16)
    block = kv_bytes_per_token("llama-2-7b") * 16
    bandwidths = {"memory": 10e9, "posix": 1e9}
    grid = [Candidate(int(gb * GB) // block * block, 0, e)
            for gb in (0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0) for e in ("lru", "s3fifo",
                                                                           "adaptive", "shadow")]
    assert len(grid) >= 20
    best = max(tuner.evaluate(requests, c, block, bandwidths).hit_ratio for c in grid)
    assert tuner.best.hit_ratio >= best
    report = tuner.report()
    assert report["hit_ratio"] == tuner.best.hit_ratio and report["eviction"] in (
        "lru", "s3fifo", "adaptive", "shadow")


def test_a_latency_budget_is_kept_and_a_disk_tier_is_weighed(tmp_path):
    sample = chat_tokens(200)
    tight = AutoTuner(constraints={"max_memory_gb": 0.05, "max_latency_ms": 1e-6,
                                   "max_disk_gb": 4.0}, bench_json=bench_file(tmp_path),
                      progress=False)
    tight.tune("llama-2-7b", sample)  # every hit costs time: only configs without hits fit
    assert tight.best is not None and tight.best.hit_ratio == 0.0
    tuner = AutoTuner(constraints={"max_memory_gb": 0.05, "max_disk_gb": 4.0},
                      bench_json=bench_file(tmp_path), progress=False)
    config = tuner.tune("llama-2-7b", sample)
    load_config(config)
    assert tuner.best is not None
    assert tuner.best.hit_ratio >= max(p.hit_ratio for p in tuner.predictions
                                       if p.candidate.disk_bytes == 0)


def test_bench_tune_vs_grid_prints_the_tuner_no_worse_than_24_configs(tmp_path):
    from ucm.bench.policy import main as policy_main

    trace = tmp_path / "chat.json"
    trace.write_text(json.dumps(chat_tokens(120)))
    out = tmp_path / "tvg.json"
    assert policy_main(["--trace", str(trace), "--tune-vs-grid", "--bench",
                        str(bench_file(tmp_path)), "--model", "llama-2-7b",
                        "--max-memory-gb", "2", "--max-disk-gb", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["grid"]) == 24
    assert len({json.dumps(p["candidate"], sort_keys=True) for p in data["grid"]}) == 24
    assert data["grid_best"] is not None
    assert data["tuner"]["hit_ratio"] >= data["grid_best"]["hit_ratio"]
    assert data["tuner"]["memory_gb"] <= 2


def test_bench_tune_vs_grid_needs_a_memory_constraint(tmp_path):
    from ucm.bench.policy import main as policy_main

    trace = tmp_path / "chat.json"
    trace.write_text(json.dumps(chat_tokens(10)))
    with pytest.raises(SystemExit):
        policy_main(["--trace", str(trace), "--tune-vs-grid", "--bench",
                     str(bench_file(tmp_path))])


def test_equal_hit_ratios_go_to_the_faster_load_then_to_less_memory():
    from ucm.autotune._tuner import Prediction, best_of

    def pred(hit: float, load_ms: float, memory: float) -> Prediction:
        return Prediction(candidate=Candidate(memory * GB, 1024 * GB, "shadow"), hit_ratio=hit,
                          bytes_loaded_per_request=0.0, load_ms_per_request=load_ms,
                          memory_gb=memory, disk_gb=1024.0)

    small_slow, big_fast, bigger_fast = pred(0.28, 157.0, 32), pred(0.28, 40.0, 256), \
        pred(0.28, 40.0, 512)
    assert best_of([small_slow, big_fast, bigger_fast]) is big_fast
    assert best_of([small_slow, pred(0.27, 1.0, 8)]) is small_slow  # hit ratio first


def test_a_latency_bound_between_two_disk_sizes_is_bisected(tmp_path):
    """With the bound between the load times of the half and the whole disk, the tuner
    replays disk sizes in between and keeps the largest that fits: it hits at least as often
    as every candidate of the first pass that fits."""
    sample = chat_tokens(200)
    base = {"max_memory_gb": 0.05, "max_disk_gb": 4.0}
    free = AutoTuner(constraints=dict(base), bench_json=bench_file(tmp_path), progress=False)
    free.tune("llama-2-7b", sample)
    best = free.best
    assert best is not None and best.candidate.disk_bytes == 4 * GB
    half = next(p for p in free.predictions
                if p.candidate == Candidate(best.candidate.memory_bytes, 2 * GB,
                                            best.candidate.eviction))
    # load_ms_per_request is predicted (hits x block bytes / bench_file's bandwidths): no clock
    assert half.load_ms_per_request < best.load_ms_per_request  # else the test shows nothing
    bound = (half.load_ms_per_request + best.load_ms_per_request) / 2
    tuner = AutoTuner(constraints={**base, "max_latency_ms": bound},
                      bench_json=bench_file(tmp_path), progress=False)
    tuner.tune("llama-2-7b", sample)
    assert tuner.best is not None and tuner.best.load_ms_per_request <= bound
    first_pass = tuner.predictions[:len(free.predictions)]
    assert tuner.best.hit_ratio >= max(p.hit_ratio for p in first_pass
                                       if p.fits(tuner.constraints))
    between = {p.candidate.disk_bytes for p in tuner.predictions[len(free.predictions):]}
    assert between and all(2 * GB < d < 4 * GB for d in between)
