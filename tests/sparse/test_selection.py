"""Exact properties of selection and sparse attention."""

from __future__ import annotations

import pytest
import torch

import ucm.sparse as sparse
from ucm.bench.sparse_eval import method_for, selection
from ucm.sparse import (
    SparseConfig,
    SparseSession,
    block_token_mask,
    dense_attention,
    masked_attention,
    select_blocks,
    sparse_attention,
)

ALL = ["quest", "esa", "gsa", "kvstar", "adaptive", "random"]


def _qkv(seed: int, hq=4, hkv=2, n=300, d=16):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(hq, d, generator=g) * 2,
        torch.randn(hkv, n, d, generator=g),
        torch.randn(hkv, n, d, generator=g),
    )


def test_public_names_are_exported_once_and_resolve():
    assert len(sparse.__all__) == len(set(sparse.__all__)) == len(sparse._EXPORTS)
    for name in sparse.__all__:
        assert getattr(sparse, name) is not None


@pytest.mark.parametrize("method", ALL)
def test_full_budget_equals_dense_attention(method):
    q, k, v = _qkv(0)
    m = method_for(method, budget=1.0, block_size=16, mass_target=1.0)
    chosen, _ = selection(m, q[None].expand(8, -1, -1), k)
    assert chosen.tolist() == list(range(-(-300 // 16)))
    out = sparse_attention(q, k, v, chosen, 16)
    assert torch.allclose(out, dense_attention(q, k, v), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", ALL)
def test_sparse_output_equals_masked_dense_reference(method):
    q, k, v = _qkv(1)
    m = method_for(method, budget=3, block_size=16, mass_target=1.0)
    chosen, _ = selection(m, q[None].expand(8, -1, -1), k)
    mask = block_token_mask(chosen, k.shape[1], 16)
    out = sparse_attention(q, k, v, chosen, 16)
    assert torch.allclose(out, masked_attention(q, k, v, mask), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out, dense_attention(q, k, v), atol=1e-3)  # it is sparse


@pytest.mark.parametrize("method", ["quest", "esa", "gsa", "kvstar", "random"])
@pytest.mark.parametrize("budget", [0, 2, 5])
def test_sinks_and_local_window_always_selected_and_count_exact(method, budget):
    q, k, _ = _qkv(2)
    m = method_for(method, budget=budget, block_size=16, sink_blocks=2, local_blocks=3)
    chosen, _ = selection(m, q[None].expand(8, -1, -1), k)
    nb = -(-300 // 16)
    ids = chosen.tolist()
    assert {0, 1, nb - 3, nb - 2, nb - 1} <= set(ids)
    assert len(ids) == 5 + budget


def test_select_blocks_edges():
    s = torch.arange(10.0)
    assert select_blocks(s, 3, 1, 1).tolist() == [0, 6, 7, 8, 9]
    assert select_blocks(s, 100, 1, 1).tolist() == list(range(10))
    assert select_blocks(s[:2], 5, 3, 3).tolist() == [0, 1]  # fewer blocks than resident


def test_config_validation():
    with pytest.raises(ValueError, match="fractional budget"):
        SparseConfig(budget=1.5)
    with pytest.raises(ValueError):
        SparseConfig(method="nope")
    with pytest.raises(ValueError, match="hash_bits must be a multiple of 8"):
        SparseConfig(method="gsa", hash_bits=12)
    assert SparseConfig(method="gsa").hash_bits == 128
    assert SparseConfig(method="gsa").prefetch_enabled
    assert not SparseConfig(method="esa").prefetch_enabled
    assert SparseConfig(budget=1.0).budget_blocks(40) == 40
    assert SparseConfig(budget=1 / 8).budget_blocks(40) == 5
    assert SparseConfig(budget=7).budget_blocks(5) == 5


def _session(method="quest", **kw):
    cfg = SparseConfig(method=method, block_size=8, sink_blocks=1, local_blocks=1, **kw)
    return SparseSession(cfg)


def test_session_loads_only_changed_blocks_and_refreshes_every_stride():
    g = torch.Generator().manual_seed(5)
    layers = [torch.randn(2, 200, 16, generator=g) for _ in range(2)]
    s = _session(budget=4, stride=4)
    s.prefill(layers)
    plans = []
    q = torch.randn(4, 16, generator=g)
    for step in range(12):
        if step % 4 == 0:
            q = torch.randn(4, 16, generator=g)  # the focus moves at each refresh
        plans.append(s.step([q, q]))
        assert s.n_blocks - 1 in plans[-1].selected  # the local window
        s.append([torch.randn(2, 1, 16, generator=g) for _ in range(2)])
    assert [p.refreshed for p in plans] == [i % 4 == 0 for i in range(12)]
    resident: set[int] = set()
    prompt_blocks = 200 // 8  # later blocks are written by the decode, never loaded
    for p in plans:
        changed = {b for b in set(p.selected) - resident if b < prompt_blocks}
        assert set(p.load) == changed  # only changed blocks are loaded
        assert set(p.evict) == resident - set(p.selected)
        assert 0 in p.selected
        resident = set(p.selected)
    assert plans[0].load == plans[0].selected  # nothing resident after prefill
    assert sum(len(p.load) for p in plans[1:4]) == 0  # no refresh, no new blocks
    assert any(p.load for p in plans[4:])  # a refresh with a new focus brings blocks in


def test_decode_blocks_are_resident_from_birth():
    g = torch.Generator().manual_seed(6)
    s = _session(budget=2, stride=100)
    s.prefill([torch.randn(1, 16, 8, generator=g)])  # exactly 2 blocks
    s.step([torch.randn(1, 8, generator=g)])
    for _ in range(8):  # fills block 2 during decode
        s.append([torch.randn(1, 1, 8, generator=g)])
    plan = s.step([torch.randn(1, 8, generator=g)])
    assert 2 in plan.selected and 2 not in plan.load


def test_gsa_prefetch_announces_blocks_before_the_refresh_needs_them():
    g = torch.Generator().manual_seed(8)
    keys = torch.randn(2, 640, 16, generator=g)
    s = _session(method="gsa", budget=6, stride=8, prefetch_lead=2)
    s.prefill([keys])
    base = torch.randn(4, 16, generator=g)
    prefetched: set[int] = set()
    for step in range(40):
        if step % 8 == 5:  # the focus moves just before the prediction step
            base = torch.randn(4, 16, generator=g)
        plan = s.step([base + 0.05 * torch.randn(4, 16, generator=g)])
        if plan.prefetch:
            assert (step + 2) % 8 == 0
            assert not set(plan.prefetch) & set(plan.selected)
        prefetched |= set(plan.prefetch)
    stats = s.prefetch_stats
    assert stats.issued > 0 and stats.needed > 0
    assert stats.hit_rate >= 0.6, stats


def test_adaptive_budget_grows_with_flatter_attention():
    g = torch.Generator().manual_seed(9)
    keys = torch.randn(1, 1024, 32, generator=g)
    sharp = keys[0, 500] * 3.0
    flat = torch.randn(32, generator=g) * 0.05
    budgets = []
    for q in (sharp, flat):
        m = method_for("adaptive", block_size=16, mass_target=0.9, budget=1.0)
        budgets.append(selection(m, q[None, None], keys)[1])
    assert budgets[0] < budgets[1]
    assert budgets[1] > 30  # nearly uniform attention needs most blocks


# ----- GSA: hashed keys, Hamming similarity -----
def _brute_bits(codes: torch.Tensor) -> torch.Tensor:
    """(..., nbytes) uint8 -> (..., 8 nbytes) bool, bit i of byte j at 8 j + i."""
    return torch.stack([(codes.int() >> i) & 1 == 1 for i in range(8)], -1).flatten(-2)


def test_gsa_hamming_similarity_equals_a_brute_force_bit_count():
    from ucm.sparse.methods import hamming_similarity, pack_bits, popcount

    g = torch.Generator().manual_seed(20)
    for nbytes in (16, 5):  # 8-byte words (the SWAR count) and the byte table
        a = torch.randint(0, 256, (5, 7, nbytes), generator=g, dtype=torch.uint8)
        b = torch.randint(0, 256, (1, 7, nbytes), generator=g, dtype=torch.uint8)
        a[0, 0] = 255  # every bit set, the int64 sign bit included
        b[0, 1] = 255
        equal = (_brute_bits(a) == _brute_bits(b)).sum(-1)
        assert torch.equal(hamming_similarity(a, b), equal)
        assert torch.equal(8 * nbytes - popcount(a ^ b), equal)
    flat = torch.randint(0, 256, (3 * 16 + 1,), generator=g, dtype=torch.uint8)
    odd = flat[1:].reshape(3, 16)  # not 8-byte aligned: the byte table
    assert torch.equal(hamming_similarity(odd, odd[:1]),
                       (_brute_bits(odd) == _brute_bits(odd[:1])).sum(-1))
    assert popcount(torch.arange(256, dtype=torch.uint8)[:, None]).tolist() == [
        bin(i).count("1") for i in range(256)]
    bits = torch.rand(3, 40, generator=g) > 0.5
    assert torch.equal(_brute_bits(pack_bits(bits)), bits)  # packing round-trips


def test_gsa_hash_is_the_sign_of_a_seeded_projection_and_deterministic():
    import subprocess
    import sys

    g = torch.Generator().manual_seed(21)
    keys = torch.randn(2, 64, 64, generator=g)
    m = sparse.GSA(SparseConfig(method="gsa", seed=3))
    codes = m.hash(keys)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 64, 16)
    assert torch.equal(_brute_bits(codes), keys @ m.projection(64, keys.device) > 0)
    assert torch.equal(sparse.GSA(SparseConfig(method="gsa", seed=3)).hash(keys), codes)
    assert not torch.equal(sparse.GSA(SparseConfig(method="gsa", seed=4)).hash(keys), codes)
    child = ("import torch; from ucm.sparse import GSA, SparseConfig; "
             "x = torch.arange(64 * 5, dtype=torch.float32).reshape(5, 64).sin(); "
             "print(GSA(SparseConfig(method='gsa', seed=3)).hash(x).flatten().tolist())")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         check=True).stdout
    x = torch.arange(64 * 5, dtype=torch.float32).reshape(5, 64).sin()
    assert out.strip() == str(m.hash(x).flatten().tolist())  # the same in another process


def test_gsa_with_gqa_bf16_keys_scores_each_query_head_against_its_kv_head():
    """SmolLM2's shape: 9 query heads over 3 KV heads, head dim 64; bf16 keys."""
    g = torch.Generator().manual_seed(22)
    keys = torch.randn(3, 320, 64, generator=g).to(torch.bfloat16)
    q = torch.randn(9, 64, generator=g)
    m = sparse.GSA(SparseConfig(method="gsa", block_size=32))
    reps = m.prepare(keys)
    assert reps.per_block["codes"].shape == (3, 10, 32, 16)
    assert reps.per_block["codes"].dtype == torch.uint8
    sim = m.block_similarity(reps, q)
    p = m.projection(64, keys.device)
    kbits = (keys.float() @ p > 0).reshape(3, 10, 32, 128)
    for h in range(9):
        brute = ((q[h] @ p > 0) == kbits[h // 3]).sum(-1).amax(-1)
        assert torch.equal(sim[h], brute), h
    scores = m.block_scores(reps, q[None])
    assert scores.shape == (10,) and (scores > 0).all() and (scores <= 1).all()
    s = SparseSession(SparseConfig(method="gsa", block_size=32, budget=3, stride=2))
    s.prefill([keys[:, :300], keys[:, :300]])  # a partial last block, padded for scoring
    for _ in range(4):
        plan = s.step([q, q])
        assert len(plan.selected) == 1 + 2 + 3 and plan.budget == 3
        new = torch.randn(3, 16, 64, generator=g).to(torch.bfloat16)
        s.append([new, new])  # full blocks' codes are appended to the prompt's
    assert s._reps[0].per_block["codes"].shape == (3, (300 + 64) // 32, 32, 16)
    assert s.block_scores().shape == (s.n_blocks,)
