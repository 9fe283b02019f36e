"""A real redis-server for the redis tests, started and stopped by scripts/backends/
start_redis.sh and stop_redis.sh (bound to 127.0.0.1, password enforced, no persistence), and
the storage-side hooks the contract suite uses on it.

The session's server listens on 6390; tests that pause or kill a server start their own on
6391. A server that cannot start raises ServerError with the script's output and log tail: the
test that needed it fails (CI installs every backend), it is never skipped.
"""

from __future__ import annotations

import atexit
import os
import signal
from pathlib import Path
from typing import Any

import trio

from ._mooncake_nfs import RUN_ROOT, ServerError, run_script

__all__ = ["PASSWORD", "RedisServer", "ServerError", "shared_redis"]

PASSWORD = "ucmtest-redis"
SHARED_PORT = 6390


class RedisServer:
    def __init__(self, port: int, **env: str) -> None:
        self.port = port
        self.run_dir = RUN_ROOT / f"redis-{port}"
        self.env = dict(os.environ, REDIS_PORT=str(port), REDIS_PASSWORD=PASSWORD,
                        UCM_RUN_DIR=str(self.run_dir), **env)
        self.running = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return int((self.run_dir / f"redis-{self.port}.pid").read_text())

    @property
    def log(self) -> Path:
        return self.run_dir / f"redis-{self.port}.log"

    def start(self) -> None:
        run_script("stop_redis.sh", self.env)  # a server left by a crashed session
        run_script("start_redis.sh", self.env)
        self.running = True

    def stop(self) -> None:
        if self.running:
            self.running = False
            run_script("stop_redis.sh", self.env)

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def options(self, prefix: str, **extra: Any) -> dict[str, Any]:
        return {"url": self.url, "password": PASSWORD, "prefix": prefix, **extra}


_shared: RedisServer | None = None


def shared_redis() -> RedisServer:
    """The session's redis-server, started on first use and stopped when the process exits."""
    global _shared
    if _shared is None:
        server = RedisServer(SHARED_PORT)
        server.start()
        atexit.register(server.stop)
        _shared = server
    return _shared


# --- contract-suite hooks --------------------------------------------------------------------


def _unwrap(driver: Any) -> Any:
    while hasattr(driver, "inner"):
        driver = driver.inner
    return driver


async def _rewrite_value(driver: Any, key: bytes, change: Any) -> None:
    drv = _unwrap(driver)
    name = drv.redis_key(key)

    def rewrite() -> None:
        value = bytearray(drv.client.get(name))
        drv.client.set(name, bytes(change(value)))

    await trio.to_thread.run_sync(rewrite)


async def flip_redis_byte(driver: Any, key: bytes) -> None:
    def flip(value: bytearray) -> bytearray:
        value[4096 + (len(value) - 4096) // 2] ^= 0x40
        return value

    await _rewrite_value(driver, key, flip)


async def truncate_redis_value(driver: Any, key: bytes) -> None:
    await _rewrite_value(driver, key, lambda value: value[: 4096 + (len(value) - 4096) // 2])
