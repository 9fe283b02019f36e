"""Server processes the benches start and stop: a free loopback port, `ucm` as this
interpreter's environment runs it, and an HTTP server process waited for until it answers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ucm_command() -> list[str]:
    """The `ucm` command of this interpreter's environment (the installed entry point)."""
    return [sys.executable, "-c", "import sys; from ucm.cli import main; sys.exit(main())"]


class ServerProcess:
    """`argv` in its own session (stopping it stops what it started), its output in `log`;
    returns once http://127.0.0.1:`port``health` answers, or raises naming `name` and the log
    when the process exits or `timeout` seconds pass first."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: str, port: int,
                 health: str = "/health", timeout: float = 600) -> None:
        self.port, self.log_path = port, log
        self._log = open(log, "w")  # noqa: SIM115 (closed by stop)
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        end = time.monotonic() + timeout
        while not self._ok(health):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"{name} did not start; see {log}")
            time.sleep(1)

    def _ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait)
            except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                pass
        self._log.close()
