"""The thread-hosted Kernel: non-blocking submit, busy inbox, cancellation, clean shutdown."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from types import SimpleNamespace

import pytest

from ucm.drivers import LoadState
from ucm.errors import InvalidRequest, KernelBusy, KernelClosed, UCMError
from ucm.kernel import Kernel, KernelCore, Load, Lookup, Store
from ucm.trace import Tracer


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def own_threads() -> list[str]:
    """Threads other than trio's worker cache (its threads exit on their own after 10 s): the
    kernel's copy and store threads (kit.Workers) must be gone after close."""
    return [t.name for t in threading.enumerate() if not t.name.startswith("Trio thread")]


def faulty(tmp_path, **faults) -> dict:
    return {"tiers": [{"driver": "faulty", "name": "disk",
                       "inner": {"driver": "posix", "path": str(tmp_path / "b")},
                       "ops": ["load", "lookup", "store"], **faults}]}


def test_round_trip_and_no_leaks(tmp_path):
    threads, files = own_threads(), fds()
    kernel = Kernel({"tiers": [{"driver": "memory"},
                               {"driver": "posix", "path": str(tmp_path / "b")}]})
    data = os.urandom(1 << 20)
    assert kernel.submit(Store([b"k"], buffers=[data])).result(10).ok
    out = bytearray(len(data))
    result = kernel.submit(Load([b"k"], buffers=[out])).result(10)
    assert result.states == (LoadState.OK,) and out == data
    stats = kernel.statistics()
    assert stats["load_hits.memory"] == 1 and stats["in_flight"] == 0
    kernel.close()
    assert own_threads() == threads
    assert fds() == files


def test_submit_never_blocks_and_a_full_inbox_fails_at_once(tmp_path):
    kernel = Kernel({**faulty(tmp_path, hang=True), "inbox_size": 3}, drain_timeout=0.2)
    kernel.start()
    try:
        handles = [kernel.submit(Lookup([b"k"])) for _ in range(3)]
        busy = kernel.submit(Lookup([b"k"]))
        assert busy.done()  # resolved inside submit: it did not wait for the held kernel
        with pytest.raises(KernelBusy, match="inbox full"):
            busy.result()
        assert not any(h.done() for h in handles)
        assert kernel.statistics()["busy_rejections"] == 1
    finally:
        kernel.close()
    for handle in handles:  # drain_timeout passed: they fail with a clear error
        with pytest.raises(KernelClosed, match="closed before the event finished"):
            handle.result(5)


def test_cancel_reaches_the_driver(tmp_path):
    kernel = Kernel(faulty(tmp_path, hang=True))
    try:
        handle = kernel.submit(Load([b"k"], buffers=[bytearray(8)]))
        with pytest.raises(concurrent.futures.TimeoutError):
            handle.result(timeout=0.1)
        assert handle.cancel()
        with pytest.raises(concurrent.futures.CancelledError):
            handle.result(timeout=5)
        assert kernel.statistics()["in_flight"] == 0
    finally:
        kernel.close()


def test_close_lets_in_flight_events_finish(tmp_path):
    kernel = Kernel(faulty(tmp_path, latency=0.3))
    kernel.submit(Store([b"k"], buffers=[b"x" * 100])).result(10)
    handle = kernel.submit(Load([b"k"], buffers=[bytearray(100)]))
    kernel.close()
    assert handle.result(0).ok
    late = kernel.submit(Lookup([b"k"]))
    with pytest.raises(KernelClosed):
        late.result(0)


def test_deadline_from_config_fails_the_handle(tmp_path):
    kernel = Kernel({**faulty(tmp_path, hang=True), "deadline": 0.2})
    try:
        with pytest.raises(TimeoutError, match=r"did not finish within 0\.2 s"):
            kernel.submit(Lookup([b"k"])).result(5)
    finally:
        kernel.close()


