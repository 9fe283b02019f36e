"""Hosts that look like a cluster for the tests: scripts/backends/cluster.sh builds host
namespaces and a storage namespace on one bridged LAN with shaped links; the storage servers
run in the storage namespace (the project's start_* scripts); each host is a process with its
own kernel in its own namespace (`_cluster_host.py`), driven over stdin/stdout.

Namespace names, addresses and ports are the tests' own (prefix `ucmt`, 10.89.0.0/24), so
`cluster.sh` runs by hand (prefix `ucmc`) and the other backend tests run beside them.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from ._mooncake_nfs import REPO, RUN_ROOT, SCRIPTS, run_script

HOST_SCRIPT = Path(__file__).with_name("_cluster_host.py")
BACKENDS = ("mooncake", "s3", "nfs", "redis")
ACCESS_KEY, SECRET_KEY, PASSWORD = "ucmtest", "ucmtest-secret", "ucmtest-redis"


class Host:
    """One host process: a kernel on `tier` in namespace `ns`. Answers are read by a thread
    into a queue, so a host that stops answering fails the test instead of hanging it."""

    def __init__(self, ns: str, tier: dict[str, Any]) -> None:
        env = {k: v for k, v in os.environ.items() if k != "MC_TCP_BIND_ADDRESS"}
        env.update(PYTHONPATH=str(REPO), MC_LOG_LEVEL="ERROR")
        self.ns = ns
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(HOST_SCRIPT), json.dumps(tier)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.answers: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.answer(120) == {"ready": True}, f"host in {ns} did not start"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.answers.put(line)
        self.answers.put(None)

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def answer(self, wait: float = 120) -> dict[str, Any]:
        try:
            line = self.answers.get(timeout=wait)
        except queue.Empty:
            raise AssertionError(f"host in {self.ns} gave no answer in {wait} s") from None
        assert line is not None, f"host in {self.ns} exited (rc {self.proc.wait()})"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def call(self, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.answer()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="quit")
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


class Cluster:
    """`hosts` host namespaces and the storage namespace; servers start on first use."""

    def __init__(self, hosts: int = 2, *, prefix: str = "ucmt", net: str = "10.89.0",
                 link: str = "10gbit:0.1ms") -> None:
        self.hosts, self.prefix, self.net, self.link = hosts, prefix, net, link
        self.run_dir = RUN_ROOT / f"cluster-{prefix}"
        self.env = dict(os.environ, CLUSTER_PREFIX=prefix, CLUSTER_NET=net,
                        CLUSTER_RUN_DIR=str(self.run_dir),
                        MC_RPC_PORT="50461", MC_META_PORT="8491", MC_METRICS_PORT="9461",
                        MC_CLIENT_TTL="2", MC_LEASE_TTL_MS="500",
                        S3_PORT="8463", WEED_PORT_BASE="9463", S3_ACCESS_KEY=ACCESS_KEY,
                        S3_SECRET_KEY=SECRET_KEY, NFS_PORT="20460", REDIS_PORT="6460",
                        REDIS_PASSWORD=PASSWORD, UCM_VENV=str(Path(sys.executable).parents[1]),
                        WEED_BIN=str(Path(sys.executable).with_name("weed")))
        self.servers: set[str] = set()
        self.running: list[Host] = []

    @property
    def server(self) -> str:
        return f"{self.net}.1"

    def ns(self, host: int) -> str:
        return f"{self.prefix}-h{host}" if host else f"{self.prefix}-s"

    def address(self, host: int) -> str:
        return f"{self.net}.{10 + host}"

    def script(self, *args: str, **env: str) -> str:
        return run_script("cluster.sh", {**self.env, **env}, *args, timeout=120)

    def up(self) -> None:
        self.script("down")  # what a crashed session left
        self.script("up", str(self.hosts), "--link", self.link)

    def down(self) -> None:
        for host in self.running:
            host.kill()
        self.script("down")

    def start(self, backend: str, **env: str) -> None:
        if backend not in self.servers:
            self.script("servers", "start", backend, **env)
            self.servers.add(backend)

    def stop(self, backend: str, **env: str) -> None:
        self.servers.discard(backend)
        self.script("servers", "stop", backend, **env)

    def kill_s3(self) -> None:
        """SIGKILL SeaweedFS, keeping its data: `start("s3", WEED_KEEP="1")` brings it back."""
        os.kill(int((self.run_dir / "run" / "weed-8463.pid").read_text()), signal.SIGKILL)
        run_script("stop_seaweedfs.sh", {**self.env, "UCM_RUN_DIR": str(self.run_dir / "run"),
                                         "UCM_DATA_DIR": str(self.run_dir / "data")})
        self.servers.discard("s3")

    def cut(self, host: int) -> None:
        self.script("cut", str(host))

    def heal(self, host: int) -> None:
        self.script("heal", str(host))

    def tier(self, backend: str, host: int, *, lend: str = "64MiB") -> dict[str, Any]:
        """Tier options for a kernel in `host`'s namespace; `lend`: the Mooncake segment this
        host contributes to the pool."""
        srv = self.server
        if backend == "mooncake":
            return {"driver": "mooncake", "master": f"{srv}:50461",
                    "metadata": f"http://{srv}:8491/metadata",
                    "local_hostname": self.address(host), "segment_bytes": lend,
                    "staging_bytes": "32MiB"}
        if backend == "s3":
            return {"driver": "s3", "bucket": "ucm", "endpoint": f"http://{srv}:8463",
                    "prefix": "cluster", "access_key_id": ACCESS_KEY,
                    "secret_access_key": SECRET_KEY}
        if backend == "nfs":
            return {"driver": "nfs", "url": f"nfs://{srv}:20460/export?version=4.1",
                    "root": "ucm-cluster", "timeout": 5.0}
        if backend == "redis":
            return {"driver": "redis", "url": f"redis://{srv}:6460/0", "password": PASSWORD,
                    "prefix": "cluster"}
        raise ValueError(f"unknown backend {backend!r}")

    def host(self, host: int, backend: str, **tier: Any) -> Host:
        self.start(backend)
        proc = Host(self.ns(host), self.tier(backend, host, **tier))
        self.running.append(proc)
        return proc


__all__ = ["BACKENDS", "SCRIPTS", "Cluster", "Host"]
