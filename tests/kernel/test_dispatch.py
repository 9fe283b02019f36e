"""Priorities at a saturated driver, and the driver registry (built-in, registered, entry
points)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from ucm.config import load_config
from ucm.drivers import available_drivers, get_driver_class, register_driver, unregister_driver
from ucm.drivers.memory import MemoryDriver
from ucm.errors import ConfigError
from ucm.kernel import KernelCore, Lookup, Priority, PriorityLimiter, Store


async def test_waiters_are_served_by_priority_then_arrival():
    limiter = PriorityLimiter(1)
    order: list[str] = []
    await limiter.acquire(Priority.STORE)  # saturate

    async def wait(name: str, priority: int) -> None:
        async with limiter.slot(priority):
            order.append(name)

    async with trio.open_nursery() as nursery:
        for name, priority in [("prefetch", Priority.PREFETCH), ("store", Priority.STORE),
                               ("load-1", Priority.LOAD), ("lookup", Priority.LOOKUP),
                               ("load-2", Priority.LOAD)]:
            nursery.start_soon(wait, name, priority)
            await trio.testing.wait_all_tasks_blocked()
        limiter.release()
    assert order == ["load-1", "load-2", "lookup", "store", "prefetch"]
    assert limiter.in_use == 0


async def test_a_cancelled_waiter_gives_its_turn_away():
    limiter = PriorityLimiter(1)
    await limiter.acquire(Priority.LOAD)
    got: list[str] = []

    async def wait(name: str, scope: trio.CancelScope) -> None:
        with scope:
            async with limiter.slot(Priority.LOAD):
                got.append(name)

    first = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, "first", first)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(wait, "second", trio.CancelScope())
        await trio.testing.wait_all_tasks_blocked()
        first.cancel()
        await trio.testing.wait_all_tasks_blocked()
        limiter.release()
    assert got == ["second"]
    assert limiter.in_use == 0 and limiter.waiting == 0


async def test_loads_overtake_queued_prefetch_at_a_busy_tier(tmp_path, autojump_clock):
    cfg = load_config({"tiers": [{"driver": "faulty", "name": "slow", "concurrency": 1,
                                  "latency": 1.0, "inner": {"driver": "memory"},
                                  "ops": ["lookup", "store"]}]})
    async with KernelCore.open(cfg) as core:
        done: list[str] = []

        async def lookup(name: str, priority_event) -> None:
            await core.run(priority_event)
            done.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lookup, "first", Lookup([b"a"]))
            await trio.testing.wait_all_tasks_blocked()
            # queued behind "first": a store (lower priority) then a lookup
            nursery.start_soon(lookup, "store", Store([b"s"], buffers=[b"x"]))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(lookup, "second", Lookup([b"b"]))
        # the lookup submitted after the store overtook it at the saturated driver
        assert done == ["first", "second", "store"]


class CountingMemory(MemoryDriver):
    """A third-party driver: the memory driver under another name."""


def test_register_driver_and_use_it_in_config():
    register_driver("counting", CountingMemory)
    try:
        assert "counting" in available_drivers()
        cfg = load_config({"tiers": [{"driver": "counting"}]})
        assert get_driver_class(cfg.tiers[0].driver) is CountingMemory
    finally:
        unregister_driver("counting")
    with pytest.raises(ConfigError, match="unknown driver 'counting'"):
        load_config({"tiers": [{"driver": "counting"}]})


def test_register_driver_by_path_and_bad_names():
    register_driver("lazy-memory", "ucm.drivers.memory:MemoryDriver")
    try:
        assert get_driver_class("lazy-memory") is MemoryDriver
    finally:
        unregister_driver("lazy-memory")
    with pytest.raises(ConfigError, match="alphanumeric"):
        register_driver("bad name!", MemoryDriver)
    register_driver("broken", "ucm.drivers.nosuchmodule:Driver")
    try:
        with pytest.raises(ConfigError, match="cannot be imported"):
            get_driver_class("broken")
    finally:
        unregister_driver("broken")


def test_entry_point_group_is_read(monkeypatch):
    import importlib.metadata

    from ucm.drivers import _registry

    class EP:
        name = "from-plugin"
        value = "ucm.drivers.memory:MemoryDriver"

    def fake_entry_points(*, group):
        assert group == "ucm.drivers"
        return [EP()]

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    monkeypatch.setattr(_registry, "_entry_points_loaded", False)
    try:
        assert get_driver_class("from-plugin") is MemoryDriver
    finally:
        unregister_driver("from-plugin")
        monkeypatch.setattr(_registry, "_entry_points_loaded", False)
