"""UCMStorage without SGLang: a host pool of torch tensors laid out as SGLang's layer_first MHA
pool, driven through the backend's methods the way SGLang's cache controller drives them."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ucm.engine.keys import make_namespace, model_identity  # noqa: E402
from ucm.errors import ConfigError  # noqa: E402
from ucm.sglang_hook import UCMStorageBase, page_namespace  # noqa: E402
from ucm.sglang_hook.backend import storage_key  # noqa: E402

PAGE = 4


class LayerFirstPool:
    """SGLang's MHA host pool, layer_first: kv_buffer[2, layers, tokens, heads, dim]."""

    layout = "layer_first"
    page_size = PAGE

    def __init__(self, tokens: int = 64, layers: int = 3, heads: int = 2, dim: int = 4,
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn((2, layers, tokens, heads, dim), generator=g)
        self.dtype = self.kv_buffer.dtype
        self.layers = self.layer_num = layers
        self.head_num, self.head_dim = heads, dim

    def token_bytes(self) -> int:
        return self.kv_buffer[0, 0, 0].nbytes

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        ptrs, sizes = [], []
        idx = indices.tolist()
        for first in idx[::PAGE]:
            for layer in range(self.layers):
                for kv in (0, 1):  # SGLang's order: K then V of each layer
                    ptrs.append(self.kv_buffer[kv, layer, first].data_ptr())
                    sizes.append(PAGE * self.token_bytes())
        return ptrs, sizes

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros_like(self.page(0))

    def page(self, first: int) -> torch.Tensor:
        return self.kv_buffer[:, :, first:first + PAGE].flatten()


def storage_config(ucm: Any, **extra: Any) -> SimpleNamespace:
    return SimpleNamespace(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, is_mla_model=False,
                           model_name="unused", extra_config={"ucm": ucm, "model_id": "m",
                                                              **extra})


def backend(ucm: Any, pool: LayerFirstPool, **extra: Any) -> UCMStorageBase:
    b = UCMStorageBase(storage_config(ucm, **extra), {})
    b.register_mem_pool_host(pool)
    return b


def indices(*pages: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


MEMORY = {"tiers": [{"driver": "memory", "capacity": "64MiB"}]}
KEYS = [f"{i:064x}" for i in range(1, 6)]


def test_zero_copy_pages_round_trip_and_read_as_sglangs_flat_pages(tmp_path):
    src, dst = LayerFirstPool(seed=1), LayerFirstPool(seed=2)
    ucm = {"tiers": [{"driver": "posix", "path": str(tmp_path)}]}
    writer = backend(ucm, src)
    assert writer.batch_set_v1(KEYS[:3], indices(0, 1, 2)) == [True] * 3
    reader = backend(ucm, dst)
    assert reader.batch_exists(KEYS) == 3
    assert reader.batch_get_v1(KEYS[:3], indices(5, 7, 9)) == [True] * 3
    for s, d in ((0, 5), (1, 7), (2, 9)):
        assert torch.equal(dst.page(d * PAGE), src.page(s * PAGE))
    # The plain interface reads the same bytes as SGLang's flat page (K of all layers, then V).
    [flat] = reader.batch_get(KEYS[1:2], [dst.get_dummy_flat_data_page()])
    assert torch.equal(flat, src.page(PAGE))
    assert reader.batch_set(KEYS[3:4], [src.page(3 * PAGE)])
    assert reader.batch_get_v1(KEYS[3:4], indices(11)) == [True]
    assert torch.equal(dst.page(11 * PAGE), src.page(3 * PAGE))
    stats = reader.statistics()
    assert stats["loaded_pages"] == 5 and stats["lookup_hit_pages"] == 3
    writer.close()
    reader.close()


def test_failures_are_misses_counted_never_exceptions():
    pool = LayerFirstPool()
    failing = {"tiers": [{"driver": "faulty", "inner": {"driver": "memory"},
                          "error_rate": 1.0}]}
    b = backend(failing, pool, timeout=2)
    assert b.batch_set_v1(KEYS[:2], indices(0, 1)) == [False, False]
    assert b.batch_exists(KEYS[:2]) == 0
    assert b.batch_get_v1(KEYS[:2], indices(0, 1)) == [False, False]
    assert b.batch_get(KEYS[:1], [pool.get_dummy_flat_data_page()]) == [None]
    assert not b.batch_set(KEYS[:1], [pool.page(0)])
    assert not b.exists(KEYS[0])
    stats = b.statistics()
    assert stats["store_failed_pages"] + stats.get("stored_pages", 0) == 3
    assert stats.get("stored_pages", 0) == 0
    b.close()
    good = backend(MEMORY, pool)

    def broken(indices: Any) -> Any:
        raise RuntimeError("no such pages")

    # A host pool that fails, or keys SGLang would never send: misses as well.
    pool.get_page_buffer_meta = broken  # type: ignore[method-assign]
    assert good.batch_get_v1(KEYS[:2], indices(0, 1)) == [False, False]
    assert good.batch_set_v1(KEYS[:2], indices(0, 1)) == [False, False]
    assert good.batch_exists(["not hex"]) == 0
    stats = good.statistics()
    assert stats["load_failed_pages"] == stats["store_failed_pages"] == 2
    assert stats["lookup_failed_pages"] == 1
    good.close()


def test_a_hanging_tier_answers_within_the_timeout():
    pool = LayerFirstPool()
    hanging = {"tiers": [{"driver": "faulty", "inner": {"driver": "memory"}, "hang": True}],
               "deadline": 0.5}
    b = backend(hanging, pool, timeout=0.5)
    assert b.batch_exists(KEYS) == 0
    assert b.batch_get_v1(KEYS[:1], indices(0)) == [False]
    assert b.batch_set_v1(KEYS[:1], indices(0)) == [False]
    stats = b.statistics()
    assert stats["lookup_failures"] == stats["load_failures"] == stats["store_failures"] == 1
    b.close()


@pytest.mark.parametrize(("extra", "message"), [
    ({"ucm": {"tiers": [{"driver": "no-such-driver"}]}}, "no-such-driver"),
    ({"ucm": {"tiers": []}}, "tiers"),
    ({"ucm": {"tiers": [{"driver": "memory"}]}, "timeout": 0}, "timeout"),
    ({"ucm": {"tiers": [{"driver": "memory"}]}, "tiemout": 3},
     r"^hicache_storage_backend_extra_config\.tiemout: unknown key$"),
    ({}, r"^hicache_storage_backend_extra_config\.ucm: Field required$"),
    ({"ucm": {"tiers": [{"driver": "memory"}]}, "timeout": True},
     r"^hicache_storage_backend_extra_config\.timeout: Input should be a valid number$"),
    ({"ucm": {"tiers": [{"driver": "memory", "compression": {"bits": 8}}]}},
     r"^hicache_storage_backend_extra_config\.ucm\.tiers\.0\.compression: not a key; use "
     r"the tier's `codec`"),
    ({"ucm": "/no/such/ucm.yaml"},
     r"^hicache_storage_backend_extra_config\.ucm: cannot read config file /no/such/ucm\.yaml"),
    ({"ucm": {"tiers": [{"driver": "memory"}]}, "model_id": ""}, "model_id"),
], ids=["unknown-driver", "no-tiers", "bad-timeout", "unknown-key", "no-ucm", "bool-timeout",
        "retired-key", "missing-file", "empty-model-id"])
def test_a_bad_config_is_a_clear_error_at_construction(extra, message):
    config = SimpleNamespace(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, is_mla_model=False,
                             model_name="m", extra_config=extra)
    with pytest.raises(ConfigError, match=message):
        UCMStorageBase(config, {})


def test_the_module_imports_without_sglang_or_torch():
    code = ("import sys, ucm.sglang_hook as h\n"
            "assert 'torch' not in sys.modules and 'sglang' not in sys.modules\n"
            "print(h.UCMStorage.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() in ("UCMStorageBase", "UCMStorage")


def test_keys_are_per_namespace_and_per_rank():
    seed_a, seed_b = b"a" * 16, b"b" * 16
    assert storage_key(seed_a, KEYS[0], rank=0, size=1) != storage_key(seed_b, KEYS[0], rank=0,
                                                                      size=1)
    shards = {storage_key(seed_a, KEYS[0], rank=r, size=2) for r in range(2)}
    assert len(shards) == 2


def test_vllm_and_sglang_pages_of_one_model_never_share_a_namespace():
    """vLLM on CPU stores a block as its per-layer pieces in the layout its attention ISA
    picks; SGLang's layer_first host pool orders K of every layer, then V. The bytes differ, so
    the namespaces must: they differ in the layout field, whatever else is equal."""
    from ucm.vllm_hook.settings import kv_layout_tag

    model_id = model_identity({"model_type": "llama", "hidden_size": 128})
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.float32, get_head_size=lambda: 32),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto", kv_cache_layout=None))
    vllm_ns = make_namespace(model_type="llama", model_id=model_id, dtype="torch.float32",
                             block_size=16, kv_layout=kv_layout_tag(vllm_config))
    for layout in ("layer_first", "page_first", "page_first_direct"):
        sglang_ns = page_namespace(model_id=model_id, model_type="llama", dtype="torch.float32",
                                   page_size=16, layout=layout, is_mla=False)
        assert sglang_ns != vllm_ns
        same = [a == b for a, b in zip(sglang_ns.split("-"), vllm_ns.split("-"), strict=True)]
        assert same == [True, True, True, True, False, True]  # only the layout differs


def test_a_page_is_stored_from_where_it_lies_in_one_span_or_in_pieces():
    from ucm.block import Scatter
    from ucm.sglang_hook.backend import _one_span

    data = torch.arange(16, dtype=torch.uint8)
    base = data.data_ptr()
    view = _one_span([(base, 4), (base + 4, 12)])
    assert isinstance(view, memoryview) and view.nbytes == 16
    data[0] = 99  # the same memory: no copy was made
    assert view[0] == 99
    pieces = _one_span([(base + 8, 4), (base + 12, 4), (base, 4)])
    assert isinstance(pieces, Scatter)
    assert [p.nbytes for p in pieces.parts] == [8, 4]  # pieces end to end: one span
    data[1] = 77  # still the pool's memory: nothing copied
    assert list(pieces.gather()) == [8, 9, 10, 11, 12, 13, 14, 15, 99, 77, 2, 3]


class PageFirstPool(LayerFirstPool):
    """SGLang's MHA host pool, page_first: kv_buffer[2, tokens, layers, heads, dim], a page's
    K of every layer in one piece and its V in another (two separate spans)."""

    layout = "page_first"

    def __init__(self, tokens: int = 64, layers: int = 3, heads: int = 2, dim: int = 4,
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn((2, tokens, layers, heads, dim), generator=g)
        self.dtype = self.kv_buffer.dtype
        self.layers = layers

    def token_bytes(self) -> int:
        return self.kv_buffer[0, 0].nbytes  # every layer's

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        ptrs, sizes = [], []
        for first in indices.tolist()[::PAGE]:
            for kv in (0, 1):
                ptrs.append(self.kv_buffer[kv, first].data_ptr())
                sizes.append(PAGE * self.token_bytes())
        return ptrs, sizes

    def page(self, first: int) -> torch.Tensor:
        return self.kv_buffer[:, first:first + PAGE].flatten()


@pytest.mark.parametrize("tier", ["posix", "memory"])
def test_mha_page_first_pages_round_trip_with_no_copy(tmp_path, tier):
    """K and V of a page lie in separate halves of the pool: the store writes from both
    pieces as they lie (no gather), and the page loads back byte-identical, also through the
    plain interface in SGLang's flat-page order."""
    src, dst = PageFirstPool(seed=3), PageFirstPool(seed=4)
    ucm = ({"tiers": [{"driver": "posix", "path": str(tmp_path)}]} if tier == "posix"
           else MEMORY)
    b = backend(ucm, src)
    assert b.batch_set_v1(KEYS[:3], indices(0, 2, 4)) == [True] * 3
    # memory is this process's: the same backend loads into other pages of its own pool
    reader = b if tier == "memory" else backend(ucm, dst)
    target = dst if tier == "posix" else src
    assert reader.batch_get_v1(KEYS[:3], indices(9, 11, 13)) == [True] * 3
    for s, d in ((0, 9), (2, 11), (4, 13)):
        assert torch.equal(target.page(d * PAGE), src.page(s * PAGE))
    [flat] = reader.batch_get(KEYS[1:2], [target.get_dummy_flat_data_page()])
    assert torch.equal(flat, src.page(2 * PAGE))
    stats = b.statistics()
    assert stats["stored_pages"] == 3 and stats["kernel"].get("store_gathers", 0) == 0
    b.close()
    if reader is not b:
        reader.close()


def _stored_headers(root) -> list:
    from ucm.block import PAYLOAD_OFFSET, decode_header

    return [decode_header(p.read_bytes()[:PAYLOAD_OFFSET]) for p in sorted(root.rglob("*"))
            if p.is_file() and p.stat().st_size > PAYLOAD_OFFSET]


def test_layer_first_pages_quantize_on_an_int8_tier(tmp_path):
    """The backend gives its kernel the layout of SGLang's layer_first MHA pages: an int8 tier
    quantizes them as K and V of each layer (its headers say so), and a fresh backend loads
    each page within half a quantization step, through either interface."""
    from ucm.block import Codec
    from ucm.codecs import KVLayout
    from ucm.codecs.layout import unpack

    src, dst = LayerFirstPool(seed=5, dim=32), LayerFirstPool(seed=6, dim=32)
    ucm = {"codec": "int8", "tiers": [{"driver": "posix", "path": str(tmp_path)}]}
    writer = backend(ucm, src)
    want = KVLayout("fp32", (("k", PAGE, 64),) * 3 + (("v", PAGE, 64),) * 3)
    assert writer.kv_layouts == [want]
    assert writer.batch_set_v1(KEYS[:3], indices(0, 1, 2)) == [True] * 3
    headers = _stored_headers(tmp_path)
    assert [h.codec for h in headers] == [Codec.INT8] * 3
    assert all(unpack(h.params, h.raw_len)[0] == want for h in headers)
    reader = backend(ucm, dst)
    assert reader.batch_get_v1(KEYS[:3], indices(3, 4, 5)) == [True] * 3
    for stored, loaded in ((0, 3), (1, 4), (2, 5)):
        x, y = src.page(stored * PAGE), dst.page(loaded * PAGE)
        bound = float(x.max() - x.min()) * (1 + 2 / 255) / 255 * 0.51
        assert float((x - y).abs().max()) <= bound and not torch.equal(x, y)
        plain = reader.get(KEYS[stored], torch.zeros_like(x))
        assert plain is not None and torch.equal(plain, y)
    writer.close()
    reader.close()


def test_pages_without_a_layout_stay_exact_on_a_quantizing_tier(tmp_path):
    """page_first pages (no known layout) on an int4 tier: stored losslessly, read back
    byte-identical."""
    from ucm.block import Codec

    src, dst = PageFirstPool(seed=7), PageFirstPool(seed=8)
    ucm = {"tiers": [{"driver": "posix", "path": str(tmp_path), "codec": "int4"}]}
    writer = backend(ucm, src)
    assert writer.kv_layouts == []
    assert writer.batch_set_v1(KEYS[:2], indices(0, 1)) == [True] * 2
    assert [h.codec for h in _stored_headers(tmp_path)] == [Codec.SHUFFLE_ZSTD] * 2
    reader = backend(ucm, dst)
    assert reader.batch_get_v1(KEYS[:2], indices(2, 3)) == [True] * 2
    assert torch.equal(dst.page(2 * PAGE), src.page(0)) and torch.equal(dst.page(3 * PAGE),
                                                                        src.page(PAGE))
    writer.close()
    reader.close()
