"""The warm process of ucm/bench/_warm.py: imports vLLM once, then forks an engine process
(`engines._main`) for each request on its socket. A module of its own so that the engine
runner, which asks for warm starts, and what the warm process runs do not import each other."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from typing import Any

from ucm.bench._warm import MAX_MESSAGE, load_time_env


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
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as engines.make_engine, before the imports
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # What every engine process imports first; nothing here starts a thread pool or an engine.
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    import ucm.bench.engines
    import ucm.vllm_hook  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the engines
    with open("/proc/self/maps") as f:
        mapped = {os.path.realpath(line.split()[-1]) for line in f if ".so" in line}
    ready = {"env": load_time_env(os.environ), "mapped": sorted(mapped)}
    sock.send(b"ready " + json.dumps(ready).encode())
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
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
