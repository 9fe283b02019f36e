"""Asymmetric min/max group quantization (int8 or packed int4) along the last axis.

`quantize_groups` splits the last axis into groups of `group` values and stores, per group, a
minimum and a step (`scale`) plus one code per value. Every element decodes to within half a
step: the minimum is rounded down and the step up when the parameters are kept in float16, so
the codes never clip. The torch functions run wherever the tensors are; the `*_cupy` twins run
`native/quant.cu` (float32 parameters only) and agree with the reference bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from ucm.ops._native import kernel, launch_1d

BITS = (4, 8)


def _check(bits: int, group: int, length: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if group < 2 or group % 2:
        raise ValueError(f"group must be an even number >= 2, got {group}")
    if length % group:
        raise ValueError(f"last axis ({length}) must be a multiple of group ({group})")


def _round_toward(values: torch.Tensor, dtype: torch.dtype, direction: float) -> torch.Tensor:
    """values cast to dtype, moved one ulp toward `direction` where the cast went the other way."""
    cast = values.to(dtype)
    if dtype == torch.float32:
        return cast
    if not torch.isfinite(cast).all():
        raise ValueError(f"quantization parameters overflow {dtype}; use float32 parameters")
    wrong = cast.float() > values if direction < 0 else cast.float() < values
    return torch.where(wrong, torch.nextafter(cast, torch.full_like(cast, direction)), cast)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last axis; the even index goes in the low nibble."""
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`."""
    low = packed & 15
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], -1)


def quantize_groups(
    x: torch.Tensor, bits: int, group: int, param_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (codes uint8, scale, minimum); codes are packed two per byte when bits == 4.

    x is (..., L) with L a multiple of group; scale and minimum are (..., L // group).
    """
    _check(bits, group, x.shape[-1])
    qmax = float((1 << bits) - 1)
    xf = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    minimum = _round_toward(xf.amin(-1), param_dtype, float("-inf"))
    step = (xf.amax(-1) - minimum.float()) / qmax
    scale = _round_toward(step, param_dtype, float("inf"))
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round((xf - minimum.float()[..., None]) / scale.float()[..., None])
    codes = codes.clamp_(0, qmax).to(torch.uint8).reshape(x.shape)
    if bits == 4:
        codes = pack_int4(codes)
    return codes, scale, minimum


def dequantize_groups(
    codes: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    bits: int,
    group: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of `quantize_groups` up to half a step per element."""
    values = unpack_int4(codes) if bits == 4 else codes
    _check(bits, group, values.shape[-1])
    v = values.float().reshape(*values.shape[:-1], values.shape[-1] // group, group)
    out = v * scale.float()[..., None] + minimum.float()[..., None]
    return out.reshape(values.shape).to(dtype)


def quantize_groups_cupy(x: Any, bits: int, group: int) -> tuple[Any, Any, Any]:
    """CuPy twin of `quantize_groups` with float32 parameters (runs native/quant.cu)."""
    import cupy

    _check(bits, group, x.shape[-1])
    xf = cupy.ascontiguousarray(x, dtype=cupy.float32)
    n_groups = xf.size // group
    lead = xf.shape[:-1]
    codes = cupy.empty((*lead, xf.shape[-1] * bits // 8), dtype=cupy.uint8)
    scale = cupy.empty((*lead, xf.shape[-1] // group), dtype=cupy.float32)
    minimum = cupy.empty_like(scale)
    grid, block = launch_1d(n_groups)
    kernel("quant", "quantize_groups")(
        grid,
        block,
        (xf, codes, scale, minimum, cupy.int64(n_groups), cupy.int32(group), cupy.int32(bits)),
    )
    return codes, scale, minimum


def dequantize_groups_cupy(codes: Any, scale: Any, minimum: Any, bits: int, group: int) -> Any:
    """CuPy twin of `dequantize_groups`, float32 out (runs native/quant.cu)."""
    import cupy

    length = codes.shape[-1] * 8 // bits
    _check(bits, group, length)
    out = cupy.empty((*codes.shape[:-1], length), dtype=cupy.float32)
    grid, block = launch_1d(out.size)
    kernel("quant", "dequantize_groups")(
        grid,
        block,
        (
            cupy.ascontiguousarray(codes),
            cupy.ascontiguousarray(scale, dtype=cupy.float32),
            cupy.ascontiguousarray(minimum, dtype=cupy.float32),
            out,
            cupy.int64(out.size),
            cupy.int32(group),
            cupy.int32(bits),
        ),
    )
    return out
