"""Compression as configuration (a codec per tier, one top-level default), the KV layouts a
kernel gives its quantizing tiers, and mixed codecs across tiers through the kernel: every
tier's store encodes with its own codec, promotion and propagation re-encode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ucm.block import PAYLOAD_OFFSET, Codec, decode_header
from ucm.codecs import KVLayout, KVLayouts
from ucm.codecs.layout import Order, unpack
from ucm.codecs.quant import from_f32, to_f32
from ucm.config import load_config
from ucm.errors import ConfigError
from ucm.kernel import Kernel, KernelCore, Load, Store

LAYOUT = KVLayout("bf16", (("k", 16, 64), ("v", 16, 64)) * 4)


@pytest.fixture
def layouts():
    """What the engine hook gives its kernel: the layouts of the namespace's blocks."""
    return KVLayouts([LAYOUT])


def kv_blocks(n: int) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(1)
    data = []
    for _ in range(n):
        raw = np.empty(LAYOUT.raw_bytes, np.uint8)
        from_f32(rng.standard_normal(LAYOUT.raw_bytes // 2).astype(np.float32), "bf16", raw)
        data.append(raw.tobytes())
    return [bytes([i]) * 16 for i in range(n)], data


def stored_codecs(root: Path) -> list[Codec]:
    files = [p for p in root.rglob("*") if p.is_file() and p.stat().st_size > PAYLOAD_OFFSET]
    return [decode_header(p.read_bytes()[:PAYLOAD_OFFSET]).codec for p in files]


def memory_codecs(core: KernelCore) -> list[Codec]:
    return [r.header.codec for r in core.tiers[0].driver.backend.records.values()]


def close_to(loaded: bytes, original: bytes, bits: int) -> bool:
    x = to_f32(np.frombuffer(original, np.uint8), "bf16")
    y = to_f32(np.frombuffer(loaded, np.uint8), "bf16")
    return bool(np.abs(x - y).max() <= (x.max() - x.min()) / ((1 << bits) - 1))


async def test_quantized_lower_tier_under_an_uncompressed_memory_tier(tmp_path, layouts):
    config = load_config({
        "codec": "int8",
        "tiers": [{"driver": "memory", "codec": "none"},
                  {"driver": "posix", "path": str(tmp_path / "blocks")}],
    })
    assert [t.codec for t in config.tiers] == ["none", "int8"]
    keys, data = kv_blocks(3)
    async with KernelCore.open(config, layouts=layouts) as core:
        assert (await core.run(Store(keys, buffers=data))).ok
        await core.wait_background_idle()
        assert stored_codecs(tmp_path / "blocks") == [Codec.INT8] * 3
        assert memory_codecs(core) == [Codec.NONE] * 3
        memory = core.tiers[0]
        for key in keys:
            memory.discard(key)
        await memory.driver.delete(keys)
        out = [bytearray(len(d)) for d in data]
        result = await core.run(Load(keys, buffers=out))
        assert result.tiers == ("posix",) * 3
        assert all(close_to(o, d, 8) and bytes(o) != d for o, d in zip(out, data, strict=True))
        await core.wait_background_idle()  # promoted: stored again, with memory's codec
        assert memory_codecs(core) == [Codec.NONE] * 3
        again = [bytearray(len(d)) for d in data]
        assert (await core.run(Load(keys, buffers=again))).tiers == ("memory",) * 3
        assert again == out


async def test_quantized_memory_over_a_lossless_disk(tmp_path, layouts):
    config = load_config({
        "tiers": [{"driver": "memory", "codec": "int4"},
                  {"driver": "posix", "path": str(tmp_path / "blocks"),
                   "codec": "shuffle_zstd"}],
        "durability": "all",
    })
    keys, data = kv_blocks(2)
    async with KernelCore.open(config, layouts=layouts) as core:
        assert (await core.run(Store(keys, buffers=data))).ok
        assert memory_codecs(core) == [Codec.INT4] * 2
        assert stored_codecs(tmp_path / "blocks") == [Codec.SHUFFLE_ZSTD] * 2
        out = [bytearray(len(d)) for d in data]
        assert (await core.run(Load(keys, buffers=out))).tiers == ("memory",) * 2
        assert all(close_to(o, d, 4) for o, d in zip(out, data, strict=True))
        memory = core.tiers[0]
        for key in keys:
            memory.discard(key)
        await memory.driver.delete(keys)
        exact = [bytearray(len(d)) for d in data]
        assert (await core.run(Load(keys, buffers=exact))).tiers == ("posix",) * 2
        assert [bytes(b) for b in exact] == data


async def test_opaque_blocks_on_a_quantizing_tier_stay_exact(tmp_path):
    config = load_config({"tiers": [{"driver": "memory", "codec": "int4"}]})
    data = [bytes(range(256)) * 40]
    async with KernelCore.open(config) as core:
        await core.run(Store([b"k" * 16], buffers=data))
        assert memory_codecs(core) == [Codec.SHUFFLE_ZSTD]
        out = [bytearray(len(data[0]))]
        await core.run(Load([b"k" * 16], buffers=out))
        assert bytes(out[0]) == data[0]


@pytest.mark.parametrize(("config", "message"), [
    ({"codec": "int2"}, "codec: Input should be 'none', 'zstd', 'shuffle_zstd', 'int8' or "
     "'int4'"),
    ({"tiers": [{"driver": "memory", "codec": "lz4"}]}, "tiers.0.codec: Input should be"),
    # the keys of the earlier schema say what replaces them
    ({"ucm_compression": {"method": "quantize", "bits": 8}},
     "ucm_compression: not a key; use the top-level `codec`, every tier's default"),
    ({"tiers": [{"driver": "memory", "compression": {"method": "lossless"}}]},
     "tiers.0.compression: not a key; use the tier's `codec`"),
    ({"tiers": [{"driver": "memory"}, {"driver": "memory", "name": "b",
                                       "compression": {"compression_ratio": 0.5}}]},
     "tiers.1.compression: not a key; use the tier's `codec`: none, zstd, shuffle_zstd, int8 "
     "or int4 (compression's method lossless is shuffle_zstd; quantize with bits 8 or 4 is "
     "int8 or int4)"),
    ({"tiers": [{"driver": "memory", "codec": "int8", "compression": {"bits": 8}}]},
     "tiers.0.compression: not a key; use the tier's `codec`"),
    ({"compression_ratio": 0.5}, "compression_ratio: unknown key"),
    ({"codecs": "int8"}, "codecs: unknown key"),
])
def test_config_errors_name_the_key(config, message):
    with pytest.raises(ConfigError) as err:
        load_config({"tiers": [{"driver": "memory"}], **config})
    assert str(err.value).startswith(message), str(err.value)


def test_codec_config_forms(tmp_path):
    config = load_config({
        "codec": "int4",
        "tiers": [{"driver": "memory"},
                  {"driver": "memory", "name": "b", "codec": "none"},
                  {"driver": "memory", "name": "c", "codec": "zstd"}],
    })
    assert [t.codec for t in config.tiers] == ["int4", "none", "zstd"]
    assert load_config(config.model_dump()) == config  # a dump loads back the same
    assert load_config({"tiers": [{"driver": "memory"}]}).tiers[0].codec == "none"
    path = tmp_path / "ucm.yaml"
    path.write_text("codec: shuffle_zstd\ntiers:\n  - driver: memory\n    codec: int8\n"
                    "  - driver: memory\n    name: b\n")
    assert [t.codec for t in load_config(path).tiers] == ["int8", "shuffle_zstd"]


async def test_a_tier_attached_without_a_codec_takes_the_default(layouts):
    config = load_config({"codec": "int8", "tiers": [{"driver": "memory"}]})
    keys, data = kv_blocks(1)
    async with KernelCore.open(config, layouts=layouts) as core:
        await core.attach({"driver": "memory", "name": "late"})
        late = core.tiers[-1]
        assert late.config.codec is None and late.driver.backend.codec is Codec.INT8
        await late.driver.store(keys, [memoryview(d) for d in data])
        assert [r.header.codec for r in late.driver.backend.records.values()] == [Codec.INT8]


def test_the_layout_of_vllm_caches():
    torch = pytest.importorskip("torch")
    from ucm.codecs.vllm import cache_layouts
    from ucm.vllm_hook.layout import BlockLayout

    halves = {f"l{i}": torch.zeros(2, 10, 16, 2, 32, dtype=torch.bfloat16) for i in range(3)}
    found = cache_layouts(halves, 10, BlockLayout(halves, 10).block_bytes, interpretable=True)
    assert found == [KVLayout("bf16", (("k", 16, 64), ("v", 16, 64)) * 3),
                     KVLayout("bf16", (("k", 16, 64), ("v", 16, 64)))]
    bound = KVLayouts(found)  # the block's and one layer's: two sizes, no conflict
    assert bound.for_size(3 * 2 * 16 * 64 * 2) == found[0] and found[0].dtype == "bf16"
    assert bound.for_size(2 * 16 * 64 * 2) == found[1]
    joint = {"l": torch.zeros(10, 2, 16, 2, 32, dtype=torch.float16)}
    assert cache_layouts(joint, 10, 2 * 16 * 64 * 2, interpretable=True) == [
        KVLayout("fp16", (("k", 16, 64), ("v", 16, 64)))]
    # CPU caches of an unknown ISA (or none named): no layout
    assert cache_layouts(halves, 10, 3 * 2 * 16 * 64 * 2, interpretable=False) == []
    cpu = {"l": torch.zeros(10, 2, 32, 128, dtype=torch.bfloat16)}
    assert cache_layouts(cpu, 10, 2 * 32 * 128 * 2, interpretable=False, cpu_isa="neon") == []


def test_an_mla_cache_is_stored_losslessly_by_name(caplog):
    torch = pytest.importorskip("torch")
    from ucm.codecs.vllm import cache_layouts

    latent = {f"l{i}": torch.zeros(10, 32, 576, dtype=torch.bfloat16) for i in range(2)}
    with caplog.at_level("INFO", logger="ucm.codecs"):
        for interpretable, isa in ((True, None), (False, "amx")):
            assert cache_layouts(latent, 10, 2 * 32 * 576 * 2, interpretable=interpretable,
                                 cpu_isa=isa) == []
    assert caplog.text.count("an MLA cache") == 2


def test_posix_compressed_loads_through_the_reused_stage(tmp_path):
    """A compressed posix tier reads header and payload into one reused stage per thread:
    blocks of two sizes alternate in one thread, into buffers and Scatters, each as the
    codec's round trip gives it; a truncated, an extended and a planted oversized file are
    CORRUPT, and a good block loads after each of them."""
    from ucm.block import Scatter, decode_payload_into, encode_header, encode_payload
    from ucm.drivers._blockfiles import BlockFiles, FileLayout
    from ucm.drivers.kit import LoadState

    small = KVLayout("bf16", (("k", 16, 64), ("v", 16, 64)))
    layouts = KVLayouts([LAYOUT, small])
    files = BlockFiles.open(FileLayout((str(tmp_path / "t"),), 2), namespace="ns",
                            codec=Codec.INT4, fsync=False, direct=False, layouts=layouts)
    _, data = kv_blocks(2)
    blocks = [data[0], data[1][:small.raw_bytes]]
    keys = [b"big", b"small"]
    files.store(keys, [memoryview(b) for b in blocks])
    assert stored_codecs(tmp_path / "t") == [Codec.INT4, Codec.INT4]
    want = []
    for b in blocks:
        payload = encode_payload(Codec.INT4, memoryview(b), layouts)
        out = bytearray(len(b))
        decode_payload_into(decode_header(encode_header(b"k", "n", Codec.INT4, payload,
                                                        len(b))), bytes(payload),
                            memoryview(out))
        want.append(bytes(out))
    for _ in range(2):
        for key, b, w in zip(keys, blocks, want, strict=True):
            out = bytearray(len(b))
            assert files.load_one(key, memoryview(out)) is LoadState.OK and out == w
            pieces = [bytearray(len(b) // 3), bytearray(len(b) - len(b) // 3)]
            target = Scatter([memoryview(p) for p in pieces])
            assert files.load_one(key, target) is LoadState.OK
            assert b"".join(pieces) == w
    path = Path(files.path_for(b"big"))
    good = path.read_bytes()
    for bad in (good[:-1], good + b"\0", good + bytes(8 * len(blocks[0]))):
        path.write_bytes(bad)
        assert files.load_one(b"big", memoryview(bytearray(len(blocks[0])))) is (
            LoadState.CORRUPT)
        out = bytearray(len(blocks[1]))
        assert files.load_one(b"small", memoryview(out)) is LoadState.OK and out == want[1]


# the same byte size as LAYOUT, another element order: what another engine's blocks may be
AMX = KVLayout("bf16", (("k", 16, 64, Order(False, 16, 2)),
                        ("v", 16, 64, Order(True, 2, 16))) * 4)


def stored_layouts(root: Path) -> list[KVLayout]:
    found = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.stat().st_size > PAYLOAD_OFFSET:
            header = decode_header(p.read_bytes()[:PAYLOAD_OFFSET])
            found.append(unpack(header.params, header.raw_len)[0])
    return found


async def test_two_namespaces_quantize_blocks_of_one_size_each_with_its_own_layout(tmp_path):
    """Two kernels of one process, each given a layout of the same block size for its own
    namespace: each tier quantizes with its kernel's layout (its headers say which), and each
    loads its blocks back within the codec's bound."""
    assert AMX.raw_bytes == LAYOUT.raw_bytes and AMX != LAYOUT
    keys, data = kv_blocks(2)
    configs = [load_config({"namespace": ns, "tiers": [
        {"driver": "posix", "path": str(tmp_path / ns), "codec": "int8"}]})
        for ns in ("plain", "amx")]
    async with (KernelCore.open(configs[0], layouts=KVLayouts([LAYOUT])) as plain,
                KernelCore.open(configs[1], layouts=KVLayouts([AMX])) as amx):
        for core in (plain, amx):
            assert (await core.run(Store(keys, buffers=data))).ok
        assert stored_layouts(tmp_path / "plain") == [LAYOUT, LAYOUT]
        assert stored_layouts(tmp_path / "amx") == [AMX, AMX]
        for core in (plain, amx):
            out = [bytearray(len(d)) for d in data]
            assert (await core.run(Load(keys, buffers=out))).ok
            assert all(close_to(o, d, 8) for o, d in zip(out, data, strict=True))


def test_two_layouts_of_one_size_for_one_namespace_are_an_error_naming_both():
    config = load_config({"namespace": "model-x", "tiers": [{"driver": "memory"}]})
    with pytest.raises(ConfigError, match="model-x") as err:
        Kernel(config, layouts=[LAYOUT, AMX])
    text = str(err.value)
    assert f"{LAYOUT.raw_bytes}-byte blocks" in text
    assert "bf16 [k 16x64, v 16x64] x 4" in text  # the first
    assert "bf16 [k 16x64 t-major 16x2, v 16x64 c-major 2x16] x 4" in text  # the second
    with pytest.raises(ConfigError, match="two KV layouts"):
        KVLayouts([LAYOUT]).with_layouts([AMX])
    same = KVLayouts([LAYOUT, LAYOUT, KVLayout("bf16", (("k", 16, 64), ("v", 16, 64)))])
    assert len(same) == 2 and same.for_size(LAYOUT.raw_bytes) == LAYOUT
    assert Kernel(config, layouts=[]).layouts is None


async def test_the_layouts_reach_the_quantizing_tiers_only(tmp_path, layouts):
    """Tiers opened at start and attached later get the kernel's layouts where their codec
    quantizes (a faulty wrapper hands them to the tier it wraps); others store as given."""
    config = load_config({"tiers": [
        {"driver": "memory", "codec": "none"},
        {"driver": "faulty", "name": "wrapped", "codec": "int4",
         "inner": {"driver": "memory"}}]})
    keys, data = kv_blocks(1)
    async with KernelCore.open(config, layouts=layouts) as core:
        plain, wrapped = (t.driver for t in core.tiers)
        assert plain.backend.layouts is None and wrapped.inner.backend.layouts == layouts
        await core.attach({"driver": "memory", "name": "late", "codec": "int8"})
        late = core.tiers[-1].driver
        assert late.backend.layouts == layouts
        await late.store(keys, [memoryview(d) for d in data])
        await wrapped.inner.store(keys, [memoryview(d) for d in data])
        assert [r.header.codec for r in late.backend.records.values()] == [Codec.INT8]
        assert [r.header.codec for r in wrapped.inner.backend.records.values()] == [Codec.INT4]
