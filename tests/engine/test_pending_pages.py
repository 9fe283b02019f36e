"""ucm.engine.PageIO's non-blocking calls (PendingPages) on a real kernel, faults injected by
the `faulty` driver: plain answers, failures counted once when the result is taken."""

from __future__ import annotations

import concurrent.futures

from ucm.drivers import LoadState
from ucm.engine import PageIO
from ucm.errors import DeadlineExceeded, InvalidRequest, KernelClosed
from ucm.kernel import Kernel

PAGE = 64
KEYS = [bytes([i]) * 16 for i in range(1, 4)]


def faulty(**faults: object) -> dict:
    return {"tiers": [{"driver": "faulty", "inner": {"driver": "memory"}, **faults}]}


def pages(n: int, fill: int = 7) -> list[bytearray]:
    return [bytearray([fill + i]) * PAGE for i in range(n)]


def test_answers_are_plain_and_counted_once():
    with Kernel(faulty(ops=[])) as kernel:
        io = PageIO(kernel, timeout=10)
        store = io.start_store(KEYS[:2], pages(2))
        assert store.result() == [True, True]
        lookup = io.start_lookup(KEYS)
        assert lookup.wait(10) and lookup.done()
        assert lookup.result() == 2 and lookup.result() == 2
        assert lookup.hits == (True, True, False)
        out = pages(3, fill=0)
        load = io.start_load(KEYS, [memoryview(b) for b in out])
        assert load.result() == [True, True, False]
        assert load.states == (LoadState.OK, LoadState.OK, LoadState.MISSING)
        assert out[:2] == pages(2)
        stats = io.statistics()
    assert stats["lookups"] == stats["loads"] == stats["stores"] == 1
    assert stats["lookup_hit_pages"] == 2 and stats["loaded_pages"] == 2
    assert stats["load_missing_pages"] == 1 and stats["stored_pages"] == 2
    assert not any(name.endswith("_failures") for name in stats)


def test_a_failure_is_counted_once_when_the_result_is_taken():
    with Kernel(faulty(hang=True, ops=["load"])) as kernel:
        io = PageIO(kernel, timeout=30, deadline=0.2)  # the kernel's deadline ends the load
        assert io.store(KEYS[:1], pages(1)) == [True]
        load = io.start_load(KEYS[:1], [memoryview(bytearray(PAGE))])
        assert load.wait(30)
        assert "load_failures" not in io.statistics()  # not yet taken
        assert load.result() == [False] and load.result() == [False]
        assert isinstance(load.error, DeadlineExceeded) and not load.timed_out
        assert load.states is None
        stats = io.statistics()
    assert stats["load_failures"] == 1 and stats["load_failed_pages"] == 1


def test_a_failing_tier_is_a_failed_page_not_a_failed_call():
    with Kernel(faulty(error_rate=1.0, ops=["load"])) as kernel:
        io = PageIO(kernel, timeout=10)
        assert io.store(KEYS[:1], pages(1)) == [True]
        load = io.start_load(KEYS[:1], [memoryview(bytearray(PAGE))])
        assert load.result() == [False] and load.error is None
        assert load.states == (LoadState.FAILED,)
        stats = io.statistics()
    assert stats["load_failed_pages"] == 1 and "load_failures" not in stats


def test_cancel_is_a_counted_miss():
    with Kernel(faulty(hang=True, ops=["load"])) as kernel:
        io = PageIO(kernel, timeout=30)
        assert io.store(KEYS[:2], pages(2)) == [True, True]
        load = io.start_load(KEYS[:2], [memoryview(bytearray(PAGE)) for _ in range(2)])
        assert not load.done() and not load.wait(0.05)
        assert load.cancel()
        assert load.result() == [False, False]
        assert isinstance(load.error, concurrent.futures.CancelledError)
        assert not load.timed_out and load.completion.done()
        stats = io.statistics()
    assert stats["load_failures"] == 1 and stats["load_failed_pages"] == 2


def test_a_hanging_tier_is_a_timeout_counted_as_a_miss():
    with Kernel(faulty(hang=True, ops=["lookup", "load"])) as kernel:
        io = PageIO(kernel, timeout=0.2, deadline=None)  # no kernel deadline: our wait ends it
        assert io.store(KEYS[:1], pages(1)) == [True]
        lookup = io.start_lookup(KEYS[1:])  # not stored: the tier is asked, and hangs
        assert lookup.result() == 0 and lookup.result() == 0
        assert lookup.timed_out and isinstance(lookup.error, TimeoutError)
        assert lookup.completion.done()  # waited for until it stopped
        assert lookup.hits == (False, False)
        assert io.load(KEYS[:1], [memoryview(bytearray(PAGE))]) == [False]
        stats = io.statistics()
    assert stats["lookup_failures"] == stats["load_failures"] == 1
    assert stats["lookup_failed_pages"] == 2


def test_a_call_the_kernel_refuses_is_a_miss_counted_when_taken():
    with Kernel(faulty(ops=[])) as kernel:
        io = PageIO(kernel, timeout=10)
        store = io.start_store(KEYS[:2], pages(2), deadline=-1.0)  # refused as it is built
        assert not store.submitted and store.done() and store.completion is None
        assert isinstance(store.error, InvalidRequest)
        assert "store_failures" not in io.statistics()
        assert store.result() == [False, False]
    assert io.stored_prefix(KEYS) == 0  # a closed kernel
    load = io.start_load(KEYS[:1], [memoryview(bytearray(PAGE))])
    assert load.result() == [False] and isinstance(load.error, KernelClosed)
    stats = io.statistics()
    assert stats["store_failures"] == stats["lookup_failures"] == stats["load_failures"] == 1
    assert stats["store_failed_pages"] == 2
    # no pages, no event: answered at once, nothing counted
    assert io.start_load([], []).result() == [] and io.start_lookup([]).result() == 0
    assert io.statistics()["loads"] == 1
