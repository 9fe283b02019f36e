"""Machinery for drivers whose backend is a server that can stall (nfs, mooncake).

A client library blocked on a paused or dead server may not return for its own timeout
(30 s for a Mooncake master RPC), far past an event's deadline. `RemoteDriver` therefore runs
its backend calls with `abandon_on_cancel=True` on a limiter of its own: a cancelled call
returns at once, the worker thread finishes in the background, and other tiers' threads are
not starved by this driver's stuck ones.

An abandoned thread must not write into the caller's buffer afterwards. Backends read into
memory they own and check and copy it into the caller's buffer under the call's `Gate`
(`verify_into`): once the trio side was cancelled the gate is shut and the copy is skipped
(`Abandoned` is raised in the worker, where nobody waits for it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import trio

from ucm.block import PAYLOAD_OFFSET, decode_header, decode_payload_into
from ucm.drivers._files import Backend, ThreadedDriver, os_error, size_mismatch
from ucm.drivers._protocol import LoadState
from ucm.errors import BlockCorrupt, StorageUnavailable


class Abandoned(Exception):
    """The trio side gave up on this call; its results go nowhere."""


class Gate:
    """Shared by one backend call and its trio waiter."""

    __slots__ = ("_lock", "open")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.open = True

    def shut(self) -> None:
        with self._lock:  # waits for a copy in progress: after this none starts
            self.open = False

    def run(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if not self.open:
                raise Abandoned
            return fn()


_current = threading.local()


def gate(fn: Callable[[], Any]) -> Any:
    """Runs `fn` (which writes into caller memory) under the current call's gate."""
    current: Gate | None = getattr(_current, "gate", None)
    if current is None:
        return fn()
    return current.run(fn)


def verify_into(key: bytes, stored: memoryview, out: memoryview) -> LoadState:
    """Checks a block a remote server returned (header + payload, `ucm.block` format) and
    delivers its raw bytes into `out` under the current call's gate: OK, or CORRUPT."""
    try:
        header = decode_header(stored[:PAYLOAD_OFFSET], expect_key=key)
        if header.raw_len != out.nbytes:
            raise size_mismatch(out, header)
        payload = stored[PAYLOAD_OFFSET:]
        # Checked and copied in one pass (ucm.block.copy_verified), outside the GIL.
        gate(lambda: decode_payload_into(header, payload, out))
    except BlockCorrupt:
        return LoadState.CORRUPT
    return LoadState.OK


def _call_gated(gate_: Gate, fn: Callable[..., Any], *args: Any) -> Any:
    _current.gate = gate_
    try:
        return fn(*args)
    finally:
        _current.gate = None


class RemoteDriver(ThreadedDriver):
    """A ThreadedDriver whose calls a deadline can abandon (see the module docstring)."""

    def __init__(self, backend: Backend, *, name: str, threads: int) -> None:
        super().__init__(backend, name=name)
        self._limiter = trio.CapacityLimiter(threads)

    async def _map(self, fn: Callable[..., list[Any]], keys: list[bytes],
                   views: list[memoryview]) -> list[Any]:
        # One thread hop per batch, not parts in parallel: the client libraries spread a call
        # over their own threads or concurrent RPCs, and for both Mooncake and nfs-rs two
        # concurrent parts measured slower than one call on this 2-core machine. A cancel
        # does not wait for a big batch either: calls are abandonable.
        return await self._run(fn, keys, views)

    async def _run(self, fn: Callable[..., Any], *args: Any, inline: bool = False) -> Any:
        if self._closed:
            raise StorageUnavailable("driver is closed", driver=self.name)
        call_gate = Gate()
        try:
            return await trio.to_thread.run_sync(_call_gated, call_gate, fn, *args,
                                                 abandon_on_cancel=True, limiter=self._limiter)
        except trio.Cancelled:
            call_gate.shut()
            raise
        except OSError as exc:
            raise os_error(exc, self.name) from exc
