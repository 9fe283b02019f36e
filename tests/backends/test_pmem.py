"""The pmem driver on real libpmem: recovery after SIGKILL (on /dev/shm and on ext4), torn
index entries, a full pool, the pmem_persist path (PMEM_IS_PMEM_FORCE=1), one owner per pool,
deletes that never break a load in progress, and batches spread over threads (a failed block,
a cancel between parts)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import trio

from ucm.drivers import LoadState
from ucm.drivers.pmem import PmemDriver
from ucm.errors import NoCapacity, StorageUnavailable

MiB = 2**20
WRITER = r"""
import json, os, sys, trio
from ucm.drivers.pmem import PmemDriver
job = json.loads(sys.argv[1])
async def main():
    drv = await PmemDriver.open(job["options"], namespace="crash")
    print("is_pmem", drv.statistics()["is_pmem"], flush=True)
    data = [memoryview(os.urandom(job["size"])) for _ in range(3)]
    live = []
    for i in range(100_000):
        keys = [b"k%d-%d" % (i, j) for j in range(3)]
        sizes = await drv.store(keys, data)
        assert all(sizes), sizes
        live.append(keys)
        if len(live) > 4:  # churn: freed extents and slots get reused
            await drv.delete(live.pop(0))
        print(i, " ".join(k.hex() for batch in live for k in batch), flush=True)
