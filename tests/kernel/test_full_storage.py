"""Storage that is fuller than a tier's capacity says: stores evict and go on (the capacity
shrinks to fit), and a capacity above the free space is reported at start."""

from __future__ import annotations

import logging

from ucm.config import load_config
from ucm.drivers import register_driver, unregister_driver
from ucm.drivers.memory import MemoryDriver
from ucm.errors import NoCapacity
from ucm.kernel import KernelCore, Load, Store

BLOCK = 64 * 1024
DEVICE = 4 * (BLOCK + 4096)  # what the device really takes: four blocks and their headers


class FullDevice(MemoryDriver):
    """Fault injection: the memory driver on a 'device' that fails stores with ENOSPC (as
    kit.os_error reports it) once they would pass DEVICE bytes."""

    async def store(self, keys, buffers):
        held = sum(4096 + len(r.payload) for r in self._backend.records.values())
        if held + sum(len(b) + 4096 for b in buffers) > DEVICE:
            self.enospc += 1
            raise NoCapacity("no space left on device", driver=self.name)
        return await super().store(keys, buffers)

    enospc = 0


async def test_a_full_device_shrinks_the_capacity_and_stores_go_on():
    register_driver("full-device", FullDevice)
    try:
        config = load_config({"tiers": [{"driver": "full-device", "capacity": "1GiB"}],
                              "promote": False})
        async with KernelCore.open(config) as core:
            data = [bytes([i]) * BLOCK for i in range(10)]
            for i, block in enumerate(data):  # one at a time, as a step's saves arrive
                result = await core.run(Store([b"k%d" % i], buffers=[block]))
                assert result.stored == (True,), result.errors
            tier = core.tiers[0]
            assert tier.driver.enospc == 1  # once: from then on the capacity is the device's
            assert core.stats["capacity_shrunk.full-device"] == 1
            # what it held when the device filled; a store's reservation counts its header
            assert tier.policy.capacity <= DEVICE and 3 <= len(tier.policy) <= 4
            out = bytearray(BLOCK)  # the newest block is there and reads back
            assert (await core.run(Load([b"k9"], buffers=[out]))).ok and out == data[9]
    finally:
        unregister_driver("full-device")


async def test_an_empty_full_device_fails_the_store_and_keeps_the_capacity():
    register_driver("full-device", FullDevice)
    try:
        config = load_config({"tiers": [{"driver": "full-device", "capacity": "1GiB"}]})
        async with KernelCore.open(config) as core:
            result = await core.run(Store([b"big"], buffers=[b"x" * (DEVICE + 1)]))
            assert result.stored == (False,) and "no space" in result.errors[0]
            assert core.tiers[0].policy.capacity == 2**30
            assert core.stats["errors.full-device.store.NoCapacity"] == 1
    finally:
        unregister_driver("full-device")


async def test_a_capacity_above_the_free_space_is_reported(tmp_path, caplog):
    config = load_config({"tiers": [{"driver": "posix", "path": str(tmp_path),
                                     "capacity": "1000PiB"}]})
    with caplog.at_level(logging.WARNING, logger="ucm.kernel"):
        async with KernelCore.open(config) as core:
            await core.wait_background_idle()  # the check runs once the listing is done
    [record] = [r for r in caplog.records if "more than its storage can take" in r.message]
    assert record.message.startswith("tier posix: capacity ")
    assert core.tiers == []  # closed


async def test_a_capacity_within_the_free_space_is_not_reported(tmp_path, caplog):
    config = load_config({"tiers": [{"driver": "posix", "path": str(tmp_path),
                                     "capacity": "1MiB"}]})
    with caplog.at_level(logging.WARNING, logger="ucm.kernel"):
        async with KernelCore.open(config) as core:
            await core.wait_background_idle()
    assert not [r for r in caplog.records if "more than its storage" in r.message]
