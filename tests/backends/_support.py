"""Real backend servers for the tests, started by the project's own scripts in
scripts/backends/, and the storage-side hooks the contract suite uses on them.

A server that cannot start fails the test that needed it, with the script's output and the
server's log tail: CI installs every backend (scripts/backends/install.sh), so a missing one is
a broken machine, not a reason to skip. Test servers use their own ports and run directory, so
a developer's server on the default ports is left alone.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "backends"
RUN_ROOT = Path(os.environ.get("UCM_TEST_BACKENDS", "/tmp/ucm-backends/test"))
ACCESS_KEY, SECRET_KEY, BUCKET = "ucmtest", "ucmtest-secret", "ucm"


class ServerError(RuntimeError):
    pass


class SeaweedFS:
    """One `weed mini` with an S3 endpoint on `port`; start/stop through the scripts."""

    def __init__(self, port: int, port_base: int) -> None:
        self.port = port
        self.port_base = port_base
        self.run_dir = RUN_ROOT / f"weed-{port}"
        self.env = dict(os.environ, S3_PORT=str(port), WEED_PORT_BASE=str(port_base),
                        S3_ACCESS_KEY=ACCESS_KEY, S3_SECRET_KEY=SECRET_KEY, S3_BUCKET=BUCKET,
                        UCM_RUN_DIR=str(self.run_dir), UCM_DATA_DIR=str(self.run_dir / "data"))
        self.running = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return int((self.run_dir / f"weed-{self.port}.pid").read_text())

    def _script(self, name: str, **env: str) -> str:
        done = subprocess.run(["bash", str(SCRIPTS / name)], env={**self.env, **env},
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise ServerError(f"{name} failed (rc {done.returncode}):\n{done.stdout}"
                              f"{done.stderr}")
        return done.stdout

    def start(self, *, keep_data: bool = False) -> None:
        self._script("stop_seaweedfs.sh")  # a server left by a crashed session
        self._script("start_seaweedfs.sh", WEED_KEEP="1" if keep_data else "0")
        self.running = True

    def stop(self) -> None:
        if self.running:
            self.running = False
            self._script("stop_seaweedfs.sh", WEED_WIPE="1")

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def options(self, prefix: str, **extra: Any) -> dict[str, Any]:
        return {"bucket": BUCKET, "endpoint": self.endpoint, "prefix": prefix,
                "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, **extra}


_shared: SeaweedFS | None = None


def shared_seaweedfs() -> SeaweedFS:
    """The session's SeaweedFS, started on first use and stopped when the process exits."""
    global _shared
    if _shared is None:
        server = SeaweedFS(8433, 9433)
        server.start()
        atexit.register(server.stop)
        _shared = server
    return _shared


def scratch_prefix(where: Path) -> str:
    """A bucket prefix unique to one test (its tmp_path), stable across calls."""
    return "t-" + hashlib.blake2b(str(where).encode(), digest_size=8).hexdigest()


# --- contract-suite hooks for s3 -------------------------------------------------------------


def _unwrap(driver: Any) -> Any:
    while hasattr(driver, "inner"):
        driver = driver.inner
    return driver


async def _rewrite_object(driver: Any, key: bytes, change: Any) -> None:
    drv = _unwrap(driver)
    name = drv.object_key(key)
    body = bytearray((await drv.client.request("GET", name)).content)
    await drv.client.request("PUT", name, content=bytes(change(body)))


async def flip_object_byte(driver: Any, key: bytes) -> None:
    def flip(body: bytearray) -> bytearray:
        body[4096 + (len(body) - 4096) // 2] ^= 0x40
        return body

    await _rewrite_object(driver, key, flip)


async def truncate_object(driver: Any, key: bytes) -> None:
    await _rewrite_object(driver, key, lambda body: body[: 4096 + (len(body) - 4096) // 2])


# --- contract-suite hooks for pmem ------------------------------------------------------------


def flip_pool_byte(driver: Any, key: bytes) -> None:
    """Flips the middle payload byte of a block inside the mapped pool."""
    pool = _unwrap(driver).pool
    entry = pool.index[key]
    pool.view[entry.offset + 4096 + (entry.length - 4096) // 2] ^= 0x40
