"""Loads of blocks the fastest tier holds in memory run off the trio thread
(`ucm.kernel._fastpath`): same answers, counters and trace records as an event, the blocks
that do not load that way go through the trio thread, and closing waits for them."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import trio

from ucm.drivers import LoadState
from ucm.kernel import Kernel, Load, Lookup, Store
from ucm.trace import Tracer

BLOCK = 256 * 1024
KEYS = [b"block-%d" % i for i in range(6)]


def posix(tmp_path, name: str = "disk", **extra) -> dict:
    return {"driver": "posix", "name": name, "path": str(tmp_path / name), **extra}


def shm(tmp_path) -> dict:
    return {"driver": "memory", "name": "shm",
            "options": {"shared": True, "shm_dir": str(tmp_path / "shm"), "size": 16 * 2**20}}


def stored(config: dict, keys=KEYS) -> list[bytes]:
    """Stores random blocks under `keys` in a kernel of its own (a restart then maps them)."""
    data = [os.urandom(BLOCK) for _ in keys]
    with Kernel(config) as kernel:
        assert kernel.submit(Store(keys, buffers=data)).result(10).ok
    return data


@pytest.mark.parametrize("tier", ["posix", "shm"])
def test_a_load_of_blocks_in_memory_completes_while_the_trio_thread_is_held(
        tmp_path, tier, hold_trio_thread):
    config = {"tiers": [posix(tmp_path) if tier == "posix" else shm(tmp_path)]}
    data = stored(config)
    records: list = []
    kernel = Kernel(config, tracer=Tracer(sinks=[SimpleNamespace(consume=records.extend)]))
    try:
        kernel.start()
        assert kernel.wait_indexed(10)  # the posix listing maps what it finds
        release = hold_trio_thread(kernel)
        out = [bytearray(BLOCK) for _ in KEYS]
        completion = kernel.submit(Load(KEYS, buffers=out, request_id="r1"))
        result = completion.result(10)  # the trio thread is still held
        release()
        name = config["tiers"][0]["name"]
        assert result.states == (LoadState.OK,) * len(KEYS)
        assert result.tiers == (name,) * len(KEYS)
        assert out == data
        stats = kernel.statistics()
        assert stats["loads_from_memory"] == 1
        assert stats["load_keys"] == len(KEYS)
        assert stats[f"load_hits.{name}"] == len(KEYS)
        assert stats["bytes_loaded"] == len(KEYS) * BLOCK
        assert stats[f"tier.{name}.driver"]["loaded"] == len(KEYS)  # the driver's counters too
    finally:
        kernel.close()
    mine = [(phase, fields) for _, _, phase, eid, fields in records
            if eid == completion.event_id]
    assert [phase for phase, _ in mine] == ["submit", "start", "op", "done"]
    assert mine[1][1]["request_id"] == "r1"
    op = mine[2][1]
    assert (op["tier"], op["op"], op["keys"], op["hits"], op["bytes"], op["in_memory"]) == (
        name, "load", len(KEYS), len(KEYS), len(KEYS) * BLOCK, True)
    assert mine[3][1] == {"outcome": "ok"}


def test_blocks_that_fail_in_memory_load_through_the_trio_thread(tmp_path):
    """A corrupt block in tier 0 is found by the in-memory load, then loaded by the trio
    thread as usual: removed from tier 0 and read from the tier below."""
    upper, lower = posix(tmp_path, "upper"), posix(tmp_path, "lower")
    data = stored({"tiers": [upper]})
    stored({"tiers": [lower]}, KEYS[:1])  # lower's copy of block 0 differs from upper's
    with Kernel({"tiers": [lower]}) as kernel:
        good = bytearray(BLOCK)
        assert kernel.submit(Load(KEYS[:1], buffers=[good])).result(10).ok
    kernel = Kernel({"tiers": [upper, lower], "promote": False})
    try:
        kernel.start()
        assert kernel.wait_indexed(10)
        backend = kernel._core.tiers[0].driver._backend
        assert backend.in_memory(KEYS)
        path = backend.layout.path_for(KEYS[0])
        with open(path, "r+b") as f:  # a bit flipped in the payload, written in place
            f.seek(os.path.getsize(path) - 1)
            last = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([last[0] ^ 1]))
        out = [bytearray(BLOCK) for _ in KEYS]
        result = kernel.submit(Load(KEYS, buffers=out)).result(10)
        assert result.states == (LoadState.OK,) * len(KEYS)
        assert result.tiers == ("lower",) + ("upper",) * (len(KEYS) - 1)
        assert out[0] == good and out[1:] == data[1:]
        stats = kernel.statistics()
        assert stats["loads_from_memory"] == 1
        assert stats["load_keys"] == len(KEYS)  # the trio thread's Load counted the one
        assert stats["load_hits.upper"] == len(KEYS) - 1 and stats["load_hits.lower"] == 1
        assert stats["errors.upper.load.corrupt"] == 1
        # The corrupt block is removed in the background: wait for that, then look.
        trio.from_thread.run(kernel._core.wait_background_idle, trio_token=kernel._token)
        assert kernel.submit(Lookup(KEYS[:1])).result(10).tiers == ("lower",)  # removed
    finally:
        kernel.close()


def test_a_corrupt_block_in_the_only_tier_reads_as_corrupt(tmp_path):
    config = {"tiers": [posix(tmp_path)]}
    stored(config)
    with Kernel(config) as kernel:
        assert kernel.wait_indexed(10)
        path = kernel._core.tiers[0].driver._backend.layout.path_for(KEYS[2])
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 1)
        out = [bytearray(BLOCK) for _ in KEYS]
        result = kernel.submit(Load(KEYS, buffers=out)).result(10)
        assert result.states[2] is LoadState.CORRUPT
        assert [s for i, s in enumerate(result.states) if i != 2] == [LoadState.OK] * 5
        assert result.tiers[2] is None
        assert kernel.statistics()["loads_from_memory"] == 1


def test_pinned_keys_load_through_the_trio_thread_which_unpins_them(tmp_path):
    config = {"tiers": [posix(tmp_path)]}
    stored(config)
    with Kernel(config) as kernel:
        assert kernel.wait_indexed(10)
        assert kernel.submit(Lookup(KEYS, pin=True)).result(10).hits == (True,) * len(KEYS)
        assert kernel.statistics()["tier.disk.pinned"] == len(KEYS)
        out = [bytearray(BLOCK) for _ in KEYS]
        assert kernel.submit(Load(KEYS, buffers=out)).result(10).ok
        stats = kernel.statistics()
        assert stats.get("loads_from_memory", 0) == 0
        assert stats["tier.disk.pinned"] == 0
        assert kernel.submit(Load(KEYS, buffers=out)).result(10).ok  # unpinned: in memory
        assert kernel.statistics()["loads_from_memory"] == 1


def test_blocks_loaded_in_memory_count_as_used_for_eviction(tmp_path):
    """The least recently used block, once loaded off the trio thread, is not the one a store
    evicts next."""
    config = {"tiers": [posix(tmp_path)], "eviction": "lru"}
    stored(config, KEYS[:3])
    config["tiers"][0]["capacity"] = 4 * (BLOCK + 4096) - 1  # room for three blocks
    with Kernel(config) as kernel:
        assert kernel.wait_indexed(10)
        oldest = next(iter(kernel._core.tiers[0].policy.index))  # listing order = LRU order
        out = bytearray(BLOCK)
        assert kernel.submit(Load([oldest], buffers=[out])).result(10).ok
        assert kernel.statistics()["loads_from_memory"] == 1
        assert kernel.submit(Store([b"new"], buffers=[os.urandom(BLOCK)])).result(10).ok
        hits = kernel.submit(Lookup(KEYS[:3])).result(10).hits
        assert hits.count(True) == 2 and hits[KEYS.index(oldest)]


def test_closing_waits_for_an_in_memory_load_that_is_copying(tmp_path, monkeypatch):
    config = {"tiers": [posix(tmp_path)]}
    data = stored(config)
    kernel = Kernel(config)
    kernel.start()
    assert kernel.wait_indexed(10)
    backend = kernel._core.tiers[0].driver._backend
    real, started = backend.load_one, threading.Event()

    def slow_load_one(key, view):  # fault injection: a slow copy
        started.set()
        time.sleep(0.05)
        return real(key, view)

    monkeypatch.setattr(backend, "load_one", slow_load_one)
    kernel._core.tiers[0].driver._backend = backend
    out = [bytearray(BLOCK) for _ in KEYS]
    completion = kernel.submit(Load(KEYS, buffers=out))
    assert started.wait(10)
    kernel.close()
    assert completion.done()
    assert completion.result(0).ok and out == data


def test_a_cancelled_in_memory_load_stops_before_its_remaining_blocks(tmp_path, monkeypatch):
    config = {"tiers": [posix(tmp_path)]}
    stored(config)
    with Kernel(config) as kernel:
        assert kernel.wait_indexed(10)
        backend = kernel._core.tiers[0].driver._backend
        real, first = backend.load_one, threading.Event()

        def slow_load_one(key, view):
            first.set()
            time.sleep(0.1)
            return real(key, view)

        monkeypatch.setattr(backend, "load_one", slow_load_one)
        out = [bytearray(BLOCK) for _ in KEYS]
        completion = kernel.submit(Load(KEYS, buffers=out))
        assert first.wait(10)
        assert completion.cancel()
        with pytest.raises(concurrent.futures.CancelledError):
            completion.result(10)
        assert out[-1] == bytearray(BLOCK)  # never written
        assert kernel.statistics()["loads_from_memory"] == 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity")
                    else True, reason="needs two CPUs")
def test_a_caller_bound_to_one_cpu_copies_too(tmp_path):
    config = {"tiers": [posix(tmp_path)]}
    keys = [b"big-%d" % i for i in range(8)]
    data = [np.random.bytes(2 * 2**20) for _ in keys]  # wide: two copiers
    with Kernel(config) as kernel:
        assert kernel.submit(Store(keys, buffers=data)).result(10).ok
    with Kernel(config) as kernel:
        assert kernel.wait_indexed(10)
        cpus = kernel._core.workers.copy._cpus
        outcome: dict = {}

        def bound_caller() -> None:
            os.sched_setaffinity(0, {cpus[0]})
            out = [bytearray(len(d)) for d in data]
            completion = kernel.submit(Load(keys, buffers=out))
            outcome["helped"] = completion._prepared is not None
            outcome["ok"] = completion.result(10).ok and out == data

        thread = threading.Thread(target=bound_caller)
        thread.start()
        thread.join(20)
        assert outcome == {"helped": True, "ok": True}
        assert kernel.statistics()["loads_from_memory_helped"] == 1
        out = [bytearray(len(d)) for d in data]
        completion = kernel.submit(Load(keys, buffers=out))  # this thread: not bound
        assert completion._prepared is None
        assert completion.result(10).ok and out == data
