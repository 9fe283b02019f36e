"""The corpus tests/test_native_sanitizers.py runs over a build of native/ with AddressSanitizer
and UndefinedBehaviorSanitizer (run as a script, not collected):

    python _native_corpus.py KVCODEC_SO HOSTCOPY_SO

It loads the two sanitized modules as ucm._kvcodec and ucm._hostcopy before ucm imports them,
then drives every loop of both: valid blocks of every element order, dtype and width (odd
channels, parts at odd offsets, blocks large enough for streamed stores), decoded into one
buffer and into pieces cut anywhere; forged blocks (random payloads, plans that do not fit);
and ucm's own load path over forged blocks. Each call runs twice, through the loops chosen at
import (AVX2 where the CPU has it) and the portable ones. Prints one line of counts; any
sanitizer report ends the process with an error first.
"""

from __future__ import annotations

import importlib.util
import itertools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_sanitized(name: str, path: str) -> object:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


import ucm  # noqa: E402, F401  (the package first: its __init__ loads neither)

kvcodec = load_sanitized("ucm._kvcodec", sys.argv[1])
hostcopy = load_sanitized("ucm._hostcopy", sys.argv[2])

import numpy as np  # noqa: E402
import xxhash  # noqa: E402
from _hostile import kv_values  # noqa: E402  (tests/: this script's own directory)

from ucm.block import (  # noqa: E402
    Scatter,
    copy_verified,
    decode_header,
    decode_payload_into,
    encode_header,
)
from ucm.codecs import layout, quant  # noqa: E402
from ucm.codecs.layout import KVLayout, Order  # noqa: E402
from ucm.errors import BlockCorrupt  # noqa: E402

assert quant._dequantize_block is kvcodec.dequantize_block, "ucm loaded another _kvcodec"
counts: dict[str, int] = {}


def count(what: str) -> None:
    counts[what] = counts.get(what, 0) + 1


DTYPES = ("fp16", "bf16", "fp32")
# every decoding path of native/kvcodec_impl.h (AMX-like tiles, runs of 1/2/4/8, channel-major
# keys, row-major, the group table), odd channels for int4, parts at odd byte offsets
LAYOUTS = [
    (("k", 32, 40, Order(False, 16, 2)), ("v", 32, 48, Order(True, 2, 16)),
     ("k", 16, 32, Order(False, 2, 4)), ("v", 8, 64, Order(True, 8, 8)),
     ("k", 16, 8, Order(False, 8, 1)), ("k", 16, 24, Order(True, 1, 1)), ("v", 8, 24),
     ("raw", 8, 1), ("k", 8, 64), ("v", 8, 24, Order(False, 4, 2)),
     ("k", 8, 16, Order(True, 2, 4)), ("k", 6, 8, Order(False, 3, 2))),
    (("raw", 3, 1), ("k", 4, 7), ("v", 5, 3), ("raw", 1, 1), ("k", 6, 9, Order(True, 2, 3)),
     ("raw", 5, 1), ("v", 4, 5, Order(False, 2, 5)), ("k", 3, 5), ("v", 7, 7, Order(True, 7, 1)),
     ("v", 9, 33), ("k", 17, 15)),
    (("raw", 1, 1), ("k", 16, 64), ("v", 16, 64)),  # fp16 elements at odd addresses
]
LARGE = (("k", 128, 64, Order(False, 16, 2)), ("v", 128, 64, Order(True, 2, 16))) * 12


def pieces(out: np.ndarray, cuts: list[int]) -> list[memoryview]:
    bounds = [0, *sorted(cuts), out.nbytes]
    return [memoryview(out[a:b]) for a, b in itertools.pairwise(bounds)]


def both(name: str) -> tuple:
    return getattr(kvcodec, name), getattr(kvcodec, f"{name}_portable")


