"""Secrets in driver options (redis password and URL, s3 keys) never show where a config is
printed, dumped or rejected, and still tell configs apart (`config_fingerprint`)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from ucm.config import config_fingerprint, load_config
from ucm.drivers.redis import RedisOptions, _address, redact_url
from ucm.drivers.s3 import S3Driver
from ucm.errors import ConfigError

SECRETS = ("hunter2", "s3cr3t-key", "t0ken")


def config(url: str = "redis://alice:hunter2@cache.example:6380/1", **redis: object):
    return load_config({"tiers": [
        {"driver": "redis", "url": url, **redis},
        {"driver": "s3", "bucket": "blocks", "access_key_id": "AKID",
         "secret_access_key": "s3cr3t-key", "session_token": "t0ken"},
    ]})


def shown(text: str) -> list[str]:
    return [secret for secret in SECRETS if secret in text]


@pytest.mark.parametrize("url", [
    "redis://alice:hunter2@cache.example:6380/1",
    "redis://:hunter2@cache.example:6380/1",
    "rediss://alice:hunter2@cache.example:6380/1?ssl_cert_reqs=none",
    "unix:///run/redis.sock?db=1&password=hunter2",
    "redis://alice:hun/ter2@cache.example/1",  # a stray "/" in the password
])
def test_a_config_never_prints_or_dumps_a_secret(url: str):
    cfg = config(url)
    for text in (repr(cfg), str(cfg), json.dumps(cfg.model_dump(mode="json")),
                 str(cfg.model_dump()), repr(cfg.tiers[0].options)):
        assert shown(text.replace("hun/ter2", "hunter2")) == [], text
    dumped = cfg.model_dump(mode="json")["tiers"]
    assert dumped[1]["options"]["secret_access_key"] == "**********"
    assert dumped[1]["options"]["session_token"] == "**********"
    assert "**********" in dumped[0]["options"]["url"]


def test_a_redacted_url_keeps_what_is_not_secret():
    assert redact_url("redis://alice:hunter2@cache.example:6380/1") == \
        "redis://alice:**********@cache.example:6380/1"
    assert redact_url("redis://cache.example:6380/1") == "redis://cache.example:6380/1"
    assert redact_url("unix:///run/redis.sock?db=1&password=hunter2") == \
        "unix:///run/redis.sock?db=1&password=**********"
    assert redact_url("alice:hunter2@cache.example") == "**********"  # not a URL: all hidden


def test_the_driver_still_gets_the_real_password():
    kwargs, where, source = _address(config().tiers[0].options)
    assert kwargs["password"] == "hunter2" and kwargs["username"] == "alice"
    assert where == "redis://cache.example:6380/1" and source == "the URL"


@pytest.mark.parametrize("tier, key", [
    ({"url": "http://alice:hunter2@cache.example"}, "tiers.0.url"),  # the wrong scheme
    ({"url": "redis://alice:hunter2@cache.example", "host": "h"}, "tiers.0"),  # model-level
    ({"url": "redis://alice:hunter2@cache.example", "pool_size": 0}, "tiers.0.pool_size"),
])
def test_a_rejected_config_does_not_quote_the_secret(tier: dict, key: str):
    with pytest.raises(ConfigError, match=key) as caught:
        load_config({"tiers": [{"driver": "redis", **tier}]})
    assert shown(str(caught.value)) == []
    with pytest.raises(ValidationError) as direct:  # the options alone, as a driver's open does
        RedisOptions(**tier)
    assert shown(str(direct.value)) == []


def test_a_rejected_s3_config_does_not_quote_the_secret():
    with pytest.raises(ValidationError) as caught:
        S3Driver.Options(bucket="x", secret_access_key="s3cr3t-key", session_token="t0ken")
    assert "bucket" in str(caught.value) and shown(str(caught.value)) == []


@pytest.mark.parametrize("url", ["redis://alice:hunter2@cache.example:notaport/1",
                                 "redis://alice:hun/ter2@cache.example/1"])
def test_an_unparsable_url_is_refused_without_its_password(url: str):
    with pytest.raises(ConfigError, match="url: not a valid redis URL") as caught:
        _address(RedisOptions(url=url))
    assert "hunter2" not in str(caught.value) and "hun/" not in str(caught.value)
    assert "cache.example" in str(caught.value)


def test_the_fingerprint_tells_apart_configs_that_differ_only_in_a_secret():
    base = config_fingerprint(config())
    assert config_fingerprint(config()) == base
    others = [config("redis://alice:hunter3@cache.example:6380/1"),
              config(password="other"),
              load_config({"tiers": [{"driver": "redis",
                                      "url": "redis://alice:hunter2@cache.example:6380/1"},
                                     {"driver": "s3", "bucket": "blocks",
                                      "access_key_id": "AKID",
                                      "secret_access_key": "another-key",
                                      "session_token": "t0ken"}]})]
    # Their printable dumps are equal (the secrets are starred): only the fingerprint differs.
    assert all(json.dumps(o.model_dump(mode="json")) ==
               json.dumps(config().model_dump(mode="json"))
               for o in (others[0], others[2]))
    assert len({base, *(config_fingerprint(o) for o in others)}) == 4
    assert shown(base) == []


def test_the_fingerprint_covers_every_driver_option():
    a = load_config({"tiers": [{"driver": "posix", "path": "/a"}]})
    b = load_config({"tiers": [{"driver": "posix", "path": "/b"}]})
    assert config_fingerprint(a) != config_fingerprint(b)
    assert a.model_dump(mode="json")["tiers"][0]["options"]["path"] == "/a"


def test_a_dumped_config_loads_back_to_the_same_fingerprint():
    cfg = config()
    assert config_fingerprint(load_config(cfg.model_dump())) == config_fingerprint(cfg)


def test_the_kernel_registry_key_never_holds_a_secret():
    from ucm.vllm_hook.settings import ProcessKernels

    assert shown(repr(ProcessKernels._key(config()))) == []


def test_a_wrapped_drivers_secret_is_hidden_too():
    """The faulty driver wraps another tier's options: a password there stays hidden, and
    the wrapped driver still gets it."""
    config = load_config({"tiers": [{"driver": "faulty", "inner": {
        "driver": "redis", "url": "redis://u:hunter2@127.0.0.1:1/0"}}]})
    assert "hunter2" not in repr(config) and "hunter2" not in str(config.model_dump())
    inner = config.tiers[0].options.inner["options"]
    assert "hunter2" in inner.url.get_secret_value()
