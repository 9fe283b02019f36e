"""The connector's view of vLLM's KV cache groups with its hybrid KV cache manager, without an
engine: the kinds it stores and refuses, the namespace, the hit every group can serve, and
which blocks a sliding-window group stores."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from ucm.config import load_config
from ucm.errors import ConfigError
from ucm.vllm_hook.keys import group_key
from ucm.vllm_hook.scheduler import SchedulerSide, _window_blocks
from ucm.vllm_hook.settings import HookSettings, KVGroup, groups_tag, kv_groups


class AttentionSpec:  # vLLM's spec classes, as the connector reads them: by name
    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size


class FullAttentionSpec(AttentionSpec):
    pass


class SlidingWindowSpec(AttentionSpec):
    def __init__(self, window: int, block_size: int = 16) -> None:
        self.block_size, self.sliding_window = block_size, window


class SinkFullAttentionSpec(FullAttentionSpec):
    pass


class MLAAttentionSpec(FullAttentionSpec):
    pass


class MambaSpec:
    block_size = 16


def _config(*specs) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=s, layer_names=[f"layer.{i}"]) for i, s in enumerate(specs)])


def test_groups_name_their_kind_and_window():
    groups = kv_groups(_config(SlidingWindowSpec(64), SinkFullAttentionSpec(),
                               MLAAttentionSpec()))
    assert [(g.kind, g.window, g.window_blocks) for g in groups] == [
        ("sliding", 64, 4), ("full.sinks", None, None), ("mla", None, None)]
    assert kv_groups(_config(FullAttentionSpec())) == ()  # one group: the dense path
    assert kv_groups(None) == ()


def test_mamba_and_unknown_kinds_are_refused_by_name():
    with pytest.raises(ConfigError, match="group 1 is MambaSpec: its Mamba / linear-attention"):
        kv_groups(_config(FullAttentionSpec(), MambaSpec()))
    with pytest.raises(ConfigError, match="MambaSpec"):  # even alone
        kv_groups(_config(MambaSpec()))
    with pytest.raises(ConfigError, match="group 1 is object"):
        kv_groups(_config(FullAttentionSpec(), object()))


def test_the_namespace_tag_and_keys_tell_layouts_apart():
    a = kv_groups(_config(SlidingWindowSpec(64), FullAttentionSpec()))
    b = kv_groups(_config(SlidingWindowSpec(128), FullAttentionSpec()))
    assert groups_tag(a).startswith("hma.1sliding64x1.1fullx1.")
    assert groups_tag(a) != groups_tag(b)
    assert len({group_key(b"k", 0, "sliding"), group_key(b"k", 1, "sliding"),
                group_key(b"k", 0, "full")}) == 3


def _side(groups: tuple[KVGroup, ...], tp: int = 1) -> SchedulerSide:
    cfg = load_config({"tiers": [{"driver": "memory"}], "namespace": "ns"})
    return SchedulerSide(HookSettings(ucm_config=cfg, namespace="ns", block_size=16,
                                      tp_size=tp, groups=groups))


def test_a_hit_is_the_longest_prefix_every_group_serves():
    groups = (KVGroup(0, "full", ("a",), 16), KVGroup(1, "sliding", ("b",), 16, 33))
    side = _side(groups)  # the sliding group needs 2 blocks (32 tokens) before the hit
    full = [True] * 10
    window_at_8 = [False] * 6 + [True, True] + [False] * 2
    assert side._hybrid_hit(full + window_at_8, 10) == 8
    assert side._hybrid_hit([True] * 5 + [False] * 5 + window_at_8, 10) == 0
    assert side._hybrid_hit(full + [True] * 10, 10) == 10
    one_short = [False] * 7 + [True] + [False] * 2
    assert side._hybrid_hit(full + one_short, 10) == 0
    # with TP a block is held only where every rank holds it
    tp = _side(groups, tp=2)
    rank1 = full + [False] * 6 + [True, False, False, False]
    assert tp._hybrid_hit(full + window_at_8 + rank1, 10) == 0


def test_a_sliding_group_stores_the_window_before_the_same_prompts_hit():
    # 400 tokens in blocks of 32: the same prompt hits at 12 blocks (399 tokens)
    assert list(_window_blocks(400, 32, 2, 0, 12)) == [10, 11]
    assert list(_window_blocks(400, 32, 2, 0, 11)) == [10]  # a chunk that ends earlier
    assert list(_window_blocks(384, 32, 2, 0, 12)) == [9, 10]  # 383 tokens: 11 blocks
    assert list(_window_blocks(40, 32, 4, 0, 1)) == [0]


def test_a_hybrid_hit_loads_asynchronously_and_a_failed_one_becomes_a_miss():
    side = _side((KVGroup(0, "full", ("a",), 16), KVGroup(1, "sliding", ("b",), 16, 33)))
    req = SimpleNamespace(request_id="r", all_token_ids=list(range(170)),
                          prompt_token_ids=list(range(170)), cache_salt=None, lora_request=None)
    st = side._state(req)
    st.hit_blocks, st.looked_up_blocks = 8, 10  # as a finished lookup leaves it
    assert side._match(req, 0) == (128, True)  # vLLM waits for the load: no block errors
    assert side._match(req, 128) == (0, False)
    side.load_failed({"r", "gone"})
    assert side._match(req, 0) == (0, False)  # recomputed whole, not the same hit again
    assert side.stats["load_failed_requests"] == 1
    # what it recomputes past the engine's own 2 blocks is stored again, not taken as stored
    other = SimpleNamespace(**{**vars(req), "request_id": "s"})
    st2 = side._state(other)
    st2.hit_blocks, st2.saved_blocks, st2.local_tokens = 8, 8, 32
    side.load_failed({"s"})
    assert st2.saved_blocks == 2
