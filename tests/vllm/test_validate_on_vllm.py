"""Predicted against measured hits on real vLLM (`ucm.bench.validate`): a 10-request
slice of the Mooncake conversation trace, scaled to 32-token blocks, replayed one request at a
time through vLLM-CPU with the ucm connector over a memory tier of 36 blocks, for LRU and
S3-FIFO (which evict differently there). The simulator's hits must equal the blocks each
request loaded, request by request."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow

TRACE = "/work/shared/data/mooncake-traces/conversation_trace.jsonl"


@pytest.mark.skipif(not os.path.exists(TRACE), reason="the Mooncake trace is not here")
def test_predicted_hits_equal_measured_hits(tiny_model, tmp_path, engine_pool):
    from ucm.bench.models import ModelSpec
    from ucm.bench.validate import validate

    spec = ModelSpec(max_positions=33792)  # tiny_model's

    def one(policy: str) -> dict:  # an engine per policy: the two run side by side
        out = validate(TRACE, tiny_model, policies=(policy,), requests=10, sample=50,
                       capacity_blocks=36, block_size=32, vocab=spec.vocab,
                       block_bytes=spec.kv_bytes_per_token() * 32,
                       log_path=str(tmp_path / f"engines-{policy}.log"))
        [row] = out["rows"]
        return dict(row)

    futures = {p: engine_pool.submit(one, p) for p in ("lru", "s3fifo")}
    rows = {p: f.result() for p, f in futures.items()}
    for row in rows.values():
        assert row["measured_per_request"] == row["predicted_per_request"]
        assert row["predicted_hits"] == row["measured_hits"] > 0
        # every hit was a load from ucm: vLLM's own prefix cache is off
        assert [t // 32 for t in row["cached_tokens"]] == row["measured_per_request"]
    # on this slice the two policies keep different blocks (so eviction is what is checked):
    # 34 and 31 hits predicted of 222 lookup blocks
    assert rows["lru"]["predicted_hits"] != rows["s3fifo"]["predicted_hits"]
