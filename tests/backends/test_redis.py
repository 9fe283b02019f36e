"""The redis driver against a real redis-server (password enforced): bad settings at open,
credentials from the URL and the environment and never shown, a full server, listing and
deleting a namespace, a server paused under a load, and a server paused, killed and restarted
under a running kernel. The driver contract suite runs on it too (specs redis, redis-zstd).
"""

from __future__ import annotations

import logging
import os
import signal

import pytest
import trio

from ucm.drivers import LoadState
from ucm.drivers.redis import RedisDriver, RedisOptions
from ucm.errors import ConfigError, StorageUnavailable

from ._faults import memory_over, paused_then_killed
from ._redis import PASSWORD, RedisServer
from ._support import scratch_prefix

MiB = 2**20


# --- opening -------------------------------------------------------------------------------


async def test_wrong_password_fails_at_open_without_showing_it(redis_options, caplog):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ConfigError, match=r"password: redis at redis://127.0.0.1:6390/0 "
                                          r"refused the credentials from the driver options"
                       ) as info:
        await RedisDriver.open({**redis_options, "password": "not-the-password"},
                               namespace="x")
    assert "not-the-password" not in str(info.value)
    assert "not-the-password" not in caplog.text
    options = RedisOptions.model_validate({**redis_options, "password": "not-the-password"})
    assert "not-the-password" not in repr(options) + str(options.model_dump())


async def test_missing_password_fails_at_open(redis_options, monkeypatch):
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    opts = {k: v for k, v in redis_options.items() if k != "password"}
    with pytest.raises(ConfigError, match=r"password: redis at .* requires one; set password"):
        await RedisDriver.open(opts, namespace="x")


async def test_password_from_url_then_environment(redis_server, redis_options, monkeypatch):
    opts = {k: v for k, v in redis_options.items() if k not in ("password", "url")}
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    drv = await RedisDriver.open({**opts, "url": f"redis://:{PASSWORD}@127.0.0.1:"
                                                 f"{redis_server.port}/0"}, namespace="x")
    await drv.aclose()
    monkeypatch.setenv("REDIS_PASSWORD", PASSWORD)
    monkeypatch.setenv("REDIS_URL", redis_server.url)  # no url, no host: REDIS_URL
    drv = await RedisDriver.open(opts, namespace="x")
    try:
        assert await drv.store([b"k"], [memoryview(b"v")]) == [4097]
        assert drv.backend.where == redis_server.url
    finally:
        await drv.delete_namespace()
        await drv.aclose()
    monkeypatch.setenv("REDIS_PASSWORD", "wrong")
    with pytest.raises(ConfigError, match=r"refused the credentials from REDIS_PASSWORD"):
        await RedisDriver.open(opts, namespace="x")


async def test_unreachable_server_fails_at_open():
    start = trio.current_time()
    with pytest.raises(StorageUnavailable, match=r"redis: cannot reach redis at "
                                                 r"redis://127.0.0.1:9/0: .*refused"):
        await RedisDriver.open({"port": 9, "retries": 0, "connect_timeout": 1},
                               namespace="x")
    assert trio.current_time() - start < 3


async def test_missing_database_fails_at_open(redis_options):
    with pytest.raises(ConfigError, match=r"db: redis at redis://127.0.0.1:6390/99 has no"):
        await RedisDriver.open({**redis_options, "db": 99}, namespace="x")


@pytest.mark.parametrize("options, match", [
    ({"url": "http://127.0.0.1:6379"}, "url must start with redis://, rediss:// or unix://"),
    ({"url": "redis://h:1", "host": "h"}, "give url or host/port, not both"),
    ({"port": 0}, "greater than or equal to 1"),
    ({"pool_size": 0}, "greater than or equal to 1"),
    ({"prefix": "a b"}, "prefix must not contain white space"),
    ({"passwd": "x"}, "Extra inputs are not permitted"),
])
def test_bad_options_name_the_problem(options, match):
    with pytest.raises(ValueError, match=match):
        RedisOptions.model_validate(options)


# --- storage ---------------------------------------------------------------------------------