def valid_blocks(rng: np.random.Generator) -> None:
    for parts in [*LAYOUTS, LARGE]:
        for dtype in DTYPES:
            lay = KVLayout(dtype, parts)
            raw = kv_values(lay, rng, spread=True)
            for bits in (8, 4):
                steps = quant.plan(lay, 64, bits)
                reference = quant.encode_reference(lay, 64, bits, memoryview(raw))
                for fn in both("quantize_block"):
                    out = bytearray(len(reference))
                    assert fn(out, raw, steps, bits, layout.DTYPES[dtype]) == 0
                    assert bytes(out) == reference
                    count("encode")
                want = np.zeros_like(raw)
                quant.decode_reference(lay, 64, bits, memoryview(reference), want)
                cutsets = [[], [1], [3, 5, 1000], sorted(rng.integers(0, raw.nbytes, 30).tolist())]
                for fn in both("dequantize_block"):
                    for cuts in cutsets:
                        out = np.zeros_like(raw)
                        target = pieces(out, cuts) if cuts else out
                        digest = fn(target, reference, steps, bits, layout.DTYPES[dtype])
                        assert digest is None or digest == xxhash.xxh3_64_intdigest(reference)
                        assert np.array_equal(out, want)
                        count("decode")
                    # a destination starting at an odd address
                    backing = np.zeros(raw.nbytes + 1, np.uint8)
                    fn(memoryview(backing[1:]), reference, steps, bits, layout.DTYPES[dtype])
                    assert np.array_equal(backing[1:], want)
                    count("decode")


def forged_payloads(rng: np.random.Generator) -> None:
    """Valid plans over random payload bytes (any scales: inf, NaN, subnormals)."""
    for parts in LAYOUTS:
        for dtype in DTYPES:
            lay = KVLayout(dtype, parts)
            for bits in (8, 4):
                steps = quant.plan(lay, 64, bits)
                for _ in range(4):
                    payload = rng.integers(0, 256, quant.payload_bytes(lay, 64, bits),
                                           np.uint8).tobytes()
                    for fn in both("dequantize_block"):
                        out = np.zeros(lay.raw_bytes, np.uint8)
                        fn(pieces(out, sorted(rng.integers(0, out.nbytes, 5).tolist())),
                           payload, steps, bits, layout.DTYPES[dtype])
                        count("forged_payload")


def forged_plans(rng: np.random.Generator) -> None:
    """Plans that do not fit their buffers: refused with ValueError, nothing touched."""
    base = (1, 16, 8, 16, 0, 0, 0, 1, 1)
    bad = [(1, 16, 8, 16, 1, 0, 0, 1, 1), (1, 16, 8, 16, 0, 1, 0, 1, 1),
           (1, 16, 8, 5, 0, 0, 0, 1, 1), (3, 16, 8, 16, 0, 0, 0, 1, 1),
           (0, 1 << 40, 1, 1, 0, 0, 0, 1, 1), (1, -16, 8, 16, 0, 0, 0, 1, 1),
           (1, 16, 8, 16, 0, 0, 2, 1, 1), (1, 16, 8, 16, 0, 0, 0, 3, 1),
           (1, 16, 8, 16, 0, 0, 0, 1, 0), (0, 4, 2, 1, 0, 0, 0, 1, 1),
           (1, 1 << 25, 1, 1, 0, 0, 0, 1, 1), (2, 1, 1 << 62, 1, 0, 0, 0, 1, 1),
           (1, 16, 8, 16, (1 << 63) - 1, 0, 0, 1, 1), (1, 16, 8, 16, 0, (1 << 63) - 1, 0, 1, 1)]
    for _ in range(40):
        row = list(base)
        row[rng.integers(0, 9)] = int(rng.integers(-(1 << 40), 1 << 40))
        bad.append(tuple(row))
    out, payload = bytearray(16 * 8 * 2), bytes(4 + 2 * 8 + 16 * 8)
    for row in bad:
        steps = np.array([base, row], np.int64).tobytes()
        for fn in (*both("dequantize_block"), *both("quantize_block")):
            for bits in (8, 4):
                try:
                    fn(out, payload, steps, bits, 2)
                except ValueError:
                    count("plan_refused")
                else:
                    count("plan_taken")
    for fn in both("dequantize_block"):
        for target in ([bytearray(100), bytearray(100)], [], [bytearray(1)] * 4097):
            try:
                fn(target, payload, np.array([base], np.int64).tobytes(), 8, 2)
            except ValueError:
                count("pieces_refused")


