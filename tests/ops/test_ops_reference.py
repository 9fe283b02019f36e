"""Torch reference ops: block scores, top-k (the KV codecs' references: tests/test_kivi.py)."""

from __future__ import annotations

import torch

from ucm.ops.score import box_from_bounds, mean_scores, quest_lower_scores, quest_scores, topk_rows


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
