"""torch versions of the kvcacheio transfer HiCache's `direct` io backend uses with the
layer_first host layout; the other transfers raise NotImplementedError when called."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from sgl_kernel import missing


def transfer_kv_direct(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor,
                       page_size: int = 1) -> None:
    src_i = src_indices.to(torch.int64)
    dst_i = dst_indices.to(torch.int64)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        rows = src.index_select(0, src_i.to(src.device)).to(dst.dtype)
        dst.index_copy_(0, dst_i.to(dst.device), rows)


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)
    return missing("sgl_kernel.kvcacheio", name)
