"""The s3 driver against a real SeaweedFS: bad settings at open, credentials from the AWS
environment, large blocks, retries, a server paused or killed under a running kernel, and two
processes (each with its own kernel) sharing one bucket.

The two "hosts" are processes in two network namespaces, each joined by a veth pair
(private 10.78.x addresses) to a third namespace that runs SeaweedFS, so their S3 traffic
crosses a real network link and neither reaches the server on a loopback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ucm.drivers import LoadState
from ucm.drivers.s3 import S3Driver
from ucm.errors import ConfigError, StorageUnavailable

from ._faults import memory_over, paused_then_killed
from ._mooncake_nfs import run_script
from ._support import ACCESS_KEY, SECRET_KEY, SeaweedFS, scratch_prefix

MiB = 2**20
HOST = Path(__file__).with_name("_host.py")


# --- opening -------------------------------------------------------------------------------


async def test_wrong_secret_fails_at_open_without_showing_it(s3_options):
    with pytest.raises(ConfigError, match=r"access denied to bucket 'ucm' at http") as info:
        await S3Driver.open({**s3_options, "secret_access_key": "not-the-secret"},
                            namespace="x")
    assert "not-the-secret" not in str(info.value)


async def test_missing_bucket_fails_at_open(s3_options):
    with pytest.raises(ConfigError, match=r"bucket: bucket 'no-such-bucket' .* does not exist"):
        await S3Driver.open({**s3_options, "bucket": "no-such-bucket"}, namespace="x")


async def test_unreachable_endpoint_fails_at_open(s3_options):
    opts = {**s3_options, "endpoint": "http://127.0.0.1:9", "max_attempts": 2}
    with pytest.raises(StorageUnavailable, match=r"cannot reach bucket 'ucm' at "
                                                 r"http://127.0.0.1:9: .*ConnectError"):
        await S3Driver.open(opts, namespace="x")


async def test_credentials_from_aws_profile_file(s3_options, tmp_path, monkeypatch):
    creds = tmp_path / "credentials"
    creds.write_text(f"[kv]\naws_access_key_id = {ACCESS_KEY}\n"
                     f"aws_secret_access_key = {SECRET_KEY}\n")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    opts = {k: v for k, v in s3_options.items()
            if k not in ("access_key_id", "secret_access_key")}
    monkeypatch.setenv("AWS_PROFILE", "kv")
    drv = await S3Driver.open(opts, namespace="x")
    await drv.aclose()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)  # the environment beats the file
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    monkeypatch.delenv("AWS_PROFILE")
    with pytest.raises(ConfigError, match=r"access denied .* with the AWS env credentials"):
        await S3Driver.open(opts, namespace="x")


# --- transfers -------------------------------------------------------------------------------


async def test_large_block_goes_multipart_and_loads_by_ranges(s3_options):
    drv = await S3Driver.open({**s3_options, "part_size": "5MiB",
                               "multipart_threshold": "8MiB"}, namespace="big")
    try:
        data = os.urandom(13 * MiB + 7)
        assert await drv.store([b"big"], [memoryview(data)]) == [4096 + len(data)]
        out = memoryview(bytearray(len(data)))
        assert await drv.load([b"big"], [out]) == [LoadState.OK]
        assert out == data
        stats = drv.statistics()
        assert stats["multipart_puts"] == 1 and stats["ranged_gets"] == 1
        assert await drv.delete_namespace() == 1
        assert await drv.lookup([b"big"]) == [False]
    finally:
        await drv.aclose()


async def test_throttled_requests_on_the_event_loop_are_retried_then_given_up(s3_options):
    """Lookups, listing, deletes and multipart uploads go through httpx on the event loop."""
    import httpx

    drv = await S3Driver.open({**s3_options, "max_attempts": 3, "backoff_base": 0.001},
                              namespace="retry")
    real = drv.client.client
    answers = [503, 500]

    async def flaky(request: httpx.Request) -> httpx.Response:
        if answers:
            code = answers.pop(0)
            return httpx.Response(code, content=b"<Error><Code>SlowDown</Code></Error>")
        return await real.send(request)

    try:
        assert await drv.store([b"k"], [memoryview(b"v" * 10)]) == [4106]
        drv.client.client = httpx.AsyncClient(transport=httpx.MockTransport(flaky))
        assert await drv.lookup([b"k"]) == [True]
        assert drv.statistics()["retries"] == 2
        answers[:] = [503] * 3
        with pytest.raises(StorageUnavailable,
                           match=r"lookup failed: HEAD failed after 3 attempts: "
                                 r"HEAD -> HTTP 503 SlowDown"):
            await drv.lookup([b"k"])
    finally:
        await drv.client.client.aclose()
        drv.client.client = real
        await drv.aclose()


async def test_throttled_stores_and_loads_are_retried_then_given_up(s3_options):
    """Block PUTs and GETs go through connections of their own (worker threads): the first
    `throttled` of them reach a server that reads the request, answers 503 SlowDown and
    closes the connection."""
    import http.client
    import socket
    import threading

    fault = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = fault.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                need = int(length.group(1)) if length else 0
                while len(body) < need:
                    body += conn.recv(1 << 20)
                answer = b"<Error><Code>SlowDown</Code></Error>"
                conn.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Length: %d\r\n"
                             b"Connection: close\r\n\r\n%s" % (len(answer), answer))

    threading.Thread(target=serve, daemon=True).start()
    drv = await S3Driver.open({**s3_options, "max_attempts": 3, "backoff_base": 0.001},
                              namespace="retry-threads")
    pool = drv.client.pool
    real_take = pool._take
    throttled = [0]

    def take() -> tuple[http.client.HTTPConnection, bool]:
        if throttled[0]:
            throttled[0] -= 1
            return http.client.HTTPConnection("127.0.0.1", fault.getsockname()[1]), False
        return real_take()

    pool._take = take
    try:
        data = os.urandom(3 * MiB)
        throttled[0] = 2
        assert await drv.store([b"k"], [memoryview(data)]) == [4096 + len(data)]
        out = memoryview(bytearray(len(data)))
        throttled[0] = 2
        assert await drv.load([b"k"], [out]) == [LoadState.OK] and out == data
        assert drv.statistics()["retries"] == 4
        throttled[0] = 3
        with pytest.raises(StorageUnavailable,
                           match=r"all 1 writes failed: PUT failed after 3 attempts: "
                                 r"PUT -> HTTP 503 SlowDown"):
            await drv.store([b"k"], [memoryview(data)])
        throttled[0] = 3
        with pytest.raises(StorageUnavailable,
                           match=r"all 1 reads failed: GET failed after 3 attempts: "
                                 r"GET -> HTTP 503 SlowDown"):
            await drv.load([b"k"], [out])
        assert not throttled[0]
    finally:
        fault.close()
        await drv.aclose()


# --- faults under a running kernel ---------------------------------------------------------


@pytest.fixture
def own_server(tmp_path):
    """A SeaweedFS of this test's own, since the test pauses and kills it."""
    server = SeaweedFS(8533, 9533)
    server.start()
    yield server
    server.stop()


