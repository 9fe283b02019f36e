"""Hostile bytes against the int8/int4 codecs (issue 32): mis-sized raw parts, decode errors
that are not BlockCorrupt, codec parameters that expand to many parts, plan caches. Each forged
block has valid header and payload checksums (what a hostile server or a co-user of a shared
tier can write); each must be a per-key CORRUPT miss, never data, and never a failed event.
Through the kernel on a posix tier (real files) and on a redis tier whose server lies
(tests/_hostile.py)."""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest
from _hostile import Plant, forge_block, params_of, posix_kernel, redis_kernel
from _hostile import kv_values as hostile_kv_values

from ucm import codecs
from ucm.block import (
    PAYLOAD_OFFSET,
    Codec,
    Scatter,
    decode_header,
    decode_payload_into,
    encode_header,
    encode_payload,
)
from ucm.codecs import KVLayout, KVLayouts, layout, quant
from ucm.codecs.layout import MAX_DIM, MAX_PARTS, Order
from ucm.codecs.quant import from_f32
from ucm.drivers import LoadState
from ucm.errors import BlockCorrupt
from ucm.kernel import Kernel, Load

NS = "trust"
FP16, INT8, INT4 = 1, int(Codec.INT8), int(Codec.INT4)
RAW, K, V = 0, 1, 2


def fp16_values(n: int, seed: int = 0) -> np.ndarray:
    raw = np.empty(2 * n, np.uint8)
    from_f32(np.random.default_rng(seed).standard_normal(n).astype(np.float32), "fp16", raw)
    return raw


def kv_values(lay: KVLayout, seed: int = 0) -> np.ndarray:
    return hostile_kv_values(lay, np.random.default_rng(seed))


def k_part_payload(tokens: int, channels: int, bits: int, seed: int = 0) -> bytes:
    """A k part's payload from real values (the encoder's own bytes)."""
    x = fp16_values(tokens * channels, seed).view(np.float16).astype(np.float32)
    return quant.encode_part(x.reshape(tokens, channels), "k", 64, bits)


# -- the kernel over a posix tier and over a redis tier whose server lies -----------------------

@pytest.fixture(scope="module")
def posix(tmp_path_factory) -> Iterator[tuple[Kernel, Plant]]:
    with posix_kernel(str(tmp_path_factory.mktemp("posix")), NS) as tier:
        yield tier


@pytest.fixture(scope="module")
def redis() -> Iterator[tuple[Kernel, Plant]]:
    with redis_kernel(NS) as tier:
        yield tier


@pytest.fixture(params=["posix", "redis"])
def tier(request) -> tuple[Kernel, Plant]:
    return request.getfixturevalue(request.param)


