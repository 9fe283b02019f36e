"""Hypothesis over int8/int4 layouts, parameters and payloads (issue 32): blocks forged with
valid checksums around parameters of any shape (mis-sized raw parts, tiles that do not divide,
unknown kinds and dtypes, other parameter formats, many parts) and payloads of random or real bytes,
through the block decoder into buffers and Scatters, and through the kernel's real load path on
a posix tier (real files) and a redis tier whose server lies (tests/_hostile.py).

The rule, from an oracle written here and not from the code under test: a block whose
parameters are well formed and whose lengths match loads OK, as the numpy reference decodes
it; any other is a CORRUPT miss for its key; the batch's other key loads; no event fails."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np
import pytest
from _hostile import Plant, forge_block, kv_values, params_of, posix_kernel, redis_kernel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucm.block import PAYLOAD_OFFSET, Codec, Scatter, decode_header, decode_payload_into
from ucm.codecs import layout, quant
from ucm.codecs.quant import to_f32
from ucm.drivers import LoadState
from ucm.errors import BlockCorrupt
from ucm.kernel import Kernel, Load

NS = "fuzz"
ITEMSIZE = {1: 2, 2: 2, 3: 4}
DTYPE = {1: "fp16", 2: "bf16", 3: "fp32"}
FAST = settings(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

FAULTS = ["raw channels", "raw order", "tile", "kind", "c-major", "dtype", "format",
          "group", "payload length"]


@st.composite
def run_st(draw) -> tuple[int, int, int, int, int, int, int]:
    """A well-formed run: (kind id 0 raw / 1 k / 2 v, tokens, channels, count, c-major, ti,
    ci), its tile dividing its tokens and channels."""
    kind = draw(st.sampled_from([0, 1, 2]))
    count = draw(st.integers(1, 3))
    if kind == 0:
        return (0, draw(st.integers(1, 40)), 1, count, 0, 1, 1)
    ti, ci = draw(st.sampled_from([1, 1, 2, 3, 4])), draw(st.sampled_from([1, 1, 2, 3, 16]))
    return (kind, ti * draw(st.integers(1, 6)), ci * draw(st.integers(1, 5)), count,
            draw(st.integers(0, 1)), ti, ci)


@st.composite
def forged(draw) -> dict:
    """A forged block's fields: parameters, codec, raw size, payload; well formed, or with one
    fault (`fault`) a hostile store could plant, checksums right either way."""
    runs = draw(st.lists(run_st(), min_size=1, max_size=4))
    first, dtype_id = 0xC0, draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([64, 64, 1, 2, 3, 4, 5, 8, 16, 32, 40, 70]))
    repeat = draw(st.integers(1, 3))
    bits = draw(st.sampled_from([8, 4]))
    fault = draw(st.sampled_from([None] * len(FAULTS) + FAULTS))
    jitter = 0
    pick = draw(st.integers(0, len(runs) - 1))
    kind, tokens, channels, count, c_major, ti, ci = runs[pick]
    if fault in ("raw channels", "raw order"):
        tokens = draw(st.integers(1, 40))
        runs[pick] = ((0, tokens, draw(st.integers(2, 4)), count, 0, 1, 1)
                      if fault == "raw channels" else
                      (0, tokens, 1, count, *draw(st.sampled_from([(1, 1, 1), (0, 2, 1),
                                                                    (0, 1, 3)]))))
    elif fault == "tile":
        tile = draw(st.sampled_from([2, 5]))  # a tile that does not divide the tokens
        runs[pick] = (1 + kind % 2, tile * draw(st.integers(1, 4)) + 1, channels, count,
                      c_major, tile, ci)
    elif fault == "kind":
        runs[pick] = (draw(st.sampled_from([3, 4, 255])), tokens, channels, count, c_major,
                      ti, ci)
    elif fault == "c-major":
        runs[pick] = (kind, tokens, channels, count, draw(st.sampled_from([2, 255])), ti, ci)
    elif fault == "dtype":
        dtype_id = draw(st.sampled_from([0, 4, 15]))
    elif fault == "format":
        first = draw(st.sampled_from([0x00, 0x80, 0xD0, 0xF0]))
    elif fault == "group":
        group = 0
    elif fault == "payload length":
        jitter = draw(st.sampled_from([-1, 1, -4, 7]))
    itemsize = ITEMSIZE.get(dtype_id, 2)
    # the raw size as a forger declares it: raw parts tokens x channels bytes
    raw_len = repeat * sum(n * t * c * (1 if k == 0 else itemsize) for k, t, c, n, *_ in runs)
    payload_len = repeat * sum(n * _payload(k, t, c, max(group, 1), bits)
                               for k, t, c, n, *_ in runs)
    ok = fault is None
    assert not ok or _well_formed(first, dtype_id, group, runs)
    if ok and draw(st.booleans()):
        payload = _real_payload(dtype_id, group, repeat, runs, bits, draw(st.integers(0, 99)))
    else:
        size = max(0, payload_len + jitter)
        payload = draw(st.binary(min_size=size, max_size=size))
    return {"params": params_of(dtype_id, group, repeat, runs, first=first),
            "codec": int(Codec.INT8 if bits == 8 else Codec.INT4), "bits": bits,
            "raw_len": raw_len, "payload": payload, "ok": ok, "fault": fault}


def _payload(kind: int, tokens: int, channels: int, group: int, bits: int) -> int:
    """A part's payload bytes (the format's rule, docs/compression.md), raw parts `tokens`."""
    if kind == 0:
        return tokens
    axis = tokens if kind == 1 else channels
    g = math.gcd(group, axis)
    g = g if g >= 4 else axis
    groups = (tokens // g) * channels if kind == 1 else tokens * (channels // g)
    n = tokens * channels
    return 4 + 2 * groups + (n if bits == 8 else (n + 1) // 2)


def _well_formed(first: int, dtype_id: int, group: int, runs: list) -> bool:
    """The oracle: what a decoder must accept (the rules of a KVLayout)."""
    if first != 0xC0 or dtype_id not in ITEMSIZE or group < 1:
        return False
    for kind, tokens, channels, _, c_major, ti, ci in runs:
        if kind not in (0, 1, 2) or c_major > 1:
            return False
        if kind == 0 and (channels != 1 or c_major or ti != 1 or ci != 1):
            return False
        if kind != 0 and (tokens % ti or channels % ci):
            return False
    return True


def _real_payload(dtype_id: int, group: int, repeat: int, runs: list, bits: int,
                  seed: int) -> bytes:
    """What the encoder writes for random values of this layout."""
    lay = layout.KVLayout(DTYPE[dtype_id], tuple(
        (("raw", "k", "v")[k], t, c, layout.Order(bool(cm), ti, ci))
        for k, t, c, n, cm, ti, ci in runs for _ in range(n)) * repeat)
    raw = kv_values(lay, np.random.default_rng(seed))
    return quant.encode_reference(lay, group, bits, memoryview(raw))


def reference(block: dict) -> np.ndarray:
    """The numpy reference's decoding of a well-formed forged block."""
    lay, group = layout.unpack(block["params"], block["raw_len"])
    out = np.zeros(block["raw_len"], np.uint8)
    quant.decode_reference(lay, group, block["bits"], memoryview(block["payload"]), out)
    return out


