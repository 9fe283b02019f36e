"""The driver contract, run against the spec of the `ucm_driver_spec` fixture: round trips,
per-key outcomes, argument checks, corruption, concurrency, restarts and other processes.
Checks of a capability the driver or its spec lacks skip, saying which."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from ucm.drivers import STATISTICS, Driver, Listing, LoadState
from ucm.errors import InvalidRequest, StorageUnavailable
from ucm.testing._fixtures import _capability, driver, requires, scratch, spec
from ucm.testing._spec import DriverSpec, Scratch, call_hook, open_driver

pytestmark = pytest.mark.trio

SIZES = [1, 4095, 4096, 64 * 1024, 2 * 2**20 + 1]


def blocks(sizes: list[int], seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    rng = random.Random(seed)
    keys = [rng.randbytes(16) for _ in sizes]
    return keys, [rng.randbytes(n) for n in sizes]


def views(datas: list[bytes]) -> list[memoryview]:
    return [memoryview(d) for d in datas]


def empty(datas: list[bytes]) -> list[memoryview]:
    return [memoryview(bytearray(len(d))) for d in datas]


async def test_round_trip_is_bit_exact(driver: Driver) -> None:
    assert isinstance(driver, Driver), "the driver lacks part of ucm.drivers.Driver"
    keys, datas = blocks(SIZES)
    sizes = await driver.store(keys, views(datas))
    assert len(sizes) == len(keys) and all(s > 0 for s in sizes)
    assert await driver.lookup(keys) == [True] * len(keys)
    for key, data in zip(keys, datas, strict=True):  # one block per call, too
        assert await driver.lookup([key]) == [True]
        out = memoryview(bytearray(len(data)))
        assert await driver.load([key], [out]) == [LoadState.OK]
        assert out == data
    outs = empty(datas)
    assert await driver.load(keys, outs) == [LoadState.OK] * len(keys)
    assert [bytes(o) for o in outs] == datas
    stats = driver.statistics()
    missing = [k for k in STATISTICS if not isinstance(stats.get(k), int)]
    assert not missing, f"statistics() lacks these int counters: {missing}"
    assert stats["corrupt"] == 0


async def test_load_into_numpy_and_sliced_buffers(driver: Driver) -> None:
    np = pytest.importorskip("numpy")
    keys, datas = blocks([8192, 8192], seed=1)
    await driver.store(keys, [np.frombuffer(d, np.uint8).view(np.float32) for d in datas])
    arena = bytearray(3 * 8192)
    outs = [memoryview(arena)[100 : 100 + 8192], np.zeros(2048, np.float32)]
    assert await driver.load(keys, outs) == [LoadState.OK] * 2
    assert bytes(outs[0]) == datas[0] and outs[1].tobytes() == datas[1]


async def test_missing_key(driver: Driver) -> None:
    keys, datas = blocks([4096, 4096], seed=2)
    await driver.store(keys[:1], views(datas[:1]))
    assert await driver.lookup(keys) == [True, False]
    assert await driver.load(keys, empty(datas)) == [LoadState.OK, LoadState.MISSING]
    assert driver.statistics()["missing"] == 1


async def test_overwrite_then_load_gets_new_value(driver: Driver) -> None:
    keys, datas = blocks([65536], seed=3)
    _, newer = blocks([65536], seed=4)
    await driver.store(keys, views(datas))
    await driver.store(keys, views(newer))
    out = empty(newer)
    assert await driver.load(keys, out) == [LoadState.OK]
    assert out[0] == newer[0]


async def test_delete(driver: Driver) -> None:
    keys, datas = blocks([4096, 100], seed=5)
    await driver.store(keys, views(datas))
    await driver.delete([keys[0], b"never-stored"])
    assert await driver.lookup(keys) == [False, True]
    assert await driver.load(keys, empty(datas)) == [LoadState.MISSING, LoadState.OK]


async def test_list_blocks_matches_stores(driver: Driver) -> None:
    if not isinstance(driver, Listing):
        pytest.skip("driver does not list its blocks (ucm.drivers.Listing)")
    keys, datas = blocks([10, 5000, 70000], seed=6)
    sizes = await driver.store(keys, views(datas))
    listed = {key: size async for key, size in driver.list_blocks()}
    assert listed == dict(zip(keys, sizes, strict=True))


@requires("corrupt")
async def test_flipped_payload_byte_is_corrupt(spec: DriverSpec, driver: Driver) -> None:
    keys, datas = blocks([4096, 64 * 1024], seed=7)
    await driver.store(keys, views(datas))
    assert spec.corrupt is not None  # @requires("corrupt")
    await call_hook(spec.corrupt, driver, keys[1])
    before = driver.statistics()["corrupt"]
    outs = empty(datas)
    assert await driver.load(keys, outs) == [LoadState.OK, LoadState.CORRUPT]
    assert driver.statistics()["corrupt"] == before + 1
    assert outs[0] == datas[0]


@requires("truncate")
async def test_truncated_block_is_corrupt(spec: DriverSpec, driver: Driver) -> None:
    keys, datas = blocks([64 * 1024], seed=8)
    await driver.store(keys, views(datas))
    assert spec.truncate is not None  # @requires("truncate")
    await call_hook(spec.truncate, driver, keys[0])
    assert await driver.load(keys, empty(datas)) == [LoadState.CORRUPT]
    assert driver.statistics()["corrupt"] == 1


async def test_wrong_buffer_size_is_corrupt_or_invalid(driver: Driver) -> None:
    """A stored block that holds another size than the buffer is storage that lies or another
    layout: CORRUPT for that key, the rest of the batch loads. Only a tier whose blocks never
    left this process (memory) may call it the caller's mistake: InvalidRequest."""
    keys, datas = blocks([4096, 4096], seed=9)
    await driver.store(keys, views(datas))
    outs = [memoryview(bytearray(4095)), memoryview(bytearray(4096))]
    try:
        states = await driver.load(keys, outs)
    except InvalidRequest as exc:
        assert "buffer is 4095 bytes; the block holds 4096" in str(exc)
        assert driver.statistics()["corrupt"] == 0
        return
    assert states == [LoadState.CORRUPT, LoadState.OK]
    assert outs[1] == datas[1]
    assert driver.statistics()["corrupt"] == 1