trio.run(main)
"""


def _spawn(options: dict, size: int, **env: str) -> subprocess.Popen:
    job = json.dumps({"options": options, "size": size})
    return subprocess.Popen([sys.executable, "-c", WRITER, job], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, **env,
                                            "PYTHONPATH": str(Path(__file__).parents[2])})


@pytest.fixture(params=["shm", "ext4"])
def pool_dir(request, tmp_path):
    if request.param == "ext4":
        yield tmp_path / "pmem"
        return
    path = Path("/dev/shm") / f"ucm-pmem-{uuid.uuid4().hex[:8]}"
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


@pytest.mark.timeout(60)
async def test_sigkill_mid_store_recovers_every_announced_block(pool_dir):
    options = {"path": str(pool_dir), "size": "48MiB", "max_blocks": 64}
    proc = _spawn(options, 1 * MiB + 17)
    lines = [proc.stdout.readline() for _ in range(25)]  # many times around the pool
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    last, *live = lines[-1].split()
    # the next delete (of the oldest batch) may have run before the kill
    announced = {bytes.fromhex(k) for k in live[3:]}
    gone = {b"k%d-%d" % (i, j) for i in range(int(last) - 4) for j in range(3)}
    drv = await PmemDriver.open(options, namespace="crash")
    try:
        listed = {k async for k, _ in drv.list_blocks()}
        assert announced <= listed
        keys = sorted(listed)
        outs = [memoryview(bytearray(MiB + 17)) for _ in keys]
        assert await drv.load(keys, outs) == [LoadState.OK] * len(keys)
        assert drv.statistics()["corrupt"] == 0
        assert not listed & gone  # deletes persisted too
    finally:
        await drv.aclose()


async def test_torn_index_entry_is_invisible(tmp_path):
    options = {"path": str(tmp_path), "size": "8MiB"}
    drv = await PmemDriver.open(options, namespace="torn")
    keys = [b"a", b"b", b"c"]
    await drv.store(keys, [memoryview(bytes([i]) * 5000) for i in range(3)])
    slot = drv.pool.index[b"b"].slot
    await drv.aclose()
    pool = tmp_path / "torn.pmem"
    with open(pool, "r+b") as f:  # flip a byte of b's entry, as a torn write would
        f.seek(4096 + slot * 64 + 20)
        byte = f.read(1)
        f.seek(4096 + slot * 64 + 20)
        f.write(bytes([byte[0] ^ 1]))
    drv = await PmemDriver.open(options, namespace="torn")
    try:
        assert await drv.lookup(keys) == [True, False, True]
        assert drv.statistics()["recovered_dropped"] == 1
        sizes = await drv.store([b"b"], [memoryview(b"x" * 5000)])  # its space is free again
        assert sizes == [4096 + 5000]
    finally:
        await drv.aclose()


async def test_full_pool_is_no_capacity_until_deleted(tmp_path):
    drv = await PmemDriver.open({"path": str(tmp_path), "size": "4MiB"}, namespace="full")
    try:
        block = memoryview(os.urandom(MiB))
        stored = []
        for i in range(8):
            sizes = await drv.store([b"%d" % i, b"%d+" % i], [block, block])
            stored += [k for k, s in zip([b"%d" % i, b"%d+" % i], sizes, strict=True) if s]
            if 0 in sizes:
                break
        assert 1 <= len(stored) < 4
        with pytest.raises(NoCapacity, match="no space left"):
            await drv.store([b"more"], [block])
        await drv.delete(stored[:1])
        assert await drv.store([b"more"], [block]) == [4096 + MiB]
    finally:
        await drv.aclose()


async def test_one_process_owns_a_pool(tmp_path):
    options = {"path": str(tmp_path), "size": "2MiB"}
    drv = await PmemDriver.open(options, namespace="own")
    try:
        with pytest.raises(StorageUnavailable, match=r"own.pmem is open in another process"):
            await PmemDriver.open(options, namespace="own")
    finally:
        await drv.aclose()
    await (await PmemDriver.open(options, namespace="own")).aclose()


def test_pmem_persist_path_when_forced(tmp_path):
    proc = _spawn({"path": str(tmp_path), "size": "8MiB"}, 4096, PMEM_IS_PMEM_FORCE="1")
    try:
        assert proc.stdout.readline().split() == ["is_pmem", "1"]
        assert proc.stdout.readline()  # a batch stored through pmem_persist
    finally:
        proc.kill()
        proc.wait()


async def test_delete_and_overwrite_never_break_a_load(tmp_path):
    drv = await PmemDriver.open({"path": str(tmp_path), "size": "32MiB"}, namespace="race")
    size = 4 * MiB
    patterns = [os.urandom(size) for _ in range(2)]
    states = []

    async def churn() -> None:
        for i in range(30):
            await drv.delete([b"k"])
            await drv.store([b"filler"], [memoryview(patterns[1])])  # reuses freed extents
            await drv.store([b"k"], [memoryview(patterns[i % 2])])
            await drv.delete([b"filler"])

    try:
        await drv.store([b"k"], [memoryview(patterns[0])])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(churn)
            for _ in range(30):
                out = memoryview(bytearray(size))
                state = (await drv.load([b"k"], [out]))[0]
                states.append(state)
                if state is LoadState.OK:
                    assert bytes(out) in patterns
        assert set(states) <= {LoadState.OK, LoadState.MISSING}
    finally:
        await drv.aclose()


# --- batches spread over threads ---------------------------------------------------------------


async def test_wide_batch_round_trips_across_threads(pool_dir):
    drv = await PmemDriver.open({"path": str(pool_dir), "size": "64MiB"}, namespace="wide")
    try:
        blocks = [os.urandom(MiB + 4096 * i) for i in range(7)]  # 7 MiB+: two threads
        keys = [b"w%d" % i for i in range(7)]
        twin = os.urandom(len(blocks[2]))  # w2 twice in one batch: one of the two is kept
        sizes = await drv.store([*keys, b"w2"], [memoryview(b) for b in [*blocks, twin]])
        assert sizes == [4096 + len(b) for b in [*blocks, twin]]
        assert drv.statistics()["blocks"] == 7
        outs = [memoryview(bytearray(len(b))) for b in blocks]
        assert await drv.load(keys, outs) == [LoadState.OK] * 7
        assert [bytes(o) for i, o in enumerate(outs) if i != 2] == blocks[:2] + blocks[3:]
        assert bytes(outs[2]) in (blocks[2], twin)
    finally:
        await drv.aclose()


async def test_failed_block_fails_its_part_and_stores_nothing(tmp_path, monkeypatch):
    drv = await PmemDriver.open({"path": str(tmp_path), "size": "32MiB"}, namespace="fail")
    free = drv.pool.free_bytes()
    place = drv.pool.place

    def flaky(key: bytes, view: memoryview):
        if key == b"bad":
            raise OSError(5, "injected")
        return place(key, view)

    monkeypatch.setattr(drv.pool, "place", flaky)
    try:
        keys = [b"a", b"bad", b"c", b"d"]
        with pytest.raises(StorageUnavailable, match="injected"):
            await drv.store(keys, [memoryview(os.urandom(2 * MiB))] * 4)
        assert await drv.lookup(keys) == [False] * 4
        assert drv.pool.free_bytes() == free  # the blocks that were copied are given back
    finally:
        await drv.aclose()
    drv = await PmemDriver.open({"path": str(tmp_path), "size": "32MiB"}, namespace="fail")
    try:
        assert await drv.lookup(keys) == [False] * 4  # nor after a restart
    finally:
        await drv.aclose()


async def test_cancel_lands_between_parts(tmp_path, monkeypatch):
    from ucm.drivers import pmem

    monkeypatch.setattr(pmem, "CHUNK_BYTES", 2 * MiB)  # one 2 MiB block per store part
    drv = await PmemDriver.open({"path": str(tmp_path), "size": "32MiB"}, namespace="cancel")
    entered, release = threading.Event(), threading.Event()
    place = drv.pool.place

    def slow(key: bytes, view: memoryview):
        entered.set()
        assert release.wait(10)
        return place(key, view)

    monkeypatch.setattr(drv.pool, "place", slow)
    keys = [b"p0", b"p1", b"p2"]
    try:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drv.store, keys, [memoryview(os.urandom(2 * MiB))] * 3)
                await trio.to_thread.run_sync(entered.wait)
                scope.cancel()  # the first part is being copied: it finishes, no other starts
                release.set()
        assert scope.cancelled_caught
        assert await drv.lookup(keys) == [True, False, False]
    finally:
        release.set()
        await drv.aclose()


def test_pmem_path_round_trips_when_forced(tmp_path):
    script = r"""