def same_values(block: dict, got: bytes, want: np.ndarray) -> bool:
    """Byte for byte, except that a NaN equals any NaN (its payload bits are the CPU's)."""
    if bytes(got) == want.tobytes():
        return True
    lay, _ = layout.unpack(block["params"], block["raw_len"])
    data, pos = np.frombuffer(got, np.uint8), 0
    for part in lay.parts:
        n = lay.part_bytes(part)
        a, b = data[pos:pos + n].copy(), want[pos:pos + n].copy()
        pos += n
        if part[0] == "raw" and not np.array_equal(a, b):
            return False
        if part[0] != "raw" and not np.array_equal(to_f32(a, lay.dtype), to_f32(b, lay.dtype),
                                                   equal_nan=True):
            return False
    return True


# -- the block decoder: buffers and Scatters ------------------------------------------------------

@settings(max_examples=300, deadline=None, derandomize=True)
@given(block=forged(), cuts=st.lists(st.integers(0, 1 << 14), max_size=4))
def test_forged_blocks_decode_as_the_reference_or_are_corrupt(block, cuts):
    whole = forge_block(b"k", NS, block["codec"], block["params"], block["payload"],
                        block["raw_len"])
    out = np.full(block["raw_len"], 0xEE, np.uint8)
    bounds = sorted({0, block["raw_len"], *(c % (block["raw_len"] + 1) for c in cuts)})
    target = (Scatter([memoryview(out[a:b]) for a, b in itertools.pairwise(bounds)])
              if len(bounds) > 2 else memoryview(out))
    try:
        header = decode_header(whole[:PAYLOAD_OFFSET], expect_key=b"k", expect_namespace=NS)
        decode_payload_into(header, whole[PAYLOAD_OFFSET:], target)
    except BlockCorrupt:
        assert not block["ok"], "a well-formed block was refused"
        return
    assert block["ok"], "a malformed block decoded"
    assert same_values(block, out.tobytes(), reference(block))


