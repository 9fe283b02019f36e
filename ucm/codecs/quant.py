"""KIVI group quantization of KV blocks (numpy on the CPU): keys per channel (groups along the
token axis), values per token (groups along the channel axis), int8 or packed int4 codes.

Per part the payload is the group minimums (float16), the group steps (float16), then the
codes (one byte each for int8; two per byte, the even index in the low nibble, for int4).
Minimums are rounded down and steps up when kept in float16, so codes never clip and every
element decodes to within half a step (before the cast to the cache's dtype). A block that
does not fit (non-finite values, parameters beyond float16) raises `Unquantizable`, and the
caller stores it losslessly.
"""

from __future__ import annotations

import functools

import numpy as np

from ucm.codecs.layout import DTYPES, KVLayout, Part, group_for
from ucm.errors import BlockCorrupt

try:  # native/kvcodec.c: the decoding loop outside the GIL (setup.py builds it)
    from ucm._kvcodec import dequantize as _dequantize
    from ucm._kvcodec import dequantize_block as _dequantize_block
except ImportError:  # pragma: no cover - a host without a C compiler
    _dequantize = _dequantize_block = None

_KIND_IDS = {"raw": 0, "k": 1, "v": 2}


class Unquantizable(Exception):
    """This block cannot be quantized within the bound (store it losslessly)."""


