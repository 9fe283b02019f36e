"""Installed, the driver is found by name through its entry point, and a kernel uses it."""

from __future__ import annotations

import ucm_sqlite

from ucm.config import load_config
from ucm.drivers import Driver, Listing, available_drivers, get_driver_class
from ucm.kernel import KernelCore, Load, Lookup, Store


def test_entry_point_registers_the_driver():
    assert available_drivers()["sqlite"] == "ucm_sqlite:SqliteDriver"
    assert get_driver_class("sqlite") is ucm_sqlite.SqliteDriver


async def test_a_kernel_stores_and_loads_through_it(tmp_path):
    keys = [b"block-0", b"block-1"]
    blocks = [bytes([1]) * 8192, bytes([2]) * 8192]
    config = {"tiers": [{"driver": "sqlite", "path": str(tmp_path / "blocks.db")}]}
    async with KernelCore.open(load_config(config)) as core:
        driver = core.tiers[0].driver
        assert isinstance(driver, Driver) and isinstance(driver, Listing)
        assert (await core.run(Store(keys, buffers=blocks))).ok
        assert (await core.run(Lookup([*keys, b"absent"]))).hits == (True, True, False)
        out = [bytearray(8192) for _ in keys]
        assert (await core.run(Load(keys, buffers=out))).ok
        assert [bytes(b) for b in out] == blocks
    # a new kernel on the same file finds the blocks again (the tier lists them at start)
    async with KernelCore.open(load_config(config)) as core:
        out = [bytearray(8192) for _ in keys]
        assert (await core.run(Load(keys, buffers=out))).ok
        assert [bytes(b) for b in out] == blocks