import os, sys, trio
from ucm.drivers import LoadState
from ucm.drivers.pmem import PmemDriver
async def main():
    options = {"path": sys.argv[1], "size": "32MiB"}
    blocks = [os.urandom(2 * 2**20) for _ in range(4)]
    keys = [b"k%d" % i for i in range(4)]
    drv = await PmemDriver.open(options, namespace="forced")
    assert drv.statistics()["is_pmem"] == 1
    await drv.store(keys, [memoryview(b) for b in blocks])
    await drv.aclose()
    drv = await PmemDriver.open(options, namespace="forced")
    outs = [memoryview(bytearray(len(b))) for b in blocks]
    assert await drv.load(keys, outs) == [LoadState.OK] * 4
    assert [bytes(o) for o in outs] == blocks
    await drv.aclose()
    print("ok")
trio.run(main)
"""
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, timeout=60,
                         env={**os.environ, "PMEM_IS_PMEM_FORCE": "1",
                              "PYTHONPATH": str(Path(__file__).parents[2])})
    assert out.stdout.split() == ["ok"], out.stderr



def test_next_fit_moves_round_the_pool():
    from ucm.drivers._pmem_pool import _NextFit

    free = _NextFit([(0, 100)])
    assert [free.allocate(10) for _ in range(3)] == [0, 10, 20]
    free.release(0, 10)  # behind the cursor: used again only after a wrap
    assert free.allocate(10) == 30
    assert free.allocate(60) == 40
    assert free.allocate(10) == 0  # wrapped round
    assert free.allocate(30) is None
    free.release(10, 20)
    assert free.allocate(20) == 10
    assert free.free_bytes == 0


def _mapped_bytes(path: str) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, current = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            if line[:1].isdigit() or line[:1] in "abcdef":  # a mapping's header line
                current = line.rstrip().endswith(path)
            elif current and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.parametrize("populate", [True, False])
async def test_reopened_pool_maps_its_blocks_at_open(tmp_path, populate):
    """After a restart the stored blocks are in this process's page tables before the first
    load (populate: true), not faulted in a few pages at a time during it."""
    options = {"path": str(tmp_path), "size": "64MiB", "populate": populate}
    drv = await PmemDriver.open(options, namespace="populate")
    data = memoryview(os.urandom(2 * MiB))
    assert all(await drv.store([b"k%d" % i for i in range(8)], [data] * 8))
    pool_path = drv.pool.path
    await drv.aclose()
    drv = await PmemDriver.open(options, namespace="populate")
    try:
        mapped = _mapped_bytes(pool_path)
        if populate:
            assert mapped >= 16 * MiB, mapped
        else:
            assert mapped < 4 * MiB, mapped  # headers read by recovery, little else
        out = memoryview(bytearray(2 * MiB))
        assert await drv.load([b"k3"], [out]) == [LoadState.OK] and out == data
    finally:
        await drv.aclose()