def part_geometry(part: Part, group: int) -> tuple[int, int]:
    """(group along the quantized axis, number of groups) of a k or v part."""
    kind, tokens, channels = part
    if kind == "k":
        g = group_for(group, tokens)
        return g, (tokens // g) * channels
    g = group_for(group, channels)
    return g, tokens * (channels // g)


def payload_bytes(layout: KVLayout, group: int, bits: int) -> int:
    """The exact payload length of a block of `layout` quantized with `bits`."""
    total = 0
    for part in layout.parts:
        kind, tokens, channels = part
        if kind == "raw":
            total += tokens
            continue
        _, ngroups = part_geometry(part, group)
        n = tokens * channels
        total += 4 * ngroups + (n if bits == 8 else (n + 1) // 2)
    return total


# -- dtype conversions (bf16 has no numpy dtype: it is the top half of a float32) ---------------

def to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "fp32":
        return raw.view(np.float32)
    if dtype == "fp16":
        return raw.view(np.float16).astype(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def from_f32(x: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """out (uint8) = x cast to `dtype`, rounding to nearest even."""
    if dtype == "fp32":
        out.view(np.float32)[...] = x.reshape(-1)
    elif dtype == "fp16":
        out.view(np.float16)[...] = x.reshape(-1)
    else:
        u = x.reshape(-1).view(np.uint32)
        rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16
        out.view(np.uint16)[...] = rounded


def _f16_toward(values: np.ndarray, direction: float) -> np.ndarray:
    cast = values.astype(np.float16)
    if not np.isfinite(cast).all():
        raise Unquantizable("quantization parameters overflow float16")
    wrong = cast.astype(np.float32) > values if direction < 0 else cast.astype(np.float32) < values
    return np.where(wrong, np.nextafter(cast, np.float16(direction)), cast)


def _grouped(x: np.ndarray, part: Part, g: int) -> np.ndarray:
    kind, tokens, channels = part
    if kind == "k":  # [T/g, g, C]: reduce over axis 1
        return x.reshape(tokens // g, g, channels)
    return x.reshape(tokens, channels // g, g)  # reduce over axis 2


def encode(layout: KVLayout, group: int, bits: int, raw: memoryview) -> bytes:
    data = np.frombuffer(raw, np.uint8)
    levels = (1 << bits) - 1
    out, pos = [], 0
    for part in layout.parts:
        n = layout.part_bytes(part)
        chunk = data[pos:pos + n]
        pos += n
        kind = part[0]
        if kind == "raw":
            out.append(chunk.tobytes())
            continue
        x = to_f32(chunk, layout.dtype)
        if not np.isfinite(x).all():
            raise Unquantizable("non-finite values")
        g, _ = part_geometry(part, group)
        xs = _grouped(x, part, g)
        axis = 1 if kind == "k" else 2
        mn = _f16_toward(xs.min(axis), -np.inf)
        mn32 = mn.astype(np.float32)
        step = (xs.max(axis) - mn32) / np.float32(levels)
        scale = _f16_toward(np.where(step > 0, step, np.float32(1)), np.inf)
        inv = np.float32(1) / scale.astype(np.float32)
        e = np.expand_dims
        codes = np.rint((xs - e(mn32, axis)) * e(inv, axis))
        codes = np.clip(codes, 0, levels).astype(np.uint8).reshape(-1)
        if bits == 4:
            if codes.size % 2:
                codes = np.append(codes, np.uint8(0))
            codes = codes[0::2] | (codes[1::2] << 4)
        out += [mn.tobytes(), scale.tobytes(), codes.tobytes()]
    return b"".join(out)


@functools.lru_cache(maxsize=64)
def plan(layout: KVLayout, group: int, bits: int) -> bytes | None:
    """The native loop's plan of a block (per part: kind, tokens, channels, group, offset in
    the raw block, offset in the payload), or None when a part has an odd number of channels
    for int4 (the numpy loop decodes those)."""
    rows, opos, pos = [], 0, 0
    for part in layout.parts:
        kind, tokens, channels = part
        if kind == "raw":
            rows.append((0, tokens, 1, 1, opos, pos))
            pos += tokens
        else:
            if bits == 4 and channels % 2:
                return None
            g, ngroups = part_geometry(part, group)
            rows.append((_KIND_IDS[kind], tokens, channels, g, opos, pos))
            pos += 4 * ngroups + (tokens * channels if bits == 8 else tokens * channels // 2)
        opos += layout.part_bytes(part)
    return np.array(rows, np.int64).tobytes()


def decode_into(layout: KVLayout, group: int, bits: int, stored: memoryview,
                out: np.ndarray) -> None:
    """out (uint8, raw size) = the block `stored` holds; `stored` has the length
    `payload_bytes` gives (checked by the caller)."""
    steps = plan(layout, group, bits) if _dequantize_block is not None else None
    if steps is not None:
        _dequantize_block(out, stored, steps, bits, DTYPES[layout.dtype])
        return
    data = np.frombuffer(stored, np.uint8)
    pos = opos = 0
    for part in layout.parts:
        kind, tokens, channels = part
        n = layout.part_bytes(part)
        dst = out[opos:opos + n]
        opos += n
        if kind == "raw":
            dst[...] = data[pos:pos + tokens]
            pos += tokens
            continue
        g, ngroups = part_geometry(part, group)
        count = tokens * channels
        if _dequantize is not None and (bits == 8 or channels % 2 == 0):
            end = pos + 4 * ngroups + (count if bits == 8 else count // 2)
            _dequantize(dst, data[pos + 4 * ngroups:end], data[pos:pos + 2 * ngroups],
                        data[pos + 2 * ngroups:pos + 4 * ngroups], kind == "k", bits,
                        DTYPES[layout.dtype], tokens, channels, g)
            pos = end
            continue
        mn = data[pos:pos + 2 * ngroups].view(np.float16).astype(np.float32)
        scale = data[pos + 2 * ngroups:pos + 4 * ngroups].view(np.float16).astype(np.float32)
        pos += 4 * ngroups
        if bits == 8:
            codes = data[pos:pos + count]
            pos += count
        else:
            packed = data[pos:pos + (count + 1) // 2]
            pos += (count + 1) // 2
            codes = np.empty(2 * packed.size, np.uint8)
            codes[0::2] = packed & 15
            codes[1::2] = packed >> 4
            codes = codes[:count]
        shape_p = (tokens // g, 1, channels) if kind == "k" else (tokens, channels // g, 1)
        xs = _grouped(codes.astype(np.float32), part, g)
        x = xs * scale.reshape(shape_p) + mn.reshape(shape_p)
        from_f32(x, layout.dtype, dst)
    if pos != data.size:
        raise BlockCorrupt("quantized payload has the wrong length")