# -- the kernel's load path: a posix tier and a redis tier whose server lies ---------------------

@pytest.fixture(scope="module")
def posix(tmp_path_factory) -> Iterator[tuple[Kernel, Plant]]:
    with posix_kernel(str(tmp_path_factory.mktemp("fuzz")), NS) as tier:
        yield tier


@pytest.fixture(scope="module")
def redis() -> Iterator[tuple[Kernel, Plant]]:
    with redis_kernel(NS) as tier:
        yield tier


@pytest.fixture(params=["posix", "redis"])
def tier(request) -> tuple[Kernel, Plant]:
    return request.getfixturevalue(request.param)


_keys = itertools.count()
GOOD_LAYOUT = layout.KVLayout("bf16", (("k", 8, 8), ("raw", 3, 1), ("v", 8, 8)))


def _good() -> tuple[bytes, bytes]:
    raw = np.arange(GOOD_LAYOUT.raw_bytes, dtype=np.uint8)
    raw[:128] = 0x3F  # finite bf16 values (the raw part's bytes are opaque)
    raw[131:] = 0x3E
    payload = quant.encode_reference(GOOD_LAYOUT, 64, 8, memoryview(raw))
    want = np.zeros_like(raw)
    quant.decode_reference(GOOD_LAYOUT, 64, 8, memoryview(payload), want)
    return payload, want.tobytes()


GOOD_PAYLOAD, GOOD_BYTES = _good()


@FAST
@given(block=forged())
def test_forged_blocks_through_the_kernel_are_per_key_outcomes(tier, block):
    """Each example: a forged block and a good one, one Load. The event never fails, the good
    block loads, and the forged one is OK (as the reference decodes it) exactly when it is
    well formed, else CORRUPT."""
    kernel, plant = tier
    n = next(_keys)
    bad, good = b"forged-%d" % n, b"good-%d" % n  # fresh keys: a background delete never races
    plant(bad, forge_block(bad, NS, block["codec"], block["params"], block["payload"],
                           block["raw_len"]))
    plant(good, forge_block(good, NS, int(Codec.INT8), layout.pack(GOOD_LAYOUT, 64),
                            GOOD_PAYLOAD, GOOD_LAYOUT.raw_bytes))
    out, good_out = bytearray(b"\xee" * block["raw_len"]), bytearray(len(GOOD_BYTES))
    result = kernel.submit(Load([bad, good], buffers=[out, good_out])).result(30)
    assert result.states[1] is LoadState.OK and bytes(good_out) == GOOD_BYTES
    if block["ok"]:
        assert result.states[0] is LoadState.OK
        assert same_values(block, bytes(out), reference(block))
    else:
        assert result.states[0] is LoadState.CORRUPT
