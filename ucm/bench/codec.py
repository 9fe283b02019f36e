"""`ucm bench codec`: encode and decode rates of the block codecs on one core, per cache dtype,
next to memcpy and the codec-none load (copy + checksum) in the same run.

Blocks are KV of a registered layout (`--layers` x K and V of `--tokens` x `--channels`),
normally distributed values; rates are GB/s of raw (decoded) bytes, the best of `--repeat`
runs. Decode includes the payload checksum, as every load does.

    ucm bench codec [--dtypes bf16,fp16,fp32] [--codecs none,zstd,shuffle_zstd,int8,int4]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from ucm.block import (
    Codec,
    buffer_address,
    decode_header,
    decode_payload_into,
    encode_header,
    encode_payload,
)
from ucm.codecs import KVLayout, register_layout, unregister_layout
from ucm.codecs.quant import from_f32


def _best(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm: allocations, thread-local compressors, page faults
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(dtypes: list[str], codecs: list[str], *, layers: int, tokens: int, channels: int,
        repeat: int) -> list[dict[str, Any]]:
    rows = []
    for dtype in dtypes:
        layout = KVLayout(dtype, (("k", tokens, channels), ("v", tokens, channels)) * layers)
        register_layout(layout)
        try:
            rows += _rows(layout, codecs, repeat)
        finally:
            unregister_layout(layout)
    return rows


def _memmove(out: memoryview, src: memoryview) -> None:
    ctypes.memmove(buffer_address(out), buffer_address(src), out.nbytes)


def _rows(layout: KVLayout, codecs: list[str], repeat: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    raw = np.empty(layout.raw_bytes, np.uint8)
    from_f32(rng.standard_normal(layout.raw_bytes // layout.itemsize).astype(np.float32),
             layout.dtype, raw)
    src = memoryview(raw)
    out = memoryview(bytearray(raw.nbytes))
    gb = raw.nbytes / 1e9
    memcpy = _best(partial(_memmove, out, src), repeat)
    rows: list[dict[str, Any]] = [{
        "dtype": layout.dtype, "codec": "memcpy", "block_bytes": raw.nbytes, "ratio": 1.0,
        "encode_gbps": None, "decode_gbps": round(gb / memcpy, 2)}]
    for name in codecs:
        codec = Codec.parse(name)
        payload = encode_payload(codec, src)
        header = decode_header(encode_header(b"k", "bench", codec, payload, raw.nbytes))
        stored = bytes(payload)
        enc = _best(partial(encode_payload, codec, src), repeat)
        dec = _best(partial(decode_payload_into, header, stored, out), repeat)
        rows.append({"dtype": layout.dtype, "codec": name, "block_bytes": raw.nbytes,
                     "stored_as": header.codec.name.lower(),
                     "ratio": round(len(stored) / raw.nbytes, 4),
                     "encode_gbps": round(gb / enc, 2) if codec else None,
                     "decode_gbps": round(gb / dec, 2)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ucm bench codec", description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="bf16,fp16,fp32")
    parser.add_argument("--codecs", default="none,zstd,shuffle_zstd,int8,int4")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--channels", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args(argv)
    rows = run(args.dtypes.split(","), args.codecs.split(","), layers=args.layers,
               tokens=args.tokens, channels=args.channels, repeat=args.repeat)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"{'dtype':6} {'codec':13} {'stored as':13} {'ratio':>6} {'encode GB/s':>12} "
          f"{'decode GB/s':>12}")
    for r in rows:
        enc = "-" if r["encode_gbps"] is None else f"{r['encode_gbps']:.2f}"
        print(f"{r['dtype']:6} {r['codec']:13} {r.get('stored_as', '-'):13} {r['ratio']:6.3f} "
              f"{enc:>12} {r['decode_gbps']:12.2f}")
    return 0
