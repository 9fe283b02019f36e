"""KIVI group quantization of KV blocks (numpy on the CPU, the reference of native/kvcodec*.c):
keys per channel (groups along the token axis), values per token (groups along the channel
axis), int8 or packed int4 codes.

A part is quantized as its [tokens, channels] matrix, whatever order its elements are stored in
(ucm.codecs.layout.Order); its codes are kept in that stored order, so decoding writes the
block sequentially and only the scales are looked up by logical position. Scales are
two-level, two bytes a group: per part a grid of 255 steps over its range (minimum M rounded
down and step S rounded up, float16), and per group
the grid lines below its minimum (lo) and above its maximum (hi), so the group's minimum is
M + lo*S and its step (hi - lo)*S/levels, all in float32. Codes never clip (within float32
rounding): every element decodes to within about half its group's step before the cast to the
cache's dtype.

Per part the payload is M and S (float16), lo and hi per group (u8, all lo then all hi), then
the codes in the part's stored order (one byte each for int8; two per byte, the even position
in the low nibble, for int4).
A block that does not fit (non-finite values, a range beyond float16) raises `Unquantizable`,
and the caller stores it losslessly.

The native loops take a block's plan (`plan`): a row of int64 per part, built from the packed
parameters with numpy (a header's `Packed` is never expanded in Python for them), raw parts
over MAX_DIM bytes split into several rows. Plans are cached by parameters and width, at most
PLAN_CACHE_BYTES of them (a forged header's plan of MAX_PARTS rows is 4.5 MiB).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import numpy as np

from ucm.codecs.layout import (
    DTYPES,
    MAX_DIM,
    TC,
    ByteBoundedCache,
    KVLayout,
    Order,
    Packed,
    pack,
    parsed,
    part_geometry,
    part_payload,
)
from ucm.errors import BlockCorrupt

if TYPE_CHECKING:  # collections.abc.Buffer is new in Python 3.12; annotations only
    from typing_extensions import Buffer

_dequantize_block: Callable[[np.ndarray | memoryview | tuple[memoryview, ...], Buffer, bytes,
                             int, int], int | None] | None
_quantize_block: Callable[[bytearray, Buffer, bytes, int, int], int] | None
try:  # native/kvcodec.c: the coding loops outside the GIL (setup.py builds it)
    from ucm._kvcodec import HASHES as _HASHES
    from ucm._kvcodec import dequantize_block as _dequantize_block
    from ucm._kvcodec import quantize_block as _quantize_block
except ImportError:  # pragma: no cover - a host without a C compiler
    _dequantize_block = _quantize_block = None
    _HASHES = 0
MAX_PIECES = 4096  # destination pieces the native decoder takes (native/kvcodec.c)

_KIND_IDS = {"raw": 0, "k": 1, "v": 2}
GRID = 255  # steps of a part's grid (lo and hi are bytes)
_F32 = np.float32


class Unquantizable(Exception):
    """This block cannot be quantized within the bound (store it losslessly)."""


def payload_bytes(layout: KVLayout | Packed, group: int, bits: int) -> int:
    """The exact payload length of a block of `layout` quantized with `bits` (a `Packed`'s
    from its runs, without expanding them)."""
    if type(layout) is Packed and group == layout.group:
        return layout.payload_bytes(bits)
    return sum(part_payload(part, group, bits) for part in layout.parts)


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


# -- element orders ------------------------------------------------------------------------------

def to_logical(x: np.ndarray, tokens: int, channels: int, order: Order) -> np.ndarray:
    """A part's elements in stored order -> its [tokens, channels] matrix (a copy unless TC)."""
    c_major, ti, ci = order
    if c_major:  # [C/ci, T/ti, ci, ti] -> [T/ti, ti, C/ci, ci]
        return x.reshape(channels // ci, tokens // ti, ci, ti).transpose(1, 3, 0, 2).reshape(
            tokens, channels)
    if ti == 1 and ci == 1:
        return x.reshape(tokens, channels)
    return x.reshape(tokens // ti, channels // ci, ti, ci).transpose(0, 2, 1, 3).reshape(
        tokens, channels)


