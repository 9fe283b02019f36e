"""The validation slice without vLLM: token ids generated from hash ids (equal ids, equal
blocks; chains as in the trace) and the prediction with vLLM's prefix semantics and the
kernel's byte accounting, on a 4-request trace worked by hand."""

from __future__ import annotations

import json

from ucm.autotune import Request, SimTier, simulate
from ucm.autotune._validate import (
    TraceRequest,
    block_tokens,
    predict,
    read_slice,
    scale_prompt,
    vllm_requests,
)

BS = 4
VOCAB = 2048


def test_equal_hash_ids_give_equal_blocks_and_chains_share_prefixes():
    assert block_tokens(7, BS, VOCAB) == block_tokens(7, BS, VOCAB)
    assert block_tokens(7, BS, VOCAB) != block_tokens(8, BS, VOCAB)
    assert all(3 <= t < VOCAB for t in block_tokens(7, 64, VOCAB))
    a = scale_prompt(TraceRequest((0, 1, 2), 3 * 512), BS, VOCAB)
    b = scale_prompt(TraceRequest((0, 1, 5, 6), 3 * 512 + 256), BS, VOCAB)
    assert len(a) == 3 * BS and len(b) == 3 * BS + BS // 2  # the partial block, scaled
    assert a[:2 * BS] == b[:2 * BS] and a[2 * BS:] != b[2 * BS:3 * BS]
    ka, kb = vllm_requests([a, b], BS, "ns")
    assert ka.blocks[:2] == kb.blocks[:2] and ka.blocks[2] != kb.blocks[2]
    # the same hash id after another parent is another key (keys chain)
    c = scale_prompt(TraceRequest((9, 2), 2 * 512), BS, VOCAB)
    assert vllm_requests([c], BS, "ns")[0].blocks[1] != ka.blocks[2]
    # vLLM never loads the last token: a whole-block prompt looks up one block fewer
    assert (len(ka.blocks), ka.lookup) == (3, 2) and (len(kb.blocks), kb.lookup) == (3, 3)


def test_a_partial_block_stays_partial():
    tiny = scale_prompt(TraceRequest((1, 2), 512 + 1), BS, VOCAB)
    almost = scale_prompt(TraceRequest((1, 2), 2 * 512 - 1), BS, VOCAB)
    assert len(tiny) == BS + 1 and len(almost) == 2 * BS - 1


def test_slice_samples_conversations_and_cuts_requests(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [{"hash_ids": list(range(i * 100, i * 100 + 40)), "input_length": 40 * 512 - 7}
             for i in range(30)]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    every = read_slice(path, requests=5, sample=1, max_blocks=8)
    assert [r.hash_ids[0] for r in every] == [0, 100, 200, 300, 400]
    assert all(len(r.hash_ids) == 8 and r.input_length == 8 * 512 for r in every)
    some = read_slice(path, requests=30, sample=3, max_blocks=64)
    assert 0 < len(some) < 30 and some[0].input_length == 40 * 512 - 7


def test_lookup_limit_in_the_plain_simulator():
    k = [i.to_bytes(8, "little") for i in range(4)]
    requests = [Request((k[0], k[1]), lookup=1), Request((k[0], k[1]), lookup=1)]
    result = simulate(requests, [SimTier("lru", None)])
    assert (result.hits, result.accesses) == (1, 2)


def _four() -> list[Request]:
    prompts = [scale_prompt(r, BS, VOCAB) for r in (
        TraceRequest((1, 2, 3), 3 * 512),          # stores 3, looks up 2
        TraceRequest((1, 2, 3, 4), 4 * 512),       # looks up 3
        TraceRequest((1, 2, 5), 2 * 512 + 100),    # stores 2, looks up 2
        TraceRequest((1, 2, 3), 3 * 512))]
    return vllm_requests(prompts, BS, "ns")


def test_prediction_on_four_requests_counts_the_store_headers():
    # A tier of 300 bytes, blocks of 100: a store reserves 150 a block (with its header), so
    # the first request's third block finds no room; the second hits two blocks, and its
    # store of two evicts both; the third misses and evicts them again; the fourth hits two.
    result = predict(_four(), "lru", 300, 100, header_bytes=50)
    assert result.per_request == [0, 2, 0, 2]
    assert (result.hits, result.accesses) == (4, 9)
    # Without headers all three fit: the second hits three, and the third's store (its
    # chain's head evicted) takes the LRU victims a2 and a3, so the fourth hits two.
    assert predict(_four(), "lru", 300, 100, header_bytes=0).per_request == [0, 3, 0, 2]
