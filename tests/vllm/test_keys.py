"""Block keys, TP rank logic, options and block layout: no engine needed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ucm.vllm_hook.keys import (
    RequestChain,
    chain_digests,
    chain_seed,
    make_namespace,
    model_identity,
    rank_key,
)

_PRINT_KEYS = (
    "from ucm.vllm_hook.keys import chain_seed, chain_digests\n"
    "seed = chain_seed('ns', cache_salt='s')\n"
    "print(b''.join(chain_digests(seed, list(range(100)), 16, 6)).hex())\n"
)


def test_keys_equal_across_processes_whatever_the_hash_seed():
    outs = set()
    for hash_seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        outs.add(subprocess.check_output([sys.executable, "-c", _PRINT_KEYS], env=env))
    assert len(outs) == 1


def test_chain_depends_on_every_earlier_block_and_on_the_seed():
    seed = chain_seed("ns")
    a = chain_digests(seed, list(range(64)), 16, 4)
    b = chain_digests(seed, [999, *range(1, 64)], 16, 4)
    assert all(x != y for x, y in zip(a, b, strict=True))  # a change in block 0 moves all
    c = chain_digests(seed, list(range(48)) + [0] * 16, 16, 4)
    assert a[:3] == c[:3] and a[3] != c[3]
    for other in (chain_seed("ns2"), chain_seed("ns", cache_salt="x"),
                  chain_seed("ns", lora="adapter")):
        assert chain_digests(other, list(range(64)), 16, 4)[0] != a[0]


def test_request_chain_extends_incrementally():
    seed = chain_seed("ns")
    tokens = list(range(200))
    chain = RequestChain(seed, 32)
    assert chain.upto(tokens, 2) == chain_digests(seed, tokens, 32, 2)
    assert chain.upto(tokens, 6) == chain_digests(seed, tokens, 32, 6)
    with pytest.raises(ValueError, match="need"):
        chain_digests(seed, tokens, 32, 7)


def test_rank_keys_are_distinct_per_rank_and_size():
    d = chain_seed("ns")
    assert rank_key(d, 0, 1) == d
    keys = {rank_key(d, r, s) for s in (2, 4) for r in range(s)}
    assert len(keys) == 6 and d not in keys


def test_model_identity_ignores_the_path():
    cfg = {"model_type": "llama", "hidden_size": 128, "_name_or_path": "/tmp/a"}
    assert model_identity(cfg) == model_identity({**cfg, "_name_or_path": "/other/b"})
    assert model_identity(cfg) != model_identity({**cfg, "hidden_size": 256})
    ns = make_namespace(model_type="llama", model_id="abc", dtype="torch.bfloat16",
                        block_size=32, kv_layout="cpu.amx")
    assert ns == "llama-abc-bfloat16-bs32-cpu.amx-k1"


def test_scheduler_config_keeps_only_tiers_it_can_see():
    from ucm.config import load_config
    from ucm.vllm_hook.settings import scheduler_config

    cfg = load_config({"tiers": [{"driver": "memory"}, {"driver": "posix", "path": "/tmp/x"}]})
    sched = scheduler_config(cfg)
    assert [t.driver for t in sched.tiers] == ["posix"] and sched.promote is False
    assert sched.tiers[0].options.map_bytes == 0 and cfg.tiers[1].options.map_bytes == "auto"
    only_mem = load_config({"tiers": [{"driver": "memory"}]})
    assert [t.driver for t in scheduler_config(only_mem).tiers] == ["memory"]
    shared = load_config({"tiers": [{"driver": "memory", "shared": True}]})
    assert scheduler_config(shared).tiers == shared.tiers


def test_layout_round_trips_blocks_through_staging():
    torch = pytest.importorskip("torch")
    from ucm.vllm_hook.layout import BlockLayout, runs

    assert list(runs([3, 4, 5, 9, 2, 3])) == [(3, 0, 3), (9, 3, 1), (2, 4, 2)]
    caches = {f"l{i}": torch.randn(10, 2, 4, 8, dtype=torch.bfloat16) for i in range(3)}
    layout = BlockLayout(caches)
    assert layout.block_bytes == 3 * 2 * 4 * 8 * 2
    ids = [7, 2, 3, 5]
    staging = layout.new_staging(len(ids))
    layout.copy_out(ids, staging)
    # layer-major: the first third of a row is layer 0's bytes of that block
    first = staging[0, : layout.block_bytes // 3].view(torch.bfloat16).reshape(2, 4, 8)
    assert torch.equal(first, caches["l0"][7])
    original = {k: v.clone() for k, v in caches.items()}
    for v in caches.values():
        v.zero_()
    for name in caches:  # layer by layer, as the layerwise mode does
        layout.copy_in(ids, staging, layer=name)
    for name, v in caches.items():
        assert torch.equal(v[ids], original[name][ids])
        assert not v[[0, 1, 4, 6, 8, 9]].any()


def test_layout_scatter_is_the_staging_row_in_place():
    """A direct load's target (one piece per layer segment of one block) takes exactly the
    bytes a staging row holds, and writes nothing outside that block."""
    torch = pytest.importorskip("torch")
    from ucm.block import copy_bytes
    from ucm.vllm_hook.layout import BlockLayout

    caches = {f"l{i}": torch.randn(2, 5, 4, 2, 8) for i in range(2)}  # K/V halves
    layout = BlockLayout(caches, num_blocks=5)
    assert layout.scatters
    staging = layout.new_staging(1)
    layout.copy_out([3], staging)
    target = layout.scatter(3)
    assert target.nbytes == layout.block_bytes and len(target.parts) == 4
    original = {k: v.clone() for k, v in caches.items()}
    for v in caches.values():
        v.zero_()
    copy_bytes(target, staging[0].numpy())
    for k, v in caches.items():
        assert torch.equal(v[:, 3], original[k][:, 3])
        assert not v[:, [0, 1, 2, 4]].any()


def test_layout_scatters_cover_every_block_of_a_padded_cache():
    """Scatters slice one flat view per segment: right for the first and last block, for a
    cache whose blocks are further apart than their bytes, and for one layer alone."""
    torch = pytest.importorskip("torch")
    from ucm.vllm_hook.layout import BlockLayout

    base = torch.randn(6, 24)
    padded = base[:, :16]  # 6 blocks of 16 floats, 24 apart
    caches = {"l0": padded, "l1": torch.randn(2, 6, 4)}
    layout = BlockLayout(caches, num_blocks=6)
    for block in (0, 3, 5):
        got = layout.scatter(block).gather()
        want = b"".join(bytes(t.contiguous().view(torch.uint8).numpy())
                        for t in (padded[block], caches["l1"][0, block], caches["l1"][1, block]))
        assert bytes(got) == want
        layer = layout.scatter_layer(block, "l1")
        assert len(layer.parts) == 2 and bytes(layer.gather()) == want[64:]
    before = base.clone()
    layout.scatter(5).parts[0][:] = bytes(64)  # writes land in the cache, inside block 5
    assert not padded[5].any()
    before[5, :16] = 0
    assert torch.equal(base, before)  # nothing else, padding included
    with pytest.raises(IndexError, match="outside the cache's 6 blocks"):
        layout.scatter(6)


def test_layout_splits_k_and_v_halves_of_cuda_style_caches():
    torch = pytest.importorskip("torch")
    from ucm.vllm_hook.layout import BlockLayout

    caches = {"l0": torch.randn(2, 6, 4, 2, 8), "l1": torch.randn(2, 6, 4, 2, 8)}
    layout = BlockLayout(caches, num_blocks=6)
    assert len(layout.segments) == 4 and layout.block_bytes == 4 * 4 * 2 * 8 * 4
    staging = layout.new_staging(2)
    layout.copy_out([1, 4], staging)
    clone = {k: v.clone() for k, v in caches.items()}
    for v in caches.values():
        v.zero_()
    layout.copy_in([1, 4], staging)
    for k, v in caches.items():
        assert torch.equal(v[:, [1, 4]], clone[k][:, [1, 4]])
