"""The kernel's half of the driver contract, run against the spec of the `ucm_driver_spec`
fixture: capacity eviction
keeps pinned blocks, detach while busy loses nothing, deadlines and cancellation reach the
driver, prefix lookup through the tier."""

from __future__ import annotations

import itertools
import random

import pytest
import trio
import trio.testing

from ucm.block import Scatter
from ucm.config import load_config
from ucm.drivers import LoadState
from ucm.errors import DeadlineExceeded
from ucm.kernel import KernelCore, Load, Lookup, Store
from ucm.testing._fixtures import _capability, scratch, spec
from ucm.testing._spec import DriverSpec, Scratch, call_hook

pytestmark = pytest.mark.trio

BLOCK = 32 * 1024


def tier_of(spec: DriverSpec, scratch: Scratch, **common: object) -> dict[str, object]:
    return {"driver": spec.registered_name(), "name": "t", "codec": spec.codec,
            **spec.options_for(scratch), **common}


def faulty_of(spec: DriverSpec, scratch: Scratch, **faults: object) -> dict[str, object]:
    inner = {"driver": spec.registered_name(), "codec": spec.codec, **spec.options_for(scratch)}
    return {"driver": "faulty", "name": "t", "inner": inner, "ops": ["load", "lookup"],
            **faults}