@pytest.mark.timeout(90)
def test_paused_then_killed_server(own_server, tmp_path):
    tier = {"driver": "s3", "name": "s3",
            **own_server.options(scratch_prefix(tmp_path), max_attempts=2, read_timeout=2.0)}
    kernel = memory_over(tier)
    try:  # over HTTP a store to the paused server ends at its deadline, and the first store
        # after SIGCONT already succeeds; the restarted server keeps its data
        paused_then_killed(kernel, own_server, pause_raises=True, resumes_at_once=True,
                           restart=lambda: own_server.start(keep_data=True))
    finally:
        kernel.close()


# --- two hosts -----------------------------------------------------------------------------

NS_SERVER, NS_A, NS_B = "ucm-s3-srv", "ucm-s3-a", "ucm-s3-b"
ADDR_A, ADDR_B = "10.78.1.1", "10.78.2.1"  # the server's end of each host's veth


@pytest.fixture
def networked_seaweedfs():
    """SeaweedFS in its own network namespace, joined to two host namespaces by veth pairs
    (private 10.78.x addresses made here). Namespaces and server go even when start fails."""
    env = dict(os.environ)
    server = SeaweedFS(8533, 9533)
    server.env["WEED_NETNS"] = NS_SERVER
    try:
        run_script("netns.sh", env, "veth", NS_SERVER, NS_A, ADDR_A, "10.78.1.2")
        run_script("netns.sh", env, "veth", NS_SERVER, NS_B, ADDR_B, "10.78.2.2")
        server.start()
        yield server
    finally:
        server.running = True  # stop even a half-started server
        server.stop()
        for ns in (NS_A, NS_B, NS_SERVER):
            run_script("netns.sh", env, "down", ns)


