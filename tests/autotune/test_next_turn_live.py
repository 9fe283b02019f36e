"""The live next-turn prefetch's timer (`ucm.vllm_hook.next_turn`, `sessions.predict_next_turn`):
a conversation recognised by its chain is prefetched once its predicted time has come, once,
and a turn that comes first cancels it. A fake clock; the thread is woken by hand."""

from __future__ import annotations

import threading

from ucm.config import load_config
from ucm.vllm_hook.next_turn import NextTurnTimer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _blocks(conversation: int, n: int) -> list[bytes]:
    return [bytes([conversation, i]) * 8 for i in range(n)]


def test_a_returning_conversation_is_prefetched_at_its_predicted_time():
    clock, issued, done = Clock(), [], threading.Event()

    def issue(blocks: list[bytes]) -> None:
        issued.append(blocks)
        done.set()

    timer = NextTurnTimer(issue, clock=clock)
    try:
        timer.after(_blocks(1, 4))  # turn 1 at 0 s
        timer.after(_blocks(9, 3))  # another conversation's only turn
        clock.now = 100.0
        timer.after(_blocks(1, 6))  # turn 2 at 100 s: extends turn 1; next predicted at 200
        assert timer.due() == [] and not issued
        clock.now = 200.0
        timer._wake.set()
        assert done.wait(10)
        assert issued == [_blocks(1, 6)]
        assert (timer.fed, timer.issued, timer.blocks) == (3, 1, 6)
        assert timer.due() == []  # never twice
        # a turn before its predicted time cancels the prefetch
        timer.after(_blocks(1, 8))  # turn 3 at 200 s: next predicted at 300
        clock.now = 250.0
        timer.after(_blocks(1, 9))  # turn 4 came first: next predicted at 300
        clock.now = 299.0
        assert timer.due() == []
    finally:
        timer.stop()


def test_the_opt_in_key_is_off_by_default():
    config = load_config({"tiers": [{"driver": "memory", "capacity": "1MiB"}]})
    assert config.sessions.predict_next_turn is False
    on = load_config({"tiers": [{"driver": "memory", "capacity": "1MiB"}],
                      "sessions": {"predict_next_turn": True}})
    assert on.sessions.predict_next_turn is True


def test_the_kernel_counts_what_became_of_prefetched_blocks():
    from ucm.kernel import Kernel, Load, Prefetch, Store

    block = 4096
    keys = [bytes([7, i]) * 8 for i in range(8)]
    flood = [bytes([8, i]) * 8 for i in range(16)]
    config = {"tiers": [{"driver": "memory", "capacity": 12 * (block + 4096), "name": "fast"},
                        {"driver": "memory", "name": "slow"}], "eviction": "lru",
              "durability": "all"}
    with Kernel(config) as kernel:
        kernel.submit(Store(keys, buffers=[bytes(block)] * 8)).result(10)
        kernel.submit(Store(flood, buffers=[bytes(block)] * 16)).result(10)  # pushes keys out
        result = kernel.submit(Prefetch(keys, block_bytes=block)).result(10)
        assert result.promoted == 8
        kernel.submit(Load(keys[:5], buffers=[bytearray(block) for _ in range(5)])).result(10)
        kernel.submit(Store(flood[:12], buffers=[bytes(block)] * 12)).result(10)  # evicts
        stats = kernel.statistics()
    assert stats["prefetched"] == 8
    assert stats["tier.fast.prefetch_hits"] == 5
    assert stats["tier.fast.prefetch_evicted"] == 3
