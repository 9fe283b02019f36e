"""The vLLM sparse adapter's records are bounded (ucm.vllm_hook.sparse.SparseAttention): each
request keeps its newest `step_records` step records and the adapter the newest
`request_records` ended requests', while the counters count every step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ucm.sparse.config import SparseConfig
from ucm.vllm_hook.sparse import SparseAttention, _Request

BS = 4


def _adapter(**records: int) -> SparseAttention:
    config = SparseConfig(method="quest", budget=2, block_size=BS, sink_blocks=1,
                          local_blocks=1, stride=1, **records)
    sparse = SparseAttention(config, SimpleNamespace(layout=SimpleNamespace(block_bytes=64)))
    sparse.register(["layer.0", "layer.1"])
    return sparse


def _request(sparse: SparseAttention, seed: int) -> _Request:
    """A request whose 40-token prompt this adapter saw (1 KV head, 2 query heads, dim 8)."""
    g = torch.Generator().manual_seed(seed)
    rq = _Request(2, dense=False, step_records=sparse.config.step_records)
    rq.prompt_keys = [[torch.randn(1, 40, 8, generator=g)] for _ in range(2)]
    rq.queries = [torch.randn(2, 8, generator=g) for _ in range(2)]
    rq.tokens, rq.row = 40, torch.arange(16)
    sparse._requests[seed] = rq
    return rq


def test_a_request_keeps_its_newest_step_records_and_counts_every_step():
    sparse = _adapter(step_records=3)
    rq = _request(sparse, 0)
    for _ in range(7):  # K = 7 decode steps, N = 3 records
        sparse._plan(rq, 41)
    assert [s["step"] for s in rq.steps] == [4, 5, 6]  # the newest three
    assert sparse.stats["steps"] == 7 and sparse.stats["dropped_step_records"] == 4
    [kept] = sparse.statistics()["requests"]
    assert len(kept["steps"]) == 3 and sparse.statistics()["steps"] == 7


def test_ended_requests_keep_the_newest_records():
    sparse = _adapter(step_records=2, request_records=2)
    for seed in range(5):
        rq = _request(sparse, seed)
        for _ in range(3):
            sparse._plan(rq, 41)
        sparse._retire(sparse._requests.pop(seed))
    stats = sparse.statistics()
    assert len(stats["requests"]) == 2 and stats["dropped_request_records"] == 3
    assert stats["steps"] == 15 and stats["dropped_step_records"] == 5
    assert all(len(r["steps"]) == 2 for r in stats["requests"])


def test_no_records_at_all():
    sparse = _adapter(step_records=0, request_records=0)
    rq = _request(sparse, 0)
    for _ in range(3):
        sparse._plan(rq, 41)
    sparse._retire(sparse._requests.pop(0))  # no records: nothing kept, nothing counted
    assert sparse.statistics()["requests"] == [] and sparse.stats["steps"] == 3
    assert sparse.stats["dropped_step_records"] == 3


def test_record_limits_are_validated():
    with pytest.raises(ValueError):
        SparseConfig(step_records=-1)
    with pytest.raises(ValueError):
        SparseConfig(request_records=-1)
