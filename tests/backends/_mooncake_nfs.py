"""Real servers for the mooncake and nfs tests, started by scripts/backends/, and the
storage-side hooks the contract suite uses on them.

- `Ganesha`: nfs-ganesha (NFSv4.1, VFS export of a local directory) on 127.0.0.1:20490. The
  export is a local directory, so hooks corrupt blocks by editing the exported files.
- `Mooncake`: metadata server + mooncake_master + a segment holder, all inside a lo-only
  network namespace (Mooncake clients listen on every interface). Clients must run in that
  namespace too: tests start them with `ip netns exec` (`Mooncake.python_cmd`). With `host`,
  the store binds an address on a private LAN instead, which clients in other namespaces reach.

A server that cannot start raises ServerError with the script's output and log tail: the test
that needed it fails (CI installs every backend), it is never skipped.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "backends"
RUN_ROOT = Path(os.environ.get("UCM_TEST_BACKENDS", "/tmp/ucm-backends/test"))
NFS_PORT = 20490
MC_RPC_PORT, MC_META_PORT, MC_METRICS_PORT = 50151, 8180, 9103
MC_NETNS = "ucm-mc-test"


class ServerError(RuntimeError):
    pass


def run_script(name: str, env: dict[str, str], *args: str, timeout: float = 60) -> str:
    done = subprocess.run(["bash", str(SCRIPTS / name), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise ServerError(f"{name} failed (rc {done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout


def scratch_dir(where: Path) -> str:
    """A directory name unique to one test (its tmp_path), stable across calls."""
    return "t-" + hashlib.blake2b(str(where).encode(), digest_size=8).hexdigest()


# --- NFS ---------------------------------------------------------------------------------------


class Ganesha:
    def __init__(self, port: int = NFS_PORT, *, netns: str | None = None,
                 host: str = "127.0.0.1") -> None:
        self.port = port
        self.host = host
        self.run_dir = RUN_ROOT / f"nfs-{port}"
        self.export = self.run_dir / "export"
        self.env = dict(os.environ, NFS_PORT=str(port), NFS_EXPORT_DIR=str(self.export),
                        UCM_RUN_DIR=str(self.run_dir), UCM_DATA_DIR=str(self.run_dir))
        if netns:
            self.env.update(NFS_NETNS=netns, NFS_HOST=host)
        self.running = False

    @property
    def url(self) -> str:
        return f"nfs://{self.host}:{self.port}/export?version=4.1"

    @property
    def pid(self) -> int:
        return int((self.run_dir / f"ganesha-{self.port}" / "ganesha.pid").read_text())

    def start(self) -> None:
        run_script("stop_nfs.sh", self.env)
        run_script("start_nfs.sh", self.env)
        self.running = True

    def stop(self) -> None:
        if self.running:
            self.running = False
            run_script("stop_nfs.sh", self.env)

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def options(self, root: str, **extra: Any) -> dict[str, Any]:
        return {"url": self.url, "root": f"ucm-test/{root}", "timeout": 5.0, **extra}

    def local_path(self, nfs_path: str) -> Path:
        return self.export / nfs_path


_ganesha: Ganesha | None = None


def shared_ganesha() -> Ganesha:
    """The session's Ganesha, started on first use and stopped when the process exits."""
    global _ganesha
    if _ganesha is None:
        server = Ganesha()
        server.start()
        atexit.register(server.stop)
        _ganesha = server
    return _ganesha


def nfs_options(scratch: Any) -> dict[str, Any]:
    return shared_ganesha().options(scratch_dir(scratch.disk))


def nfs_roots(scratch: Any) -> list[Path]:
    """Where the contract namespace's blocks of this test live, as local paths."""
    server = shared_ganesha()
    return [server.local_path(f"ucm-test/{scratch_dir(scratch.disk)}/contract")]


def _nfs_file(driver: Any, key: bytes) -> Path:
    while hasattr(driver, "inner"):
        driver = driver.inner
    return shared_ganesha().local_path(driver.block_path(key))


