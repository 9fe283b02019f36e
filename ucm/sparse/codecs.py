"""KV codecs for storage: int8 / int4 group quantization (KIVI-style) and lossless
byte-shuffle + zstd. Host-side (torch on the CPU, numpy, zstandard); a tier applies them to a
block's bytes before a store and after a load.

Each codec is `encode(x) -> bytes` / `decode(data) -> tensor` (or bytes, for the lossless codec
given bytes). Every payload starts with a small self-describing header, so `decode` needs no
side information and `decode_any` picks the codec from the header:

    magic b"UKC1" | codec u8 | dtype u8 | flags u8 | ndim u8 | shape (ndim x u32) | codec fields

Quantization follows KIVI: keys are grouped along the token axis for each channel
(`kind="key"`), values along the channel axis for each token (`kind="value"`). The tensor's
last two axes are (tokens, channels); the grouped axis must be a multiple of `group`. Every
element decodes to within half a quantization step (see ucm.ops.quant).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch

from ucm.ops.quant import dequantize_groups, quantize_groups

MAGIC = b"UKC1"
_HEAD = struct.Struct("<4sBBBB")
_DTYPES: list[torch.dtype] = [torch.float32, torch.float16, torch.bfloat16, torch.uint8]
_CODEC_IDS = {"lossless": 1, "int8": 2, "int4": 4}
_FLAG_BYTES = 1  # lossless: the input was bytes, decode returns bytes


def _header(codec: str, dtype: torch.dtype, shape: tuple[int, ...], flags: int = 0) -> bytes:
    head = _HEAD.pack(MAGIC, _CODEC_IDS[codec], _DTYPES.index(dtype), flags, len(shape))
    return head + struct.pack(f"<{len(shape)}I", *shape)


def _parse(data: bytes) -> tuple[int, torch.dtype, int, tuple[int, ...], int]:
    """(codec id, dtype, flags, shape, offset of the codec fields)."""
    magic, codec, dtype, flags, ndim = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError("not a ucm KV codec payload (bad magic)")
    shape = struct.unpack_from(f"<{ndim}I", data, _HEAD.size)
    return codec, _DTYPES[dtype], flags, tuple(shape), _HEAD.size + 4 * ndim


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a (numel, itemsize) uint8 array (works for bfloat16 too)."""
    flat = t.detach().contiguous().cpu().reshape(-1)
    return flat.view(torch.uint8).numpy().reshape(flat.numel(), t.element_size())


