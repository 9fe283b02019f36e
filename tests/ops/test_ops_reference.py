"""Torch reference ops: group quantization, block scores, top-k."""

from __future__ import annotations

import pytest
import torch

from ucm.ops.quant import dequantize_groups, pack_int4, quantize_groups, unpack_int4
from ucm.ops.score import box_from_bounds, mean_scores, quest_lower_scores, quest_scores, topk_rows


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("params", [torch.float32, torch.float16])
def test_quantization_error_within_half_a_step(bits, params):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(6, 128, generator=g) * torch.logspace(-2, 2, 128)
    x[0, :32] = 1.5  # a constant group: step 0, decodes exactly
    codes, scale, minimum = quantize_groups(x, bits, 32, params)
    assert scale.dtype == params and codes.dtype == torch.uint8
    assert codes.shape[-1] == 128 * bits // 8
    back = dequantize_groups(codes, scale, minimum, bits, 32)
    step = scale.float().repeat_interleave(32, dim=-1)
    err = (back - x).abs()
    assert (err <= step * 0.5 * (1 + 1e-5) + 1e-6 * x.abs()).all()
    assert torch.equal(back[0, :32], x[0, :32])
    # float16 parameters are rounded outward, so no code clips and the bound still holds
    if bits == 8:
        assert err.max() > 0  # and it is a real quantizer, not an identity


def test_int4_packing_round_trips():
    codes = torch.randint(0, 16, (3, 10), generator=torch.Generator().manual_seed(2))
    packed = pack_int4(codes)
    assert packed.shape == (3, 5)
    assert torch.equal(unpack_int4(packed), codes.to(torch.uint8))
    assert int(packed[0, 0]) == int(codes[0, 0]) | (int(codes[0, 1]) << 4)


def test_quantize_rejects_bad_groups():
    with pytest.raises(ValueError, match="multiple of group"):
        quantize_groups(torch.zeros(2, 30), 8, 32)
    with pytest.raises(ValueError, match="bits must be"):
        quantize_groups(torch.zeros(2, 32), 3, 32)


def test_quest_bound_never_below_true_max_and_lower_bound_never_above_min():
    g = torch.Generator().manual_seed(3)
    hkv, hq, nb, bs, d = 2, 4, 40, 16, 32
    keys = torch.randn(hkv, nb, bs, d, generator=g) * 3 - 1  # mixed signs
    q = torch.randn(hq, d, generator=g)
    center, radius = box_from_bounds(keys.amin(2), keys.amax(2))
    upper = quest_scores(q, center, radius)
    lower = quest_lower_scores(q, center, radius)
    true = torch.einsum("hd,hbtd->hbt", q, keys.repeat_interleave(hq // hkv, 0))
    tol = 1e-4 * true.abs().amax()
    assert (upper >= true.amax(-1) - tol).all()
    assert (lower <= true.amin(-1) + tol).all()
    # the bound is the elementwise form sum_i max(q_i kmax_i, q_i kmin_i)
    kmax = keys.amax(2).repeat_interleave(2, 0)
    kmin = keys.amin(2).repeat_interleave(2, 0)
    direct = torch.maximum(q[:, None] * kmax, q[:, None] * kmin).sum(-1)
    assert torch.allclose(upper, direct, atol=1e-4)


def test_mean_scores_and_topk():
    g = torch.Generator().manual_seed(4)
    kmean = torch.randn(2, 10, 8, generator=g)
    q = torch.randn(4, 8, generator=g)
    s = mean_scores(q, kmean)
    assert torch.allclose(s[3], kmean[1] @ q[3], atol=1e-6)
    idx = topk_rows(s, 3)
    assert torch.equal(idx[0], torch.argsort(s[0], descending=True)[:3])
