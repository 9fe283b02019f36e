"""Blend (CacheBlend) on a tiny random-weight transformer with rotate-half RoPE."""

from __future__ import annotations

import math

import pytest
import torch

from ucm.sparse import apply_rope, blend_prefill, rerotate
from ucm.sparse.blend import causal_attention

E, HQ, HKV, DH = 32, 4, 2, 8


class ToyLayer:
    """Pre-norm attention + MLP block; token-wise qkv and output as BlendLayer asks."""

    def __init__(self, g: torch.Generator) -> None:
        def w(i, o):
            return torch.randn(i, o, generator=g, dtype=torch.float64) / math.sqrt(i)

        self.wq, self.wk, self.wv = w(E, HQ * DH), w(E, HKV * DH), w(E, HKV * DH)
        self.wo, self.w1, self.w2 = w(HQ * DH, E), w(E, 64), w(64, E)

    def qkv(self, h, positions):
        x = torch.nn.functional.layer_norm(h, (E,))

        def heads(m, n):
            return (x @ m).reshape(len(h), n, DH).transpose(0, 1)

        q = apply_rope(heads(self.wq, HQ), positions)
        k = apply_rope(heads(self.wk, HKV), positions)
        return q, k, heads(self.wv, HKV)

    def output(self, h, attn):
        h = h + attn @ self.wo
        x = torch.nn.functional.layer_norm(h, (E,))
        return h + torch.nn.functional.gelu(x @ self.w1) @ self.w2


def prefill(layers, hidden, positions):
    kv, h = [], hidden
    for layer in layers:
        q, k, v = layer.qkv(h, positions)
        kv.append((k, v))
        h = layer.output(h, causal_attention(q, k, v, positions, positions))
    return kv, h


@pytest.fixture(scope="module")
def scene():
    g = torch.Generator().manual_seed(0)
    layers = [ToyLayer(g) for _ in range(4)]
    emb = torch.randn(100, E, generator=g, dtype=torch.float64)
    a, b, s = (torch.randint(0, 100, (n,), generator=g) for n in (20, 24, 6))
    tokens = torch.cat((a, b, s))
    pos = torch.arange(len(tokens))
    kv_a, _ = prefill(layers, emb[a], torch.arange(20))
    kv_b, _ = prefill(layers, emb[b], torch.arange(24))  # cached at chunk-local positions
    reused = []
    for (ka, va), (kb, vb) in zip(kv_a, kv_b, strict=True):
        kb = rerotate(kb, torch.arange(24), torch.arange(20, 44))
        pad = torch.zeros(HKV, 6, DH, dtype=torch.float64)
        reused.append((torch.cat((ka, kb, pad), 1), torch.cat((va, vb, pad), 1)))
    cached = torch.zeros(len(tokens), dtype=torch.bool)
    cached[:44] = True
    full_kv, full_h = prefill(layers, emb[tokens], pos)
    return layers, emb[tokens], pos, reused, cached, full_kv, full_h


def test_rerotation_matches_direct_rotation():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 50, 64, generator=g)
    p = torch.arange(50) * 7
    for delta in (1, 333, 4096, -20):
        direct = apply_rope(x, p + delta)
        moved = rerotate(apply_rope(x, p), p, p + delta)
        assert torch.allclose(moved, direct, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(apply_rope(x, p + 1), apply_rope(x, p), atol=1e-3)


def test_ratio_one_equals_full_prefill(scene):
    layers, hidden, pos, reused, cached, full_kv, full_h = scene
    out = blend_prefill(layers, hidden, pos, reused, cached, ratio=1.0)
    assert out.recomputed.tolist() == list(range(50))
    for (k, v), (fk, fv) in zip(out.kv, full_kv, strict=True):
        assert torch.allclose(k, fk, atol=1e-10) and torch.allclose(v, fv, atol=1e-10)
    assert torch.allclose(out.hidden, full_h, atol=1e-10)


def test_ratio_zero_equals_plain_reuse(scene):
    layers, hidden, pos, reused, cached, full_kv, _ = scene
    out = blend_prefill(layers, hidden, pos, reused, cached, ratio=0.0)
    assert out.recomputed.tolist() == list(range(44, 50))
    h = hidden[44:]  # plain reuse: only the suffix runs, against the reused KV
    for layer, (k_old, v_old), (k, v) in zip(layers, reused, out.kv, strict=True):
        q, ks, vs = layer.qkv(h, pos[44:])
        k_ref = torch.cat((k_old[:, :44], ks), 1)
        v_ref = torch.cat((v_old[:, :44], vs), 1)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
        h = layer.output(h, causal_attention(q, k_ref, v_ref, pos[44:], pos))
    assert torch.allclose(out.hidden, h, atol=1e-12)
    # plain reuse is not a full prefill: chunk B lacks its attention to chunk A
    assert not torch.allclose(out.kv[-1][0], full_kv[-1][0], atol=1e-3)


def test_deviation_picks_the_non_prefix_chunk_and_error_falls_with_ratio(scene):
    layers, hidden, pos, reused, cached, full_kv, _ = scene
    out = blend_prefill(layers, hidden, pos, reused, cached, ratio=0.2)
    assert out.deviation[:20].max() < 1e-16  # chunk A is a true prefix: its KV is exact
    picked = set(out.recomputed.tolist()) - set(range(44, 50))
    assert picked and picked <= set(range(20, 44))
    errors = []
    for ratio in (0.0, 0.1, 0.25, 0.5, 1.0):
        kv = blend_prefill(layers, hidden, pos, reused, cached, ratio=ratio).kv
        pairs = zip(kv, full_kv, strict=True)
        errors.append(sum(float((k - fk).norm()) for (k, _), (fk, _) in pairs))
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-9 < errors[0]


def test_ratio_out_of_range(scene):
    layers, hidden, pos, reused, cached, _, _ = scene
    with pytest.raises(ValueError, match="ratio"):
        blend_prefill(layers, hidden, pos, reused, cached, ratio=1.5)
