"""The drivers' worker threads, owned by one `kit.Workers`: stores on idle-priority threads
(_idle), load copies on pinned pump threads (_pump)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import trio

from ucm.drivers import _blockfiles, _pump
from ucm.drivers._idle import IdleThreads
from ucm.drivers.kit import Workers
from ucm.drivers.posix import PosixDriver
from ucm.kernel import Kernel, Load, Store


async def run_idle(fn, *args):
    return await Workers.default().run_store(fn, *args)

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux scheduling")


@linux
async def test_stores_run_on_idle_priority_threads_and_nothing_else_does():
    assert await run_idle(os.sched_getscheduler, 0) == os.SCHED_IDLE
    # trio's thread cache (loads, lookups) and the calling thread keep their policy
    assert await trio.to_thread.run_sync(os.sched_getscheduler, 0) == os.SCHED_OTHER
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


@linux
async def test_a_posix_store_writes_on_an_idle_thread_and_a_load_does_not(tmp_path, monkeypatch):
    seen: dict[str, set[int]] = {"store": set(), "load": set()}
    real_store, real_load = _blockfiles.BlockFiles.store, _blockfiles.BlockFiles.load_one

    def store(self, keys, views):
        seen["store"].add(os.sched_getscheduler(0))
        return real_store(self, keys, views)

    def load_one(self, key, view):
        seen["load"].add(os.sched_getscheduler(0))
        return real_load(self, key, view)

    monkeypatch.setattr(_blockfiles.BlockFiles, "store", store)
    monkeypatch.setattr(_blockfiles.BlockFiles, "load_one", load_one)
    drv = await PosixDriver.open({"path": str(tmp_path)}, name="p", namespace="ns")
    blocks = [os.urandom(2**20) for _ in range(8)]  # split over parts: the threaded path
    keys = [b"k%d" % i for i in range(8)]
    assert all(await drv.store(keys, [memoryview(b) for b in blocks]))
    out = [bytearray(2**20) for _ in range(8)]
    states = await drv.load(keys, [memoryview(b) for b in out])
    assert all(s.name == "OK" for s in states) and out == [bytearray(b) for b in blocks]
    assert seen == {"store": {os.SCHED_IDLE}, "load": {os.SCHED_OTHER}}
    await drv.aclose()


async def test_idle_threads_return_raise_and_queue_beyond_their_limit():
    pool = IdleThreads(limit=2)
    running, most = 0, 0
    lock = threading.Lock()
    both = threading.Barrier(2, timeout=10)  # the first two jobs run at once

    def job(i: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        if i < 2:
            both.wait()
        time.sleep(0.002)
        with lock:
            running -= 1
        if i == 3:
            raise ValueError("block 3")
        return i * i

    results: dict[int, object] = {}

    async def one(i: int) -> None:
        try:
            results[i] = await pool.run(job, i)
        except ValueError as exc:
            results[i] = exc

    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(one, i)
    assert {i: r for i, r in results.items() if i != 3} == {i: i * i for i in range(10) if i != 3}
    assert isinstance(results[3], ValueError) and str(results[3]) == "block 3"
    assert most == 2  # ten jobs, two threads: the rest waited in the queue
    assert pool._threads == 2
    await trio.to_thread.run_sync(pool.close)
    assert not any(t.is_alive() for t in pool._started)
    with pytest.raises(RuntimeError, match="closed"):
        await pool.run(job, 0)


async def test_a_cancelled_caller_waits_until_its_call_has_returned():
    done = threading.Event()

    def slow() -> None:  # as a store reading the caller's snapshot
        time.sleep(0.2)
        done.set()

    with trio.move_on_after(0.01) as scope:
        await run_idle(slow)
    assert not scope.cancelled_caught  # the cancel could not land while the call ran
    assert done.is_set()


@linux
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity")
                    else True, reason="needs two CPUs")
async def test_pump_threads_copy_on_two_cpus_of_their_own_and_stop_at_close():
    pump = _pump.Pump(2)
    assert pump._cpus == sorted(os.sched_getaffinity(0))[-2:][::-1]
    seen: dict[int, set[frozenset[int]]] = {}
    both = threading.Barrier(2, timeout=10)  # each thread's first run waits for the other's

    def fn(key: bytes, view: memoryview) -> None:
        first = threading.get_ident() not in seen
        seen.setdefault(threading.get_ident(), set()).add(frozenset(os.sched_getaffinity(0)))
        if first:
            both.wait()

    views = [memoryview(bytearray(_pump.GRAB_BYTES)) for _ in range(8)]  # a run each
    for _ in range(3):  # the same two threads, bound to the same CPUs, batch after batch
        spread = await _pump.Spread(fn, [b"k"] * 8, views).run(pump, 2)
        assert spread.errors == [None] * 8
        assert len(seen) == 2
        both.reset()
    assert all(len(s) == 1 for s in seen.values())  # each thread on one CPU throughout
    cpus = [next(iter(s)) for s in seen.values()]
    assert sorted(len(c) for c in cpus) == [1, 1] and cpus[0] != cpus[1]
    deadline = time.monotonic() + 5  # the last thread marks itself idle after the wake-up
    while pump._busy != [False, False] and time.monotonic() < deadline:
        await trio.sleep(0.001)
    assert pump._busy == [False, False]
    names = {t.name for t in threading.enumerate()}
    assert {"ucm-copy-0", "ucm-copy-1"} <= names

    await trio.to_thread.run_sync(pump.close)
    assert not any(t.is_alive() for t in pump._threads if t is not None)
    with pytest.raises(RuntimeError, match="closed"):
        pump.submit(_pump.Spread(fn, [b"k"], views[:1]), 1)


@linux
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity")
                    else True, reason="needs two CPUs")
async def test_a_helping_caller_copies_and_the_thread_woken_avoids_its_cpu():
    pump = _pump.Pump(2)
    where: dict[str, set[int]] = {}
    caller = pump._cpus[1]

    def fn(key: bytes, view: memoryview) -> None:
        time.sleep(0.002)  # long enough that both sides take runs
        name = "caller" if threading.current_thread().name == "helper" else "pump"
        where.setdefault(name, set()).add(next(iter(os.sched_getaffinity(0))))

    done = threading.Event()
    views = [memoryview(bytearray(_pump.GRAB_BYTES)) for _ in range(16)]
    spread = _pump.Spread(fn, [b"k"] * 16, views)
    spread._wake = done.set

    def helper() -> None:
        os.sched_setaffinity(0, {caller})
        assert _pump.bound_cpu() == caller
        pump.submit(spread, 1, avoid_cpu=caller)
        pump.help(spread)

    thread = threading.Thread(target=helper, name="helper")
    thread.start()
    thread.join(10)
    assert done.wait(10)
    assert spread.errors == [None] * 16 and spread.next == 16
    assert where["caller"] == {caller} and where["pump"] == {pump._cpus[0]}
    pump.close()


def test_one_cpu_or_an_opt_out_pins_nothing(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {3})
    assert _pump.Pump(2)._cpus == []
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1, 2})
    assert _pump.Pump(2)._cpus == [2, 1]
    assert _pump.Pump(2, pin=False)._cpus == []


def _threads_named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_a_kernel_lends_one_set_of_threads_to_all_its_tiers_and_stops_them_at_close(tmp_path):
    before = len(_threads_named("ucm-copy")), len(_threads_named("ucm-store"))
    config = {"tiers": [{"driver": "memory", "shared": True, "shm_dir": str(tmp_path / "shm")},
                        {"driver": "posix", "path": str(tmp_path / "b")}],
              "threads": {"copy_threads": 2, "store_threads": 3}}
    with Kernel(config) as kernel:
        drivers = [t.driver for t in kernel._core.tiers]
        assert drivers[0]._workers is drivers[1]._workers is kernel._core.workers
        data = [os.urandom(4 << 20) for _ in range(4)]  # wide enough for both copy threads
        keys = [b"k%d" % i for i in range(4)]
        assert kernel.submit(Store(keys, buffers=data, durability="all")).result(10).ok
        out = [bytearray(4 << 20) for _ in range(4)]
        assert kernel.submit(Load(keys, buffers=out)).result(10).ok
        assert out == [bytearray(d) for d in data]
        copy = len(_threads_named("ucm-copy")) - before[0]
        store = len(_threads_named("ucm-store")) - before[1]
        assert 1 <= copy <= 2  # one pool for both tiers, not two threads per tier
        assert 1 <= store <= 3
    assert (len(_threads_named("ucm-copy")), len(_threads_named("ucm-store"))) == before


def test_copy_pinning_is_a_config_entry(tmp_path):
    config = {"tiers": [{"driver": "posix", "path": str(tmp_path)}],
              "threads": {"pin_copy": False}}
    with Kernel(config) as kernel:
        assert kernel._core.workers.copy._cpus == []