def _host(ns: str, address: str, server: SeaweedFS, prefix: str, **job) -> subprocess.Popen:
    """A process with its own kernel in network namespace `ns`, reaching S3 at `address`."""
    opts = server.options(prefix, part_size="5MiB", multipart_threshold="5MiB")
    opts["endpoint"] = opts["endpoint"].replace("127.0.0.1", address)
    job["tier"] = {"driver": "s3", **opts}
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(HOST),
                             json.dumps(job)], stdout=subprocess.PIPE, text=True, env=env)


@pytest.mark.timeout(150)
def test_two_hosts_over_veth_share_one_bucket(networked_seaweedfs, tmp_path):
    prefix = scratch_prefix(tmp_path)
    size = 6 * MiB  # multipart PUTs and ETag-pinned ranged GETs (5 MiB parts)
    a = lambda **job: _host(NS_A, ADDR_A, networked_seaweedfs, prefix, size=size, **job)  # noqa: E731
    b = lambda **job: _host(NS_B, ADDR_B, networked_seaweedfs, prefix, size=size, **job)  # noqa: E731

    stored = a(mode="store", count=4, seed=1)  # host A stores, host B hits
    keys = stored.stdout.readline().split()
    assert stored.wait(60) == 0 and len(keys) == 4
    hit = b(mode="load", keys=keys, seed=1)
    assert hit.stdout.readline().strip() == "ok" and hit.wait(60) == 0

    # both write one key at once while B watches it: one whole block per load
    same = b"same".hex()
    first = a(mode="hammer", key=same, seed=1, count=1)
    assert first.wait(60) == 0
    watcher = b(mode="watch", keys=[same], seeds=[1, 2, 3], seconds=4)
    assert watcher.stdout.readline().strip() == "ready"
    writers = [a(mode="hammer", key=same, seed=2, count=8),
               b(mode="hammer", key=same, seed=3, count=8)]
    report = json.loads(watcher.stdout.readline())
    assert [w.wait(60) for w in writers] == [0, 0] and watcher.wait(60) == 0
    assert report["mixed"] == 0 and report["states"].get("OK", 0) > 0, report
    # A load that loses the ETag race on every one of its bounded retries is FAILED (a miss
    # for the caller, seen once in 184 loads in CI); never a mixed or corrupt block.
    assert set(report["states"]) <= {"OK", "FAILED"}, report

    # A deletes what B is loading: B sees whole blocks or misses, never corrupt
    watcher = b(mode="watch", keys=keys, seeds=[1], seconds=2)
    assert watcher.stdout.readline().strip() == "ready"
    deleter = a(mode="delete", keys=keys)
    assert deleter.wait(60) == 0
    report = json.loads(watcher.stdout.readline())
    assert watcher.wait(60) == 0
    assert report["mixed"] == 0 and set(report["states"]) <= {"OK", "MISSING"}, report