def good_block(key: bytes) -> tuple[bytes, bytes]:
    """A valid int8 block and the bytes it loads as."""
    lay = KVLayout("fp16", (("k", 8, 16), ("v", 8, 16)))
    raw = fp16_values(lay.raw_bytes // 2, seed=3)
    payload = quant.encode_reference(lay, 64, 8, memoryview(raw))
    want = np.empty_like(raw)
    quant.decode_reference(lay, 64, 8, memoryview(payload), want)
    return forge_block(key, NS, INT8, layout.pack(lay, 64), payload, lay.raw_bytes), bytes(want)


def load_beside_a_good_block(tier, key: bytes, block: bytes, size: int) -> LoadState:
    """Plants `block` under `key` and a good block under another key, loads both in one
    event: the good one must load, whatever the forged one does; returns the forged one's
    state, and checks a CORRUPT block is removed."""
    kernel, plant = tier
    good, want = good_block(b"good-" + key)
    plant(b"good-" + key, good)
    plant(key, block)
    out, good_out = bytearray(b"\xee" * size), bytearray(len(want))
    result = kernel.submit(Load([key, b"good-" + key], buffers=[out, good_out])).result(30)
    assert result.states[1] is LoadState.OK and bytes(good_out) == want
    if result.states[0] is LoadState.CORRUPT:
        for _ in range(1000):  # the kernel deletes it in the background
            if not plant.present(key):
                break
            time.sleep(0.01)
        assert not plant.present(key), "a corrupt block was left in place"
    return result.states[0]


# -- 1. a raw part has one channel ----------------------------------------------------------------

def test_a_raw_part_of_several_channels_is_refused_at_registration():
    with pytest.raises(ValueError, match="raw part"):
        KVLayout("fp16", (("raw", 16, 4), ("k", 4, 8)))
    with pytest.raises(ValueError, match="raw part"):
        KVLayout("fp16", (("raw", 16, 1, Order(True)),))
    assert KVLayout("fp16", (("raw", 16, 1), ("k", 4, 8))).raw_bytes == 80


def test_a_forged_raw_part_of_several_channels_is_corrupt_in_the_header():
    params = params_of(FP16, 64, 1, [(RAW, 16, 4, 1, 0, 1, 1), (K, 4, 8, 1, 0, 1, 1)])
    payload = bytes(range(16)) + k_part_payload(4, 8, 8)
    block = forge_block(b"k", NS, INT8, params, payload, 16 * 4 + 4 * 8 * 2)
    with pytest.raises(BlockCorrupt, match="raw part"):
        decode_header(block[:PAYLOAD_OFFSET])
    with pytest.raises(BlockCorrupt, match="raw part"):
        layout.unpack(params, 16 * 4 + 4 * 8 * 2)


def test_a_forged_raw_part_of_several_channels_is_a_corrupt_miss(tier):
    """The block the issue describes: 64 raw bytes declared as 16 tokens of 4 channels, of
    which the codec wrote 16; its checksums are right, so only the layout rule can tell."""
    params = params_of(FP16, 64, 1, [(RAW, 16, 4, 1, 0, 1, 1), (K, 4, 8, 1, 0, 1, 1)])
    payload = bytes(range(16)) + k_part_payload(4, 8, 8)
    block = forge_block(b"raw-c4", NS, INT8, params, payload, 128)
    assert load_beside_a_good_block(tier, b"raw-c4", block, 128) is LoadState.CORRUPT


# -- 2. every decode error is a per-key CORRUPT miss ----------------------------------------------

def test_an_int4_block_with_a_mis_sized_raw_part_and_odd_channels_is_a_corrupt_miss(tier):
    """An odd-channel int4 part and a raw part of 3 channels: numpy's broadcast ValueError,
    which failed the whole Load (the other key lost, the block kept)."""
    params = params_of(FP16, 64, 1, [(RAW, 16, 3, 1, 0, 1, 1), (K, 4, 7, 1, 0, 1, 1)])
    payload = bytes(16) + k_part_payload(4, 7, 4)
    block = forge_block(b"odd-int4", NS, INT4, params, payload, 16 * 3 + 4 * 7 * 2)
    assert load_beside_a_good_block(tier, b"odd-int4", block, 16 * 3 + 4 * 7 * 2) is \
        LoadState.CORRUPT


def test_a_raw_part_over_the_native_dimension_limit_loads(tier):
    """A raw part of more than 2^24 bytes (the native loops' bound on a dimension) is a valid
    layout: it loads, bit for bit, where the native check's ValueError failed the event."""
    size = MAX_DIM + 5
    raw = np.random.default_rng(1).integers(0, 256, size, np.uint8).tobytes()
    params = params_of(FP16, 64, 1, [(RAW, size, 1, 1, 0, 1, 1), (K, 4, 8, 1, 0, 1, 1)])
    block = forge_block(b"big-raw", NS, INT8, params, raw + k_part_payload(4, 8, 8),
                        size + 64)
    kernel, plant = tier
    plant(b"big-raw", block)
    out = bytearray(size + 64)
    result = kernel.submit(Load([b"big-raw"], buffers=[out])).result(60)
    assert result.states == (LoadState.OK,) and out[:size] == raw


def test_unexpected_decode_errors_are_counted_corrupt_misses(tier, monkeypatch):
    """Fault injection: the decoder raising something no check foresaw, for int4 blocks only.
    That key is a CORRUPT miss (counted in ucm.codecs.decode_errors), the batch's other key
    (int8) loads."""
    def breaks_int4(real, bits_at):
        def decode(*args):
            if args[bits_at] == 4:
                raise RuntimeError("injected")
            return real(*args)
        return decode

    if quant._dequantize_block is not None:
        monkeypatch.setattr(quant, "_dequantize_block", breaks_int4(quant._dequantize_block, 3))
    else:  # pragma: no cover - without the native loops
        monkeypatch.setattr(quant, "decode_reference", breaks_int4(quant.decode_reference, 2))
    lay = KVLayout("fp16", (("k", 4, 8), ("v", 4, 8)))
    payload = quant.encode_reference(lay, 64, 4, memoryview(fp16_values(64)))
    block = forge_block(b"fault", NS, INT4, layout.pack(lay, 64), payload, lay.raw_bytes)
    before = codecs.decode_errors["RuntimeError"]
    assert load_beside_a_good_block(tier, b"fault", block, lay.raw_bytes) is LoadState.CORRUPT
    assert codecs.decode_errors["RuntimeError"] == before + 1


# -- 3. parameters are checked before anything is built from them ---------------------------------

def test_packed_parameters_are_checked_without_expanding_them():
    """27 bytes of parameters declaring 65,536 raw parts of 2^24 bytes (2^40 in all): the header
    is checked by arithmetic over its one run. Counted: no KVLayout is built and the check
    allocates a few KiB, where expanding the parts took tens of MiB and 0.4 s of CPU."""
    params = params_of(FP16, 64, MAX_PARTS, [(RAW, MAX_DIM, 1, 1, 0, 1, 1)])
    assert len(params) == 27
    block = forge_block(b"k", NS, INT8, params, b"", 1 << 40, payload_len=1 << 40)
    built = []
    original = KVLayout.__post_init__
    KVLayout.__post_init__ = lambda self: built.append(1) or original(self)
    try:
        tracemalloc.start()
        header = decode_header(block[:PAYLOAD_OFFSET])
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        # the buffer is compared next; the plan is never built for a block of another size
        with pytest.raises(BlockCorrupt, match="buffer is"):
            decode_payload_into(header, b"", memoryview(bytearray(4096)))
    finally:
        KVLayout.__post_init__ = original
    assert header.raw_len == 1 << 40 and built == []
    assert peak < 64 * 1024


def test_too_many_parts_are_refused_from_the_packed_form():
    params = params_of(FP16, 64, MAX_PARTS, [(RAW, 1, 1, 2, 0, 1, 1)])
    tracemalloc.start()
    with pytest.raises(BlockCorrupt, match="parts"):
        decode_header(forge_block(b"k", NS, INT8, params, b"", 2 * MAX_PARTS,
                                  payload_len=2 * MAX_PARTS)[:PAYLOAD_OFFSET])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 1024


def test_plan_caches_are_bounded_in_bytes():
    """Forty forged blocks, each of a distinct layout of 8,192 parts (a 576 KiB plan each),
    decoded into buffers of their size: what stays cached is at most PLAN_CACHE_BYTES (the
    cache of 64 plans kept 23 MiB of these), and every one decodes as the reference."""
    good, want = good_block(b"warm")  # lazy imports and first-use allocations, outside
    header = decode_header(good[:PAYLOAD_OFFSET])
    decode_payload_into(header, good[PAYLOAD_OFFSET:], memoryview(bytearray(len(want))))
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(40):
        params = params_of(FP16, 64, 8192, [(RAW, 1 + i, 1, 1, 0, 1, 1)])
        raw = bytes([i]) * ((1 + i) * 8192)
        header = decode_header(forge_block(b"k", NS, INT8, params, raw, len(raw))
                               [:PAYLOAD_OFFSET])
        out = bytearray(len(raw))
        decode_payload_into(header, raw, memoryview(out))
        assert out == raw
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert quant.plan_cache_bytes() <= quant.PLAN_CACHE_BYTES
    assert kept < quant.PLAN_CACHE_BYTES + (4 << 20)


def test_a_plan_is_built_from_the_runs_not_the_parts():
    """A block of 65,536 parts decodes through a plan built from its two runs: a KVLayout of
    its parts is never built (counted)."""
    params = params_of(FP16, 64, MAX_PARTS // 2, [(RAW, 3, 1, 1, 0, 1, 1),
                                                 (K, 1, 2, 1, 0, 1, 1)])
    packed = layout.parse(params)
    assert packed.nparts == MAX_PARTS and packed.raw_bytes == (3 + 4) * MAX_PARTS // 2
    built = []
    original = KVLayout.__post_init__
    KVLayout.__post_init__ = lambda self: built.append(1) or original(self)
    try:
        steps = np.frombuffer(quant.plan(packed, 64, 8), np.int64).reshape(-1, 9)
    finally:
        KVLayout.__post_init__ = original
    assert built == [] and len(steps) == MAX_PARTS
    assert steps[-1, 4] == packed.raw_bytes - 4  # the last part's offsets, by arithmetic
    assert steps[-1, 5] == quant.payload_bytes(packed, 64, 8) - (4 + 2 * 2 + 2)


