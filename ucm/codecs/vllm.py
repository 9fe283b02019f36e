"""The KV layout of a vLLM block (ucm.vllm_hook.layout.BlockLayout's byte order), for the
quantizing codecs: which bytes are keys and values, as [tokens, channels] matrices.

A layer's cache whose per-block bytes are [block_size, heads, head_size] in that order (the
CUDA backends' NHD layout, K and V halves or a [2, ...] block) gives a k and a v part; any
other layer (CPU caches, whose order inside a block depends on the ISA; unknown shapes) gives
raw parts, kept exact. Runs in the worker process (torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ucm.codecs.layout import KVLayout, Part, register_layout

if TYPE_CHECKING:
    import torch

_DTYPES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32"}


def kv_layout_of(kv_caches: dict[str, torch.Tensor], num_blocks: int, *,
                 interpretable: bool) -> list[KVLayout]:
    """The layout of one ucm block over `kv_caches` (layers in order, shared tensors once, as
    BlockLayout orders them) and, when every layer has the same, the layout of one layer's
    part (what layerwise saves store); [] when no byte of a block can be read as keys or
    values. `interpretable`: whether the caches' element order is the backend's logical one
    (CUDA)."""
    layers: list[list[Part]] = []
    dtypes = set()
    seen: set[tuple[int, int]] = set()
    for tensor in kv_caches.values():
        ident = (tensor.data_ptr(), tensor.numel())
        if ident in seen:
            continue
        seen.add(ident)
        dtypes.add(_DTYPES.get(str(tensor.dtype)))
        layers.append(_layer_parts(tensor, num_blocks, interpretable))
    parts = [part for layer in layers for part in layer]
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    if dtype is None or all(kind == "raw" for kind, _, _ in parts):
        return []
    found = [KVLayout(dtype, tuple(parts))]
    if len(layers) > 1 and all(layer == layers[0] for layer in layers):
        found.append(KVLayout(dtype, tuple(layers[0])))
    return found


def _layer_parts(tensor: torch.Tensor, num_blocks: int, interpretable: bool) -> list[Part]:
    shape = tuple(tensor.shape)
    if interpretable and tensor.dim() == 5:
        if shape[0] == 2 and shape[1] == num_blocks and tensor[0][0].is_contiguous():
            _, _, tokens, heads, size = shape  # K and V halves, each [blocks, T, H, D]
            return [("k", tokens, heads * size), ("v", tokens, heads * size)]
        if shape[0] == num_blocks and shape[1] == 2 and tensor[0].is_contiguous():
            _, _, tokens, heads, size = shape  # [blocks, 2, T, H, D]
            return [("k", tokens, heads * size), ("v", tokens, heads * size)]
    return [("raw", tensor.numel() // num_blocks * tensor.element_size(), 1)]


def register_kv_caches(kv_caches: dict[str, torch.Tensor], num_blocks: int, block_bytes: int,
                       *, interpretable: bool) -> list[KVLayout]:
    """Registers the caches' block (and layer) layouts for the quantizing codecs; the vLLM
    hook calls it once the cache is known. Nothing is registered when nothing in a block can
    be read as keys or values: its blocks are stored losslessly."""
    found = kv_layout_of(kv_caches, num_blocks, interpretable=interpretable)
    if not found or found[0].raw_bytes != block_bytes:
        return []
    for layout in found:
        register_layout(layout)
    return found
