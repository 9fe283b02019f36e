"""CuPy kernels (native/*.cu) against their torch references. Needs cupy and a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ucm.ops import cupy_unavailable_reason, quant, score

REASON = cupy_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"GPU parity tests: {REASON}")


@pytest.fixture
def cp():
    import cupy

    return cupy


def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a.get()))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_dequantize_bit_exact(cp, bits):
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(bits)) * 3
    x[0, :32] = 2.0
    codes, scale, minimum = quant.quantize_groups_cupy(cp.asarray(x.numpy()), bits, 32)
    ref = quant.quantize_groups(x, bits, 32)
    assert torch.equal(_t(codes), ref[0])
    assert torch.equal(_t(scale), ref[1])
    assert torch.equal(_t(minimum), ref[2])
    back = quant.dequantize_groups_cupy(codes, scale, minimum, bits, 32)
    assert torch.equal(_t(back), quant.dequantize_groups(*ref, bits, 32))


def test_scores_and_topk(cp):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(8, 64, generator=g)
    center, radius = torch.randn(2, 300, 64, generator=g), torch.rand(2, 300, 64, generator=g)
    got = _t(
        score.quest_scores_cupy(
            cp.asarray(q.numpy()), cp.asarray(center.numpy()), cp.asarray(radius.numpy())
        )
    )
    assert torch.allclose(got, score.quest_scores(q, center, radius), rtol=1e-4, atol=1e-3)
    got = _t(score.mean_scores_cupy(cp.asarray(q.numpy()), cp.asarray(center.numpy())))
    ref = score.mean_scores(q, center)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-3)
    idx = _t(score.topk_rows_cupy(cp.asarray(ref.numpy()), 17))
    assert torch.equal(idx, score.topk_rows(ref, 17))
