"""The connector's options (`kv_connector_extra_config`) as a strict model: unknown keys and bad
values raise ConfigError naming the key, booleans parse as written, and the settings a process
derives keep the defaults they had."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ucm.errors import ConfigError
from ucm.vllm_hook.settings import HookOptions, HookSettings, settings_from_vllm

SECONDS = ["lookup_wait", "lookup_timeout", "start_timeout", "index_wait", "load_timeout"]
BOOLS = ["layerwise", "direct_loads", "early_loads", "hugepages", "save_generated"]
MEMORY = {"tiers": [{"driver": "memory", "capacity": "64MiB"}]}


def _vllm_config(extra: dict | None, *, block_size: int = 16, async_scheduling: bool = False,
                 ) -> SimpleNamespace:
    hf = SimpleNamespace(model_type="llama", hidden_size=64, num_hidden_layers=2)
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        model_config=SimpleNamespace(hf_config=hf, dtype="torch.float32"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=2048,
                                         async_scheduling=async_scheduling))


def _settings(**extra) -> HookSettings:
    return settings_from_vllm(_vllm_config({"ucm": MEMORY, **extra}))


def test_an_unknown_key_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.layer_wise: unknown key$"):
        _settings(layer_wise=True)


@pytest.mark.parametrize("key", BOOLS)
@pytest.mark.parametrize(("value", "expected"), [("false", False), ("true", True), (0, False),
                                                 (1, True), (False, False), (True, True)])
def test_booleans_parse_as_written(key, value, expected):
    assert getattr(HookOptions.parse({key: value}), key) is expected


@pytest.mark.parametrize("value", [2, "maybe", 0.5, None])
def test_a_value_that_is_no_boolean_is_an_error_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.layerwise: Input should "
                                          r"be a valid boolean"):
        HookOptions.parse({"layerwise": value})


@pytest.mark.parametrize("key", SECONDS)
def test_seconds_are_non_negative(key):
    with pytest.raises(ConfigError, match=rf"^kv_connector_extra_config\.{key}: Input should be "
                                          r"greater than or equal to 0$"):
        HookOptions.parse({key: -0.5})
    assert getattr(HookOptions.parse({key: 0}), key) == 0.0


def test_ucm_and_ucm_config_file_exclude_each_other(tmp_path):
    with pytest.raises(ConfigError, match="either 'ucm' or 'ucm_config_file', not both"):
        HookOptions.parse({"ucm": MEMORY, "ucm_config_file": str(tmp_path / "ucm.yaml")})
    with pytest.raises(ConfigError, match="not both"):  # even when one of them is None
        HookOptions.parse({"ucm": None, "ucm_config_file": str(tmp_path / "ucm.yaml")})


def test_bad_values_name_their_key():
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.load_failure: Input "
                                          r"should be 'recompute' or 'fail'$"):
        HookOptions.parse({"load_failure": "ignore"})
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.max_store_bytes: "):
        HookOptions.parse({"max_store_bytes": "lots"})
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.ucm\.tiers\.0\.capacity"
                                          r": "):
        HookOptions.parse({"ucm": {"tiers": [{"driver": "memory", "capacity": "lots"}]}})
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.ucm\.tiers\.0\.shared: "
                                          r"unknown key$"):  # a driver's own option
        HookOptions.parse({"ucm": {"tiers": [{"driver": "posix", "path": "/x", "shared": 1}]}})


def test_keys_of_the_earlier_schema_say_what_replaces_them():
    """The ucm config's one formatter words errors under the connector's option too."""
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.ucm\.ucm_compression: "
                                          r"not a key; use the top-level `codec`"):
        HookOptions.parse({"ucm": {"ucm_compression": {"bits": 4}, **MEMORY}})
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.ucm\.tiers\.0\."
                                          r"compression: not a key; use the tier's `codec`"):
        HookOptions.parse({"ucm": {"tiers": [{"driver": "memory", "compression": {}}]}})
    assert HookOptions.parse({"ucm": {"codec": "int8", **MEMORY}}).ucm.tiers[0].codec == "int8"


def test_defaults_are_unchanged():
    s = _settings()
    assert (s.layerwise, s.direct_loads, s.early_loads, s.hugepages, s.save_generated) == (
        False, True, True, False, True)
    assert (s.lookup_wait, s.lookup_timeout, s.start_timeout, s.index_wait, s.load_timeout) == (
        0.002, 5.0, 30.0, 2.0, 30.0)
    assert s.max_store_bytes == 2**30 and s.load_failure == "recompute" and s.sparse is None
    assert s.block_size == 16 and s.step_tokens == 2048 and (s.tp_rank, s.tp_size) == (0, 1)
    assert s.ucm_config.namespace == s.namespace and s.namespace.startswith("llama-")
    assert [t.driver for t in s.ucm_config.tiers] == ["memory"]
    # HookSettings built by hand (tests, tools) has the same defaults
    bare = HookSettings(ucm_config=s.ucm_config, namespace=s.namespace, block_size=16,
                        step_tokens=2048)
    assert bare == s


def test_timeouts_default_to_the_ucm_configs_deadline():
    s = _settings(ucm={**MEMORY, "deadline": 1.5})
    assert (s.lookup_timeout, s.load_timeout) == (1.5, 1.5)
    s = _settings(ucm={**MEMORY, "deadline": 1.5}, lookup_timeout=0.25, load_timeout=4)
    assert (s.lookup_timeout, s.load_timeout) == (0.25, 4.0)


def test_early_loads_only_where_steps_run_in_turn():
    extra = {"ucm": MEMORY, "early_loads": "true"}
    assert settings_from_vllm(_vllm_config(extra)).early_loads
    assert not settings_from_vllm(_vllm_config(extra, async_scheduling=True)).early_loads


def test_a_config_file_is_read(tmp_path):
    path = tmp_path / "ucm.yaml"
    path.write_text("tiers:\n  - driver: memory\n    capacity: 8MiB\ndeadline: 2\n")
    s = settings_from_vllm(_vllm_config({"ucm_config_file": str(path)}))
    assert s.ucm_config.tiers[0].capacity == 8 * 2**20 and s.load_timeout == 2.0
    with pytest.raises(ConfigError, match="cannot read config file"):
        settings_from_vllm(_vllm_config({"ucm_config_file": str(tmp_path / "none.yaml")}))


def test_sparse_takes_vllms_block_size():
    assert HookOptions.parse({"sparse": {}}, block_size=16).sparse is None  # empty: dense
    sparse = HookOptions.parse({"sparse": {"budget": 4}}, block_size=16).sparse
    assert sparse.block_size == 16 and sparse.budget == 4
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.sparse: .*block_size 8 "
                                          r"must be vLLM's \(16\)"):
        HookOptions.parse({"sparse": {"block_size": 8}}, block_size=16)
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.sparse\.topk: unknown"):
        HookOptions.parse({"sparse": {"topk": 4}}, block_size=16)
    assert _settings(sparse={"method": "quest", "budget": 2}).sparse.block_size == 16


def test_a_valid_config_round_trips():
    extra = {"ucm": MEMORY, "model_id": "m1", "layerwise": True, "direct_loads": False,
             "early_loads": False, "hugepages": True, "lookup_wait": 0.01,
             "lookup_timeout": 2, "start_timeout": 3, "index_wait": 0, "load_timeout": 4,
             "max_store_bytes": "2MiB", "save_generated": False, "load_failure": "fail",
             "sparse": {"method": "kvstar", "budget": 3}}
    options = HookOptions.parse(extra, block_size=16)
    dumped = options.model_dump(mode="json", exclude_unset=True)
    assert set(dumped) == set(extra) and dumped["max_store_bytes"] == 2 * 2**20
    assert HookOptions.parse(dumped, block_size=16) == options
    s = settings_from_vllm(_vllm_config(extra))
    assert (s.layerwise, s.direct_loads, s.early_loads, s.hugepages, s.save_generated) == (
        True, False, False, True, False)
    assert (s.lookup_wait, s.lookup_timeout, s.start_timeout, s.index_wait, s.load_timeout) == (
        0.01, 2.0, 3.0, 0.0, 4.0)
    assert s.max_store_bytes == 2 * 2**20 and s.load_failure == "fail"
    assert s.sparse.method == "kvstar" and "-m1-" in s.namespace
    with pytest.raises(Exception, match="frozen"):
        options.layerwise = False  # type: ignore[misc]


def test_every_option_says_what_it_means():
    for name, field in HookOptions.model_fields.items():
        assert field.description and "\n" not in field.description, name
