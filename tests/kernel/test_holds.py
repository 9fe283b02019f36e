"""Session holds: held blocks stay in the fastest tier through a flood, within the held-bytes
cap (oldest released first), until `end` or expiry (virtual time)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import trio

from ucm.config import load_config
from ucm.errors import ConfigError, InvalidRequest
from ucm.kernel import Delete, Kernel, KernelCore, Lookup, Store
from ucm.kernel._holds import Holds
from ucm.kernel._policy import LRUPolicy

SIZE = 4096
SLOT = SIZE  # a block's bytes in the memory tier (checked below)


def blocks(n: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)], [rng.randbytes(SIZE) for _ in range(n)]


def memory(slots: int, **sessions: object) -> object:
    return load_config({"tiers": [{"driver": "memory", "capacity": slots * SLOT}],
                        "sessions": sessions, "durability": "memory"})


async def resident(core: KernelCore, keys: list[bytes]) -> int:
    return sum(k in core.tiers[0] for k in keys)


async def test_a_held_session_survives_a_flood_that_evicts_an_unheld_one(autojump_clock):
    held, held_data = blocks(4, 1)
    other, other_data = blocks(4, 2)
    flood, flood_data = blocks(40, 3)
    async with KernelCore.open(memory(16)) as core:
        await core.run(Store(held, buffers=held_data))
        await core.run(Store(other, buffers=other_data))
        assert core.hold("s1", held, 300) == 4
        for i in range(0, 40, 4):
            assert (await core.run(Store(flood[i:i + 4], buffers=flood_data[i:i + 4]))).ok
        assert await resident(core, held) == 4
        assert await resident(core, other) == 0
        snap = core.snapshot()
        assert snap["tier.memory.held_bytes"] == sum(core.tiers[0].policy.size_of(k) or 0
                                                     for k in held)
        assert snap["tier.memory.held_sessions"] == 1 and snap["session_holds"] == 1
        # end: the next flood evicts them
        assert core.release("s1") and not core.release("s1")
        for i in range(0, 40, 4):
            await core.run(Store(flood[i:i + 4], buffers=flood_data[i:i + 4]))
        assert await resident(core, held) == 0
        assert core.stats["session_releases.end"] == 1


async def test_holds_expire_after_retain_s(autojump_clock):
    held, data = blocks(2, 4)
    flood, flood_data = blocks(8, 5)
    async with KernelCore.open(memory(4)) as core:
        await core.run(Store(held, buffers=data))
        core.hold("s", held, 10)
        await core.run(Store(flood[:2], buffers=flood_data[:2]))
        assert (await core.run(Store(flood[2:4], buffers=flood_data[2:4]))).ok
        assert await resident(core, held) == 2
        await trio.sleep(11)
        assert (await core.run(Store(flood[4:6], buffers=flood_data[4:6]))).ok
        assert (await core.run(Store(flood[6:], buffers=flood_data[6:]))).ok
        assert await resident(core, held) == 0
        assert core.stats["session_releases.expired"] == 1
        assert core.snapshot()["tier.memory.held_sessions"] == 0


async def test_over_the_cap_the_oldest_holds_go_first(autojump_clock):
    keys, data = blocks(9, 6)
    async with KernelCore.open(memory(20, max_pinned="25%")) as core:  # 5 blocks' bytes
        await core.run(Store(keys, buffers=data))
        assert {core.tiers[0].policy.size_of(k) for k in keys} == {SLOT}
        assert core.hold("a", keys[0:2], 300) == 2
        await trio.sleep(1)
        assert core.hold("b", keys[2:4], 300) == 2
        await trio.sleep(1)
        assert core.hold("c", keys[4:6], 300) == 2  # 6 blocks > 5 slots: "a" goes
        assert core.session_keys("a") == set() and core.session_keys("b") == set(keys[2:4])
        assert core.stats["session_releases.cap"] == 1
        assert core.tiers[0].holds is not None
        assert core.tiers[0].holds.held_bytes <= 5 * SLOT
        # a session whose own blocks are over the cap holds nothing
        assert core.hold("big", keys[:6] + keys[6:9], 300) == 0
        assert core.stats["session_releases.cap"] == 4


async def test_a_later_hold_adds_keys_and_restarts_the_time(autojump_clock):
    keys, data = blocks(4, 7)
    async with KernelCore.open(memory(8)) as core:
        await core.run(Store(keys, buffers=data))
        core.hold("s", keys[:2], 10)
        await trio.sleep(8)
        assert core.hold("s", keys[1:], 10) == 4
        await trio.sleep(8)  # 16 s after the first hold, 8 after the second
        core.tiers[0].holds.expire()  # type: ignore[union-attr]
        assert core.session_keys("s") == set(keys)


def test_holds_count_shared_keys_once_per_session() -> None:
    now = [0.0]
    policy = LRUPolicy(10 * SLOT, clock=lambda: now[0])
    for i in range(4):
        policy.insert(bytes([i]) * 16, SLOT)
    stats: Counter[str] = Counter()
    holds = Holds(policy, None, stats, clock=lambda: now[0])
    shared = bytes([0]) * 16
    holds.hold("a", [shared, bytes([1]) * 16], 5)
    holds.hold("b", [shared], 50)
    assert holds.held_bytes == 2 * SLOT
    now[0] = 6
    holds.expire()
    assert policy.is_pinned(shared) and not policy.is_pinned(bytes([1]) * 16)
    assert stats["session_releases.expired"] == 1
    holds.release("b")
    assert not policy.is_pinned(shared) and holds.held_bytes == 0


def test_kernel_holds_from_a_host_thread() -> None:
    keys, data = blocks(3, 8)
    with Kernel(memory(8)) as kernel:
        kernel.submit(Store(keys, buffers=data)).result()
        assert kernel.hold("chat-1", keys, 60).result() == 3
        stats = kernel.statistics()
        assert stats["tier.memory.held_sessions"] == 1 and stats["session_holds"] == 1
        assert kernel.release("chat-1").result() is True
        assert kernel.release("chat-1").result() is False
        assert kernel.submit(Lookup(keys)).result().hits == (True,) * 3
        with pytest.raises(InvalidRequest, match="retain_s"):
            kernel.hold("chat-1", keys, 0)
        with pytest.raises(InvalidRequest, match="empty batch"):
            kernel.hold("chat-1", [], 10)
        with pytest.raises(InvalidRequest):
            kernel.hold("chat-1", ["not bytes"], 10)  # type: ignore[list-item]


@pytest.mark.parametrize("value, message", [
    ("150%", "0% to 100%"), ("lots", "a share such as"), (-1, "bytes >= 0")])
def test_bad_max_pinned_is_a_clear_error(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        memory(4, max_pinned=value)
    with pytest.raises(ConfigError, match="max_retain_s"):
        memory(4, max_retain_s=0)


def test_max_pinned_in_bytes_and_shares() -> None:
    cfg = memory(4, max_pinned="1MiB")
    assert cfg.sessions.cap_bytes(None) == 1 << 20  # type: ignore[attr-defined]
    assert memory(4).sessions.cap_bytes(1000) == 500  # type: ignore[attr-defined]
    assert memory(4).sessions.cap_bytes(None) is None  # type: ignore[attr-defined]


async def test_blocks_that_arrive_after_the_hold_count_against_the_cap(autojump_clock):
    keys, data = blocks(8, 9)
    async with KernelCore.open(memory(20, max_pinned="25%")) as core:  # 5 blocks' bytes
        holds = core.tiers[0].holds
        assert holds is not None
        await core.run(Store(keys[:2], buffers=data[:2]))
        core.hold("old", keys[:2], 300)
        await trio.sleep(1)
        core.hold("new", keys[2:6], 300)  # not stored yet: nothing counts
        assert holds.held_bytes == 2 * SLOT
        await core.run(Store(keys[2:5], buffers=data[2:5]))  # 5 blocks: at the cap
        assert holds.held_bytes == 5 * SLOT and not core.stats["session_releases.cap"]
        await core.run(Store(keys[5:6], buffers=data[5:6]))  # over it: the oldest goes
        assert core.stats["session_releases.cap"] == 1 and core.session_keys("old") == set()
        assert holds.held_bytes == 4 * SLOT
        await core.run(Delete(keys[2:3]))
        assert holds.held_bytes == 3 * SLOT == sum(
            core.tiers[0].policy.size_of(k) or 0 for k in core.session_keys("new"))
