"""`ucm bench vllm`'s arithmetic, without engines: the raw read baseline and the table."""

from __future__ import annotations

import pytest

from ucm.bench.vllm import Row, _drop_bulk, _print_table, _prompts, _raw_read_bandwidth, main


def test_raw_read_reads_as_many_files_as_the_kv_needs(tmp_path):
    paths = []
    for i in range(6):
        path = tmp_path / f"{i}.blk"
        path.write_bytes(bytes([i]) * 8192)
        paths.append(str(path))
    bandwidth, total = _raw_read_bandwidth(paths, 4 * 8192)
    assert total == 4 * 8192 and bandwidth > 0


def test_table_reports_overheads_ratios_and_load_bandwidth(capsys):
    rows = {"example": {4096: Row(220.0, 200.0, 20.0, None, None)},
            "ucm-posix": {4096: Row(208.0, 200.0, 8.0, 7.5, 2.5)},
            "ucm-shm": {4096: Row(212.0, 199.0, 12.0, 9.0, 9.0)}}
    miss = {"recompute": {4096: 4000.0}, "ucm": {4096: 4080.0}, "null": {4096: 4040.0}}
    _print_table([4096], miss, rows, {4096: 64 * 2**20}, 8 * 2**30, 64 * 2**20)
    out = capsys.readouterr().out
    assert "ucm-posix overhead / example overhead = 0.40" in out
    assert "ucm-shm overhead / example overhead = 0.60" in out
    assert "ucm-posix effective load bandwidth 7.81 GiB/s" in out
    assert "ucm-posix load 7.5 ms (8.33 GiB/s), the step waited 2.5 ms of it" in out
    assert "64 MiB of KV" in out
    assert "overhead +2.0% (target <= 5%)" in out
    assert "null connector) 4040 ms (+1.0%), ucm over it +1.0%" in out


def test_prompts_are_whole_blocks_plus_the_tail_and_all_differ():
    prompts = _prompts([256, 512], 2, 3, 10)
    assert [len(p) for p in prompts[256]] == [258] * 3
    assert [len(p) for p in prompts[512]] == [514] * 3
    firsts = {tuple(p[:128]) for ps in prompts.values() for p in ps}
    assert len(firsts) == 6  # no two prompts share a first block
    assert _prompts([256], 2, 3, 10) == {256: prompts[256]}  # seeded: the same every run