@pytest.mark.parametrize("op", ["lookup", "load", "store", "delete"])
async def test_empty_batch_is_invalid(driver: Driver, op: str) -> None:
    args: tuple[list[object], ...] = ([],) if op in ("lookup", "delete") else ([], [])
    with pytest.raises(InvalidRequest, match="empty batch"):
        await getattr(driver, op)(*args)


@pytest.mark.parametrize("op", ["lookup", "load", "store", "delete"])
async def test_bad_keys_are_invalid(driver: Driver, op: str) -> None:
    for key, match in [(b"k" * 256, "256 bytes; the limit is 255"),
                       ("text", "must be bytes, not str"),
                       (b"", "must not be empty")]:
        args = ([key],) if op in ("lookup", "delete") else ([key], [memoryview(bytearray(8))])
        with pytest.raises(InvalidRequest, match=match):
            await getattr(driver, op)(*args)


@pytest.mark.parametrize("op", ["load", "store"])
async def test_keys_and_buffers_must_pair_up(driver: Driver, op: str) -> None:
    with pytest.raises(InvalidRequest, match="2 keys but 1 buffers"):
        await getattr(driver, op)([b"a", b"b"], [memoryview(bytearray(8))])
    with pytest.raises(InvalidRequest, match="buffer 0 is a int, not a buffer"):
        await getattr(driver, op)([b"a"], [7])


async def test_load_needs_writable_buffer(driver: Driver) -> None:
    with pytest.raises(InvalidRequest, match="read-only"):
        await driver.load([b"a"], [memoryview(b"12345678")])


async def test_concurrent_stores_and_loads_of_one_key(driver: Driver) -> None:
    key = b"contended"
    patterns = [bytes([i]) * 300_000 for i in range(1, 4)]

    async def writer(pattern: bytes) -> None:
        for _ in range(5):
            await driver.store([key], [memoryview(pattern)])

    seen = []
    async with trio.open_nursery() as nursery:
        for p in patterns:
            nursery.start_soon(writer, p)
        for _ in range(15):
            out = memoryview(bytearray(300_000))
            state = (await driver.load([key], [out]))[0]
            if state is LoadState.OK:
                seen.append(bytes(out))
            await trio.sleep(0)
    assert all(s in patterns for s in seen)
    out = memoryview(bytearray(300_000))
    assert await driver.load([key], [out]) == [LoadState.OK] and bytes(out) in patterns


async def test_closed_driver_refuses_work(spec: DriverSpec, scratch: Scratch) -> None:
    drv = await open_driver(spec, scratch)
    await drv.aclose()
    with pytest.raises(StorageUnavailable, match="closed"):
        await drv.lookup([b"a"])


@requires("outlives_instance")
async def test_restart_finds_blocks(spec: DriverSpec, scratch: Scratch) -> None:
    keys, datas = blocks([4096, 70000, 2 * 2**20 + 1], seed=10)
    first = await open_driver(spec, scratch)
    sizes = await first.store(keys, views(datas))
    await first.aclose()
    second = await open_driver(spec, scratch)
    try:
        assert await second.lookup(keys) == [True] * 3
        if isinstance(second, Listing):
            listed = {k: s async for k, s in second.list_blocks()}
            assert listed == dict(zip(keys, sizes, strict=True))
        outs = empty(datas)
        assert await second.load(keys, outs) == [LoadState.OK] * 3
        assert [bytes(o) for o in outs] == datas
    finally:
        await second.aclose()