def load_path(rng: random.Random) -> None:
    """ucm's own decode over forged blocks: headers with random runs, payloads of random bytes
    with right checksums, into buffers and Scatters."""
    for _ in range(300):
        runs = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice([0, 1, 2])
            ti, ci = rng.choice([1, 1, 2, 3]), rng.choice([1, 1, 2, 4])
            run = [kind, ti * rng.randint(1, 8), ci * rng.randint(1, 6), rng.randint(1, 3),
                   rng.randint(0, 1), ti, ci]
            if kind == 0:
                run[2], run[4:] = 1, [0, 1, 1]
            if rng.random() < 0.1:  # one field anything
                run[rng.randrange(7)] = rng.choice([0, 2, 3, 5, 255])
            runs.append(tuple(run))
        dtype_id = rng.choice([1, 2, 3, 0])
        params = layout._HEAD.pack(0xC0 | dtype_id, rng.choice([64, 1, 3, 8, 40]),
                                   rng.randint(1, 3), len(runs)) + b"".join(
            layout._RUN.pack(*r) for r in runs)
        try:
            packed = layout.parse(params)
            raw_len = packed.raw_bytes
            bits = rng.choice([8, 4])
            payload_len = quant.payload_bytes(packed, packed.group, bits)
        except BlockCorrupt:
            count("params_refused")
            continue
        payload = rng.randbytes(payload_len)
        codec = 3 if bits == 8 else 4
        from ucm.codecs import _encoded

        head = encode_header(b"k", "ns", codec, _encoded(payload, codec, params), raw_len)
        try:
            header = decode_header(head, expect_key=b"k", expect_namespace="ns")
        except BlockCorrupt:  # a payload longer than any block of its raw size may be
            count("header_refused")
            continue
        out = np.zeros(raw_len, np.uint8)
        cuts = sorted(rng.randrange(raw_len + 1) for _ in range(rng.randint(0, 4)))
        target = Scatter(pieces(out, cuts)) if cuts else memoryview(out)
        for impl in both("dequantize_block"):
            quant._dequantize_block = impl
            decode_payload_into(header, payload, target)
            count("load_path")
            try:
                decode_payload_into(header, payload[:-1] + bytes([payload[-1] ^ 1]), target)
            except BlockCorrupt:
                count("load_path_corrupt")
    quant._dequantize_block = kvcodec.dequantize_block


def host_copies(rng: random.Random) -> None:
    for size in (1, 63, 4096, 65535, 65536, 65537, 300001):
        src = rng.randbytes(size)
        digest = xxhash.xxh3_64_intdigest(src)
        for fn in (hostcopy.hash_copy, hostcopy.hash_copy_portable):
            for k in (0, 1, 3, 9):
                cuts = sorted(rng.randrange(size + 1) for _ in range(k))
                backing = bytearray(size + 1)
                dst = memoryview(backing)[1:]  # odd addresses
                target = ([dst[a:b] for a, b in itertools.pairwise([0, *cuts, size])]
                          if k else dst)
                assert fn(target, src) == digest and bytes(dst) == src
                count("hash_copy")
            try:
                fn(bytearray(size + 1), src)
            except ValueError:
                count("hash_copy_refused")
    from ucm.block import BlockHeader, Codec

    src = rng.randbytes(1 << 18)
    header = BlockHeader(b"k", "ns", Codec.NONE, len(src), len(src), xxhash.xxh3_64_intdigest(src))
    out = bytearray(len(src))
    copy_verified(header, Scatter([memoryview(out)[:5], memoryview(out)[5:]]), src)
    assert out == src
    count("copy_verified")


nrng = np.random.default_rng(32)
valid_blocks(nrng)
forged_payloads(nrng)
forged_plans(nrng)
load_path(random.Random(32))
host_copies(random.Random(33))
print("IMPL", kvcodec.IMPL, hostcopy.IMPL, "HASHES", kvcodec.HASHES,
      " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
