"""The scheduler side against a real kernel, with fake vLLM requests: prefix hits, TP ranks,
"ask again later" while a lookup is in flight, and a hanging store as a miss."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from ucm.config import load_config
from ucm.kernel import Delete, Kernel, Store
from ucm.vllm_hook.keys import chain_digests, chain_seed, layer_key, rank_key
from ucm.vllm_hook.scheduler import SchedulerSide
from ucm.vllm_hook.settings import HookSettings, kernels, kv_layer_count

BS = 4


def _settings(config: dict, **kw) -> HookSettings:
    cfg = load_config({**config, "namespace": "test-ns"})
    return HookSettings(ucm_config=cfg, namespace="test-ns", block_size=BS, **kw)


def _request(rid: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, all_token_ids=tokens, prompt_token_ids=tokens,
                           cache_salt=None, lora_request=None)


def _wait_running(kernel: Kernel) -> Kernel:
    end = time.monotonic() + 10
    while not kernel.running and time.monotonic() < end:
        time.sleep(0.01)
    assert kernel.running
    return kernel


def _store(kernel: Kernel, tokens: list[int], n_blocks: int, rank: int = 0, size: int = 1):
    digests = chain_digests(chain_seed("test-ns"), tokens, BS, n_blocks)
    keys = [rank_key(d, rank, size) for d in digests]
    kernel.submit(Store(keys, buffers=[b"x" * 64] * len(keys))).result(10)


def _answer(side: SchedulerSide, req, computed: int = 0, wait: float = 5.0):
    end = time.monotonic() + wait
    while True:
        n, asynchronous = side.get_num_new_matched_tokens(req, computed)
        if n is not None or time.monotonic() > end:
            return n, asynchronous


def test_prefix_hit_never_claims_the_last_token():
    settings = _settings({"tiers": [{"driver": "memory"}]})
    shared = kernels.acquire(settings.ucm_config, None)  # as a worker side in this process
    kernel = _wait_running(shared.kernel)
    try:
        tokens = list(range(16))  # 4 full blocks
        _store(kernel, tokens, 4)
        side = SchedulerSide(settings)
        assert _answer(side, _request("a", tokens)) == (12, False)  # block 3 holds token 15
        assert _answer(side, _request("b", tokens), computed=8) == (4, False)
        assert _answer(side, _request("c", tokens[:9] + [99] * 7)) == (8, False)
    finally:
        kernels.release(shared)
        kernel.close()


def test_tp_hit_needs_every_rank():
    settings = _settings({"tiers": [{"driver": "memory"}]}, tp_size=2)
    shared = kernels.acquire(settings.ucm_config, None)
    kernel = _wait_running(shared.kernel)
    try:
        tokens = list(range(17))
        _store(kernel, tokens, 4, rank=0, size=2)
        _store(kernel, tokens, 2, rank=1, size=2)
        side = SchedulerSide(settings)
        assert _answer(side, _request("a", tokens)) == (8, False)
    finally:
        kernels.release(shared)
        kernel.close()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_layerwise_hit_needs_every_layer_of_a_block(tp_size):
    """Layerwise, each layer of a block is a key of its own: a block whose later layer was
    evicted is not claimed (it would only fail to load and be recomputed)."""
    settings = _settings({"tiers": [{"driver": "memory"}]}, layerwise=True, tp_size=tp_size)
    shared = kernels.acquire(settings.ucm_config, None)
    kernel = _wait_running(shared.kernel)
    try:
        tokens = list(range(21))  # 5 full blocks
        digests = chain_digests(chain_seed("test-ns"), tokens, BS, 5)
        keys = [layer_key(rank_key(d, r, tp_size), i)
                for r in range(tp_size) for d in digests for i in range(3)]
        kernel.submit(Store(keys, buffers=[b"x" * 64] * len(keys))).result(10)
        side = SchedulerSide(settings, layers=3)
        assert _answer(side, _request("a", tokens)) == (20, False)
        last_layer_of_block_2 = layer_key(rank_key(digests[2], tp_size - 1, tp_size), 2)
        kernel.submit(Delete([last_layer_of_block_2])).result(10)
        assert _answer(side, _request("b", tokens)) == (8, False)  # blocks 0 and 1
        # Without the layer count only the first layer is looked up (and a warning says so).
        assert _answer(SchedulerSide(settings), _request("c", tokens)) == (20, False)
    finally:
        kernels.release(shared)
        kernel.close()


def test_layer_count_comes_from_the_kv_cache_groups():
    def group(*names):
        return SimpleNamespace(layer_names=list(names))

    config = SimpleNamespace(kv_cache_groups=[group("l.0", "l.1"), group("l.2", "l.1")])
    assert kv_layer_count(config) == 3
    assert kv_layer_count(SimpleNamespace(kv_cache_groups=[])) is None
    assert kv_layer_count(None) is None


def test_hanging_storage_answers_later_then_misses(tmp_path):
    config = {"tiers": [{"driver": "faulty", "hang": True, "ops": ["lookup"],
                         "inner": {"driver": "posix", "path": str(tmp_path)}}]}
    side = SchedulerSide(_settings(config, lookup_wait=0.001, lookup_timeout=0.3))
    req = _request("a", list(range(16)))
    _wait_running(side._get_kernel())
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # ask again later
    assert _answer(side, req) == (0, False)
    assert side.stats["lookup_timeouts"] == 1 and side.stats["lookup_deferred"] >= 1
    side.shutdown()


def test_storage_that_hangs_is_all_misses_and_never_stalls_the_step(tmp_path):
    # The kernel starts at once (a tier's index is rebuilt in the background), but every
    # driver call hangs: lookups answer "ask again later" without stalling the scheduler
    # step, then count as misses after lookup_timeout.
    config = {"tiers": [{"driver": "faulty", "hang": True,
                         "inner": {"driver": "posix", "path": str(tmp_path)}}]}
    side = SchedulerSide(_settings(config, start_timeout=0.3, lookup_timeout=0.5))
    req = _request("a", list(range(16)))
    # storage never answers, so returning at all shows the step did not wait for it
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # ask again later
    assert _answer(side, req) == (0, False)  # then a miss
    assert side.stats["lookup_timeouts"] + side.stats["lookup_kernel_not_ready"] == 1


def _step(rid: str, block_ids: list[int], tokens: int) -> SimpleNamespace:
    """A scheduler output that schedules `tokens` of a new request `rid`."""
    new = SimpleNamespace(req_id=rid, block_ids=(block_ids,), num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={rid: tokens})


@pytest.mark.parametrize("role", ["kv_both", "kv_producer", "kv_consumer"])
def test_a_consumer_plans_no_saves(role):
    settings = _settings({"tiers": [{"driver": "memory"}]}, role=role, consumer_wait=0.0)
    shared = kernels.acquire(settings.ucm_config, None)
    kernel = _wait_running(shared.kernel)
    try:
        side = SchedulerSide(settings)
        tokens = list(range(100, 116))
        assert _answer(side, _request("a", tokens)) == (0, False)  # nothing stored
        side.update_state_after_alloc(_request("a", tokens), None, 0)
        meta = side.build_connector_meta(_step("a", [0, 1, 2, 3], len(tokens)))
        saved = sum(len(t.block_ids) for t in meta.saves)
        assert saved == (0 if role == "kv_consumer" else 4)
    finally:
        kernels.release(shared)
        kernel.close()


def test_a_consumer_waits_for_blocks_being_stored_then_loads_them():
    settings = _settings({"tiers": [{"driver": "memory"}]}, role="kv_consumer",
                         consumer_wait=60.0)
    shared = kernels.acquire(settings.ucm_config, None)
    kernel = _wait_running(shared.kernel)
    try:
        tokens = list(range(200, 216))  # 3 full blocks the consumer may load
        _store(kernel, tokens, 1)  # the prefill instance has stored one so far
        side = SchedulerSide(settings)
        req = _request("a", tokens)
        assert _answer(side, req, wait=0.3) == (None, False)  # waits for the others
        _store(kernel, tokens, 3)
        assert _answer(side, req, wait=30) == (12, False)
        assert side.stats["consumer_waits_complete"] == 1
        assert side.stats["consumer_waits_expired"] == 0
        # A producer or a colocated instance never waits: storage's answer stands.
        both = SchedulerSide(_settings({"tiers": [{"driver": "memory"}]}))
        assert _answer(both, _request("b", list(range(300, 316)))) == (0, False)
    finally:
        kernels.release(shared)
        kernel.close()


def test_a_consumer_wait_is_bounded_and_the_missing_blocks_are_counted():
    settings = _settings({"tiers": [{"driver": "memory"}]}, role="kv_consumer",
                         consumer_wait=0.2)
    shared = kernels.acquire(settings.ucm_config, None)
    kernel = _wait_running(shared.kernel)
    try:
        tokens = list(range(400, 416))
        _store(kernel, tokens, 1)  # its prefill instance died after one block
        side = SchedulerSide(settings)
        assert _answer(side, _request("a", tokens), wait=30) == (4, False)
        assert side.stats["consumer_waits_expired"] == 1
        assert side.stats["consumer_missing_blocks"] == 2
        assert _answer(side, _request("b", list(range(500, 516))), wait=30) == (0, False)
        assert side.stats["consumer_waits_expired"] == 2
        assert side.stats["consumer_missing_blocks"] == 5
    finally:
        kernels.release(shared)
        kernel.close()
