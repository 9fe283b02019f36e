"""Block scoring and top-k for sparse attention.

Query q is (Hq, D); block representatives are (Hkv, nb, D); scores are (Hq, nb), where query
head h reads KV head h // (Hq // Hkv). Quest keeps each block's key box as center and radius
(center = (kmax + kmin) / 2, radius = (kmax - kmin) / 2), which turns the bound
sum_i max(q_i kmax_i, q_i kmin_i) into two matrix products: q.center + |q|.radius. The torch
functions run wherever the tensors are; the `*_cupy` twins run `native/score.cu`.
"""

from __future__ import annotations

from typing import Any

import torch

from ucm.ops._native import kernel, launch_1d

TOPK_MAX_N = 8192  # native/score.cu stages one row in shared memory


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    hq, d = q.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    return q.reshape(hkv, hq // hkv, d)


def box_from_bounds(kmin: torch.Tensor, kmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(center, radius) of the per-channel key box."""
    return (kmax + kmin) * 0.5, (kmax - kmin) * 0.5


def quest_scores(q: torch.Tensor, center: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """Upper bound of q.k over each block's keys, (Hq, nb)."""
    qg = _grouped(q.to(center.dtype), center.shape[0])
    upper = torch.bmm(qg, center.transpose(1, 2)) + torch.bmm(qg.abs(), radius.transpose(1, 2))
    return upper.reshape(q.shape[0], center.shape[1])


def quest_lower_scores(q: torch.Tensor, center: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """Lower bound of q.k over each block's keys, (Hq, nb)."""
    qg = _grouped(q.to(center.dtype), center.shape[0])
    lower = torch.bmm(qg, center.transpose(1, 2)) - torch.bmm(qg.abs(), radius.transpose(1, 2))
    return lower.reshape(q.shape[0], center.shape[1])


def mean_scores(q: torch.Tensor, kmean: torch.Tensor) -> torch.Tensor:
    """q . mean key of each block, (Hq, nb)."""
    qg = _grouped(q.to(kmean.dtype), kmean.shape[0])
    return torch.bmm(qg, kmean.transpose(1, 2)).reshape(q.shape[0], kmean.shape[1])


def topk_rows(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row, in descending score order (int64)."""
    return torch.topk(scores, k, dim=-1, largest=True, sorted=True).indices


def _scores_cupy(name: str, q: Any, reps: tuple[Any, ...]) -> Any:
    import cupy

    hkv, nb, d = reps[0].shape
    hq = q.shape[0]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    out = cupy.empty((hq, nb), dtype=cupy.float32)
    args = [cupy.ascontiguousarray(q, dtype=cupy.float32)]
    args += [cupy.ascontiguousarray(r, dtype=cupy.float32) for r in reps]
    grid, block = launch_1d(hq * nb)
    kernel("score", name)(
        grid, block, (*args, out, cupy.int32(hq), cupy.int32(hkv), cupy.int32(nb), cupy.int32(d))
    )
    return out


def quest_scores_cupy(q: Any, center: Any, radius: Any) -> Any:
    """CuPy twin of `quest_scores` (runs native/score.cu)."""
    return _scores_cupy("quest_scores", q, (center, radius))


def mean_scores_cupy(q: Any, kmean: Any) -> Any:
    """CuPy twin of `mean_scores` (runs native/score.cu)."""
    return _scores_cupy("mean_scores", q, (kmean,))


def topk_rows_cupy(scores: Any, k: int) -> Any:
    """CuPy twin of `topk_rows`; ties go to the lower index (runs native/score.cu)."""
    import cupy

    rows, n = scores.shape
    if not 0 < k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    if n > TOPK_MAX_N:
        part = cupy.argsort(-scores, axis=-1)[:, :k]
        return part.astype(cupy.int64)
    idx = cupy.empty((rows, k), dtype=cupy.int64)
    kernel("score", "topk_rows")(
        (rows,),
        (256,),
        (cupy.ascontiguousarray(scores, dtype=cupy.float32), idx, cupy.int32(n), cupy.int32(k)),
    )
    return idx
