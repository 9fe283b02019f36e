"""The worker side without an engine: a real kernel (memory tier) and CPU KV cache tensors.
Direct loads land in the cache blocks (and nowhere else), a missing block is reported for
recompute, and snapshot buffers are reused once their stores end."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from ucm.config import load_config  # noqa: E402
from ucm.kernel import Delete, Lookup  # noqa: E402
from ucm.vllm_hook.keys import layer_key  # noqa: E402
from ucm.vllm_hook.metadata import BlockTransfer, UCMConnectorMetadata  # noqa: E402
from ucm.vllm_hook.settings import HookSettings, kernels, wait_running  # noqa: E402
from ucm.vllm_hook.worker import WorkerSide  # noqa: E402


def _worker(namespace: str, **kw) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    cfg = load_config({"tiers": [{"driver": "memory", "shared": False}],
                       "namespace": namespace})
    worker = WorkerSide(HookSettings(ucm_config=cfg, namespace=namespace, block_size=16, **kw))
    caches = {f"l{i}": torch.randn(12, 16, 2, 8) for i in range(3)}
    worker.register_kv_caches(caches)
    assert wait_running(worker.kernel, 30)  # until then, saves are dropped (future misses)
    return worker, caches


def _save(worker: WorkerSide, caches: dict, transfer: BlockTransfer) -> None:
    meta = UCMConnectorMetadata(saves=[transfer])
    for name in caches:
        worker.save_kv_layer(meta, name)
    worker.wait_for_save()
    assert worker.wait_for_stores(30)


def test_direct_load_round_trip_and_missing_block():
    worker, caches = _worker("ws-direct")
    try:
        digests = [bytes([i]) * 16 for i in range(3)]
        _save(worker, caches, BlockTransfer("a", [1, 2, 3], digests))
        assert worker.stats["saved_blocks"] == 3
        original = {k: v.clone() for k, v in caches.items()}
        for v in caches.values():
            v.zero_()
        # blocks 7, 8 take the first two stored blocks; block 9 asks for one never stored
        missing = b"\xee" * 16
        worker.start_load_kv(UCMConnectorMetadata(loads=[
            BlockTransfer("b", [7, 8, 9], [digests[0], digests[1], missing])]))
        assert worker._load_staging is None  # straight into the cache, no staging buffer
        for k, v in caches.items():
            assert torch.equal(v[7], original[k][1]) and torch.equal(v[8], original[k][2])
            assert not v[[0, 1, 2, 3, 4, 5, 6, 10, 11]].any()  # nothing else was written
        assert worker.get_block_ids_with_load_errors() == {9}
        assert worker.stats["loaded_blocks"] == 2
    finally:
        worker.shutdown()


def test_staged_load_when_direct_loads_are_off():
    worker, caches = _worker("ws-staged", direct_loads=False)
    try:
        digest = b"\x01" * 16
        _save(worker, caches, BlockTransfer("a", [4], [digest]))
        expected = {k: v[4].clone() for k, v in caches.items()}
        worker.start_load_kv(UCMConnectorMetadata(loads=[BlockTransfer("b", [10], [digest])]))
        assert worker._load_staging is not None
        for k, v in caches.items():
            assert torch.equal(v[10], expected[k])
        assert not worker.get_block_ids_with_load_errors()
    finally:
        worker.shutdown()


@pytest.mark.parametrize("index_wait", [10.0, 0.05])
def test_registration_waits_up_to_index_wait_for_the_stored_blocks_to_be_indexed(
        tmp_path, index_wait):
    from ucm.kernel import Kernel, Store

    namespace = f"ws-index-{index_wait}"
    posix = {"driver": "posix", "path": str(tmp_path / "b")}
    keys = [b"%d" % i * 16 for i in range(4)]
    with Kernel({"tiers": [posix], "namespace": namespace}) as kernel:  # an earlier engine
        assert kernel.submit(Store(keys, buffers=[bytes(4096)] * 4)).result(30).ok
    cfg = load_config({"tiers": [{"driver": "faulty", "name": "disk", "latency": 1.0,
                                  "ops": ["list_blocks"], "inner": posix}],
                       "namespace": namespace})
    worker = WorkerSide(HookSettings(ucm_config=cfg, namespace=namespace, block_size=16,
                                     index_wait=index_wait))
    try:
        worker.register_kv_caches({"l0": torch.zeros(4, 16, 2, 8)})
        indexed = worker.kernel.wait_indexed(0)
        blocks = worker.kernel.statistics()["tier.disk.blocks"]
        if index_wait > 1.0:  # waited for the slow listing: everything is indexed
            assert indexed and blocks == 4 and worker.stats["index_wait_ms"] >= 1000
        else:  # gave up after index_wait: serving while the listing goes on
            assert not indexed and blocks == 0 and worker.stats["index_wait_ms"] < 1000
            assert worker.kernel.wait_indexed(30)
    finally:
        worker.shutdown()


def test_snapshot_buffers_are_reused_after_their_stores():
    worker, caches = _worker("ws-reuse")
    try:
        _save(worker, caches, BlockTransfer("a", [1, 2, 3], [bytes([i]) * 16 for i in range(3)]))
        assert len(worker._spare) == 1 and worker._store_bytes == 0
        first = worker._spare[0].data_ptr()
        meta = UCMConnectorMetadata(saves=[BlockTransfer("b", [5, 6], [b"\x05" * 16,
                                                                       b"\x06" * 16])])
        worker.save_kv_layer(meta, "l0")
        assert worker._save_staging.data_ptr() == first  # two rows of the spare three-row one
        assert not worker._spare
        for name in list(caches)[1:]:
            worker.save_kv_layer(meta, name)
        worker.wait_for_save()
        assert worker.wait_for_stores(30)
        assert worker.stats["saved_blocks"] == 5 and worker._store_bytes == 0
    finally:
        worker.shutdown()


def test_snapshot_buffers_of_several_sizes_pick_the_smallest_that_fits():
    worker, _ = _worker("ws-sizes")
    try:
        three, one = worker._take_snapshot_buffer(3), worker._take_snapshot_buffer(1)
        worker._store_bytes += three.numel() + one.numel()  # as _begin_snapshot counts them
        worker._release(three)
        worker._release(one)
        assert sorted(t.shape[0] for t in worker._spare) == [1, 3] and not worker._store_bytes
        assert worker._take_snapshot_buffer(1).data_ptr() == one.data_ptr()
        again = worker._take_snapshot_buffer(2)  # two rows of the three-row buffer
        assert again.data_ptr() == three.data_ptr() and again.shape[0] == 2
        assert not worker._spare
    finally:
        worker.shutdown()


def test_a_snapshot_buffer_for_a_whole_step_is_reserved_at_registration():
    worker, caches = _worker("ws-reserve", step_tokens=40)  # 3 blocks of 16 tokens
    try:
        assert [t.shape[0] for t in worker._spare] == [3]
        reserved = worker._spare[0].data_ptr()
        assert worker.stats["snapshot_reserved_bytes"] == 3 * worker.layout.block_bytes
        meta = UCMConnectorMetadata(saves=[BlockTransfer("a", [1, 2, 3],
                                                         [bytes([i]) * 16 for i in range(3)])])
        worker.save_kv_layer(meta, "l0")
        assert worker._save_staging.data_ptr() == reserved  # no new buffer for a full step
        for name in list(caches)[1:]:
            worker.save_kv_layer(meta, name)
        worker.wait_for_save()
        assert worker.wait_for_stores(30) and worker.stats["saved_blocks"] == 3
    finally:
        worker.shutdown()


def test_the_reserved_snapshot_buffer_stays_within_the_store_limit():
    worker, _ = _worker("ws-limit")  # no step_tokens: nothing reserved
    try:
        assert not worker._spare
        two_blocks = 2 * worker.layout.block_bytes
        cases = [(10_000, two_blocks, [2]), (10_000, 0, []), (16, two_blocks, [1])]
        for step, limit, rows in cases:
            worker._spare.clear()
            worker.settings = replace(worker.settings, step_tokens=step, max_store_bytes=limit)
            worker._reserve_snapshot_buffer()
            assert [t.shape[0] for t in worker._spare] == rows
    finally:
        worker.shutdown()


@pytest.mark.parametrize("direct", [True, False])
def test_layerwise_loads_each_layer_on_its_own_and_in_order(direct):
    """Layerwise: each layer of a block is a block of its own. A layer is in the cache once
    its wait returns (the later ones may still be loading), and a block missing one layer is
    recomputed with every block after it in its request."""
    worker, caches = _worker(f"ws-layerwise-{direct}", layerwise=True, direct_loads=direct)
    try:
        digests = [bytes([i]) * 16 for i in range(3)]
        _save(worker, caches, BlockTransfer("a", [1, 2, 3], digests))
        assert worker.stats["saved_blocks"] == 3
        pieces = [layer_key(d, j) for d in digests for j in range(len(caches))]
        assert all(worker.kernel.submit(Lookup(pieces)).result(10).hits)  # one per layer
        assert not any(worker.kernel.submit(Lookup(digests)).result(10).hits)
        original = {k: v.clone() for k, v in caches.items()}
        for v in caches.values():
            v.zero_()
        # drop block 1's last layer: block 8 (and block 9 after it) must be recomputed
        last = len(caches) - 1
        worker.kernel.submit(Delete([layer_key(digests[1], last)])).result(10)
        worker.start_load_kv(UCMConnectorMetadata(loads=[
            BlockTransfer("b", [7, 8, 9], digests)]))
        for name, v in caches.items():
            worker.wait_for_layer_load(name)
            assert torch.equal(v[7], original[name][1])  # in place once its wait returns
        assert worker.get_block_ids_with_load_errors() == {8, 9}
        assert worker.stats["loaded_blocks"] == 1 and worker.stats["load_error_blocks"] == 2
        for v in caches.values():  # nothing outside the step's blocks was written
            assert not v[[0, 1, 2, 3, 4, 5, 6, 10, 11]].any()
    finally:
        worker.shutdown()



def test_an_early_load_is_used_by_the_step_it_was_planned_for():
    worker, caches = _worker("ws-early")
    try:
        digests = [bytes([i]) * 16 for i in range(3)]
        _save(worker, caches, BlockTransfer("a", [1, 2, 3], digests))
        original = {k: v.clone() for k, v in caches.items()}
        for v in caches.values():
            v.zero_()
        missing = b"\xee" * 16
        loads = [BlockTransfer("b", [7, 8, 9], [digests[0], digests[2], missing])]
        assert worker.load_early(loads)
        worker._early[1].wait(10)  # done: its blocks are counted
        loads_before = worker.kernel.statistics()["load_keys"]
        worker.start_load_kv(UCMConnectorMetadata(loads=[BlockTransfer(
            "b", [7, 8, 9], [digests[0], digests[2], missing])]))  # equal, not the same
        assert worker.kernel.statistics()["load_keys"] == loads_before  # no second load
        for k, v in caches.items():
            assert torch.equal(v[7], original[k][1]) and torch.equal(v[8], original[k][3])
            assert not v[[0, 1, 2, 3, 4, 5, 6, 9, 10, 11]].any()
        assert worker.get_block_ids_with_load_errors() == {9}
        assert worker.stats["early_loads"] == 1 and worker.stats["loaded_blocks"] == 2
        assert worker.stats["load_ns"] > 0  # the load's own time, submitted to done
        assert "early_loads_unused" not in worker.stats
    finally:
        worker.shutdown()


def test_an_early_load_no_step_asks_for_is_waited_for_and_dropped():
    worker, caches = _worker("ws-early-unused")
    try:
        digests = [bytes([i]) * 16 for i in range(2)]
        _save(worker, caches, BlockTransfer("a", [1, 2], digests))
        assert worker.load_early([BlockTransfer("b", [5], digests[:1])])
        # The step runs other loads: the early one is dropped (once it has stopped), and the
        # step's own loads run as usual.
        worker.start_load_kv(UCMConnectorMetadata(loads=[BlockTransfer("c", [6], digests[1:])]))
        assert worker.stats["early_loads_unused"] == 1
        assert worker._early is None
        for v in caches.values():
            assert torch.equal(v[6], v[2])
        assert worker.load_early([BlockTransfer("d", [7], digests[:1])])
        worker.start_load_kv(UCMConnectorMetadata())  # a step with no loads drops it too
        assert worker.stats["early_loads_unused"] == 2
        assert worker.stats["loaded_blocks"] == 1
    finally:
        worker.shutdown()


@pytest.mark.parametrize("option", [{"direct_loads": False}, {"layerwise": True},
                                    {"early_loads": False}])
def test_no_early_loads_staged_layerwise_or_turned_off(option):
    worker, caches = _worker("ws-no-early", **option)
    try:
        digest = b"\x01" * 16
        _save(worker, caches, BlockTransfer("a", [4], [digest]))
        assert not worker.load_early([BlockTransfer("b", [5], [digest])])
        assert "early_loads" not in worker.stats
    finally:
        worker.shutdown()


def test_the_scheduler_side_starts_the_steps_loads_through_the_worker_in_its_process():
    from types import SimpleNamespace

    from ucm.vllm_hook.keys import chain_digests, chain_seed
    from ucm.vllm_hook.scheduler import SchedulerSide

    worker, caches = _worker("ws-sched-early")
    try:
        tokens = list(range(100, 149))  # 3 full blocks of 16, then one token
        digests = chain_digests(chain_seed("ws-sched-early"), tokens, 16, 3)
        _save(worker, caches, BlockTransfer("a", [1, 2, 3], digests))
        side = SchedulerSide(worker.settings)
        request = SimpleNamespace(request_id="r", all_token_ids=tokens,
                                  prompt_token_ids=tokens, cache_salt=None, lora_request=None)
        end = time.monotonic() + 10
        while (found := side.get_num_new_matched_tokens(request, 0)[0]) is None:
            assert time.monotonic() < end
        assert found == 48
        side.update_state_after_alloc(
            request, SimpleNamespace(get_block_ids=lambda: ([8, 9, 10, 11],)), 48)
        so = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="r", block_ids=([8, 9, 10, 11],),
                                                num_computed_tokens=0)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                  num_computed_tokens=[]),
            num_scheduled_tokens={"r": 1})
        meta = side.build_connector_meta(so)
        assert [t.block_ids for t in meta.loads] == [[8, 9, 10]]
        assert side.stats["early_loads"] == 1 and worker.stats["early_loads"] == 1
        worker.start_load_kv(meta)
        for v in caches.values():
            assert torch.equal(v[8:11], v[1:4])
        assert not worker.get_block_ids_with_load_errors()
        assert worker.stats["loaded_blocks"] == 3 and "early_loads_unused" not in worker.stats
    finally:
        worker.shutdown()


def test_a_scheduler_side_finds_the_workers_kernel_while_the_worker_owns_it(monkeypatch):
    """By config, in this process only (a forked child starts its own), and it hands the
    worker no more loads once the worker has shut down."""
    worker, caches = _worker("ws-shared")
    config = worker.settings.ucm_config
    digest = b"\x01" * 16
    try:
        shared = kernels.find(config)
        assert shared is not None and shared.kernel is worker.kernel
        with monkeypatch.context() as m:
            m.setattr(os, "getpid", lambda: -1)
            assert kernels.find(config) is None
        _save(worker, caches, BlockTransfer("a", [4], [digest]))
    finally:
        worker.shutdown()
    assert kernels.find(config) is None
    assert not shared.load_early([BlockTransfer("b", [5], [digest])])
    assert "early_loads" not in worker.stats


def test_a_steps_loads_from_the_shared_arena_are_one_event_each_block_copied_once(
        tmp_path, monkeypatch):
    """Issue 38: a step loading several requests' blocks from the memory tier's shared arena
    posts one Load, which the kernel serves off its trio thread, and each block is read once,
    by one pass that checks and copies it into its pieces of the cache (no staging buffer,
    no second pass). Counted: the worker's Load events, the kernel's in-memory loads, and the
    passes over stored bytes (`copy_verified`'s hash_copy and the two-pass routines)."""
    import ucm.block as block_module

    namespace = "ws-shm-batch"
    cfg = load_config({"tiers": [{"driver": "memory", "shared": True, "shm_dir": str(
        tmp_path / "shm"), "size": 64 * 2**20}], "namespace": namespace})
    worker = WorkerSide(HookSettings(ucm_config=cfg, namespace=namespace, block_size=16))
    caches = {f"l{i}": torch.randn(24, 16, 32, 64) for i in range(3)}  # 384 KiB a block
    worker.register_kv_caches(caches)
    assert wait_running(worker.kernel, 30)
    passes: list[int] = []
    others: list[str] = []
    real = block_module._hash_copy
    assert real is not None

    def hash_copy(pieces, stored):  # on the copy threads: list.append is atomic
        passes.append(memoryview(stored).nbytes)
        return real(pieces, stored)

    def counted(name, fn):
        def call(*args, **kwargs):
            others.append(name)
            return fn(*args, **kwargs)
        return call

    try:
        digests = [bytes([i]) * 16 for i in range(8)]
        _save(worker, caches, BlockTransfer("a", [1, 2, 3, 4], digests[:4]))
        _save(worker, caches, BlockTransfer("b", [5, 6, 7, 8], digests[4:]))
        original = {k: v.clone() for k, v in caches.items()}
        for v in caches.values():
            v.zero_()
        monkeypatch.setattr(block_module, "_hash_copy", hash_copy)
        for name in ("copy_bytes", "verify_payload", "checksum"):
            monkeypatch.setattr(block_module, name, counted(name, getattr(block_module, name)))
        before = worker.kernel.statistics().get("loads_from_memory", 0)
        # two requests in one step: blocks 12-15 take a's, 16-19 take b's
        worker.start_load_kv(UCMConnectorMetadata(loads=[
            BlockTransfer("c", [12, 13, 14, 15], digests[:4]),
            BlockTransfer("d", [16, 17, 18, 19], digests[4:])]))
        assert worker._load_staging is None
        for k, v in caches.items():
            assert torch.equal(v[12:20], original[k][1:9])
        assert not worker.get_block_ids_with_load_errors()
        assert worker.stats["load_events"] == 1 and worker.stats["loaded_blocks"] == 8
        assert worker.kernel.statistics()["loads_from_memory"] - before == 1
        block_bytes = worker.layout.block_bytes
        assert block_bytes == 3 * 16 * 32 * 64 * 4
        assert sorted(passes) == [block_bytes] * 8
        assert others == []
    finally:
        worker.shutdown()
