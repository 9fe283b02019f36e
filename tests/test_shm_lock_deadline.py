"""A process sharing the shm arena that holds its lock (a real flock on `<arena>.lock`, or on
the arena file, taken by a second process) stalls the others' stores, deletes and opens only
until their deadline: the event's, else `lock_wait`. A timed-out store stores nothing (never
reported stored), an open fails naming the lock file, and the pages a failed store had taken
are given back once the lock is free. Nothing here times anything: the tests count stored
blocks, timed-out waits and pages in flight."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ucm.block import PAYLOAD_OFFSET, Codec
from ucm.drivers._shm_arena import IN_FLIGHT, ShmArena
from ucm.drivers.memory import MemoryDriver
from ucm.errors import ConfigError, DeadlineExceeded, StorageUnavailable
from ucm.kernel import Kernel, Lookup, Store

MiB = 2**20
KEYS = [bytes([i]) * 16 for i in range(1, 5)]
BLOCK = memoryview(b"b" * 10_000)
PAGES = -(-(PAYLOAD_OFFSET + BLOCK.nbytes) // 4096)  # the arena pages one block takes

_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()  # holds the lock until told to let go
"""


class Holder:
    """A second process holding an exclusive flock on `path` until `release()`."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            self.proc.wait(30)

    def __enter__(self) -> Holder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@pytest.fixture
def shm_dir():
    path = Path("/dev/shm") / f"ucm-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def open_arena(shm_dir: Path, **kw) -> ShmArena:
    return ShmArena.open(str(shm_dir / "ns.arena"), size=8 * MiB, namespace="ns",
                         codec=Codec.NONE, **kw)


def in_flight(arena: ShmArena) -> int:
    return int((arena.owners == (IN_FLIGHT | os.getpid())).sum())


@pytest.mark.timeout(120)
def test_a_held_lock_fails_a_store_at_its_deadline(shm_dir: Path):
    arena = open_arena(shm_dir, lock_wait=0.2)
    try:
        with Holder(shm_dir / "ns.arena.lock"):
            # the call's deadline (the event's), then lock_wait for a call with none
            for store in (arena.until(time.monotonic() + 0.2, arena.store), arena.store):
                with pytest.raises(TimeoutError, match="held the shared-memory arena's lock"):
                    store([KEYS[0]], [BLOCK])
            with pytest.raises(TimeoutError):
                arena.delete([KEYS[0]])
            assert arena.lock_timeouts == 3
            assert arena.lookup([KEYS[0]]) == [False] and in_flight(arena) == 0
        assert arena.store([KEYS[0]], [BLOCK]) == [PAGES * 4096]  # free again
        assert arena.lookup([KEYS[0]]) == [True]
    finally:
        arena.close()


@pytest.mark.timeout(120)
def test_pages_of_a_store_that_timed_out_are_given_back(shm_dir: Path, monkeypatch):
    arena = open_arena(shm_dir, lock_wait=0.2)
    holders: list[Holder] = []
    real = arena._place

    def placed_then_locked(key, view):  # fault injection: the lock is taken after the copy
        out = real(key, view)
        if key == KEYS[1]:
            holders.append(Holder(shm_dir / "ns.arena.lock"))
        return out

    monkeypatch.setattr(arena, "_place", placed_then_locked)
    try:
        with pytest.raises(TimeoutError):
            arena.store(KEYS[:2], [BLOCK, BLOCK])
        assert arena.lookup(KEYS[:2]) == [False, False]  # neither was published
        assert in_flight(arena) == 2 * PAGES and len(arena._orphans) == 2  # held by this process
        holders[0].release()
        monkeypatch.undo()
        assert arena.store([KEYS[2]], [BLOCK]) == [PAGES * 4096]
        assert in_flight(arena) == 0 and arena._orphans == []  # given back at that turn
        assert arena.lookup(KEYS[:3]) == [False, False, True]
    finally:
        for holder in holders:
            holder.release()
        arena.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("locked", ["ns.arena.lock", "ns.arena"])
def test_opening_an_arena_whose_lock_is_held_fails_naming_it(shm_dir: Path, locked: str):
    open_arena(shm_dir).close()
    with Holder(shm_dir / locked):
        with pytest.raises(TimeoutError) as caught:
            open_arena(shm_dir, lock_wait=0.2)
        assert caught.value.filename == str(shm_dir / locked)
    open_arena(shm_dir).close()


@pytest.mark.timeout(120)
async def test_the_memory_driver_fails_open_and_stores_clearly(shm_dir: Path):
    options = {"shared": True, "shm_dir": str(shm_dir), "size": "8MiB", "lock_wait": 0.2}
    drv = await MemoryDriver.open(options, name="m", namespace="ns")
    try:
        with Holder(shm_dir / "ns.arena.lock"):
            with pytest.raises(StorageUnavailable, match=r"arena's lock .*ns\.arena\.lock"):
                await MemoryDriver.open(options, name="m2", namespace="ns")
            with pytest.raises(StorageUnavailable, match="arena's lock"):
                await drv.store([KEYS[0]], [BLOCK])  # no deadline here: lock_wait
            with pytest.raises(StorageUnavailable, match="arena's lock"):
                await drv.delete([KEYS[0]])
            assert drv.statistics()["lock_timeouts"] == 2
            assert drv.statistics()["stored"] == 0
        assert await drv.lookup([KEYS[0]]) == [False]
    finally:
        await drv.aclose()
    with pytest.raises(ConfigError, match="lock_wait: applies to shared mode only"):
        await MemoryDriver.open({"lock_wait": 1}, name="m", namespace="ns")


@pytest.mark.timeout(120)
def test_a_store_event_ends_at_its_deadline_and_stores_nothing(shm_dir: Path):
    config = {"tiers": [{"driver": "memory", "capacity": "8MiB", "shared": True,
                         "shm_dir": str(shm_dir), "size": "8MiB", "lock_wait": 600}]}
    with Kernel(config) as kernel:
        with Holder(shm_dir / f"{kernel_namespace(kernel)}.arena.lock"):
            done = kernel.submit(Store(KEYS[:2], buffers=[BLOCK, BLOCK], deadline=0.5))
            try:  # the event's deadline bounds the wait, not lock_wait (600 s)
                assert not done.result(60).ok
            except (DeadlineExceeded, StorageUnavailable):
                pass
        assert kernel.submit(Lookup(KEYS[:2])).result(30).hits == (False, False)
        assert kernel.submit(Store(KEYS[:2], buffers=[BLOCK, BLOCK])).result(30).ok


def kernel_namespace(kernel: Kernel) -> str:
    """The arena's file name stem: the tier's namespace, made a safe file name."""
    from ucm.drivers.kit import safe_dir_name

    return safe_dir_name(kernel.config.namespace)

