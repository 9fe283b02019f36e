"""The nfs driver against a real nfs-ganesha (NFSv4.1, VFS export): bad settings at open, a
server paused or killed under a running kernel, and two hosts sharing one export.

The two hosts are processes in two network namespaces, each joined to a third namespace that
runs Ganesha by a veth pair (private 10.77.x addresses), so their NFS traffic crosses a real
network link. Mount mode runs in the contract suite on a local directory (spec `nfs-mount`):
this machine's kernel has no NFS client, so it is not tested on a real NFS mount here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ucm.block import PAYLOAD_OFFSET
from ucm.drivers import _blockfiles
from ucm.drivers.contract import LoadState
from ucm.drivers.nfs import NfsDriver, NfsOptions
from ucm.errors import StorageUnavailable
from ucm.kernel import Load

from ._faults import memory_over, paused_then_killed
from ._mooncake_nfs import Ganesha, run_script, scratch_dir, shared_ganesha

MiB = 2**20
HOST = Path(__file__).with_name("_host.py")


async def test_unreachable_server_fails_at_open():
    with pytest.raises(StorageUnavailable,
                       match=r"cannot connect to NFS server nfs://127.0.0.1:9/export"):
        await NfsDriver.open({"url": "nfs://127.0.0.1:9/export?version=4.1",
                              "connect_timeout": 1}, namespace="x")


@pytest.mark.parametrize("options, match", [
    ({}, "client mode needs url: nfs://"),
    ({"url": "http://x"}, "client mode needs url"),
    ({"url": "nfs://h/e", "root": "/"}, "root must name a directory"),
    ({"mode": "mount"}, "mount mode needs the directory"),
])
def test_bad_options_name_the_problem(options, match):
    with pytest.raises(ValueError, match=match):
        NfsOptions.model_validate(options)


async def test_store_renames_within_the_block_directory_and_listing_sweeps_dead_temps(
        tmp_path):
    """A store writes its temp file next to the block (one-directory rename: cross-directory
    renames stalled on Ganesha); the listing removes temp files of dead writers on this host
    and keeps a live writer's and another host's."""
    server = shared_ganesha()
    options = server.options(scratch_dir(tmp_path))
    drv = await NfsDriver.open(options, namespace="ns")
    try:
        key = bytes(range(16))
        assert await drv.store([key], [memoryview(bytes(64 * 1024))]) == [
            PAYLOAD_OFFSET + 64 * 1024]
        shard = server.local_path(drv.block_path(key)).parent
        assert sorted(p.name for p in shard.iterdir()) == [key.hex() + ".blk"]
        assert not (shard.parent.parent / ".tmp").exists()  # the namespace (shard depth 2)
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dead_file = shard / f"{_blockfiles._HOST}.{dead}.1.abc.tmp"
        live_file = shard / f"{_blockfiles._HOST}.{os.getppid()}.1.abc.tmp"
        other_host = shard / f"elsewhere.{dead}.1.abc.tmp"
        for f in (dead_file, live_file, other_host):
            f.write_bytes(b"partial")
        assert [k async for k, _ in drv.list_blocks()] == [key]
        assert not dead_file.exists()
        assert live_file.exists() and other_host.exists()
    finally:
        await drv.aclose()


class _FlakyClient:
    """Fault injection: the real nfs-rs client, whose next `fail` opens raise `error`."""

    def __init__(self, client, error, fail: int) -> None:
        self._client, self._error, self.fail = client, error, fail

    def open(self, *args, **kwargs):
        if self.fail > 0:
            self.fail -= 1
            raise self._error
        return self._client.open(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.mark.parametrize("outcome, fail, stored", [
    ("safe_to_retry", 1, True),   # run again once, on the same session
    ("safe_to_retry", 2, False),  # a second one is a failure: not stored, client dropped
    ("uncertain", 1, False),      # may have happened: never run again blindly
])
async def test_an_error_marked_safe_to_retry_runs_the_operation_once_more(
        tmp_path, monkeypatch, outcome, fail, stored):
    from nfs_rs import NfsRetryableError

    server = shared_ganesha()
    drv = await NfsDriver.open(server.options(scratch_dir(tmp_path)), namespace="ns")
    try:
        conn = drv.backend.conn
        flaky = _FlakyClient(conn.get(), NfsRetryableError(
            message="injected", outcome=outcome, recovery_action="retry"), fail)
        monkeypatch.setattr(conn, "_client", flaky)
        key, block = bytes(range(16)), memoryview(bytes(range(256)) * 256)
        if stored:
            assert await drv.store([key], [block]) == [PAYLOAD_OFFSET + block.nbytes]
            out = memoryview(bytearray(block.nbytes))
            assert await drv.load([key], [out]) == [LoadState.OK] and out == block
        else:
            with pytest.raises(StorageUnavailable, match="injected"):
                await drv.store([key], [block])
            assert [k async for k, _ in drv.list_blocks()] == []
        stats = drv.statistics()
        assert stats["retries"] == min(fail, 1 if outcome == "safe_to_retry" else 0)
        assert (conn._client is flaky) == stored  # dropped on failure, kept after a retry
    finally:
        await drv.aclose()


@pytest.fixture
def own_ganesha():
    server = Ganesha(20491)
    server.start()
    yield server
    server.stop()


@pytest.mark.timeout(90)
def test_paused_then_killed_server(own_ganesha, tmp_path):
    tier = {"driver": "nfs", "name": "nfs",
            **own_ganesha.options(scratch_dir(tmp_path), timeout=2.0, connect_timeout=1.0)}
    kernel = memory_over(tier)
    try:  # same export directory after the restart: the blocks are still there
        block = paused_then_killed(kernel, own_ganesha, restart=own_ganesha.start)
        out = bytearray(len(block))
        result = kernel.submit(Load([b"both", b"after-restart"],
                                    buffers=[out, bytearray(len(block))])).result(20)
        assert result.ok and bytes(out) == block
    finally:
        kernel.close()


# --- two hosts -------------------------------------------------------------------------------

NS_SERVER, NS_A, NS_B = "ucm-nfs-srv", "ucm-nfs-a", "ucm-nfs-b"


@pytest.fixture
def networked_ganesha():
    env = dict(os.environ)
    run_script("netns.sh", env, "veth", NS_SERVER, NS_A, "10.77.1.1", "10.77.1.2")
    run_script("netns.sh", env, "veth", NS_SERVER, NS_B, "10.77.2.1", "10.77.2.2")
    server = Ganesha(20492, netns=NS_SERVER, host="127.0.0.1")
    try:
        server.start()
        yield server
    finally:
        server.stop()
        for ns in (NS_A, NS_B, NS_SERVER):
            run_script("netns.sh", env, "down", ns)


def _host(ns: str, address: str, server: Ganesha, root: str, **job) -> subprocess.Popen:
    opts = server.options(root)
    opts["url"] = opts["url"].replace("127.0.0.1", address)
    job["tier"] = {"driver": "nfs", **opts}
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(HOST),
                             json.dumps(job)], stdout=subprocess.PIPE, text=True, env=env)


@pytest.mark.timeout(120)
def test_two_hosts_over_veth_share_one_export(networked_ganesha, tmp_path):
    root, size = scratch_dir(tmp_path), 3 * MiB
    a = lambda **job: _host(NS_A, "10.77.1.1", networked_ganesha, root, size=size, **job)  # noqa: E731
    b = lambda **job: _host(NS_B, "10.77.2.1", networked_ganesha, root, size=size, **job)  # noqa: E731

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
    writers = [a(mode="hammer", key=same, seed=2, count=10),
               b(mode="hammer", key=same, seed=3, count=10)]
    report = json.loads(watcher.stdout.readlines()[-1])
    assert [w.wait(60) for w in writers] == [0, 0] and watcher.wait(60) == 0
    assert report["mixed"] == 0 and report["states"].get("OK", 0) > 0, report
    assert set(report["states"]) <= {"OK"}, report

    # A deletes what B is loading: B sees whole blocks or misses, never corrupt
    watcher = b(mode="watch", keys=keys, seeds=[1], seconds=2)
    assert watcher.stdout.readline().strip() == "ready"
    deleter = a(mode="delete", keys=keys)
    assert deleter.wait(60) == 0
    report = json.loads(watcher.stdout.readline())
    assert watcher.wait(60) == 0
    # A load racing the delete may also fail as a whole (a miss to the caller, as on
    # Mooncake); what must never happen is a corrupt or mixed block.
    assert report["mixed"] == 0 and set(report["states"]) <= {"OK", "MISSING", "FAILED"}, report