@requires("cross_process")
async def test_namespaces_are_separate(spec: DriverSpec, scratch: Scratch) -> None:
    a = await open_driver(spec, scratch, namespace="ns-a")
    b = await open_driver(spec, scratch, namespace="ns/b")
    try:
        await a.store([b"k"], [memoryview(b"x" * 10)])
        if spec.options_for(scratch).get("shm_dir"):
            pytest.skip("shm_dir given explicitly is shared by namespaces")
        assert await b.lookup([b"k"]) == [False]
    finally:
        await a.aclose()
        await b.aclose()


# --- cross-process -----------------------------------------------------------------------


def worker_job(spec: DriverSpec, scratch: Scratch, **job: object) -> str:
    job.update(driver=spec.driver, options=spec.options_for(scratch), codec=spec.codec,
               namespace="contract")
    return json.dumps(job)


async def start_worker(job: str) -> trio.Process:
    # The worker imports what this process does: the driver may live beside the tests.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return await trio.lowlevel.open_process([sys.executable, "-m", "ucm.testing._worker", job],
                                            stdout=subprocess.PIPE, env=env)


async def read_lines(proc: trio.Process, count: int) -> list[str]:
    stdout = proc.stdout
    assert stdout is not None  # started with stdout=PIPE
    buf = b""
    while buf.count(b"\n") < count:
        chunk = await stdout.receive_some()
        if not chunk:
            raise AssertionError(f"worker exited early (rc {await proc.wait()})")
        buf += chunk
    return buf.decode().splitlines()


@pytest.mark.timeout(60)
@requires("cross_process")
async def test_two_writer_processes_one_key(spec: DriverSpec, driver: Driver,
                                          scratch: Scratch) -> None:
    key, size = b"shared-key", 512 * 1024
    patterns = [random.Random(seed).randbytes(size) for seed in (1, 2)]
    procs = [await start_worker(worker_job(spec, scratch, mode="hammer", key=key.hex(),
                                           seed=seed, size=size, count=60))
             for seed in (1, 2)]
    try:
        for proc in procs:
            await read_lines(proc, 1)
        ok = whole = 0
        out = memoryview(bytearray(size))
        with trio.move_on_after(20):
            while any(p.poll() is None for p in procs) or ok == 0:
                if (await driver.load([key], [out]))[0] is LoadState.OK:
                    ok += 1
                    whole += bytes(out) in patterns
                    assert whole == ok, "a load mixed two writers' blocks"
        assert ok > 0
        assert [await p.wait() for p in procs] == [0, 0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            await proc.wait()
    assert driver.statistics()["corrupt"] == 0


@pytest.mark.timeout(60)
@requires("cross_process")
async def test_writer_killed_mid_write_leaves_no_partial_block(spec: DriverSpec,
                                                               scratch: Scratch) -> None:
    size = 3 * 2**20 + 5
    proc = await start_worker(worker_job(spec, scratch, mode="flood", prefix="f1", size=size))
    try:
        lines = await read_lines(proc, 3)
        await trio.sleep(random.Random().uniform(0, 0.05))
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    announced = {bytes.fromhex(k) for line in lines for k in line.split()}
    drv = await open_driver(spec, scratch)  # opening (posix) or listing (nfs) sweeps dead temps
    try:
        if isinstance(drv, Listing):
            listed = {k: s async for k, s in drv.list_blocks()}
        else:  # a cache tier that cannot list (mooncake): what the writer announced
            listed = dict.fromkeys(announced, 0)
        assert announced <= set(listed)
        keys = sorted(listed)
        assert all(await drv.lookup(keys))
        outs = [memoryview(bytearray(size)) for _ in keys]
        assert await drv.load(keys, outs) == [LoadState.OK] * len(keys)
        assert drv.statistics()["corrupt"] == 0
        if not _has_block_files(drv):
            return  # object stores: a PUT is atomic, there are no temp files to check
        tmp_dirs = {Path(p).parent for k in keys for p in [_block_path(drv, k)]}
        assert not any(d.name == ".tmp" for d in tmp_dirs)
        for root in _roots(spec, scratch):  # temp files are in .tmp (posix) or next to blocks
            leftovers = [p for p in root.rglob("*.tmp") if p.is_file()]
            assert leftovers == [], leftovers
    finally:
        await drv.aclose()


def _has_block_files(drv: object) -> bool:
    while hasattr(drv, "inner"):
        drv = drv.inner
    return hasattr(drv, "block_path")


def _block_path(drv: object, key: bytes) -> str:
    while hasattr(drv, "inner"):
        drv = drv.inner
    assert hasattr(drv, "block_path")  # _has_block_files(drv)
    path: str = drv.block_path(key)
    return path


def _roots(spec: DriverSpec, scratch: Scratch) -> list[Path]:
    if spec.roots is not None:
        return spec.roots(scratch)
    opts = spec.options_for(scratch)
    if "shm_dir" in opts:
        return [Path(opts["shm_dir"])]
    if "path" not in opts:
        return []
    paths = opts["path"] if isinstance(opts["path"], list) else [opts["path"]]
    return [Path(p) / "contract" for p in paths]


__all__ = ["_capability", "driver", "pytestmark", "scratch", "spec",
           *(name for name in globals() if name.startswith("test_"))]
