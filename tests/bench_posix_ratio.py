"""A quick local check, not a test: posix driver throughput against a raw preadv / pwritev loop
on the same files (page cache warm, no fsync). Run: .venv/bin/python tests/bench_posix_ratio.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import trio

from ucm.drivers.posix import PosixDriver

BLOCK = 2 * 2**20
COUNT = 64
BATCH = 16
ROUNDS = 5


def raw_load(paths: list[str], bufs: list[memoryview]) -> None:
    for path, buf in zip(paths, bufs, strict=True):
        fd = os.open(path, os.O_RDONLY)
        os.preadv(fd, [buf], 4096)
        os.close(fd)


def raw_store(paths: list[str], bufs: list[memoryview]) -> None:
    for path, buf in zip(paths, bufs, strict=True):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwritev(fd, [buf], 0)
        os.close(fd)


def best(fn, *args) -> float:
    times = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return min(times)


async def main(root: str) -> None:
    drv = await PosixDriver.open({"path": root}, name="bench", namespace="bench")
    keys = [os.urandom(16) for _ in range(COUNT)]
    data = [memoryview(bytearray(os.urandom(BLOCK))) for _ in range(COUNT)]
    bufs = [memoryview(bytearray(BLOCK)) for _ in range(COUNT)]
    await drv.store(keys, data)
    paths = [drv.block_path(k) for k in keys]
    raw_dir = os.path.join(root, "raw")
    os.makedirs(raw_dir)
    raw_paths = [os.path.join(raw_dir, f"{i}.bin") for i in range(COUNT)]

    async def drv_load() -> None:
        for i in range(0, COUNT, BATCH):
            await drv.load(keys[i : i + BATCH], bufs[i : i + BATCH])

    async def drv_store() -> None:
        for i in range(0, COUNT, BATCH):
            await drv.store(keys[i : i + BATCH], data[i : i + BATCH])

    async def abest(fn) -> float:
        times = []
        for _ in range(ROUNDS):
            t = time.perf_counter()
            await fn()
            times.append(time.perf_counter() - t)
        return min(times)

    gib = COUNT * BLOCK / 2**30
    raw_l = best(raw_load, paths, bufs)
    drv_l = await abest(drv_load)
    raw_s = best(raw_store, raw_paths, data)
    drv_s = await abest(drv_store)
    print(f"setup: {COUNT} blocks of {BLOCK} B under {root}, batches of {BATCH}, "
          f"best of {ROUNDS}, page cache warm, no fsync, python {sys.version.split()[0]}")
    print(f"load : raw preadv {gib / raw_l:6.2f} GiB/s  driver {gib / drv_l:6.2f} GiB/s  "
          f"ratio {raw_l / drv_l:.2f}")
    print(f"store: raw pwritev {gib / raw_s:6.2f} GiB/s  driver {gib / drv_s:6.2f} GiB/s  "
          f"ratio {raw_s / drv_s:.2f}")
    await drv.aclose()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        trio.run(main, tmp)