def test_start_reports_a_driver_that_cannot_open(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    kernel = Kernel({"tiers": [{"driver": "posix", "path": str(blocker / "sub")}]})
    # Counted against before: an earlier test in this process may hold a kernel of its own.
    running = own_threads().count("ucm-kernel")
    with pytest.raises(UCMError, match="sub"):
        kernel.start()
    assert own_threads().count("ucm-kernel") == running
    kernel.close()


def test_attach_and_detach_on_a_running_kernel(tmp_path):
    kernel = Kernel({"tiers": [{"driver": "memory"}]})
    try:
        name = kernel.attach({"driver": "posix", "path": str(tmp_path / "b")}).result(5)
        assert kernel.tier_names() == ["memory", name]
        kernel.submit(Store([b"k"], buffers=[b"v" * 10], durability="all")).result(5)
        kernel.detach("memory").result(5)
        result = kernel.submit(Lookup([b"k"])).result(5)
        assert result.tiers == ("posix",)
        with pytest.raises(InvalidRequest, match="no tier named"):
            kernel.detach("memory").result(5)
    finally:
        kernel.close()


def test_submit_rejects_what_is_not_an_event():
    kernel = Kernel({"tiers": [{"driver": "memory"}]})
    with pytest.raises(InvalidRequest, match="ucm event"):
        kernel.submit("lookup")
    kernel.close()


def test_many_threads_submit_at_once(tmp_path):
    kernel = Kernel({"tiers": [{"driver": "memory"}]})
    errors = []

    def worker(n: int) -> None:
        try:
            for i in range(50):
                key = f"{n}-{i}".encode()
                assert kernel.submit(Store([key], buffers=[key * 10])).result(10).ok
                buf = bytearray(len(key) * 10)
                assert kernel.submit(Load([key], buffers=[buf])).result(10).ok
                assert bytes(buf) == key * 10
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kernel.close()
    assert errors == []


def test_wait_indexed_returns_once_the_stored_blocks_are_listed(tmp_path):
    keys = [b"k%d" % i for i in range(3)]
    with Kernel({"tiers": [{"driver": "posix", "path": str(tmp_path / "b")}]}) as kernel:
        assert kernel.wait_indexed(10)  # nothing to list
        assert kernel.submit(Store(keys, buffers=[os.urandom(4096)] * 3)).result(10).ok
    # A restart: the listing (slowed here) indexes the three blocks in the background.
    kernel = Kernel({"tiers": [{"driver": "faulty", "name": "disk", "latency": 0.5,
                                "ops": ["list_blocks"],
                                "inner": {"driver": "posix", "path": str(tmp_path / "b")}}]})
    assert not kernel.wait_indexed(0)  # not started
    kernel.start()
    try:
        assert not kernel.wait_indexed(0.05)
        assert kernel.statistics()["tier.disk.blocks"] == 0
        assert kernel.wait_indexed(10)
        assert kernel.statistics()["tier.disk.blocks"] == 3
    finally:
        kernel.close()
    assert not kernel.wait_indexed(0)  # closed


def test_a_lookup_that_promotes_nothing_resolves_from_any_tiers_index(tmp_path,
                                                                      hold_trio_thread):
    """With promote=False a lookup whose every key some tier indexes resolves inside submit,
    each key named by the fastest tier that holds it, and nothing is promoted; a key no index
    holds still sends it to the trio thread."""
    both, lower = [b"a", b"b"], b"c"
    posix = {"driver": "posix", "path": str(tmp_path / "b")}
    with Kernel({"tiers": [posix]}) as kernel:
        assert kernel.submit(Store([lower], buffers=[b"3" * 64])).result(10).ok
    with Kernel({"tiers": [{"driver": "memory"}, posix]}) as kernel:
        assert kernel.submit(Store(both, buffers=[b"1" * 64, b"2" * 64])).result(10).ok
        assert kernel.wait_indexed(10)  # `lower` is in the posix tier's index only
        release = hold_trio_thread(kernel)
        fast = kernel.submit(Lookup([*both, lower], prefix=True, promote=False))
        slow = kernel.submit(Lookup([lower, b"absent"], prefix=True, promote=False))
        assert fast.done() and fast.result().hits == (True, True, True)
        assert fast.result().tiers == ("memory", "memory", "posix")
        assert not slow.done()
        release()
        assert slow.result(10).hits == (True, False)
        stats = kernel.statistics()
        assert stats["lookups_from_index"] == 1
        assert stats["lookup_hits.posix"] == 2 and stats["lookup_hits.memory"] == 2
        assert stats.get("promoted", 0) == 0 and stats["tier.memory.blocks"] == 2


def test_a_lookup_the_fastest_tiers_index_answers_resolves_without_the_trio_thread(
        tmp_path, hold_trio_thread):
    """A lookup whose every key tier 0 indexes resolves inside submit, with the same answer,
    counters and trace records as an event; anything else still waits for the trio thread."""
    both, lower = [b"a", b"b"], b"c"
    posix = {"driver": "posix", "path": str(tmp_path / "b")}
    with Kernel({"tiers": [posix]}) as kernel:
        assert kernel.submit(Store([lower], buffers=[b"3" * 64])).result(10).ok
    records: list = []
    tracer = Tracer(sinks=[SimpleNamespace(consume=records.extend)])
    kernel = Kernel({"tiers": [{"driver": "memory"}, posix]}, tracer=tracer)
    try:
        assert kernel.submit(Store(both, buffers=[b"1" * 64, b"2" * 64])).result(10).ok
        assert kernel.wait_indexed(10)  # `lower` is in the posix tier's index only
        release = hold_trio_thread(kernel)
        fast = kernel.submit(Lookup(both, prefix=True, request_id="r1"))
        slow = [kernel.submit(Lookup([*both, b"absent"], prefix=True)),  # a miss
                kernel.submit(Lookup([lower])),  # a hit in a lower tier: promoted
                kernel.submit(Lookup(both, pin=True))]  # pins are kept on the trio thread
        assert fast.done() and fast.result().hits == (True, True)
        assert fast.result().tiers == ("memory", "memory")
        assert not any(c.done() for c in slow)
        release()
        assert slow[0].result(10).hits == (True, True, False)
        assert slow[1].result(10).tiers == ("posix",)
        assert slow[2].result(10).hits == (True, True)
        stats = kernel.statistics()
        assert stats["lookups_from_index"] == 1
        assert stats["lookup_keys"] == 2 + 3 + 1 + 2
        assert stats["lookup_hits.memory"] == 2 + 2 + 2
        assert stats["tier.memory.pinned"] == 2
    finally:
        kernel.close()
    mine = [(phase, fields) for _, _, phase, eid, fields in records if eid == fast.event_id]
    assert [phase for phase, _ in mine] == ["submit", "start", "result", "done"]
    assert mine[1][1]["request_id"] == "r1"
    assert mine[2][1] == {"op": "lookup", "keys": 2, "hits": {"memory": 2},
                             "from_index": True}


def test_close_while_the_kernel_is_starting_stops_it(tmp_path):
    """close() from one thread while start() runs in another (as the vLLM hook starts its
    kernel in the background): the kernel stops instead of running on unseen."""
    gate = threading.Event()
    real_open = KernelCore.open

    def slow_open(*args, **kwargs):
        gate.wait(10)  # start() is inside the trio run, before the token is published
        return real_open(*args, **kwargs)

    kernel = Kernel({"tiers": [{"driver": "memory"}]})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(KernelCore, "open", slow_open)
        starter = threading.Thread(target=kernel.start)
        starter.start()
        while kernel._thread is None:
            time.sleep(0.001)
        closer = threading.Thread(target=kernel.close)
        closer.start()
        while not kernel._closing:
            time.sleep(0.001)
        gate.set()
        closer.join(20)
        starter.join(20)
    assert not closer.is_alive() and not starter.is_alive()
    assert not kernel._thread.is_alive() and not kernel.running
