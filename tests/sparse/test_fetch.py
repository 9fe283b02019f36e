"""BlockFetcher against a recording stand-in for Kernel.submit (tests the diffing, not storage)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from ucm.drivers import LoadState
from ucm.errors import InvalidRequest, KernelBusy
from ucm.sparse import BlockFetcher

BLOCK_BYTES = 64


@dataclass(frozen=True)
class Load:
    keys: list[bytes]
    buffers: list[memoryview]


@dataclass(frozen=True)
class Prefetch:
    keys: list[bytes]


@dataclass
class LoadResult:
    states: list[LoadState]


class Recorder:
    """Records events; Loads succeed except for keys listed in `fail`."""

    def __init__(self) -> None:
        self.events: list[Load | Prefetch] = []
        self.fail: set[bytes] = set()
        self.error: Exception | None = None

    def __call__(self, event):
        self.events.append(event)
        fut: Future = Future()
        if self.error is not None:
            fut.set_exception(self.error)
        elif isinstance(event, Load):
            states = [LoadState.MISSING if k in self.fail else LoadState.OK for k in event.keys]
            fut.set_result(LoadResult(states))
        else:
            fut.set_result(None)
        return fut

    def loaded(self) -> list[list[int]]:
        return [[_block(k) for k in e.keys] for e in self.events if isinstance(e, Load)]

    def prefetched(self) -> list[list[int]]:
        return [[_block(k) for k in e.keys] for e in self.events if isinstance(e, Prefetch)]


def _key(block: int) -> bytes:
    return b"blk-%04d" % block


def _block(key: bytes) -> int:
    return int(key[4:])


@pytest.fixture
def setup():
    rec = Recorder()
    cache = bytearray(BLOCK_BYTES * 64)
    fetcher = BlockFetcher(
        rec,
        _key,
        lambda b: memoryview(cache)[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES],
        load_event=Load,
        prefetch_event=Prefetch,
    )
    return rec, fetcher


def test_only_changed_blocks_are_loaded(setup):
    rec, fetcher = setup
    pending = fetcher.fetch([0, 5, 6, 9])
    assert fetcher.complete(pending) == []
    assert fetcher.fetch([0, 5, 6, 9]) is None  # nothing changed: no event
    fetcher.fetch([0, 6, 9, 12, 13])
    assert rec.loaded() == [[0, 5, 6, 9], [12, 13]]
    assert fetcher.resident == {0, 6, 9, 12, 13}
    assert fetcher.stats.blocks_loaded == 6
    assert fetcher.stats.bytes_loaded == 6 * BLOCK_BYTES
    load = rec.events[-1]
    assert isinstance(load, Load) and load.buffers[0].nbytes == BLOCK_BYTES


def test_prefetch_goes_ahead_and_is_not_repeated(setup):
    rec, fetcher = setup
    fetcher.fetch([0, 1], prefetch=[4, 5])
    fetcher.fetch([0, 1], prefetch=[5, 6, 1])  # 5 announced, 1 resident
    assert rec.prefetched() == [[4, 5], [6]]
    fetcher.fetch([0, 4, 5])  # the prefetched blocks are now needed: a Load brings them in
    assert rec.loaded() == [[0, 1], [4, 5]]
    fetcher.fetch([0, 4, 5], prefetch=[6, 7])
    assert rec.prefetched()[-1] == [7]
    kinds = [type(e).__name__ for e in rec.events]
    assert kinds == ["Load", "Prefetch", "Prefetch", "Load", "Prefetch"]


def test_failed_loads_are_asked_for_again(setup):
    rec, fetcher = setup
    rec.fail = {_key(3)}
    assert fetcher.complete(fetcher.fetch([1, 2, 3])) == [3]
    assert fetcher.resident == {1, 2}
    rec.fail = set()
    fetcher.fetch([1, 2, 3])
    assert rec.loaded()[-1] == [3]
    assert fetcher.stats.failed == 1


def test_kernel_busy_is_a_miss_and_other_errors_propagate(setup):
    rec, fetcher = setup
    rec.error = KernelBusy("inbox full")
    assert fetcher.complete(fetcher.fetch([7, 8])) == [7, 8]
    assert fetcher.resident == frozenset()
    rec.error = InvalidRequest("bad buffer")
    with pytest.raises(InvalidRequest):
        fetcher.complete(fetcher.fetch([7]))


def test_session_plans_drive_the_fetcher(setup):
    import torch

    from ucm.sparse import SparseConfig, SparseSession

    rec, fetcher = setup
    g = torch.Generator().manual_seed(3)
    cfg = SparseConfig(method="gsa", block_size=8, budget=4, stride=4, local_blocks=1)
    session = SparseSession(cfg)
    session.prefill([torch.randn(2, 400, 16, generator=g)])
    for step in range(16):
        q = torch.randn(4, 16, generator=g) if step % 4 == 3 else None
        plan = session.step([q if q is not None else torch.ones(4, 16)])
        pending = fetcher.fetch(plan.selected, plan.prefetch)
        assert (pending.blocks if pending else []) == plan.load
    loaded = sum(len(b) for b in rec.loaded())
    assert loaded == fetcher.stats.blocks_loaded < 16 * 6  # far less than reloading each step


def test_default_events_are_the_kernels():
    kernel = pytest.importorskip("ucm.kernel")
    if not hasattr(kernel, "Load") or not hasattr(kernel, "Prefetch"):
        pytest.skip("ucm.kernel does not export Load and Prefetch yet")
    rec = Recorder()
    cache = bytearray(BLOCK_BYTES * 4)
    fetcher = BlockFetcher(rec, _key, lambda b: memoryview(cache)[b * 64 : (b + 1) * 64])
    fetcher.fetch([1], prefetch=[2])
    assert [type(e) for e in rec.events] == [kernel.Load, kernel.Prefetch]
    assert list(rec.events[0].keys) == [_key(1)] and rec.events[0].buffers[0].nbytes == 64