@pytest.mark.parametrize("argv, message", [
    (["--tail", "1"], "--tail 1 makes ExampleConnector miss"),
    (["--tail", "-1"], "--tail must be 0 or more"),
])
def test_bad_tails_are_refused_before_any_engine_starts(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_table_labels_lengths_with_their_tail(capsys):
    rows = {"ucm-shm": {4096: Row(37.0, 30.0, 7.0, 5.1, 5.1)}}
    _print_table([4096], {"recompute": {4096: 4000.0}}, rows, {4096: 64 * 2**20}, 0.0, 0,
                 tail=2)
    out = capsys.readouterr().out
    assert "4096+2 tok" in out and "4096+2 tokens: " in out


def test_a_temporary_work_directory_keeps_only_the_engines_log(tmp_path):
    (tmp_path / "engines.log").write_text("engine output")
    (tmp_path / "ucm-store" / "ab").mkdir(parents=True)
    (tmp_path / "ucm-store" / "ab" / "x.blk").write_bytes(b"x" * 4096)
    (tmp_path / "model").mkdir()
    (tmp_path / "stray").write_bytes(b"y")
    _drop_bulk(str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["engines.log"]
    assert (tmp_path / "engines.log").read_text() == "engine output"


@pytest.fixture
def engine_specs(monkeypatch) -> list:
    """Engines replaced by a recorder (they are what the other vLLM tests run): the specs the
    bench started them with, in order; each phase takes 10 ms."""
    import ucm.bench.engines as engines
    import ucm.bench.vllm as bench

    specs = []

    def fake_run(spec, phases, **_):
        specs.append(spec)
        return {"phases": [{"name": p.name, "wall_s": [0.01], "worker_delta": {}}
                           for p in phases], "allocator": "glibc"}

    monkeypatch.setattr(engines, "run_in_subprocess", fake_run)
    monkeypatch.setattr(bench, "build_model", lambda path, spec: path)
    return specs


def test_all_miss_engines_run_next_to_their_baselines_in_turn(tmp_path, engine_specs, capsys):
    """The engine order: recompute and null right before ucm-posix's store pass, then further
    all-miss / recompute pairs in alternating order."""
    assert main(["--lengths", "256", "--repeat", "1", "--rounds", "1", "--miss-engines", "3",
                 "--setups", "null,ucm-posix", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    engines = [line.split("] ", 1)[1].rsplit(":", 1)[0] for line in out.splitlines()
               if line.endswith(": fresh engine process")]
    assert engines == ["recompute", "null connector", "ucm-posix store pass", "ucm-posix",
                       "all-miss (2)", "recompute (2)", "recompute (3)", "all-miss (3)"]
    assert "all-miss 256+2 tokens: no connector 10 ms, ucm on 10 ms, overhead +0.0%" in out
    assert "engine processes' malloc: glibc (vLLM on CPU asks for tcmalloc" in out


@pytest.mark.parametrize(("flag", "direct"), [([], True), (["--direct-writes"], True),
                                             (["--no-direct-writes"], False)])
def test_direct_writes_reach_every_posix_tier_and_nothing_else(tmp_path, engine_specs, flag,
                                                              direct):
    assert main(["--lengths", "256", "--repeat", "1", "--rounds", "1", "--miss-engines", "2",
                 "--setups", "ucm-posix,ucm-shm", "--workdir", str(tmp_path), *flag]) == 0
    tiers = [t for spec in engine_specs for t in (spec.ucm or {}).get("tiers", [])]
    posix = [t for t in tiers if t["driver"] == "posix"]
    assert len(posix) == 3  # store pass, hits, one more all-miss engine
    assert all(t.get("direct_writes", False) == direct for t in posix)
    assert all("direct_writes" not in t for t in tiers if t["driver"] != "posix")


def test_runs_store_afresh_and_report_each_setups_distribution(tmp_path, engine_specs, capsys):
    """`--runs 3`: three whole runs, each its own store directory, then each setup's overhead
    in every run with min / median / max and how many runs held 10 ms."""
    assert main(["--lengths", "256", "--repeat", "1", "--rounds", "1", "--miss-engines", "1",
                 "--setups", "ucm-posix,ucm-shm", "--workdir", str(tmp_path),
                 "--runs", "3"]) == 0
    out = capsys.readouterr().out
    stores = {t["path"] for spec in engine_specs for t in (spec.ucm or {}).get("tiers", [])
              if t["driver"] == "posix"}
    assert stores == {str(tmp_path / f"run{k}" / "ucm-store") for k in (1, 2, 3)}
    assert out.count("] run ") == 3 and "overhead over vLLM's own hit (ms) in each of 3" in out
    # The recorder's phases all take 10 ms: every pair differs by 0.
    assert ("ucm-posix          256 tok:    0.0    0.0    0.0   min 0.0 median 0.0 max 0.0; "
            "<= 10 ms in 3 of 3 runs") in out
    assert "ucm-shm" in out.rsplit("in each of 3", 1)[1]


def test_runs_must_be_one_or_more(capsys):
    with pytest.raises(SystemExit):
        main(["--runs", "0"])
    assert "--runs must be 1 or more" in capsys.readouterr().err


def test_batch_table_holds_each_overhead_to_its_memcpy_limit(capsys):
    from ucm.bench.vllm import BatchRow, _print_batches

    rows = [BatchRow("ucm-shm", 4096, 4, 74.0, 49.0, 24.0, 256 * 2**20, 20.0),
            BatchRow("example", 4096, 4, 119.0, 49.0, 70.0, 256 * 2**20, 20.0)]
    assert rows[0].limit == rows[1].limit == 30.0  # 1.25 x 20 + 5
    _print_batches(rows, tail=2)
    lines = [line.split() for line in capsys.readouterr().out.splitlines()[3:]]
    assert lines[0] == ["ucm-shm", "4096+2", "4", "256", "74.0", "49.0", "24.0", "20.0", "1.20",
                        "30.0", "yes"]
    assert lines[1][0] == "example" and lines[1][-3:] == ["3.50", "30.0", "NO"]


def test_batch_sizes_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["--batch", "0,4"])
    assert "--batch takes batch sizes of 1 or more" in capsys.readouterr().err


def test_a_batch_rounds_loads_read_from_the_workers_counters():
    from ucm.bench.vllm import _load_round

    delta = {"load_events": 1, "load_blocks": 512, "early_loads": 1, "load_ns": 89_400_000,
             "load_wait_ns": 78_200_000}
    assert _load_round(delta) == "1 loads of 512 blocks (1 early) 89 ms, waited 78"
    assert _load_round({}) == "0 loads of 0 blocks (0 early) 0 ms, waited 0"
