"""GSA's numpy scoring (`best_similarity`) against its torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

import ucm.sparse.methods as methods
from ucm.sparse import GSA, SparseConfig
from ucm.sparse.methods import best_similarity, best_similarity_reference

# (Hkv, G, nb, bs, nbytes): SmolLM2's GQA (3 KV heads, 3 query heads each) at 128 and 64
# bits, MHA, wide groups, 1-token blocks, 3 words (uint8 sums near their 192 maximum),
# 5 and 32 words (int32 sums), and odd byte counts (the torch path)
SHAPES = [(3, 3, 40, 32, 16), (3, 3, 7, 32, 8), (4, 1, 9, 16, 16), (1, 8, 5, 32, 16),
          (2, 4, 11, 1, 16), (2, 2, 6, 8, 24), (2, 3, 4, 32, 40), (1, 2, 3, 4, 256),
          (3, 3, 10, 32, 5), (2, 2, 3, 16, 12)]


def _codes(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_best_similarity_equals_the_torch_reference(shape):
    hkv, grp, nb, bs, nbytes = shape
    g = torch.Generator().manual_seed(sum(shape))
    codes = _codes(g, hkv, nb, bs, nbytes)
    q = _codes(g, hkv, grp, nbytes)
    codes[0, 0, 0] = 255  # every bit set (the int64 sign bit included) on both sides
    q[0, 0] = 255
    q[0, -1] = 255 - codes[0, 1 % nb, 0]  # every bit differs from one key: similarity 0
    codes[-1, -1, -1] = q[-1, -1]  # an exact match: the full similarity, 8 nbytes
    want = best_similarity_reference(q, codes)
    got = best_similarity(q, codes)
    assert got.dtype == want.dtype == torch.int32 and got.shape == (hkv, grp, nb)
    assert torch.equal(got, want)
    assert got[-1, -1, -1] == 8 * nbytes
    # not contiguous: the blocks of a wider tensor, and query codes from a transpose
    wide = _codes(g, hkv, nb + 2, bs, nbytes)
    wide[:, 1:nb + 1] = codes
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(best_similarity(qt, wide[:, 1:nb + 1]), want)


def test_whole_words_take_numpy_and_odd_bytes_the_reference(monkeypatch):
    calls = []
    real = best_similarity_reference

    def counted(q, codes):
        calls.append(codes.shape[-1])
        return real(q, codes)

    monkeypatch.setattr(methods, "best_similarity_reference", counted)
    g = torch.Generator().manual_seed(5)
    for nbytes in (8, 16, 32):
        best_similarity(_codes(g, 2, 2, nbytes), _codes(g, 2, 3, 4, nbytes))
    assert calls == []
    best_similarity(_codes(g, 2, 2, 5), _codes(g, 2, 3, 4, 5))
    assert calls == [5]
    monkeypatch.setattr(methods, "_BITWISE_COUNT", False)  # numpy < 2.0
    best_similarity(_codes(g, 2, 2, 16), _codes(g, 2, 3, 4, 16))
    assert calls == [5, 16]


@pytest.mark.parametrize("hash_bits", [64, 128, 256])
def test_gsa_block_similarity_is_the_reference_on_hashed_keys(hash_bits):
    """The path GSA takes at decode: SmolLM2's heads (9 over 3), bf16 keys, hashed codes."""
    g = torch.Generator().manual_seed(hash_bits)
    keys = torch.randn(3, 640, 64, generator=g).to(torch.bfloat16)
    m = GSA(SparseConfig(method="gsa", block_size=32, hash_bits=hash_bits))
    reps = m.prepare(keys)
    for _ in range(3):
        q = torch.randn(9, 64, generator=g)
        qc = m.hash(q).reshape(3, 3, hash_bits // 8)
        want = best_similarity_reference(qc, reps.per_block["codes"]).reshape(9, 20)
        assert torch.equal(m.block_similarity(reps, q), want)


def test_pack_bits_numpy_equals_the_torch_reference():
    from ucm.sparse.methods import pack_bits, pack_bits_reference

    g = torch.Generator().manual_seed(9)
    for shape in [(9, 128), (3, 7, 32, 64), (5, 8), (2, 0, 16)]:
        bits = torch.rand(shape, generator=g) > 0.5
        got = pack_bits(bits)
        assert got.dtype == torch.uint8 and torch.equal(got, pack_bits_reference(bits))
    bits = (torch.rand(16, 4, generator=g) > 0.5).t()  # not contiguous
    assert torch.equal(pack_bits(bits), pack_bits_reference(bits))
    with pytest.raises(ValueError):
        pack_bits(torch.ones(3, 12, dtype=torch.bool))
