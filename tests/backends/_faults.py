"""The "server paused, then killed, then restarted under a running kernel" scenario, shared by
the tests of drivers whose backend is a server (redis, s3, nfs, mooncake).

The kernel has a memory tier over the driver's tier, durability "all". While the server is
paused (SIGSTOP) a store fails within its deadline and the memory tier keeps serving; after
SIGCONT the driver works again; once the server is killed a store fails within its deadline;
after `restart` the same kernel and driver store and load again (no process restart).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from ucm.errors import DeadlineExceeded
from ucm.kernel import Kernel, Load, Store

MiB = 2**20


def memory_over(tier: dict[str, Any]) -> Kernel:
    """A started kernel: a memory tier over `tier`, every store to both."""
    kernel = Kernel({"tiers": [{"driver": "memory", "name": "mem"}, tier],
                     "namespace": "faults", "durability": "all", "promote": False})
    kernel.start()
    return kernel


def until_ok(kernel: Kernel, key: bytes, block: bytes, *, within: float = 20) -> None:
    """Stores `key` until a store succeeds; fails the test after `within` seconds. A store may
    fail (a not-ok result) or run past its deadline meanwhile; any other error fails at once."""
    deadline = time.monotonic() + within
    while True:
        future = kernel.submit(Store([key], buffers=[block], deadline=5.0))
        error = future.exception(20)
        if error is None and future.result().ok:
            return
        assert error is None or isinstance(error, DeadlineExceeded), \
            f"a store raised while the driver recovered: {error!r}"
        why = error or future.result()  # a StoreResult names each tier's error
        assert time.monotonic() < deadline, f"the driver did not recover: {why!r}"
        time.sleep(0.2)


def fails_within(kernel: Kernel, event: Any, limit: float, *, raises: bool = False) -> None:
    """Submits `event`: it must fail (an error or a not-ok result). With `raises` the error is
    the event's deadline (DeadlineExceeded): the kernel cut the hanging call, rather than the
    client library's own, much later timeout. `limit` bounds the wait for it."""
    future = kernel.submit(event)
    error = future.exception(limit + 5)
    if raises:
        assert isinstance(error, DeadlineExceeded), \
            f"{type(event).__name__} to a stopped server ended with {error!r}, not its deadline"
    else:
        assert error is not None or not future.result().ok, \
            f"{type(event).__name__} succeeded against a stopped server"


def paused_then_killed(kernel: Kernel, server: Any, *, restart: Callable[[], None],
                       block_size: int = 2 * MiB, pause_raises: bool = False,
                       while_paused: Callable[[bytes], None] | None = None,
                       resumes_at_once: bool = False, recover_within: float = 20) -> bytes:
    """Runs the scenario (see the module docstring) on `server` (which has `signal(signum)`)
    and returns the block it stored (under b"both" first, and last under b"after-restart").

    `restart` brings a killed server back. `pause_raises`: the store to the paused server must
    raise (its deadline), not only fail. `while_paused(block)` runs extra checks while the
    server is paused, after that store. `resumes_at_once`: the first store after SIGCONT must
    succeed, no retries. `recover_within`: seconds the driver has to work again after SIGCONT
    and after the restart."""
    block = os.urandom(block_size)
    assert kernel.submit(Store([b"both"], buffers=[block])).result(10).ok
    hot = b"mem-only"
    assert kernel.submit(Store([hot], buffers=[block], durability="memory")).result(10).ok

    server.signal(signal.SIGSTOP)  # paused: requests hang until a deadline
    try:
        fails_within(kernel, Store([b"during-pause"], buffers=[block], deadline=1.0), 2.5,
                     raises=pause_raises)
        if while_paused is not None:
            while_paused(block)
        out = bytearray(block_size)  # the memory tier keeps serving meanwhile
        loaded = kernel.submit(Load([hot], buffers=[out], deadline=1.0)).result(5)
        assert loaded.ok and bytes(out) == block
    finally:
        server.signal(signal.SIGCONT)
    if resumes_at_once:
        assert kernel.submit(Store([b"after-pause"], buffers=[block])).result(20).ok
    else:
        until_ok(kernel, b"after-pause", block, within=recover_within)

    server.signal(signal.SIGKILL)  # gone: fails fast, then recovers after a restart
    fails_within(kernel, Store([b"while-dead"], buffers=[block], deadline=3.0), 4)
    restart()
    until_ok(kernel, b"after-restart", block, within=recover_within)  # same kernel and driver
    out = bytearray(block_size)
    assert kernel.submit(Load([b"after-restart"], buffers=[out])).result(20).ok
    assert bytes(out) == block
    return block
