"""Gather and scatter of whole blocks between a paged KV cache and a staging buffer.

The cache is any tensor whose first dimension is the block id; a block is everything behind
that index. `gather_blocks` copies the listed blocks into a contiguous staging tensor (for a
store or a host-side codec), `scatter_blocks` copies staging rows back into the cache (after a
load). The torch functions run wherever the tensors are; the `*_cupy` twins run
`native/blocks.cu` on a CUDA device and take CuPy arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ucm.ops._native import kernel, launch_1d


def _ids(block_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=torch.long, device=device).reshape(-1)


def gather_blocks(
    cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """staging[i] = cache[block_ids[i]] (torch reference)."""
    ids = _ids(block_ids, cache.device)
    if out is None:
        return cache.index_select(0, ids)
    return torch.index_select(cache, 0, ids, out=out)


def scatter_blocks(
    staging: torch.Tensor, cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor
) -> torch.Tensor:
    """cache[block_ids[i]] = staging[i], in place (torch reference). Ids must be distinct."""
    ids = _ids(block_ids, cache.device)
    if staging.shape[0] != ids.numel() or staging.shape[1:] != cache.shape[1:]:
        raise ValueError("staging must be (len(block_ids), *cache.shape[1:])")
    cache.index_copy_(0, ids, staging.to(cache.dtype))
    return cache


def _copy_cupy(src: Any, dst: Any, block_ids: Any, gather: bool) -> None:
    import cupy

    ids = cupy.ascontiguousarray(cupy.asarray(block_ids, dtype=cupy.int64).reshape(-1))
    cache = src if gather else dst
    if not (src.flags.c_contiguous and dst.flags.c_contiguous):
        raise ValueError("cache and staging must be C-contiguous")
    block_bytes = cache.nbytes // cache.shape[0]
    n_ids = int(ids.size)
    if n_ids == 0:
        return
    aligned = block_bytes % 16 == 0 and src.data.ptr % 16 == 0 and dst.data.ptr % 16 == 0
    unit = 16 if aligned else 1
    name = ("gather" if gather else "scatter") + ("_blocks_v16" if aligned else "_blocks_u8")
    grid, block = launch_1d(block_bytes // unit)
    grid = (grid[0], min(n_ids, 65535))
    kernel("blocks", name)(
        grid, block, (src, dst, ids, cupy.int64(n_ids), cupy.int64(block_bytes // unit))
    )


def gather_blocks_cupy(cache: Any, block_ids: Any, out: Any = None) -> Any:
    """CuPy twin of `gather_blocks` (runs native/blocks.cu)."""
    import cupy

    n = len(block_ids)
    if out is None:
        out = cupy.empty((n, *cache.shape[1:]), dtype=cache.dtype)
    _copy_cupy(cache, out, block_ids, gather=True)
    return out


def scatter_blocks_cupy(staging: Any, cache: Any, block_ids: Any) -> Any:
    """CuPy twin of `scatter_blocks` (runs native/blocks.cu)."""
    if staging.dtype != cache.dtype or staging.shape[1:] != cache.shape[1:]:
        raise ValueError("staging must be (len(block_ids), *cache.shape[1:]) of cache.dtype")
    _copy_cupy(staging, cache, block_ids, gather=False)
    return cache