def data(n: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    rng = random.Random(seed)
    return ([rng.randbytes(12) for _ in range(n)], [rng.randbytes(BLOCK) for _ in range(n)])


async def test_prefix_lookup_and_load_through_the_kernel(spec: DriverSpec,
                                                         scratch: Scratch) -> None:
    keys, blocks = data(4, 1)
    cfg = load_config({"tiers": [tier_of(spec, scratch)], "namespace": "kc-prefix"})
    async with KernelCore.open(cfg) as core:
        assert (await core.run(Store(keys[:2], buffers=blocks[:2]))).ok
        assert (await core.run(Lookup(keys, prefix=True))).prefix_len == 2
        out = [bytearray(BLOCK) for _ in keys]
        result = await core.run(Load(keys, buffers=out))
        assert result.states[:2] == (LoadState.OK, LoadState.OK)
        assert result.states[2:] == (LoadState.MISSING, LoadState.MISSING)
        assert [bytes(b) for b in out[:2]] == blocks[:2]


def scatter_of(size: int) -> tuple[Scatter, list[bytearray]]:
    """A Scatter of uneven, unaligned pieces (one per vLLM layer, in real use)."""
    cuts = [0, 1, 4097, size // 2 + 3, size - 5, size]
    pieces = [bytearray(b - a) for a, b in itertools.pairwise(cuts)]
    return Scatter(pieces), pieces


async def test_scatter_load_round_trip_and_corruption(spec: DriverSpec, scratch: Scratch) -> None:
    keys, blocks = data(3, 4)
    cfg = load_config({"tiers": [tier_of(spec, scratch)], "namespace": "kc-scatter"})
    async with KernelCore.open(cfg) as core:
        assert (await core.run(Store(keys[:2], buffers=blocks[:2]))).ok
        outs = [scatter_of(BLOCK) for _ in keys]
        result = await core.run(Load(keys, buffers=[s for s, _ in outs]))
        assert result.states == (LoadState.OK, LoadState.OK, LoadState.MISSING)
        assert [b"".join(p) for _, p in outs[:2]] == blocks[:2]

        if spec.corrupt is not None:  # a scatter load of a corrupt block is CORRUPT, never OK
            await call_hook(spec.corrupt, core.tiers[0].driver, keys[1])
            target, _ = scatter_of(BLOCK)
            assert (await core.run(Load([keys[1]], buffers=[target]))).states == (
                LoadState.CORRUPT,)

        # single flight: a Scatter follower gets the leader's bytes, and the other way round
        loaded: list[bytes] = []

        async def load(as_scatter: bool) -> None:
            if as_scatter:
                target, pieces = scatter_of(BLOCK)
                assert (await core.run(Load([keys[0]], buffers=[target]))).ok
                loaded.append(b"".join(pieces))
            else:
                buf = bytearray(BLOCK)
                assert (await core.run(Load([keys[0]], buffers=[buf]))).ok
                loaded.append(bytes(buf))

        async with trio.open_nursery() as nursery:
            for as_scatter in (True, False, True):
                nursery.start_soon(load, as_scatter)
        assert loaded == [blocks[0]] * 3


async def test_capacity_eviction_keeps_pinned_blocks(spec: DriverSpec, scratch: Scratch) -> None:
    keys, blocks = data(10, 2)
    # Room for exactly 4 blocks whatever a driver charges for one: at least the block (more
    # than a quarter of the room for 5) and at most the block plus a 4 KiB header rounded up
    # to pages. A zstd frame of these random bytes is a few bytes longer than the bytes, so
    # the page-granular drivers charge 10 pages, not 9: with room for 4 x 9 pages the fourth
    # store evicted the first block, and whether the pin saw it first was a race.
    capacity = 4 * (BLOCK + 2 * 4096)
    cfg = load_config({"tiers": [tier_of(spec, scratch, capacity=capacity)],
                       "namespace": "kc-capacity"})
    async with KernelCore.open(cfg) as core:
        await core.run(Store(keys[:4], buffers=blocks[:4]))
        pinned = await core.run(Lookup(keys[:2], pin=True))
        assert pinned.hits == (True, True)
        for i in range(4, 10):
            assert (await core.run(Store([keys[i]], buffers=[blocks[i]]))).ok
        tier = core.tiers[0]
        assert tier.policy.used <= capacity
        out = [bytearray(BLOCK) for _ in range(2)]
        result = await core.run(Load(keys[:2], buffers=out))
        assert result.ok, "a pinned block was evicted"
        assert [bytes(b) for b in out] == blocks[:2]
        evicted = await core.run(Lookup(keys[2:6]))
        assert evicted.hits.count(False) >= 3  # the unpinned old blocks went


# Real time below, not an autojump clock: network drivers (s3 on httpx) keep timers of their
# own, which a jumping clock would fire while a request is on the wire.
async def test_detach_while_busy_loses_nothing(spec: DriverSpec, scratch: Scratch) -> None:
    keys, blocks = data(4, 3)
    cfg = load_config({"tiers": [faulty_of(spec, scratch, latency=0.2)],
                       "namespace": "kc-detach"})
    async with KernelCore.open(cfg) as core:
        await core.run(Store(keys, buffers=blocks))
        outcomes = []

        async def load(i: int) -> None:
            buf = bytearray(BLOCK)
            result = await core.run(Load([keys[i]], buffers=[buf]))
            outcomes.append(result.ok and bytes(buf) == blocks[i])

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(load, i)
            await trio.testing.wait_all_tasks_blocked()
            await core.detach("t")
        assert outcomes == [True] * 4


async def test_deadline_and_cancellation_reach_the_driver(spec: DriverSpec,
                                                          scratch: Scratch) -> None:
    from ucm.drivers.faulty import FaultyDriver

    keys, blocks = data(1, 4)
    cfg = load_config({"tiers": [faulty_of(spec, scratch)], "namespace": "kc-deadline"})
    async with KernelCore.open(cfg) as core:
        await core.run(Store(keys, buffers=blocks))
        faulty = core.tiers[0].driver
        assert isinstance(faulty, FaultyDriver)  # the tier faulty_of configures
        faulty.faults.hang = True
        start = trio.current_time()
        with pytest.raises(DeadlineExceeded):
            await core.run(Load(keys, buffers=[bytearray(BLOCK)], deadline=0.3))
        assert 0.3 <= trio.current_time() - start < 5
        with trio.move_on_after(0.2) as scope:  # a key the index lacks goes to the driver
            await core.run(Lookup([b"not-in-the-index"]))
        assert scope.cancelled_caught
        faulty.faults.hang = False
        out = bytearray(BLOCK)
        assert (await core.run(Load(keys, buffers=[out]))).ok and bytes(out) == blocks[0]


__all__ = ["_capability", "pytestmark", "scratch", "spec",
           *(name for name in globals() if name.startswith("test_"))]
