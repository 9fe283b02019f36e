"""`ucm bench pd` without engines: its argument checks, percentiles, CPU split and table."""

from __future__ import annotations

import pytest

from ucm.bench.pd import Figures, _cpus, _pct, _print, main


@pytest.mark.parametrize(("argv", "message"), [
    (["--decodes", "0"], "--decodes must be at least 1"),
    (["--long-every", "0"], "--long-every must be > 0"),
    (["--long-tokens", "5000"], "must fit --max-model-len"),
    (["--short-tokens", "4000", "--gen", "200"], "must fit --max-model-len"),
])
def test_bad_arguments_stop_with_the_option_named(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_one_cpu_cannot_be_split():
    with pytest.raises(SystemExit, match="at least 2 CPUs"):
        _cpus("0")
    assert _cpus("3,5") == [3, 5]


def test_percentiles_in_milliseconds():
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert _pct(values, 0.5) == pytest.approx(51)
    assert _pct(values, 0.99) == pytest.approx(100)
    assert _pct([], 0.5) != _pct([], 0.5)  # nan: no requests, no figure


def test_table_prints_both_setups_and_their_ratio(capsys):
    import argparse

    args = argparse.Namespace(short_tokens=256, gen=32, concurrency=2, long_tokens=2048,
                              long_every=2.0)
    col = Figures(ttft=[0.2, 0.4], itl=[0.05] * 10, long_ttft=[1.0], long_sent=3)
    dis = Figures(ttft=[0.1, 0.2], itl=[0.02] * 10, long_ttft=[1.5], long_sent=3,
                  errors=["decode: status 500"])
    _print({"colocated": col, "disagg": dis}, args)
    out = capsys.readouterr().out
    assert "colocated" in out and "disagg" in out
    assert "decode: status 500" in out
    ratio_line = next(line for line in out.splitlines() if line.startswith("disagg/col."))
    assert "0.50x" in ratio_line and "0.40x" in ratio_line and "1.50x" in ratio_line


def test_hit_ttft_arguments_and_line(capsys):
    import argparse

    from ucm.bench.pd import _print_hits

    with pytest.raises(SystemExit):
        main(["--hit-tokens", "5000"])
    assert "--hit-tokens and 2 generated tokens must fit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--settle", "-1"])
    assert "must be at least 0" in capsys.readouterr().err
    _print_hits({"consumer": [0.110, 0.120, 0.130], "colocated": [0.100, 0.125, 0.120]},
                argparse.Namespace(hit_tokens=4000))
    out = capsys.readouterr().out
    assert "decode instance TTFT 120.0 ms, colocated ucm hit 120.0 ms" in out
    assert "median +10.0 ms (min -5.0, max +10.0)" in out


def test_a_server_process_is_waited_for_and_stopped_with_its_group(tmp_path):
    import os
    import sys

    from ucm.bench.processes import ServerProcess, free_port

    port = free_port()
    server = ServerProcess("http.server", [sys.executable, "-m", "http.server", str(port),
                                           "--bind", "127.0.0.1"], dict(os.environ),
                           str(tmp_path / "http.log"), port, health="/", timeout=60)
    assert server.proc.poll() is None
    server.stop()
    assert server.proc.poll() is not None
    with pytest.raises(RuntimeError, match=r"quitter did not start; see .*quit\.log"):
        ServerProcess("quitter", [sys.executable, "-c", "pass"], dict(os.environ),
                      str(tmp_path / "quit.log"), free_port(), timeout=60)
