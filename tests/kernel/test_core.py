"""KernelCore on trio (virtual time where timing matters): tiers, durability, promotion,
capacity with pins, deadlines, single-flight, corrupt fallback, hot-plug."""

from __future__ import annotations

import math
import os

import pytest
import trio
import trio.testing

from ucm.config import load_config
from ucm.drivers import LoadState
from ucm.errors import ConfigError, DeadlineExceeded, InvalidRequest
from ucm.kernel import Delete, KernelCore, Load, Lookup, Prefetch, Store, Unpin

MiB = 1 << 20


def blocks(n: int, size: int = 64 * 1024, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    rng = __import__("random").Random(seed)
    keys = [rng.randbytes(16) for _ in range(n)]
    data = [rng.randbytes(size) for _ in range(n)]
    return keys, data


def two_tiers(tmp_path, *, memory: dict | None = None, posix: dict | None = None, **top):
    return load_config({
        "tiers": [
            {"driver": "memory", **(memory or {})},
            {"driver": "posix", "path": str(tmp_path / "blocks"), **(posix or {})},
        ],
        **top,
    })


def faulty_posix(tmp_path, **faults) -> dict:
    return {"driver": "faulty", "name": "disk",
            "inner": {"driver": "posix", "path": str(tmp_path / "blocks")}, **faults}


async def test_round_trip_through_two_tiers(tmp_path):
    keys, data = blocks(6)
    async with KernelCore.open(two_tiers(tmp_path)) as core:
        stored = await core.run(Store(keys, buffers=data))
        assert stored.ok
        found = await core.run(Lookup([*keys, b"absent"]))
        assert found.hits == (True,) * 6 + (False,)
        assert found.tiers[:6] == ("memory",) * 6
        out = [bytearray(len(d)) for d in data]
        loaded = await core.run(Load(keys, buffers=out))
        assert loaded.ok and loaded.tiers == ("memory",) * 6
        assert [bytes(b) for b in out] == data
        # durability "local" (the default) put every block on the persistent tier too
        assert all(k in core.tiers[1] for k in keys)


async def test_prefix_lookup_stops_at_first_miss(tmp_path):
    keys, data = blocks(5)
    async with KernelCore.open(two_tiers(tmp_path)) as core:
        await core.run(Store([keys[0], keys[1], keys[3]],
                             buffers=[data[0], data[1], data[3]]))
        result = await core.run(Lookup(keys, prefix=True))
        assert result.prefix_len == 2
        assert result.hits == (True, True, False, False, False)
        full = await core.run(Lookup(keys))
        assert full.hits == (True, True, False, True, False)


async def test_missing_block_is_a_miss_not_an_error(tmp_path):
    async with KernelCore.open(two_tiers(tmp_path)) as core:
        result = await core.run(Load([b"nothing"], buffers=[bytearray(10)]))
        assert result.states == (LoadState.MISSING,)
        assert result.tiers == (None,)


async def test_load_from_lower_tier_promotes_in_background(tmp_path):
    keys, data = blocks(3)
    async with KernelCore.open(two_tiers(tmp_path)) as core:
        await core.run(Store(keys, buffers=data))
        memory = core.tiers[0]
        for key in keys:  # drop the memory copies
            memory.discard(key)
        await memory.driver.delete(keys)
        out = [bytearray(len(d)) for d in data]
        result = await core.run(Load(keys, buffers=out))
        assert result.tiers == ("posix",) * 3 and [bytes(b) for b in out] == data
        await core.wait_background_idle()
        assert all(k in memory for k in keys)
        again = await core.run(Load(keys, buffers=out))
        assert again.tiers == ("memory",) * 3


async def test_lookup_and_load_that_ask_for_no_promotion_leave_blocks_below(tmp_path):
    keys, data = blocks(4)
    async with KernelCore.open(two_tiers(tmp_path)) as core:
        await core.run(Store(keys, buffers=data))
        memory = core.tiers[0]
        for key in keys:  # the blocks are on the posix tier only
            memory.discard(key)
        await memory.driver.delete(keys)
        found = await core.run(Lookup(keys, prefix=True, promote=False))
        assert found.tiers == ("posix",) * 4
        out = [bytearray(len(d)) for d in data]
        loaded = await core.run(Load(keys[:2], buffers=out[:2], promote=False))
        assert loaded.tiers == ("posix",) * 2 and [bytes(b) for b in out[:2]] == data[:2]
        await core.wait_background_idle()
        assert not any(k in memory for k in keys)
        assert core.stats["promoted"] == 0
        # the default still promotes: a lookup's hits, then a load's
        await core.run(Lookup(keys[:1]))
        await core.run(Load(keys[3:], buffers=out[3:]))
        await core.wait_background_idle()
        assert [k in memory for k in keys] == [True, False, False, True]


async def test_prefetch_copies_into_the_fastest_tier(tmp_path):
    keys, data = blocks(4)
    cfg = two_tiers(tmp_path, promote=False)
    async with KernelCore.open(cfg) as core:
        await core.run(Store(keys, buffers=data))
        memory = core.tiers[0]
        memory.discard(keys[0])
        await memory.driver.delete([keys[0]])
        result = await core.run(Prefetch([*keys, b"gone"]))
        assert (result.promoted, result.resident, result.missing) == (1, 3, 1)
        assert keys[0] in memory


async def test_durability_memory_completes_before_the_slow_tier(tmp_path):
    keys, data = blocks(2)
    cfg = load_config({"tiers": [{"driver": "memory"},
                                 faulty_posix(tmp_path, latency=1.0, ops=["store"])]})
    async with KernelCore.open(cfg) as core:
        result = await core.run(Store(keys, buffers=data, durability="memory"))
        assert result.ok
        disk = core.tiers[1]
        assert not any(k in disk for k in keys)  # completed while the slow tier still writes
        await core.wait_background_idle()
        assert all(k in disk for k in keys)  # propagated from the memory tier
        await core.run(Delete(keys))
        assert not any(k in disk for k in keys)
        result = await core.run(Store(keys, buffers=data, durability="local"))
        assert result.ok and all(k in disk for k in keys)  # waited for the slow tier


async def test_a_failed_store_is_never_reported_stored(tmp_path):
    keys, data = blocks(2)
    cfg = load_config({"tiers": [{"driver": "memory"},
                                 faulty_posix(tmp_path, error_rate=1.0, ops=["store"])]})
    async with KernelCore.open(cfg) as core:
        result = await core.run(Store(keys, buffers=data, durability="local"))
        assert result.stored == (False, False)
        assert "disk" in result.errors[0]
        assert core.stats["store_failed"] == 2
        # durability memory does not wait for the failing tier
        result = await core.run(Store(keys, buffers=data, durability="memory"))
        assert result.ok


async def test_capacity_eviction_never_takes_a_pinned_block(tmp_path):
    size = 64 * 1024
    keys, data = blocks(8, size)
    cfg = load_config({"tiers": [{"driver": "memory", "capacity": 3 * (size + 4096)}]})
    async with KernelCore.open(cfg) as core:
        await core.run(Store(keys[:3], buffers=data[:3]))
        await core.run(Lookup([keys[0]], pin=True))
        for i in range(3, 8):
            assert (await core.run(Store([keys[i]], buffers=[data[i]]))).ok
        tier = core.tiers[0]
        assert keys[0] in tier
        assert tier.policy.used <= tier.policy.capacity
        out = bytearray(size)
        assert (await core.run(Load([keys[0]], buffers=[out]))).ok  # releases the pin
        assert bytes(out) == data[0]
        for i in range(3, 8):
            await core.run(Store([keys[i]], buffers=[data[i]]))
        assert core.stats["evictions.memory"] >= 5


async def test_full_of_pins_refuses_the_store(tmp_path):
    size = 64 * 1024
    keys, data = blocks(3, size)
    cfg = load_config({"tiers": [{"driver": "memory", "capacity": 2 * (size + 4096)}]})
    async with KernelCore.open(cfg) as core:
        await core.run(Store(keys[:2], buffers=data[:2]))
        await core.run(Lookup(keys[:2], pin=True))
        result = await core.run(Store([keys[2]], buffers=[data[2]]))
        assert result.stored == (False,) and "no room" in result.errors[0]
        await core.run(Unpin(keys[:2]))
        assert (await core.run(Store([keys[2]], buffers=[data[2]]))).ok


async def test_pins_expire_after_pin_ttl(tmp_path, autojump_clock):
    size = 4096
    keys, data = blocks(2, size)
    cfg = load_config({"tiers": [{"driver": "memory", "capacity": size + 4096}],
                       "pin_ttl": 10})
    async with KernelCore.open(cfg) as core:
        await core.run(Store(keys[:1], buffers=data[:1]))
        await core.run(Lookup(keys[:1], pin=True))
        assert not (await core.run(Store(keys[1:], buffers=data[1:]))).ok
        await trio.sleep(11)
        assert (await core.run(Store(keys[1:], buffers=data[1:]))).ok


async def test_deadline_reaches_a_hanging_driver(tmp_path, autojump_clock):
    cfg = load_config({"tiers": [faulty_posix(tmp_path, hang=True, ops=["load", "lookup"])],
                       "deadline": 2.0})
    async with KernelCore.open(cfg) as core:
        start = trio.current_time()
        with pytest.raises(DeadlineExceeded, match=r"within 2 s"):
            await core.run(Load([b"k"], buffers=[bytearray(8)]))
        assert trio.current_time() - start == pytest.approx(2.0)
        with pytest.raises(DeadlineExceeded, match=r"within 0\.5 s"):
            await core.run(Lookup([b"k"], deadline=0.5))
        core.tiers[0].driver.faults.hang = False


async def test_concurrent_loads_of_one_key_read_storage_once(tmp_path, autojump_clock):
    keys, data = blocks(1)
    # No deadline: on virtual time the clock leaps to any finite one while a posix thread works.
    cfg = load_config({"tiers": [faulty_posix(tmp_path, latency=1.0)], "promote": False,
                       "deadline": math.inf})
    async with KernelCore.open(cfg) as core:
        await core.run(Store(keys, buffers=data))
        inner = core.tiers[0].driver.inner
        before = inner.statistics()["loads"]
        outs = [bytearray(len(data[0])) for _ in range(5)]
        results = []

        async def load(buf):
            results.append(await core.run(Load(keys, buffers=[buf])))

        async with trio.open_nursery() as nursery:
            for buf in outs:
                nursery.start_soon(load, buf)
        assert all(r.ok for r in results)
        assert all(bytes(b) == data[0] for b in outs)
        assert inner.statistics()["loads"] - before == 1
        assert core.stats["load_single_flight"] == 4


async def test_corrupt_copy_falls_back_to_the_next_tier(tmp_path):
    keys, data = blocks(2)
    cfg = load_config({"tiers": [
        {"driver": "faulty", "name": "flaky", "inner": {"driver": "memory"},
         "corrupt_rate": 1.0, "ops": ["load"]},
        {"driver": "posix", "path": str(tmp_path / "b")},
    ], "promote": False})
    async with KernelCore.open(cfg) as core:
        await core.run(Store(keys, buffers=data))
        out = [bytearray(len(d)) for d in data]
        result = await core.run(Load(keys, buffers=out))
        assert result.ok and result.tiers == ("posix", "posix")
        assert [bytes(b) for b in out] == data
        assert core.stats["errors.flaky.load.corrupt"] == 2


async def test_every_tier_failing_reports_failed_not_ok(tmp_path):
    keys, data = blocks(1)
    cfg = load_config({"tiers": [faulty_posix(tmp_path, error_rate=0.0)]})
    async with KernelCore.open(cfg) as core:
        await core.run(Store(keys, buffers=data))
        core.tiers[0].driver.faults.error_rate = 1.0
        result = await core.run(Load(keys, buffers=[bytearray(len(data[0]))]))
        assert result.states == (LoadState.FAILED,)
        assert result.errors and "disk" in result.errors[0]


async def test_detach_while_busy_loses_nothing(tmp_path, autojump_clock):
    keys, data = blocks(4)
    cfg = load_config({"tiers": [faulty_posix(tmp_path, latency=1.0)]})
    async with KernelCore.open(cfg) as core:
        await core.run(Store(keys, buffers=data))
        results = []

        async def load(i):
            buf = bytearray(len(data[i]))
            results.append((await core.run(Load([keys[i]], buffers=[buf])), bytes(buf), i))

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(load, i)
            await trio.testing.wait_all_tasks_blocked()
            await core.detach("disk")
        assert len(results) == 4
        assert all(r.ok and buf == data[i] for r, buf, i in results)
        assert core.tiers == []
        # the tier came back on attach: blocks on disk are found again, indexed or not
        await core.attach({"driver": "posix", "path": str(tmp_path / "blocks")})
        assert (await core.run(Lookup(keys))).hits == (True,) * 4
        await core.wait_background_idle()
        assert all(k in core.tiers[0] for k in keys)


async def test_attach_finds_blocks_already_on_disk(tmp_path):
    keys, data = blocks(3)
    async with KernelCore.open(two_tiers(tmp_path)) as core:
        await core.run(Store(keys, buffers=data))
    async with KernelCore.open(two_tiers(tmp_path)) as core:
        disk = core.tiers[1]
        await core.wait_background_idle()  # the index is rebuilt in the background
        assert all(k in disk for k in keys)
        assert disk.policy.used >= sum(len(d) for d in data)
        result = await core.run(Lookup(keys))
        assert result.tiers == ("posix",) * 3


async def test_delete_removes_from_every_tier(tmp_path):
    keys, data = blocks(2)
    async with KernelCore.open(two_tiers(tmp_path)) as core:
        await core.run(Store(keys, buffers=data))
        await core.run(Delete(keys[:1]))
        assert (await core.run(Lookup(keys))).hits == (False, True)


async def test_wrong_buffer_size_is_an_invalid_request(tmp_path):
    keys, data = blocks(1)
    async with KernelCore.open(two_tiers(tmp_path)) as core:
        await core.run(Store(keys, buffers=data))
        with pytest.raises(InvalidRequest, match="bytes"):
            await core.run(Load(keys, buffers=[bytearray(len(data[0]) - 1)]))


def test_bad_events_fail_in_the_callers_thread():
    with pytest.raises(InvalidRequest, match="empty batch"):
        Load([], buffers=[])
    with pytest.raises(InvalidRequest, match="2 keys but 1 buffers"):
        Store([b"a", b"b"], buffers=[b"x"])
    with pytest.raises(InvalidRequest, match="limit is 255"):
        Lookup([b"k" * 256])
    with pytest.raises(InvalidRequest, match="must be bytes"):
        Lookup(["text"])
    with pytest.raises(InvalidRequest, match="writable"):
        Load([b"k"], buffers=[b"read-only"])
    with pytest.raises(InvalidRequest, match="deadline"):
        Lookup([b"k"], deadline=0)


@pytest.mark.parametrize(("config", "message"), [
    ({"tiers": [{"driver": "memory", "capacty": "1GiB"}]}, r"tiers\.0.*capacty: unknown key"),
    ({"tiers": [{"driver": "nosuch"}]}, "unknown driver 'nosuch'"),
    ({"tiers": [{"driver": "memory", "capacity": "lots"}]}, r"tiers\.0\.capacity"),
    ({"tiers": []}, "tiers"),
    ({"tiers": [{"driver": "memory"}], "durability": "disk"}, "durability"),
    ({"tiers": [{"driver": "memory"}, {"driver": "memory"}]}, "unique"),
    ({"tiers": [{"driver": "posix"}]}, r"tiers\.0.*path"),
    # a capacity of 0 is refused; leaving it out (null) makes a tier unbounded
    ({"tiers": [{"driver": "memory", "capacity": 0}]}, r"^tiers\.0\.capacity: must be > 0"),
    # counted in bytes: 130 two-byte characters would pass a 255-character limit
    ({"tiers": [{"driver": "memory"}], "namespace": "é" * 130},
     r"^namespace: is 260 bytes as UTF-8; the limit is 255"),
    ({"tiers": [{"driver": "memory"}], "deadline": None}, r"^deadline: "),
])
def test_bad_config_names_the_key(config, message):
    with pytest.raises(ConfigError, match=message):
        load_config(config)


def test_every_event_is_bounded_by_default():
    assert load_config({"tiers": [{"driver": "memory"}]}).deadline == 30.0


def test_config_from_yaml_and_default(tmp_path):
    path = tmp_path / "ucm.yaml"
    path.write_text("tiers:\n  - driver: memory\n    capacity: 2GiB\n"
                    f"  - driver: posix\n    path: {tmp_path}\n    capacity: 100GiB\n")
    cfg = load_config(path)
    assert cfg.tiers[0].capacity == 2 * 2**30
    assert cfg.tiers[1].options.path == str(tmp_path)
    default = load_config(None)
    assert [t.driver for t in default.tiers] == ["memory", "posix"]
    assert os.path.expanduser("~") in str(default.tiers[1].options.path) or os.environ.get(
        "XDG_CACHE_HOME")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
