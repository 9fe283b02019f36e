"""KIVI and lossless coding of KV in the store path (ucm.codecs, through ucm.block as a tier
stores a block): non-finite and out-of-range values stay exact, the stored share of a KV block,
keys grouped per channel, and the numpy reference's bounds and code packing, which the native
loops (native/kvcodec*.c) reproduce bit for bit (tests/test_block_codecs.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ucm.block import Codec, decode_header, decode_payload_into, encode_header, encode_payload
from ucm.codecs import KVLayout, KVLayouts, quant, stats
from ucm.codecs.layout import DEFAULT_GROUP, group_for
from ucm.codecs.quant import from_f32, to_f32

DTYPES = ["fp16", "bf16", "fp32"]


def kv(seed: int, tokens: int = 32, channels: int = 64, parts: int = 8,
       channel_scale: float = 1.0) -> np.ndarray:
    """[parts, tokens, channels] float32 KV, each channel with a scale of its own."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.standard_normal(channels) * channel_scale)
    return (rng.standard_normal((parts, tokens, channels)) * scale + 0.5).astype(np.float32)


def block(x: np.ndarray, dtype: str) -> np.ndarray:
    raw = np.empty(x.size * {"fp16": 2, "bf16": 2, "fp32": 4}[dtype], np.uint8)
    from_f32(x.reshape(-1), dtype, raw)
    return raw


def store_and_load(codec: Codec, raw: np.ndarray, layout: KVLayout | None,
                   ) -> tuple[np.ndarray, Codec, int]:
    """(the block a load gives back, the codec its header names, stored payload bytes)."""
    layouts = KVLayouts([layout]) if layout is not None else None
    payload = encode_payload(codec, memoryview(raw), layouts)
    header = decode_header(encode_header(b"key", "ns", codec, payload, raw.nbytes))
    out = np.zeros_like(raw)
    decode_payload_into(header, bytes(payload), memoryview(out))
    return out, header.codec, header.payload_len


