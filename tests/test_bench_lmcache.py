"""`ucm bench vllm --batch`'s lmcache setup without an engine: its arguments, the message when
LMCache's venv is missing, and the LMCache server's start and cleanup (a real `lmcache
server` where .venv-lmcache is built: scripts/lmcache/setup.sh)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from ucm.bench.lmcache_server import (
    SETUP_SCRIPT,
    LMCacheMissing,
    LMCacheServer,
    lmcache_env,
    lmcache_venv,
)
from ucm.bench.vllm import main


def test_a_missing_venv_names_the_script_that_builds_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("UCM_LMCACHE_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(SystemExit):
        main(["--batch", "1,4", "--lengths", "1536", "--setups", "ucm-shm,lmcache",
              "--workdir", str(tmp_path / "work")])
    err = capsys.readouterr().err
    assert f"bash {SETUP_SCRIPT}" in err and str(tmp_path / "no-venv") in err
    assert not (tmp_path / "work").exists()  # refused before anything was built or started


def test_the_venv_flag_comes_before_the_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("UCM_LMCACHE_VENV", str(tmp_path / "env-venv"))
    with pytest.raises(SystemExit):
        main(["--batch", "1", "--setups", "lmcache", "--lmcache-venv", str(tmp_path / "flag")])
    err = capsys.readouterr().err
    assert str(tmp_path / "flag") in err and "env-venv" not in err


def test_a_venv_without_lmcache_is_refused_by_name(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    with pytest.raises(LMCacheMissing, match=r"bin/lmcache is not there"):
        lmcache_venv(tmp_path)
    (tmp_path / "bin" / "lmcache").touch()
    assert lmcache_venv(tmp_path) == tmp_path


def test_lmcache_runs_with_batch_only(capsys):
    with pytest.raises(SystemExit):
        main(["--setups", "example,lmcache"])
    assert "the lmcache setup runs with --batch only" in capsys.readouterr().err


def test_lmcaches_scratch_files_stay_in_the_work_directory(tmp_path):
    env = lmcache_env({"PATH": "/bin"}, str(tmp_path))
    assert env["PATH"] == "/bin" and env["LMCACHE_TRACK_USAGE"] == "false"
    for key in ("HOME", "TMPDIR", "PROMETHEUS_MULTIPROC_DIR"):
        assert env[key].startswith(str(tmp_path)) and os.path.isdir(env[key])


def _venv() -> Path:
    try:
        return lmcache_venv()
    except LMCacheMissing as e:
        pytest.skip(str(e))


def test_a_server_killed_mid_run_leaves_no_process_and_no_segment(tmp_path):
    server = LMCacheServer(_venv(), str(tmp_path), l1_gb=0.25)
    with pytest.raises(RuntimeError, match="the bench failed"), server:
        assert server.running() and os.path.exists(server.shm_path)
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
        pid = server._proc.pid  # type: ignore[union-attr]
        # killed with its resource tracker, nothing of the server unlinks its L1 segment
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert os.path.exists(server.shm_path)
        raise RuntimeError("the bench failed")
    assert not server.running() and not os.path.exists(server.shm_path)
    deadline = time.monotonic() + 10  # its killed children are reaped by init, not by us
    while _group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _group_alive(pid)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class _BadFlag(LMCacheServer):
    def command(self) -> list[str]:
        return [*super().command(), "--no-such-flag"]


def test_a_server_that_dies_at_start_is_reported_with_its_log(tmp_path):
    server = _BadFlag(_venv(), str(tmp_path), l1_gb=0.25)
    with pytest.raises(RuntimeError, match=r"exited with 2 before it was ready(.|\n)*"
                                           r"no-such-flag"):
        server.__enter__()
    assert not server.running() and not os.path.exists(server.shm_path)


def test_the_batch_bench_runs_lmcaches_engines_in_its_venv_beside_its_server(tmp_path,
                                                                              monkeypatch,
                                                                              capsys):
    """Engines replaced by a recorder (the vLLM tests run real ones), the server real: both
    lmcache engines get the venv's python, the server's address and LMCache's environment
    while the server is up; it is gone, with its segment, when the bench returns."""
    import ucm.bench.engines as engines
    import ucm.bench.vllm as bench

    venv = _venv()
    seen = []

    def fake_run(spec, phases, *, python=None, env=None, **_):
        port = spec.extra["lmcache.mp.port"]
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # the server is up
        seen.append((spec.connector, spec.prefix_caching, python, env, port))
        return {"phases": [{"name": p.name, "wall_s": [0.01], "worker_delta": {},
                            "num_cached_tokens": [len(x) - 2 for x in p.prompts]}
                           for p in phases], "allocator": "glibc"}

    monkeypatch.setattr(engines, "run_in_subprocess", fake_run)
    monkeypatch.setattr(bench, "build_model", lambda path, spec: path)
    assert main(["--batch", "1,2", "--lengths", "256", "--rounds", "1", "--setups", "lmcache",
                 "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert [(c, pc) for c, pc, *_ in seen] == [("lmcache", False), ("lmcache", True)]
    assert {python for _, _, python, _, _ in seen} == {str(venv / "bin" / "python")}
    assert all(env["LMCACHE_TRACK_USAGE"] == "false" for *_, env, _ in seen)
    assert "partial hit" not in out and "lmcache: LMCache 0.5.6 in its multi-process" in out
    assert len([line for line in out.splitlines() if line.startswith("lmcache ")]) == 2
    shm = out.split(" in /dev/shm/", 1)[1].split(",", 1)[0]
    assert not os.path.exists(f"/dev/shm/{shm}")
    assert "cache server is running" in (tmp_path / "lmcache" / "lmcache-server.log").read_text()