async def test_layout_listing_and_namespace_delete(redis_options):
    drv = await RedisDriver.open(redis_options, namespace="ns/list")
    other = await RedisDriver.open(redis_options, namespace="other")
    try:
        assert drv.redis_key(b"\x01k").startswith(redis_options["prefix"].encode() + b":ns_list-")
        keys = [i.to_bytes(4, "big") for i in range(2500)]  # more than one SCAN page
        sizes = await drv.store(keys, [memoryview(b"x" * 10)] * len(keys))
        assert sizes == [4106] * len(keys)
        await other.store([b"keep"], [memoryview(b"y")])
        listed = {k: s async for k, s in drv.list_blocks()}
        assert listed == dict.fromkeys(keys, 4106)
        assert await drv.delete_namespace() == 2500
        assert [k async for k, _ in drv.list_blocks()] == []
        assert await other.lookup([b"keep"]) == [True]
    finally:
        await other.delete_namespace()
        await drv.aclose()
        await other.aclose()


async def test_a_full_server_refuses_stores_and_nothing_counts_as_stored(redis_options):
    drv = await RedisDriver.open(redis_options, namespace="full")
    used = int(drv.client.info("memory")["used_memory"])
    await trio.to_thread.run_sync(drv.client.config_set, "maxmemory", used + MiB)
    try:
        sizes = await drv.store([b"a", b"b", b"c"], [memoryview(os.urandom(2 * MiB))] * 3)
        assert sizes[-1] == 0 and sizes.count(0) >= 2
        assert drv.statistics()["refused_full"] == sizes.count(0)
        stored = [k for k, s in zip([b"a", b"b", b"c"], sizes, strict=True) if s]
        assert await drv.lookup([b"a", b"b", b"c"]) == [s > 0 for s in sizes]
        if stored:  # the server counts a command's own buffers: maybe none fitted
            outs = [memoryview(bytearray(2 * MiB)) for _ in stored]
            assert await drv.load(stored, outs) == [LoadState.OK] * len(stored)
    finally:
        await trio.to_thread.run_sync(drv.client.config_set, "maxmemory", 0)
        await drv.delete_namespace()
        await drv.aclose()


# --- faults ----------------------------------------------------------------------------------


@pytest.fixture
def own_redis():
    """A redis-server of this test's own, since the test pauses and kills it."""
    server = RedisServer(6391)
    server.start()
    yield server
    server.stop()


@pytest.mark.timeout(60)
async def test_load_from_a_paused_server_is_cut_and_never_lands_late(own_redis, tmp_path):
    drv = await RedisDriver.open(own_redis.options(scratch_prefix(tmp_path), timeout=2.0),
                                 namespace="pause")
    try:
        block = os.urandom(4 * MiB)
        await drv.store([b"k"], [memoryview(block)])
        out = memoryview(bytearray(4 * MiB))
        own_redis.signal(signal.SIGSTOP)
        try:
            # the server stays stopped: returning at all shows the call was abandoned
            with trio.move_on_after(0.5) as scope:
                await drv.load([b"k"], [out])
            assert scope.cancelled_caught
        finally:
            own_redis.signal(signal.SIGCONT)
        await trio.sleep(0.5)  # the abandoned call gets its answer now, and drops it
        assert bytes(out) == bytes(4 * MiB)
        assert await drv.load([b"k"], [out]) == [LoadState.OK] and out == block

        own_redis.signal(signal.SIGSTOP)  # closing with a call stuck on the server
        try:
            with trio.move_on_after(0.3):
                await drv.lookup([b"k"])
            await drv.aclose()  # returns with the server still stopped: it did not wait
        finally:
            own_redis.signal(signal.SIGCONT)
    finally:
        await drv.aclose()


@pytest.mark.timeout(90)
def test_paused_then_killed_server(own_redis, tmp_path):
    tier = {"driver": "redis", "name": "redis",
            **own_redis.options(scratch_prefix(tmp_path), timeout=2.0, connect_timeout=1.0)}
    kernel = memory_over(tier)
    try:
        paused_then_killed(kernel, own_redis, restart=own_redis.start)
    finally:
        kernel.close()


# --- `ucm bench` baseline --------------------------------------------------------------------


def test_raw_baseline_moves_the_bytes_the_driver_moves(redis_options):
    from ucm.bench.baselines.redis import raw_baseline

    raw = raw_baseline(redis_options, "bench")
    try:
        block = memoryview(os.urandom(MiB))
        raw.store([b"a", b"b"], [block, block])
        name = raw.prefix + b"a".hex().encode()
        assert raw.client.strlen(name) == 4096 + MiB  # a block's bytes: header + payload
        outs = [memoryview(bytearray(MiB)) for _ in range(2)]
        raw.load([b"a", b"b"], outs, 2)
        assert bytes(outs[0]) == bytes(outs[1]) == bytes(block)
        raw.delete([b"a", b"b"])
        assert raw.client.exists(name) == 0
    finally:
        raw.close()
