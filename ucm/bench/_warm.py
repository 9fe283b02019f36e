"""Warm engine starts: one process imports vLLM once, then forks each engine process that
`EngineProcess` asks for, so a run that starts dozens of engines (the test suite) pays vLLM's
import (about 5 s of CPU on 2 vCPUs) once instead of per engine.

Opt-in with UCM_ENGINE_WARM_START=1 (tests/conftest.py sets it); `ucm bench` and `ucm demo`
time fresh processes and leave it off. A forked engine runs the same `engines._main` as a fresh
one, in its own session, with the asking process's environment and working directory; only
what is read while a process or a library loads (LOAD_TIME) must match the warm process's, and
a spawn whose environment differs there starts a fresh process instead.

    warm = warm_starts(env)          # None when off or not usable for this environment
    child = warm.spawn(env, log_fd)  # a Popen-like handle: pid, stdin, stdout, wait()
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

# Read when the interpreter or a shared library loads (the allocator, OpenMP's wait policy,
# sys.path, Hugging Face's offline flags): a forked child keeps the warm process's values. Not
# OMP_NUM_THREADS: vLLM's CPU platform sets it in any process that builds an engine config,
# and an engine reads it from the environment when it sizes its threads, as the child's is.
LOAD_TIME = ("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONMALLOC",
             "PYTHONHOME", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_PROC_BIND",
             "MALLOC_ARENA_MAX", "TCMALLOC_RELEASE_RATE", "HF_HUB_OFFLINE",
             "TRANSFORMERS_OFFLINE", "HF_HOME", "VIRTUAL_ENV")

MAX_MESSAGE = 1 << 20  # an environment and a working directory, as JSON


def load_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: env[k] for k in LOAD_TIME if k in env}


def _libraries(preload: str) -> list[str]:
    """LD_PRELOAD's libraries (separated by colons or spaces), real paths, in order."""
    return [os.path.realpath(p) for p in preload.replace(" ", ":").split(":") if p]


class WarmChild:
    """The part of `subprocess.Popen` that EngineProcess uses, for a process the warm process
    forked: not this process's child, so it is waited for through a pidfd, and its exit status
    is not known (`returncode` stays None)."""

    def __init__(self, pid: int, stdin: IO[str], stdout: IO[str]) -> None:
        self.pid = pid
        self.stdin: IO[str] | None = stdin
        self.stdout: IO[str] | None = stdout
        self.returncode: int | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # it has ended already
            self._pidfd = None

    def wait(self, timeout: float | None = None) -> int | None:
        if self._pidfd is not None:
            poll = select.poll()
            poll.register(self._pidfd, select.POLLIN)
            if not poll.poll(None if timeout is None else int(timeout * 1000)):
                raise subprocess.TimeoutExpired(f"engine process {self.pid}", timeout or 0)
            os.close(self._pidfd)
            self._pidfd = None
        return self.returncode

    def __enter__(self) -> WarmChild:
        return self

    def __exit__(self, *exc: Any) -> None:
        for f in (self.stdin, self.stdout):
            if f is not None:
                try:
                    f.close()
                except BrokenPipeError:
                    pass
        self.wait()


class WarmProcess:
    """The process that has imported vLLM and forks engine processes on request."""

    def __init__(self, env: Mapping[str, str], wrap: Sequence[str] = ()) -> None:
        self.load_env = load_time_env(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._errors = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        self._proc = subprocess.Popen(
            [*wrap, sys.executable, "-m", "ucm.bench._forkserver", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=dict(env), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=self._errors, start_new_session=True)
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self.loaded_env: dict[str, str] | None = None
        self._mapped: set[str] = set()  # the shared libraries it has loaded, real paths

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _wait_ready(self) -> None:
        """Waits for its imports (under the lock); then `loaded_env` is what they left."""
        if self.loaded_env is None:
            ready = self._sock.recv(MAX_MESSAGE)
            if not ready.startswith(b"ready "):
                self._errors.seek(0)
                raise WarmEnded("the warm engine process failed to start:\n"
                                + self._errors.read()[-4000:].decode(errors="replace"))
            loaded = json.loads(ready[len(b"ready "):])
            self.loaded_env, self._mapped = loaded["env"], set(loaded["mapped"])

    def accepts(self, env: Mapping[str, str]) -> bool:
        """Whether a child with `env` would load as a fresh process does: each value read at
        load is the warm process's, before its imports or as they left it (importing OpenCV
        sets LD_LIBRARY_PATH, and a process that imported vLLM has it too); LD_PRELOAD may
        add libraries the warm process has mapped already (vLLM's CPU platform adds torch's
        libgomp to the environment of any process that builds an engine config)."""
        with self._lock:
            self._wait_ready()
        assert self.loaded_env is not None
        for key in LOAD_TIME:
            value = env.get(key)
            if value in (self.load_env.get(key), self.loaded_env.get(key)):
                continue
            if key != "LD_PRELOAD" or value is None:
                return False
            ours = _libraries(self.load_env.get(key, ""))
            theirs = _libraries(value)
            if theirs[:len(ours)] != ours or not set(theirs[len(ours):]) <= self._mapped:
                return False
        return True

    def spawn(self, env: Mapping[str, str], log_fd: int) -> WarmChild:
        """A forked engine process reading stdin, answering on stdout, logging to `log_fd`."""
        with self._lock:
            self._wait_ready()
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            try:
                message = json.dumps({"env": dict(env), "cwd": os.getcwd()}).encode()
                socket.send_fds(self._sock, [message], [in_r, out_w, log_fd])
                reply = self._sock.recv(256)
            except OSError:
                reply = b""
            finally:
                os.close(in_r)
                os.close(out_w)
            if not reply:
                os.close(in_w)
                os.close(out_r)
                raise WarmEnded("the warm engine process has ended")
        pid = int(json.loads(reply)["pid"])
        return WarmChild(pid, os.fdopen(in_w, "w"), os.fdopen(out_r, "r"))

    def close(self) -> None:
        self._sock.close()  # it exits on end of file
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._errors.close()


class WarmEnded(RuntimeError):
    """The warm process has ended (killed with its network namespace, say)."""


_warm: dict[tuple[str, ...], WarmProcess] = {}
_warm_lock = threading.Lock()


def warm_starts(env: Mapping[str, str], wrap: Sequence[str] = ()) -> WarmProcess | None:
    """The warm process for `wrap` (a command prefix such as `ip netns exec NS`: one warm
    process per network namespace) when UCM_ENGINE_WARM_START=1, started at the first call
    with this process's engine environment; None when off, or when `env` differs from the
    warm process's in what is read at load."""
    if os.environ.get("UCM_ENGINE_WARM_START", "") != "1":
        return None
    with _warm_lock:
        warm = _warm.get(tuple(wrap))
        if warm is None or not warm.alive():
            from ucm.vllm_hook.environment import engine_env, find_tcmalloc

            if warm is not None:
                warm.close()
            if not _warm:
                import atexit

                atexit.register(_close_all)
            # this process's engine environment, whichever spawn comes first
            warm = WarmProcess(engine_env(os.environ, tcmalloc=find_tcmalloc()), wrap)
            _warm[tuple(wrap)] = warm
    try:
        return warm if warm.accepts(env) else None
    except WarmEnded:
        return None


def _close_all() -> None:
    with _warm_lock:
        for warm in _warm.values():
            warm.close()
        _warm.clear()
