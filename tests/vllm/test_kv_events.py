"""ucm's blocks as vLLM KV events without an engine: the worker side notes only the stores that
completed (a real kernel; a failing tier for the failed store) and the blocks a load found
gone; the scheduler side turns the notes of every TP rank into vLLM's BlockStored (one per
tier the store reached, with vLLM's block hashes and tokens) and BlockRemoved, per KV cache
group where there are several. The events on a
real engine, through vLLM's publisher: tests/vllm/test_disagg.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from ucm.config import load_config  # noqa: E402
from ucm.vllm_hook.events import (  # noqa: E402
    SchedulerEvents,
    UCMGone,
    UCMKVEvents,
    UCMStoreDone,
    WorkerEvents,
    stored_tiers,
)
from ucm.vllm_hook.metadata import BlockTransfer, UCMConnectorMetadata  # noqa: E402
from ucm.vllm_hook.settings import HookSettings, wait_running  # noqa: E402
from ucm.vllm_hook.worker import WorkerSide  # noqa: E402

BS = 4
TIERS = {"tiers": [{"driver": "memory"}, {"driver": "posix", "path": "/nonexistent"}]}


def test_a_store_is_in_the_tiers_its_durability_waits_for():
    assert stored_tiers(load_config(TIERS)) == ["memory", "posix"]  # local: the default
    assert stored_tiers(load_config({**TIERS, "durability": "memory"})) == ["memory"]
    assert stored_tiers(load_config({"tiers": [
        {"driver": "memory", "name": "ram"}, {"driver": "posix", "path": "/a"},
        {"driver": "posix", "path": "/b", "name": "cold"}], "durability": "all"})) == [
        "ram", "posix", "cold"]


def _request(tokens: list[int]) -> SimpleNamespace:
    hashes = [b"h%d" % i for i in range(len(tokens) // BS)]  # as vLLM's block_hashes
    return SimpleNamespace(request_id="r", all_token_ids=tokens, block_hashes=hashes,
                           lora_request=None)


def h(*names: bytes) -> list:
    """Block hashes as vLLM publishes them (ints unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    is off)."""
    return [maybe_convert_block_hash(n) for n in names]


def _notes(*notes, workers: int = 1) -> UCMKVEvents:
    return UCMKVEvents(notes, workers)


def test_stored_blocks_are_published_once_every_rank_stored_them():
    publisher = SchedulerEvents(load_config(TIERS), BS, ranks=2)
    tokens = list(range(20))  # 5 blocks
    digests = [b"d%d" % i for i in range(5)]
    publisher.planned(_request(tokens), 0, digests[:3])
    publisher.planned(_request(tokens), 3, digests[3:])
    # rank 0 stored blocks 0-3, rank 1 blocks 0-2: blocks 0-2 are stored
    combined = _notes(UCMStoreDone(digests=digests[:4]))
    combined.add_events([UCMStoreDone(digests=digests[:3])])  # as KVOutputAggregator adds
    combined.increment_workers(1)
    publisher.add(combined)
    events = publisher.take()
    assert [e.medium for e in events] == ["ucm:memory", "ucm:posix"]
    for e in events:
        assert isinstance(e, BlockStored)
        assert e.block_hashes == h(b"h0", b"h1", b"h2") and e.parent_block_hash is None
        assert e.token_ids == tokens[:12] and e.block_size == BS
    assert publisher.take() == []
    # rank 1 stores block 3 later; block 4's store failed: never reported, never published
    publisher.add(_notes(UCMStoreDone(digests=digests[3:4])))
    events = publisher.take()
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in events] == [
        (h(b"h3"), h(b"h2")[0], tokens[12:16])] * 2
    publisher.add(None)  # a step with no notes
    assert publisher.take() == []


def test_one_group_names_no_group():
    publisher = SchedulerEvents(load_config(TIERS), BS, ranks=1)
    tokens = list(range(8))
    publisher.planned(_request(tokens), 0, [b"d0", b"d1"])
    publisher.add(_notes(UCMStoreDone(digests=[b"d0", b"d1"])))
    events = publisher.take()
    assert len(events) == 2
    assert all((e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
               == (None, None, None) for e in events)


# vLLM's hybrid KV cache manager: group 0 full attention, group 1 a sliding window of 8 tokens
GROUPS = (("full_attention", None), ("sliding_window", 8))


def test_with_several_groups_each_groups_stored_blocks_are_published_under_it():
    publisher = SchedulerEvents(load_config(TIERS), BS, ranks=2, groups=GROUPS)
    tokens = list(range(24))  # 6 blocks; the sliding group stores blocks 3 and 4 only
    digests = [b"d%d" % i for i in range(6)]
    publisher.planned(_request(tokens), 0, digests[:5], group=0)
    publisher.planned(_request(tokens), 0, digests[3:5], group=1, positions=[3, 4])
    # rank 0 stored everything; rank 1 the full group's blocks and the sliding group's block 3
    notes = _notes(UCMStoreDone(digests=digests[:5] + digests[3:5], groups=[0] * 5 + [1] * 2))
    notes.add_events([UCMStoreDone(digests=digests[:5] + digests[3:4], groups=[0] * 5 + [1])])
    notes.increment_workers(1)
    publisher.add(notes)
    events = publisher.take()
    assert all(isinstance(e, BlockStored) for e in events)
    got = [(e.medium, e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window,
            e.block_hashes, e.parent_block_hash, e.token_ids) for e in events]
    full = (0, "full_attention", None, h(b"h0", b"h1", b"h2", b"h3", b"h4"), None, tokens[:20])
    sliding = (1, "sliding_window", 8, h(b"h3"), h(b"h2")[0], tokens[12:16])
    assert got == [("ucm:memory", *full), ("ucm:memory", *sliding),
                   ("ucm:posix", *full), ("ucm:posix", *sliding)]
    # rank 1's note of block 4 in group 1 publishes it in that group only
    publisher.add(_notes(UCMStoreDone(digests=digests[4:5], groups=[1])))
    assert [(e.group_idx, e.block_hashes, e.parent_block_hash) for e in publisher.take()] == [
        (1, h(b"h4"), h(b"h3")[0])] * 2
    # removals name the group: a load found group 1's block 3 gone; a lookup of every key
    # found group 0's block 1 only on posix, and group 1's block 0 (never published) nowhere
    publisher.add(_notes(UCMGone(digests=[b"d3"], groups=[1])))
    publisher.looked_up_each(digests[:2], ("memory", "posix"), (True, True), group=0)
    publisher.looked_up_each(digests[:1], (None,), (False,), group=1)
    assert [(type(e), e.group_idx, e.block_hashes, e.medium) for e in publisher.take()] == [
        (BlockRemoved, 1, h(b"h3"), "ucm:memory"), (BlockRemoved, 1, h(b"h3"), "ucm:posix"),
        (BlockRemoved, 0, h(b"h1"), "ucm:memory")]


def test_blocks_found_gone_are_published_as_removed_from_the_tiers_that_lost_them():
    publisher = SchedulerEvents(load_config(TIERS), BS, ranks=1)
    tokens = list(range(12))
    digests = [b"d0", b"d1", b"d2"]
    publisher.planned(_request(tokens), 0, digests)
    publisher.add(_notes(UCMStoreDone(digests=digests)))
    publisher.take()
    # a lookup: block 0 in memory, block 1 only on posix (evicted from memory), block 2 missed
    publisher.looked_up(digests, ("memory", "posix", None), leading=2)
    removed = [(e.block_hashes, e.medium) for e in publisher.take()
               if isinstance(e, BlockRemoved)]
    assert removed == [(h(b"h1"), "ucm:memory"), (h(b"h2"), "ucm:memory"),
                       (h(b"h2"), "ucm:posix")]
    publisher.looked_up(digests, ("memory", "posix", None), leading=2)
    assert publisher.take() == []  # reported once
    # a load found block 0 missing everywhere
    publisher.add(_notes(UCMGone(digests=[b"d0", b"never published"])))
    assert [(e.block_hashes, e.medium) for e in publisher.take()] == [
        (h(b"h0"), "ucm:memory"), (h(b"h0"), "ucm:posix")]


def _worker(tiers: list[dict], namespace: str) -> tuple[WorkerSide, dict]:
    cfg = load_config({"tiers": tiers, "namespace": namespace})
    worker = WorkerSide(HookSettings(ucm_config=cfg, namespace=namespace, block_size=16),
                        events=WorkerEvents())
    caches = {f"l{i}": torch.randn(8, 16, 2, 8) for i in range(2)}
    worker.register_kv_caches(caches)
    assert wait_running(worker.kernel, 30)
    return worker, caches


def _save(worker: WorkerSide, caches: dict, transfer: BlockTransfer) -> None:
    meta = UCMConnectorMetadata(saves=[transfer])
    for name in caches:
        worker.save_kv_layer(meta, name)
    worker.wait_for_save()
    assert worker.wait_for_stores(30)


def test_the_worker_notes_completed_stores_only_and_blocks_a_load_found_gone():
    worker, caches = _worker([{"driver": "memory", "shared": False}], "ev-ok")
    try:
        assert worker.events is not None and worker.events.take() is None
        digests = [bytes([i]) * 16 for i in range(3)]
        _save(worker, caches, BlockTransfer("a", [1, 2, 3], digests))
        missing = b"\xee" * 16
        worker.start_load_kv(UCMConnectorMetadata(loads=[
            BlockTransfer("b", [5, 6], [digests[0], missing])]))
        notes = worker.events.take()
        assert notes is not None
        assert [(type(n), n.digests) for n in notes.get_all_events()] == [
            (UCMStoreDone, digests), (UCMGone, [missing])]
        assert worker.events.take() is None
    finally:
        worker.shutdown()
    failing = {"driver": "faulty", "error_rate": 1.0, "ops": ["store"],
               "inner": {"driver": "memory", "shared": False}}
    worker, caches = _worker([failing], "ev-failed")
    try:
        _save(worker, caches, BlockTransfer("a", [1, 2], [b"\x01" * 16, b"\x02" * 16]))
        assert worker.stats["save_blocks"] == 2 and worker.stats["saved_blocks"] == 0
        assert worker.events is not None and worker.events.take() is None
    finally:
        worker.shutdown()