def kv_layout(dtype: str, kind_pairs: int = 4, tokens: int = 32, channels: int = 64) -> KVLayout:
    return KVLayout(dtype, (("k", tokens, channels), ("v", tokens, channels)) * kind_pairs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", [Codec.SHUFFLE_ZSTD, Codec.INT8, Codec.INT4])
def test_nan_and_inf_are_kept_bit_exact(dtype, codec):
    """A block holding NaN or an infinity is stored losslessly, whatever the tier's codec."""
    lay = kv_layout(dtype)
    raw = block(kv(0).reshape(-1)[:lay.raw_bytes // lay.itemsize], dtype)
    x = to_f32(raw, dtype).copy()
    x[5], x[6] = np.nan, -np.inf
    from_f32(x, dtype, raw)
    out, stored_as, _ = store_and_load(codec, raw, lay)
    assert stored_as is Codec.SHUFFLE_ZSTD
    assert np.array_equal(out, raw)  # NaN's bits too


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_shuffle_zstd_compresses_16_bit_kv_exactly(dtype):
    """Byte planes apart, the exponents of 16-bit KV compress (about 0.7 of the bytes on real
    KV, docs/compression.md); shuffle_zstd and plain zstd are both exact."""
    lay = kv_layout(dtype)
    raw = block(kv(1)[:lay.raw_bytes // 2 // (32 * 64)], dtype)
    shuffled, stored_as, shuffled_len = store_and_load(Codec.SHUFFLE_ZSTD, raw, lay)
    plain, _, plain_len = store_and_load(Codec.ZSTD, raw, None)
    assert stored_as is Codec.SHUFFLE_ZSTD
    assert np.array_equal(shuffled, raw) and np.array_equal(plain, raw)
    assert shuffled_len < 0.95 * raw.nbytes and plain_len < raw.nbytes


@pytest.mark.parametrize("bits", [8, 4])
def test_keys_per_channel_beat_keys_per_token_on_channel_outliers(bits):
    """KIVI's reason to group keys per channel: with channels of very different scales, the
    same matrix quantized as keys (groups of tokens in a channel) loses less than as values
    (groups of channels in a token)."""
    x = kv(2, tokens=64, channels=64, parts=4, channel_scale=1.5)
    raw = block(x, "fp16")
    ref = to_f32(raw, "fp16")
    codec = Codec.INT8 if bits == 8 else Codec.INT4
    errors = {}
    for kind in ("k", "v"):
        out, stored_as, _ = store_and_load(codec, raw, KVLayout("fp16", ((kind, 64, 64),) * 4))
        assert stored_as is codec
        errors[kind] = np.linalg.norm(to_f32(out, "fp16") - ref) / np.linalg.norm(ref)
    assert errors["k"] < 0.7 * errors["v"]


@pytest.mark.parametrize(("bits", "share", "error"), [(8, (0.5, 0.56), (0, 0.01)),
                                                      (4, (0.25, 0.31), (0.01, 0.15))])
def test_the_stored_share_and_error_of_a_kv_block(bits, share, error):
    """A vLLM-like bf16 block (K and V of 32 tokens by 64 channels per layer): codes plus two
    scale bytes a group, and a relative error that grows as the codes shrink."""
    lay = kv_layout("bf16", kind_pairs=6)
    raw = block(kv(3, parts=12, channel_scale=0.5), "bf16")
    assert raw.nbytes == lay.raw_bytes
    codec = Codec.INT8 if bits == 8 else Codec.INT4
    out, stored_as, stored = store_and_load(codec, raw, lay)
    ref, got = to_f32(raw, "bf16"), to_f32(out, "bf16")
    assert stored_as is codec and stored == quant.payload_bytes(lay, DEFAULT_GROUP, bits)
    assert share[0] < stored / raw.nbytes < share[1]
    assert error[0] < np.linalg.norm(got - ref) / np.linalg.norm(ref) < error[1]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_the_reference_decodes_within_half_a_step(bits, kind):
    """quant.encode_part / decode_reference (what the native loops match): every element within
    half its group's step, the group's range widened by at most one grid step (a 255th of the
    part's range) at each end; a constant group and a part far from zero included."""
    tokens, channels = 48, 40
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal((tokens, channels)) * np.logspace(-1, 1, channels)
         - 300).astype(np.float32)
    x[:, 0] = -301.5  # a constant channel: a key group of its own
    x[0, :] = -299.25  # a constant token: a value group of its own
    lay = KVLayout("fp32", ((kind, tokens, channels),))
    payload = quant.encode_part(x, kind, DEFAULT_GROUP, bits)
    assert len(payload) == quant.payload_bytes(lay, DEFAULT_GROUP, bits)
    out = np.zeros(lay.raw_bytes, np.uint8)
    quant.decode_reference(lay, DEFAULT_GROUP, bits, memoryview(payload), out)
    y = out.view(np.float32).reshape(tokens, channels)
    if kind == "k":
        g = group_for(DEFAULT_GROUP, tokens)
        grouped = x.reshape(tokens // g, g, channels)
        spread = np.repeat(grouped.max(1) - grouped.min(1), g, axis=0)
    else:
        g = group_for(DEFAULT_GROUP, channels)
        grouped = x.reshape(tokens, channels // g, g)
        spread = np.repeat(grouped.max(2) - grouped.min(2), g, axis=1)
    grid = (x.max() - x.min()) / 255 * (1 + 2.0**-9)
    step = (spread + 2 * grid) / ((1 << bits) - 1)
    err = np.abs(y - x)
    assert (err <= step / 2 * (1 + 2.0**-9) + np.abs(x) * 2.0**-22).all()
    assert err.max() > 0  # a real quantizer


def test_int4_codes_pack_the_even_position_in_the_low_nibble():
    """Two int4 codes a byte, in the part's stored order: flipping a code byte's low nibble
    changes the element at the even position, its high nibble the one after it."""
    x = np.arange(16, dtype=np.float32).reshape(1, 16)  # one token: one value group
    lay = KVLayout("fp32", (("v", 1, 16),))
    payload = bytearray(quant.encode_part(x, "v", DEFAULT_GROUP, 4))
    first_code = 4 + 2  # after M and S (float16 each), lo and hi (one group: a byte each)
    assert len(payload) == first_code + 8

    def decoded(data: bytes) -> np.ndarray:
        out = np.zeros(lay.raw_bytes, np.uint8)
        quant.decode_reference(lay, DEFAULT_GROUP, 4, memoryview(data), out)
        return out.view(np.float32)

    base = decoded(bytes(payload))
    for flip, changed in ((0x01, 0), (0x10, 1)):
        bad = bytearray(payload)
        bad[first_code + 3] ^= flip  # the byte of elements 6 and 7
        diff = np.flatnonzero(decoded(bytes(bad)) != base)
        assert diff.tolist() == [6 + changed]


def test_values_beyond_float16_range_are_stored_losslessly():
    """A block whose range the float16 grid cannot hold (fp32 KV of 1e6) is not quantized: it
    is stored shuffle_zstd, exact, and counted with its reason."""
    lay = kv_layout("fp32", kind_pairs=1)
    x = kv(4, parts=2).reshape(-1) * 1e6
    raw = block(x, "fp32")
    reason = "unquantizable (the range of the values overflows float16)"
    before = stats[reason]
    out, stored_as, _ = store_and_load(Codec.INT8, raw, lay)
    assert stored_as is Codec.SHUFFLE_ZSTD and np.array_equal(out, raw)
    assert stats[reason] == before + 1
