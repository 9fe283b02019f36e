"""CuPy kernels (native/*.cu) against their torch references. Needs cupy and a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ucm.ops import cupy_unavailable_reason, score

REASON = cupy_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"GPU parity tests: {REASON}")


@pytest.fixture
def cp():
    import cupy

    return cupy


def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a.get()))


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