def flip_nfs_byte(driver: Any, key: bytes) -> None:
    path = _nfs_file(driver, key)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(4096 + (size - 4096) // 2)
        byte = f.read(1)
        f.seek(4096 + (size - 4096) // 2)
        f.write(bytes([byte[0] ^ 0x40]))


def truncate_nfs_file(driver: Any, key: bytes) -> None:
    path = _nfs_file(driver, key)
    os.truncate(path, 4096 + (path.stat().st_size - 4096) // 2)


# --- Mooncake ----------------------------------------------------------------------------------


class Mooncake:
    """A Mooncake Store inside network namespace `netns` (created here if missing, lo only),
    bound to `host`: 127.0.0.1, or an address of `netns` that other namespaces reach (one
    that `netns.sh lan` gave it)."""

    def __init__(self, *, netns: str = MC_NETNS, rpc: int = MC_RPC_PORT,
                 meta: int = MC_META_PORT, metrics: int = MC_METRICS_PORT,
                 segment: str = "512 MB", lease_ms: int = 500, client_ttl: int = 5,
                 host: str = "127.0.0.1") -> None:
        self.netns = netns
        self.host = host
        self.rpc = rpc
        self.meta = meta
        self.run_dir = RUN_ROOT / f"mooncake-{rpc}"
        self.env = dict(os.environ, MC_RPC_PORT=str(rpc), MC_META_PORT=str(meta),
                        MC_METRICS_PORT=str(metrics), MC_NETNS=netns, MC_HOST=host,
                        MC_SEGMENT_SIZE=segment, MC_LEASE_TTL_MS=str(lease_ms),
                        MC_CLIENT_TTL=str(client_ttl), UCM_RUN_DIR=str(self.run_dir))
        self.running = False

    @property
    def options(self) -> dict[str, Any]:
        return {"master": f"{self.host}:{self.rpc}",
                "metadata": f"http://{self.host}:{self.meta}/metadata"}

    def pid(self, which: str = "master") -> int:
        return int((self.run_dir / f"mooncake-{self.rpc}" / f"{which}.pid").read_text())

    def start(self) -> None:
        run_script("netns.sh", self.env, "up", self.netns)
        run_script("stop_mooncake.sh", self.env)
        run_script("start_mooncake.sh", self.env)
        self.running = True

    def stop(self) -> None:
        if self.running:
            self.running = False
            run_script("stop_mooncake.sh", self.env)

    def signal(self, signum: int, which: str = "master") -> None:
        os.kill(self.pid(which), signum)

    def python_cmd(self, *args: str) -> list[str]:
        """A command line running this venv's Python inside the namespace."""
        return ["ip", "netns", "exec", self.netns, sys.executable, *args]

    def client_env(self, **extra: str) -> dict[str, str]:
        return dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", MC_LOG_LEVEL="ERROR",
                    PYTHONPATH=str(REPO), **extra)


def mooncake_from_env() -> dict[str, Any]:
    """Options for a mooncake driver in a pytest run that a test started inside the
    namespace (UCM_MOONCAKE_MASTER / UCM_MOONCAKE_METADATA)."""
    return {"master": os.environ["UCM_MOONCAKE_MASTER"],
            "metadata": os.environ["UCM_MOONCAKE_METADATA"], "staging_bytes": "64MiB"}


def mooncake_contract_enabled() -> bool:
    return "UCM_MOONCAKE_MASTER" in os.environ


async def flip_mooncake_byte(driver: Any, key: bytes) -> None:
    await _rewrite_object(driver, key, lambda b: b.__setitem__(
        4096 + (len(b) - 4096) // 2, b[4096 + (len(b) - 4096) // 2] ^ 0x40) or b)


async def truncate_mooncake_object(driver: Any, key: bytes) -> None:
    await _rewrite_object(driver, key, lambda b: b[: 4096 + (len(b) - 4096) // 2])


async def _rewrite_object(driver: Any, key: bytes, change: Any) -> None:
    import trio

    while hasattr(driver, "inner"):
        driver = driver.inner
    backend = driver.backend
    name = backend.name_of(key)

    def rewrite() -> None:
        body = bytearray(backend.client.get(name))
        assert body, "object missing"
        assert backend.client.upsert(name, bytes(change(body))) == 0

    await trio.to_thread.run_sync(rewrite)


def kill_quietly(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
