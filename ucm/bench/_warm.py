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
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from typing import IO, Any

# Read when the interpreter or a shared library loads (the allocator, OpenMP's wait policy,
# sys.path, Hugging Face's offline flags): a forked child keeps the warm process's values.
LOAD_TIME = ("LD_", "PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "TCMALLOC", "MALLOC_", "HF_",
             "TRANSFORMERS_", "TORCH", "UCM_ENGINE_MALLOC", "VIRTUAL_ENV", "PATH")

_MAX_MESSAGE = 1 << 20  # an environment and a working directory, as JSON


def load_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME)}


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

    def __init__(self, env: Mapping[str, str]) -> None:
        self.load_env = load_time_env(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._errors = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "ucm.bench._warm", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=dict(env), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=self._errors, start_new_session=True)
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._ready = False

    def spawn(self, env: Mapping[str, str], log_fd: int) -> WarmChild:
        """A forked engine process reading stdin, answering on stdout, logging to `log_fd`."""
        with self._lock:
            if not self._ready:
                if self._sock.recv(16) != b"ready":
                    self._errors.seek(0)
                    raise RuntimeError("the warm engine process failed to start:\n"
                                       + self._errors.read()[-4000:].decode(errors="replace"))
                self._ready = True
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            try:
                message = json.dumps({"env": dict(env), "cwd": os.getcwd()}).encode()
                socket.send_fds(self._sock, [message], [in_r, out_w, log_fd])
                reply = self._sock.recv(256)
            finally:
                os.close(in_r)
                os.close(out_w)
            if not reply:
                os.close(in_w)
                os.close(out_r)
                raise RuntimeError("the warm engine process has ended")
        pid = int(json.loads(reply)["pid"])
        return WarmChild(pid, os.fdopen(in_w, "w"), os.fdopen(out_r, "r"))

    def close(self) -> None:
        self._sock.close()  # it exits on end of file
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._errors.close()


_warm: WarmProcess | None = None
_warm_lock = threading.Lock()


def warm_starts(env: Mapping[str, str]) -> WarmProcess | None:
    """The warm process when UCM_ENGINE_WARM_START=1 (started at the first call, with this
    process's engine environment); None when off, or when `env` differs from the warm
    process's in what is read at load."""
    global _warm
    if os.environ.get("UCM_ENGINE_WARM_START", "") != "1":
        return None
    with _warm_lock:
        if _warm is None:
            import atexit

            from ucm.vllm_hook.environment import engine_env, find_tcmalloc

            # this process's engine environment, whichever spawn comes first
            _warm = WarmProcess(engine_env(os.environ, tcmalloc=find_tcmalloc()))
            atexit.register(_warm.close)
        return _warm if _warm.load_env == load_time_env(env) else None


def _child(message: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: its own session, the asker's pipes, environment and directory."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # vLLM waits for the processes it starts
    for fd, target in zip(fds, (0, 1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(message["cwd"])
    os.environ.clear()
    os.environ.update(message["env"])
    from ucm.bench.engines import _main

    _main()


def _serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    # What every engine process imports first; nothing here starts a thread pool or an engine.
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    import ucm.bench.engines
    import ucm.vllm_hook  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the engines
    sock.send(b"ready")
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        except OSError:
            return
        if not data:
            return  # the asking process has gone
        pid = os.fork()
        if pid == 0:
            sock.close()
            code = 1
            try:
                _child(json.loads(data), fds)
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()  # into the engine's log (its stderr)
            finally:
                os._exit(code)
        for f in fds:
            os.close(f)
        sock.send(json.dumps({"pid": pid}).encode())


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
