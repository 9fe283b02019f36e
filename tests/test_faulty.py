"""The faulty driver: each fault, runtime changes, and that it stays honest about data."""

from __future__ import annotations

import pytest
import trio

from ucm.config import load_config
from ucm.drivers import Listing, LoadState
from ucm.drivers.faulty import FaultyDriver
from ucm.errors import ConfigError, InvalidRequest, StorageUnavailable


async def open_faulty(**options) -> FaultyDriver:
    options.setdefault("inner", {"driver": "memory"})
    return await FaultyDriver.open(options, name="f", namespace="ns")


async def test_latency_delays_each_affected_op(autojump_clock):
    drv = await open_faulty(latency=0.25, ops=["load"])
    start = trio.current_time()
    await drv.store([b"k"], [memoryview(b"v")])
    assert trio.current_time() == start
    out = memoryview(bytearray(1))
    assert await drv.load([b"k"], [out]) == [LoadState.OK]
    assert trio.current_time() - start == pytest.approx(0.25)


async def test_error_rate_one_raises_storage_unavailable():
    drv = await open_faulty(error_rate=1.0)
    with pytest.raises(StorageUnavailable, match="f: injected store failure"):
        await drv.store([b"k"], [memoryview(b"v")])
    with pytest.raises(StorageUnavailable, match="injected lookup failure"):
        await drv.lookup([b"k"])
    assert drv.statistics()["injected_errors"] == 2


async def test_error_rate_is_seeded_and_repeatable():
    async def pattern(seed: int) -> list[bool]:
        drv = await open_faulty(error_rate=0.5, seed=seed)
        result = []
        for _ in range(40):
            try:
                await drv.lookup([b"k"])
                result.append(True)
            except StorageUnavailable:
                result.append(False)
        return result

    first = await pattern(7)
    assert first == await pattern(7)
    assert 5 < first.count(False) < 35


async def test_corrupt_rate_one_reports_corrupt_never_ok():
    drv = await open_faulty(corrupt_rate=1.0)
    await drv.store([b"a", b"b"], [memoryview(b"1"), memoryview(b"2")])
    outs = [memoryview(bytearray(1)) for _ in range(3)]
    states = await drv.load([b"a", b"b", b"missing"], outs)
    assert states == [LoadState.CORRUPT, LoadState.CORRUPT, LoadState.MISSING]
    assert drv.statistics()["corrupt"] == 2


async def test_hang_is_cancellable(autojump_clock):
    drv = await open_faulty(hang=True)
    with trio.move_on_after(5) as scope:
        await drv.lookup([b"k"])
    assert scope.cancelled_caught
    assert trio.current_time() == pytest.approx(5)


async def test_faults_change_at_runtime(autojump_clock):
    drv = await open_faulty()
    await drv.store([b"k"], [memoryview(b"v")])
    drv.faults.hang = True
    with trio.move_on_after(1) as scope:
        await drv.load([b"k"], [memoryview(bytearray(1))])
    assert scope.cancelled_caught
    drv.faults.hang = False
    drv.faults.error_rate = 1.0
    drv.faults.ops = {"store"}
    assert await drv.lookup([b"k"]) == [True]
    with pytest.raises(StorageUnavailable):
        await drv.store([b"k"], [memoryview(b"v")])


async def test_wraps_the_inner_driver(tmp_path):
    drv = await open_faulty(inner={"driver": "posix", "path": str(tmp_path), "codec": "zstd"})
    assert drv.persistent is True and isinstance(drv, Listing)
    await drv.store([b"k"], [memoryview(b"\0" * 10000)])
    listed = [item async for item in drv.list_blocks()]
    assert [k for k, _ in listed] == [b"k"]
    assert listed[0][1] < 10000  # the inner tier's codec applies
    memory = await open_faulty()
    assert memory.persistent is False
    await drv.aclose()


async def test_validates_input_before_faults():
    drv = await open_faulty(hang=True)
    with pytest.raises(InvalidRequest, match="empty batch"):
        await drv.load([], [])


def test_options_are_checked():
    with pytest.raises(ConfigError, match="needs a 'driver' key"):
        load_config({"tiers": [{"driver": "faulty", "inner": {}}]})
    with pytest.raises(ConfigError, match="error_rate"):
        load_config({"tiers": [{"driver": "faulty", "inner": {"driver": "memory"},
                                "error_rate": 2}]})
    with pytest.raises(ConfigError, match="ops"):
        load_config({"tiers": [{"driver": "faulty", "inner": {"driver": "memory"},
                                "ops": ["fly"]}]})