def to_stored(x: np.ndarray, order: Order) -> np.ndarray:
    """The inverse of `to_logical`: a [tokens, channels] matrix in stored order, flat."""
    c_major, ti, ci = order
    tokens, channels = x.shape
    t4 = x.reshape(tokens // ti, ti, channels // ci, ci)
    return (t4.transpose(2, 0, 3, 1) if c_major else t4.transpose(0, 2, 1, 3)).reshape(-1)


# -- scales ---------------------------------------------------------------------------------------

def _f16_toward(value: np.ndarray | np.float32, direction: float) -> np.ndarray:
    cast = np.asarray(value, _F32).astype(np.float16)
    wide = cast.astype(_F32)
    wrong = wide > value if direction < 0 else wide < value
    found = np.where(wrong, np.nextafter(cast, np.float16(direction)), cast)
    if not np.isfinite(found).all():
        raise Unquantizable("the range of the values overflows float16")
    return found


def grid(lo_value: np.float32, hi_value: np.float32) -> tuple[np.float16, np.float16]:
    """(M, S): M <= every value, M + 255*S >= every value in float32."""
    # x[()] of a 0-d array is its scalar; numpy's stubs, blind to the shape, say an array
    m = cast(np.float16, _f16_toward(lo_value, -np.inf)[()])
    span = (hi_value - _F32(m)) / _F32(GRID)
    s = cast(np.float16, _f16_toward(span if span > 0 else _F32(1), np.inf)[()])
    while _F32(m) + _F32(GRID) * _F32(s) < hi_value:  # float32 rounding of the top line
        s = np.nextafter(s, np.float16(np.inf))
        if not np.isfinite(s):
            raise Unquantizable("the range of the values overflows float16")
    return m, s


def group_params(m: np.float16, s: np.float16, lo: np.ndarray, hi: np.ndarray, levels: int,
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(minimum, step) of each group in float32, exactly as the decoders compute them."""
    mf, sf = _F32(m), _F32(s)
    return (mf + lo.astype(_F32) * sf,
            ((hi.astype(np.int32) - lo).astype(_F32) * sf) / _F32(levels))


def _lines(gmin: np.ndarray, gmax: np.ndarray, m: np.float16, s: np.float16, levels: int,
           ) -> tuple[np.ndarray, np.ndarray]:
    """The grid lines (lo, hi) around each group: lo*S below its minimum, hi above, lo < hi."""
    mf, sf = _F32(m), _F32(s)
    lo = np.clip(np.floor((gmin - mf) / sf), 0, GRID - 1).astype(np.int32)
    lo -= (mf + lo.astype(_F32) * sf > gmin) & (lo > 0)  # float32 rounding of the line
    hi = np.clip(np.ceil((gmax - mf) / sf), 1, GRID).astype(np.int32)
    hi = np.maximum(hi, lo + 1)
    mn, step = group_params(m, s, lo, hi, levels)
    hi += (mn + _F32(levels) * step < gmax) & (hi < GRID)
    return lo.astype(np.uint8), hi.astype(np.uint8)


def _grouped(x: np.ndarray, kind: str, g: int) -> np.ndarray:
    tokens, channels = x.shape
    if kind == "k":  # [T/g, g, C]: reduce over axis 1
        return x.reshape(tokens // g, g, channels)
    return x.reshape(tokens, channels // g, g)  # reduce over axis 2


def encode_part(x: np.ndarray, kind: str, group: int, bits: int, order: Order = TC
                ) -> bytes:
    """One part's payload from its [tokens, channels] float32 matrix (the numpy reference),
    its codes in the part's stored `order`."""
    levels = (1 << bits) - 1
    if not np.isfinite(x).all():
        raise Unquantizable("non-finite values")
    g, _ = part_geometry((kind, *x.shape), group)
    xs = _grouped(x, kind, g)
    axis = 1 if kind == "k" else 2
    gmin, gmax = xs.min(axis), xs.max(axis)
    m, s = grid(gmin.min(), gmax.max())
    lo, hi = _lines(gmin, gmax, m, s, levels)
    mn, step = group_params(m, s, lo, hi, levels)
    e = np.expand_dims
    codes = np.rint((xs - e(mn, axis)) * e(_F32(1) / step, axis))
    codes = to_stored(np.clip(codes, 0, levels).astype(np.uint8).reshape(x.shape), order)
    if bits == 4:
        if codes.size % 2:
            codes = np.append(codes, np.uint8(0))
        codes = codes[0::2] | (codes[1::2] << 4)
    return b"".join([np.array([m, s], np.float16).tobytes(), lo.tobytes(), hi.tobytes(),
                     codes.tobytes()])


# encoding sees only the layouts this process registered: a few, each costly to walk per block
_registered_payload_bytes = functools.lru_cache(maxsize=64)(payload_bytes)


def encode(layout: KVLayout, group: int, bits: int, raw: memoryview) -> bytes:
    steps = plan(layout, group, bits) if _quantize_block is not None else None
    if steps is not None and _quantize_block is not None:
        out = bytearray(_registered_payload_bytes(layout, group, bits))
        status = _quantize_block(out, raw, steps, bits, DTYPES[layout.dtype])
        if status:
            raise Unquantizable("non-finite values" if status == 1 else
                                "the range of the values overflows float16")
        return bytes(out)
    return encode_reference(layout, group, bits, raw)


def encode_reference(layout: KVLayout, group: int, bits: int, raw: memoryview) -> bytes:
    data = np.frombuffer(raw, np.uint8)
    out, pos = [], 0
    for part in layout.parts:
        kind, tokens, channels, order = part
        n = layout.part_bytes(part)
        chunk = data[pos:pos + n]
        pos += n
        if kind == "raw":
            out.append(chunk.tobytes())
            continue
        x = to_logical(to_f32(chunk, layout.dtype), tokens, channels, order)
        out.append(encode_part(x, kind, group, bits, order))
    return b"".join(out)


PLAN_CACHE_BYTES = 16 << 20
_plans: ByteBoundedCache[tuple[bytes, int], bytes] = ByteBoundedCache(
    PLAN_CACHE_BYTES, lambda key, steps: len(key[0]) + len(steps) + 200)


def plan(layout: KVLayout | Packed, group: int, bits: int) -> bytes:
    """The native loops' plan of a block (per part: kind, tokens, channels, group, offset in
    the raw block, offset in the payload, c-major, ti, ci; a raw part over MAX_DIM bytes takes
    several rows), from the packed parameters (a `Packed` carries its own, and its group)."""
    params = layout.params if type(layout) is Packed else pack(layout, group)
    steps = _plans.get((params, bits))
    if steps is None:
        steps = _build_plan(parsed(params), bits)
        _plans.put((params, bits), steps)
    return steps


def plan_cache_bytes() -> int:
    """Bytes the cached plans take (at most PLAN_CACHE_BYTES)."""
    return _plans.bytes


def _build_plan(packed: Packed, bits: int) -> bytes:
    """The rows of each run's part, tiled `count` times, the whole `repeat` times, then the
    offsets: numpy work proportional to the rows, Python work to the runs."""
    tables, raw_sizes, payload_sizes = [], [], []
    for run in packed.runs:
        kind, tokens, channels, order, count = run
        if kind == "raw":
            full, rest = divmod(tokens, MAX_DIM)
            chunks = [MAX_DIM] * full + ([rest] if rest else [])
            rows = [(0, n, 1, 1, 0, 0, 0, 1, 1) for n in chunks]
            sizes = pays = chunks
        else:
            rows = [(_KIND_IDS[kind], tokens, channels, part_geometry(run, packed.group)[0], 0,
                     0, int(order.c_major), order.ti, order.ci)]
            sizes = [tokens * channels * packed.itemsize]
            pays = [part_payload(run, packed.group, bits)]
        tables.append(np.tile(np.array(rows, np.int64), (count, 1)))
        raw_sizes.append(np.tile(np.array(sizes, np.int64), count))
        payload_sizes.append(np.tile(np.array(pays, np.int64), count))
    table = np.tile(np.concatenate(tables), (packed.repeat, 1))
    for column, column_sizes in ((4, raw_sizes), (5, payload_sizes)):
        ends = np.cumsum(np.tile(np.concatenate(column_sizes), packed.repeat))
        table[1:, column] = ends[:-1]
    return table.tobytes()


def decode_into(layout: KVLayout | Packed, group: int, bits: int, stored: memoryview,
                out: np.ndarray) -> None:
    """out (uint8, raw size) = the block `stored` holds; `stored` has the length
    `payload_bytes` gives (checked by the caller)."""
    if _dequantize_block is not None:
        _dequantize_block(out, stored, plan(layout, group, bits), bits, DTYPES[layout.dtype])
        return
    decode_reference(layout, group, bits, stored, out)


def decode_hashed(layout: KVLayout | Packed, group: int, bits: int, stored: memoryview,
                  out: memoryview | tuple[memoryview, ...]) -> int | None:
    """Decodes `stored` straight into `out` (one writable buffer of the raw size, or pieces
    that add up to it, filled in order) and returns the xxh3-64 of `stored`, taken in the same
    pass; None, with nothing written, when the native loops cannot (not built, built without
    xxhash.h, too many pieces). The caller compares the digest with the header's before the
    block counts as loaded."""
    if not _HASHES or _dequantize_block is None or (type(out) is tuple
                                                    and len(out) > MAX_PIECES):
        return None
    return _dequantize_block(out, stored, plan(layout, group, bits), bits,
                             DTYPES[layout.dtype])


def decode_reference(layout: KVLayout | Packed, group: int, bits: int, stored: memoryview,
                     out: np.ndarray) -> None:
    with np.errstate(all="ignore"):  # a payload of any bytes decodes (its checksum decides)
        _decode_reference(layout, group, bits, stored, out)


def _decode_reference(layout: KVLayout | Packed, group: int, bits: int, stored: memoryview,
                      out: np.ndarray) -> None:
    data = np.frombuffer(stored, np.uint8)
    levels = (1 << bits) - 1
    pos = opos = 0
    for part in layout.parts:
        kind, tokens, channels, order = part
        n = layout.part_bytes(part)
        dst = out[opos:opos + n]
        opos += n
        if kind == "raw":
            dst[...] = data[pos:pos + tokens]
            pos += tokens
            continue
        g, ngroups = part_geometry(part, group)
        count = tokens * channels
        m, s = data[pos:pos + 4].view(np.float16)
        lo = data[pos + 4:pos + 4 + ngroups]
        hi = data[pos + 4 + ngroups:pos + 4 + 2 * ngroups]
        pos += 4 + 2 * ngroups
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
        mn, step = group_params(m, s, lo, hi, levels)
        shape_p = (tokens // g, 1, channels) if kind == "k" else (tokens, channels // g, 1)
        logical = to_logical(codes, tokens, channels, order)
        xs = _grouped(logical.astype(_F32).reshape(tokens, channels), kind, g)
        x = xs * step.reshape(shape_p) + mn.reshape(shape_p)
        from_f32(to_stored(x.reshape(tokens, channels), order), layout.dtype, dst)
    if pos != data.size:
        raise BlockCorrupt("quantized payload has the wrong length")