@dataclass(frozen=True)
class LosslessCodec:
    """Byte shuffle (byte planes of each element stored together) + zstd. Bit-exact."""

    level: int = 3
    name: ClassVar[str] = "lossless"

    def encode(self, x: torch.Tensor | bytes | bytearray | memoryview, itemsize: int = 2) -> bytes:
        import zstandard

        if isinstance(x, torch.Tensor):
            planes = _raw_bytes(x)
            head = _header(self.name, x.dtype, tuple(x.shape))
        else:
            raw = np.frombuffer(bytes(x), dtype=np.uint8)
            if raw.size % itemsize:
                itemsize = 1
            planes = raw.reshape(-1, itemsize)
            head = _header(self.name, torch.uint8, (raw.size, itemsize), _FLAG_BYTES)
        body = zstandard.ZstdCompressor(level=self.level).compress(planes.T.tobytes())
        return head + body

    def decode(self, data: bytes) -> torch.Tensor | bytes:
        import zstandard

        _, dtype, flags, shape, offset = _parse(data)
        raw = zstandard.ZstdDecompressor().decompress(data[offset:])
        if flags & _FLAG_BYTES:
            size, itemsize = shape
            return np.frombuffer(raw, np.uint8).reshape(itemsize, size // itemsize).T.tobytes()
        itemsize = torch.empty(0, dtype=dtype).element_size()
        planes = np.frombuffer(raw, np.uint8).reshape(itemsize, -1).T.copy()
        return torch.from_numpy(planes.reshape(-1)).view(dtype).reshape(shape)


@dataclass(frozen=True)
class QuantCodec:
    """Asymmetric group quantization to `bits` (8 or 4) with float16 step and minimum."""

    bits: Literal[4, 8] = 8
    group: int = 32
    kind: Literal["key", "value"] = "value"
    name: ClassVar[str] = "quant"
    _FIELDS: ClassVar[struct.Struct] = struct.Struct("<BBI")  # kind, param dtype, group

    @property
    def codec(self) -> str:
        return f"int{self.bits}"

    def encode(self, x: torch.Tensor) -> bytes:
        if x.dim() < 2:
            raise ValueError("quantized KV needs (..., tokens, channels)")
        grouped = x.transpose(-1, -2) if self.kind == "key" else x
        params = torch.float16 if float(x.abs().max()) < 6e4 else torch.float32
        codes, scale, minimum = quantize_groups(grouped, self.bits, self.group, params)
        kind = 0 if self.kind == "key" else 1
        fields = self._FIELDS.pack(kind, _DTYPES.index(params), self.group)
        head = _header(self.codec, x.dtype, tuple(x.shape))
        parts = (codes, scale.contiguous(), minimum.contiguous())
        return head + fields + b"".join(_raw_bytes(p).tobytes() for p in parts)

    @classmethod
    def decode(cls, data: bytes, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor, in its stored dtype unless `dtype` asks for another (float32 keeps the
        dequantized values exact: the half-step bound holds before any final cast)."""
        codec, stored, _, shape, offset = _parse(data)
        bits = {2: 8, 4: 4}[codec]
        kind, params_code, group = cls._FIELDS.unpack_from(data, offset)
        offset += cls._FIELDS.size
        grouped = list(shape)
        if kind == 0:
            grouped[-1], grouped[-2] = grouped[-2], grouped[-1]
        lead, length = grouped[:-1], grouped[-1]
        params = _DTYPES[params_code]
        n_codes = int(np.prod(lead, dtype=np.int64)) * length * bits // 8
        n_groups = int(np.prod(lead, dtype=np.int64)) * (length // group)
        psize = torch.empty(0, dtype=params).element_size()
        buf = memoryview(data)[offset:]
        codes = torch.frombuffer(bytearray(buf[:n_codes]), dtype=torch.uint8)
        plen = n_groups * psize
        scale = torch.frombuffer(bytearray(buf[n_codes : n_codes + plen]), dtype=params)
        minimum = torch.frombuffer(
            bytearray(buf[n_codes + plen : n_codes + 2 * plen]), dtype=params
        )
        out = dequantize_groups(
            codes.reshape(*lead, length * bits // 8),
            scale.reshape(*lead, length // group),
            minimum.reshape(*lead, length // group),
            bits,
            group,
        )
        if kind == 0:
            out = out.transpose(-1, -2)
        return out.to(dtype or stored).contiguous()


def decode_any(data: bytes) -> torch.Tensor | bytes:
    """Decode a payload from any codec here, chosen by its header."""
    codec = _parse(data)[0]
    if codec == _CODEC_IDS["lossless"]:
        return LosslessCodec().decode(data)
    return QuantCodec.decode(data)


@dataclass(frozen=True)
class CodecReport:
    name: str
    ratio: float  # raw bytes / encoded bytes
    rel_error: float  # ||x - decode(encode(x))|| / ||x||
    max_error_in_steps: float  # worst |error| / step (quantized codecs; 0 for lossless)


def measure(
    codec: LosslessCodec | QuantCodec, x: torch.Tensor, label: str | None = None
) -> CodecReport:
    """Size ratio and error of one codec on one tensor (for the benchmark's table)."""
    data = codec.encode(x)
    quantized = isinstance(codec, QuantCodec)
    back = codec.decode(data, torch.float32) if quantized else codec.decode(data)
    assert isinstance(back, torch.Tensor)
    xf, bf = x.float(), back.float()
    rel = float((xf - bf).norm() / xf.norm().clamp_min(1e-30))
    steps = 0.0
    if isinstance(codec, QuantCodec):
        grouped = xf.transpose(-1, -2) if codec.kind == "key" else xf
        err = (grouped - (bf.transpose(-1, -2) if codec.kind == "key" else bf)).abs()
        g = grouped.reshape(*grouped.shape[:-1], -1, codec.group)
        step = (g.amax(-1) - g.amin(-1)) / ((1 << codec.bits) - 1)
        err = err.reshape(g.shape) / step.clamp_min(1e-30)[..., None]
        steps = float(err.max())
    ratio = x.numel() * x.element_size() / len(data)
    return CodecReport(label or codec.__class__.__name__, ratio, rel, steps)
