"""memory driver specifics: local and shared modes. The shared behaviour is in tests/contract."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest
import trio

from ucm.drivers import Listing, LoadState
from ucm.drivers.kit import Workers
from ucm.drivers.memory import SHM_ROOT, MemoryDriver
from ucm.errors import ConfigError


@pytest.fixture
def shm_dir():
    path = Path("/dev/shm") / f"ucm-test-{uuid.uuid4().hex[:12]}"
    yield str(path)
    shutil.rmtree(path, ignore_errors=True)


async def test_local_instances_do_not_share():
    a = await MemoryDriver.open({}, name="m", namespace="ns")
    b = await MemoryDriver.open({}, name="m", namespace="ns")
    await a.store([b"k"], [memoryview(b"v")])
    assert await b.lookup([b"k"]) == [False]
    assert a.persistent is False and not a.shared
    assert isinstance(a, Listing)


async def test_local_store_copies_the_callers_bytes():
    drv = await MemoryDriver.open({}, name="m", namespace="ns")
    src = bytearray(b"a" * 100_000)  # above the inline size: copied in a worker thread
    small = bytearray(b"b" * 10)
    assert await drv.store([b"big", b"small"], [memoryview(src), memoryview(small)]) == [
        100_000, 10]
    src[:] = b"z" * 100_000
    small[:] = b"z" * 10
    outs = [memoryview(bytearray(100_000)), memoryview(bytearray(10))]
    assert await drv.load([b"big", b"small"], outs) == [LoadState.OK] * 2
    assert outs[0] == b"a" * 100_000 and outs[1] == b"b" * 10


async def test_local_zstd_stores_fewer_bytes():
    drv = await MemoryDriver.open({}, name="m", namespace="ns", codec="zstd")
    [size] = await drv.store([b"k"], [memoryview(b"\0" * 1_000_000)])
    assert size < 1000
    out = memoryview(bytearray(1_000_000))
    assert await drv.load([b"k"], [out]) == [LoadState.OK] and out == b"\0" * 1_000_000


async def test_aclose_frees_local_blocks():
    drv = await MemoryDriver.open({}, name="m", namespace="ns")
    await drv.store([b"k"], [memoryview(b"v")])
    backend = drv.backend
    await drv.aclose()
    assert backend.records == {}


async def test_shared_instances_see_each_other(shm_dir: str):
    a = await MemoryDriver.open({"shared": True, "shm_dir": shm_dir}, name="m", namespace="ns")
    b = await MemoryDriver.open({"shared": True, "shm_dir": shm_dir}, name="m", namespace="ns")
    await a.store([b"k"], [memoryview(b"hello")])
    out = memoryview(bytearray(5))
    assert await b.load([b"k"], [out]) == [LoadState.OK] and out == b"hello"
    assert a.arena.path == f"{shm_dir}/ns.arena"
    assert a.persistent is False and a.shared
    await b.delete([b"k"])
    assert await a.lookup([b"k"]) == [False]
    await a.aclose()
    await b.aclose()


async def test_shared_default_arena_is_per_namespace():
    namespace = f"ucm-test-{uuid.uuid4().hex[:12]}"
    root_existed = Path(SHM_ROOT).exists()
    drv = await MemoryDriver.open({"shared": True}, name="m", namespace=namespace)
    try:
        assert drv.arena.path == f"/dev/shm/ucm-{os.geteuid()}/{namespace}.arena"
        assert drv.statistics()["arena_bytes"] > (1 << 30) - (8 << 20)  # the default 1 GiB
    finally:
        await drv.aclose()
        for suffix in ("", ".lock"):
            (Path(SHM_ROOT) / f"{namespace}.arena{suffix}").unlink()
        if not root_existed:  # leave the host's /dev/shm as the test found it
            Path(SHM_ROOT).rmdir()


async def test_arena_only_in_shared_mode():
    drv = await MemoryDriver.open({}, name="m", namespace="ns")
    with pytest.raises(TypeError, match="shared mode only"):
        drv.arena  # noqa: B018
    for options in ({"size": "1GiB"}, {"shm_dir": "/dev/shm/x"}):
        with pytest.raises(ConfigError, match="applies to shared mode only"):
            await MemoryDriver.open(options, name="m", namespace="ns")


async def test_small_local_ops_stay_on_the_trio_thread(monkeypatch):
    hops = []
    real = trio.to_thread.run_sync

    async def counting(fn, *args, **kwargs):
        hops.append(fn)
        return await real(fn, *args, **kwargs)

    workers = Workers()
    real_store = workers.run_store

    async def counting_store(fn, *args):
        hops.append(fn)
        return await real_store(fn, *args)

    monkeypatch.setattr(trio.to_thread, "run_sync", counting)
    monkeypatch.setattr(workers, "run_store", counting_store)  # stores: idle-priority threads
    drv = await MemoryDriver.open({}, name="m", namespace="ns", workers=workers)
    await drv.store([b"k"], [memoryview(b"v" * 100)])
    await drv.lookup([b"k"])
    assert hops == []
    await drv.store([b"big"], [memoryview(b"v" * 2**20)])
    assert len(hops) == 1
