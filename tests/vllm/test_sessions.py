"""Session hints without an engine: parsing (malformed hints are reasons, never errors), the
scheduler side turning a finished request's hint into the next step's op, and a worker side
holding, releasing and prefetching its keys in its kernel (real kernel, CPU KV tensors)."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from ucm.config import load_config  # noqa: E402
from ucm.vllm_hook.metadata import BlockTransfer, UCMConnectorMetadata  # noqa: E402
from ucm.vllm_hook.scheduler import SchedulerSide  # noqa: E402
from ucm.vllm_hook.sessions import SessionOp, parse_hint  # noqa: E402
from ucm.vllm_hook.settings import HookSettings, KVGroup, wait_running  # noqa: E402
from ucm.vllm_hook.worker import WorkerSide  # noqa: E402


def _parse(hint: object) -> tuple[SessionOp | None, str | None]:
    return parse_hint({"ucm": hint}, max_retain_s=600)


def test_well_formed_hints() -> None:
    assert _parse({"session": "s", "retain_s": 300})[0] == SessionOp("s", 300.0)
    assert _parse({"session": "s", "end": True})[0] == SessionOp("s", end=True)
    assert _parse({"session": "s", "prefetch": True, "retain_s": 5})[0] == SessionOp(
        "s", 5.0, prefetch=True)
    assert parse_hint(None, max_retain_s=1) == (None, None)
    assert parse_hint({"do_remote_prefill": True}, max_retain_s=1) == (None, None)


@pytest.mark.parametrize("hint, reason", [
    ("s", "must be a mapping"),
    ({"session": "s", "retain_s": 3, "pin": True}, "unknown keys"),
    ({"retain_s": 3}, "'session'"),
    ({"session": 7, "retain_s": 3}, "'session'"),
    ({"session": "x" * 257, "retain_s": 3}, "'session'"),
    ({"session": "s", "retain_s": "300"}, "number of seconds"),
    ({"session": "s", "retain_s": True}, "number of seconds"),
    ({"session": "s", "retain_s": -1}, "> 0"),
    ({"session": "s", "retain_s": 10**9}, "at most 600"),
    ({"session": "s", "retain_s": math.nan}, "> 0"),
    ({"session": "s", "end": "yes"}, "'end'"),
    ({"session": "s", "end": True, "retain_s": 3}, "contradict"),
    ({"session": "s"}, "needs"),
])
def test_malformed_hints_give_a_reason(hint: object, reason: str) -> None:
    op, problem = _parse(hint)
    assert op is None and problem is not None and reason in problem


def _settings(block_size: int, groups: tuple[KVGroup, ...] = ()) -> HookSettings:
    cfg = load_config({"tiers": [{"driver": "memory", "shared": False}],
                       "namespace": "sessions"})
    return HookSettings(ucm_config=cfg, namespace="sessions", block_size=block_size,
                        groups=groups)


# vLLM's hybrid KV cache manager: a full-attention group and a sliding one of 33 tokens (the
# 2 blocks of 16 before a hit boundary)
GROUPS = (KVGroup(0, "full", ("a",), 16), KVGroup(1, "sliding", ("b",), 16, 33))


def _request(rid: str, tokens: list[int], params: object) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, all_token_ids=tokens, prompt_token_ids=tokens,
                           cache_salt=None, lora_request=None, kv_transfer_params=params)


def _step(rid: str, block_ids: list[int], tokens: int) -> SimpleNamespace:
    new = SimpleNamespace(req_id=rid, block_ids=(block_ids,), num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={rid: tokens})


def _empty_step() -> SimpleNamespace:
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={})


def _finish(side: SchedulerSide, rid: str, tokens: list[int], params: object,
            ) -> UCMConnectorMetadata:
    """Runs a request through the scheduler side: its saves, then its end with `params`;
    returns the next step's metadata."""
    req = _request(rid, tokens, params)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, None, 0)
    side.build_connector_meta(_step(rid, list(range(len(tokens) // 16)), len(tokens)))
    side.request_finished(req, [])
    return side.build_connector_meta(_empty_step())


def test_the_scheduler_sends_a_finished_requests_hint_with_its_saved_blocks() -> None:
    side = SchedulerSide(_settings(16))
    try:
        tokens = list(range(64))  # 4 full blocks
        meta = _finish(side, "a", tokens, {"ucm": {"session": "s", "retain_s": 30}})
        [op] = meta.sessions
        assert op.session == "s" and op.retain_s == 30 and len(op.digests) == 4
        assert not side.build_connector_meta(_empty_step()).sessions  # sent once
        meta = _finish(side, "b", tokens, {"ucm": {"session": "s", "end": True}})
        assert meta.sessions == [SessionOp("s", end=True)]
        for bad in ({"ucm": {"session": "s", "retain_s": -5}}, {"ucm": "s"},
                    {"ucm": {"session": "s", "retain_s": 1, "extra": 1}}):
            assert not _finish(side, "c", tokens, bad).sessions
        assert side.stats["session_hints_malformed"] == 3
        assert side.stats["session_hints.hold"] == 1 and side.stats["session_hints.end"] == 1
    finally:
        side.shutdown()


def test_a_worker_holds_releases_and_prefetches_its_keys() -> None:
    worker = WorkerSide(_settings(16))
    caches = {f"l{i}": torch.randn(12, 16, 2, 8) for i in range(2)}
    worker.register_kv_caches(caches)
    assert wait_running(worker.kernel, 30)
    try:
        digests = [bytes([i]) * 16 for i in range(3)]
        meta = UCMConnectorMetadata(saves=[BlockTransfer("a", [1, 2, 3], digests)])
        for name in caches:
            worker.save_kv_layer(meta, name)
        worker.wait_for_save()
        assert worker.wait_for_stores(30)
        [held] = worker.apply_sessions([SessionOp("s", 60.0, digests=digests)])
        assert held.result(10) == 3
        stats = worker.kernel.statistics()
        assert stats["session_holds"] == 1 and stats["tier.memory.held_sessions"] == 1
        [released] = worker.apply_sessions([SessionOp("s", end=True)])
        assert released.result(10) is True
        [prefetched] = worker.apply_sessions([SessionOp("s", prefetch=True, digests=digests)])
        assert prefetched.result(10).resident == 3
        stats = worker.kernel.statistics()
        assert stats["tier.memory.held_sessions"] == 0
        assert stats["session_releases.end"] == 1
        assert worker.stats["session_ops"] == 3 and not worker.stats["session_ops_dropped"]
    finally:
        worker.shutdown()


def test_a_steps_session_ops_reach_the_worker_through_its_metadata() -> None:
    """vLLM's multiprocess layout: the op travels pickled in the step's metadata and the
    worker applies it in start_load_kv."""
    import pickle

    from ucm.vllm_hook.connector import StepMetadata

    worker = WorkerSide(_settings(16))
    worker.register_kv_caches({f"l{i}": torch.randn(12, 16, 2, 8) for i in range(2)})
    assert wait_running(worker.kernel, 30)
    try:
        digests = [bytes([i]) * 16 for i in range(2)]
        meta = pickle.loads(pickle.dumps(StepMetadata(sessions=[SessionOp("m", 60.0,
                                                                          digests=digests)])))
        assert meta.sessions == [SessionOp("m", 60.0, digests=digests)]
        worker.start_load_kv(meta)
        for _ in range(100):  # the hold runs on the kernel's thread
            stats = worker.kernel.statistics()
            if stats.get("session_holds"):
                break
            time.sleep(0.05)
        assert stats["session_holds"] == 1 and stats["tier.memory.held_sessions"] == 1
        assert worker.stats["session_ops"] == 1
    finally:
        worker.shutdown()


def test_with_several_groups_a_hint_names_each_groups_stored_blocks() -> None:
    side = SchedulerSide(_settings(16, GROUPS))
    try:
        tokens = list(range(160))  # 10 full blocks; the same prompt hits at 9 (159 tokens)
        req = _request("a", tokens, {"ucm": {"session": "s", "retain_s": 30}})
        side.get_num_new_matched_tokens(req, 0)
        side.update_state_after_alloc(req, None, 0)
        step = _step("a", [], len(tokens))
        step.scheduled_new_reqs[0].block_ids = (list(range(1, 11)), list(range(11, 21)))
        saves = side.build_connector_meta(step).saves
        side.request_finished(req, [])
        [op] = side.build_connector_meta(_empty_step()).sessions
        assert len(op.digests) == 10
        # what each group stored: the full one every block, the sliding one blocks 7 and 8
        assert [t.digests for t in saves] == op.group_digests == [op.digests, op.digests[7:9]]
    finally:
        side.shutdown()


def test_with_several_groups_a_worker_holds_each_groups_stored_blocks() -> None:
    worker = WorkerSide(_settings(16, GROUPS))
    caches = {name: torch.randn(12, 16, 2, 8) for name in ("a", "b")}
    worker.register_kv_caches(caches)
    assert wait_running(worker.kernel, 30)
    try:
        digests = [bytes([i]) * 16 for i in range(4)]
        meta = UCMConnectorMetadata(saves=[BlockTransfer("a", [1, 2, 3, 4], digests, 0),
                                           BlockTransfer("a", [7, 8], digests[2:], 1)])
        for name in caches:
            worker.save_kv_layer(meta, name)
        worker.wait_for_save()
        assert worker.wait_for_stores(30) and worker.stats["saved_blocks"] == 6
        op = SessionOp("s", 60.0, digests=digests, group_digests=[digests, digests[2:]])
        [held] = worker.apply_sessions([op])
        assert held.result(10) == 6  # keys: 4 of the full group, 2 of the sliding one
        stats = worker.kernel.statistics()
        assert stats["tier.memory.held_bytes"] == 6 * 16 * 2 * 8 * 4
        [prefetched] = worker.apply_sessions([SessionOp("s", prefetch=True, digests=digests,
                                                        group_digests=[digests, digests[2:]])])
        assert prefetched.result(10).resident == 6
    finally:
        worker.shutdown()
