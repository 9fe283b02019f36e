"""A pure-torch stand-in for sgl_kernel's CPU build (test venv only; no CPU wheel exists).

SGLang's CPU path imports sgl_kernel unconditionally but, on a CPU without AMX, calls only
the two helpers below; anything else raises NotImplementedError when called, never silently.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

__version__ = "0.0.0+ucm.stub"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    at = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(),
                               end_offset.tolist(), strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[at:at + n].to(req_to_token.dtype)
        at += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    # One row of `stride` bytes per token slot, in every layer's buffer.
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist(), strict=True))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for dst, src in pairs:
            ctypes.memmove(base + dst * stride, base + src * stride, stride)


def missing(module: str, name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{module}.{name} is not in the ucm test stand-in")

    call.__name__ = name
    return call


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)
    return missing("sgl_kernel", name)