# -- the native loops take odd-channel int4 parts (numpy no longer decodes any block) ----------

ODD = (("k", 4, 7), ("v", 5, 3), ("k", 6, 9, Order(True, 2, 3)), ("v", 4, 5, Order(False, 2, 5)),
       ("raw", 3, 1), ("k", 3, 5), ("raw", 1, 1), ("v", 7, 7, Order(True, 7, 1)))


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_odd_channel_int4_parts_are_coded_natively_as_the_reference(dtype):
    kvcodec = pytest.importorskip("ucm._kvcodec")
    lay = KVLayout(dtype, ODD)
    raw = kv_values(lay, seed=5)
    reference = quant.encode_reference(lay, 64, 4, memoryview(raw))
    steps = quant.plan(lay, 64, 4)
    for fn in (kvcodec.quantize_block, kvcodec.quantize_block_portable):
        native = bytearray(len(reference))
        assert fn(native, raw, steps, 4, layout.DTYPES[dtype]) == 0
        assert bytes(native) == reference
    want = np.zeros_like(raw)
    quant.decode_reference(lay, 64, 4, memoryview(reference), want)
    for fn in (kvcodec.dequantize_block, kvcodec.dequantize_block_portable):
        out = np.zeros_like(raw)
        fn([memoryview(out[:7]), memoryview(out[7:])], reference, steps, 4,
           layout.DTYPES[dtype])
        assert np.array_equal(out, want)


def test_an_odd_channel_int4_block_loads_in_one_pass(monkeypatch):
    """decode_payload_into decodes it with the one-pass native decoder (counted), which once
    left odd-channel int4 parts to numpy."""
    if not getattr(quant, "_HASHES", 0):
        pytest.skip("ucm._kvcodec is not built with xxhash.h")
    lay = KVLayout("bf16", ODD)
    raw = kv_values(lay, seed=6)
    payload = encode_payload(Codec.INT4, memoryview(raw), KVLayouts([lay]))
    header = decode_header(encode_header(b"k", NS, Codec.INT4, payload, lay.raw_bytes))
    assert header.codec is Codec.INT4
    want = np.zeros_like(raw)
    quant.decode_reference(lay, 64, 4, memoryview(bytes(payload)), want)
    digests = []
    real = quant.decode_hashed
    monkeypatch.setattr(quant, "decode_hashed", lambda *a: digests.append(real(*a)) or digests[-1])
    out = np.zeros_like(raw)
    decode_payload_into(header, bytes(payload), Scatter([memoryview(out[:3]),
                                                         memoryview(out[3:])]))
    assert np.array_equal(out, want) and len(digests) == 1 and digests[0] is not None
