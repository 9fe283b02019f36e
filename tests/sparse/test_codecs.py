"""KV codecs: lossless bit-exactness, quantization within half a step, self-describing headers."""

from __future__ import annotations

import pytest
import torch

from ucm.sparse import LosslessCodec, QuantCodec, decode_any, measure
from ucm.sparse.codecs import _parse


def _kv(seed: int, dtype=torch.float16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    channel_scale = torch.exp(torch.randn(64, generator=g))
    return (torch.randn(4, 128, 64, generator=g) * channel_scale + 0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_lossless_round_trip_is_bit_exact(dtype):
    x = _kv(0, dtype)
    x.view(-1)[5] = float("nan")
    x.view(-1)[6] = float("-inf")
    codec = LosslessCodec()
    back = decode_any(codec.encode(x))
    assert back.dtype == dtype and back.shape == x.shape
    int_view = {2: torch.int16, 4: torch.int32}[x.element_size()]
    assert torch.equal(back.view(int_view), x.view(int_view))


def test_lossless_bytes_round_trip_and_compresses():
    x = _kv(1)
    raw = x.numpy().tobytes()
    codec = LosslessCodec()
    assert codec.decode(codec.encode(raw)) == raw
    assert codec.decode(codec.encode(b"odd-length")) == b"odd-length"
    assert len(codec.encode(raw)) < 0.95 * len(raw)  # fp16 exponents are compressible


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kind", ["key", "value"])
def test_quantized_error_within_half_a_step(bits, kind):
    x = _kv(2)
    codec = QuantCodec(bits=bits, group=32, kind=kind)
    data = codec.encode(x)
    back = QuantCodec.decode(data, torch.float32)
    assert decode_any(data).dtype == torch.float16 and back.shape == x.shape
    xf = x.float()
    grouped = xf.transpose(-1, -2) if kind == "key" else xf
    g = grouped.reshape(*grouped.shape[:-1], -1, 32)
    step = (g.amax(-1) - g.amin(-1)) / ((1 << bits) - 1)
    err = (back.transpose(-1, -2) if kind == "key" else back) - grouped
    # the stored step is the true one rounded up to float16 (at most 2^-10 relative)
    bound = step.repeat_interleave(32, -1) * 0.5 * (1 + 2**-10) + 1e-6
    assert (err.abs() <= bound.reshape(err.shape)).all()


def test_quantized_sizes_and_header():
    x = _kv(3)
    raw = x.numel() * 2
    r8 = measure(QuantCodec(8, 32, "value"), x)
    r4 = measure(QuantCodec(4, 32, "value"), x)
    assert 1.7 < r8.ratio < 2.0 and 3.0 < r4.ratio < 4.0
    assert r8.rel_error < 0.01 < r4.rel_error < 0.15
    assert r8.max_error_in_steps <= 0.5 * (1 + 2**-10)
    codec_id, dtype, _, shape, _ = _parse(QuantCodec(4, 32, "key").encode(x))
    assert (codec_id, dtype, shape) == (4, torch.float16, tuple(x.shape))
    assert len(QuantCodec(8, 32).encode(x)) < raw
    with pytest.raises(ValueError, match="bad magic"):
        decode_any(b"nope" + bytes(16))


def test_keys_per_channel_beat_keys_per_token_on_channel_outliers():
    x = _kv(4)
    per_channel = measure(QuantCodec(4, 32, "key"), x).rel_error
    per_token = measure(QuantCodec(4, 32, "value"), x).rel_error
    assert per_channel < per_token
