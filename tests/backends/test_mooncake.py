"""The mooncake driver against a real Mooncake Store (metadata server, mooncake_master, a
segment holder), TCP transport.

Mooncake clients listen on every interface, so everything runs inside a lo-only network
namespace: `test_suite_inside_the_namespace` starts the store there and runs, in a pytest
that itself runs inside the namespace, the contract suite's mooncake specs and the tests of
this file marked `inside` (they skip in the outer run, which reports their result).

The two "hosts" are two processes with their own kernels in that one namespace (separate
namespaces would need the master and every transfer engine routed between them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ucm.drivers.mooncake import MooncakeDriver
from ucm.errors import NoCapacity, StorageUnavailable
from ucm.kernel import Kernel, Load, Store

from ._mooncake_nfs import REPO, Mooncake, mooncake_contract_enabled, run_script

MiB = 2**20
HOST = Path(__file__).with_name("_host.py")
inside = pytest.mark.skipif(not mooncake_contract_enabled(),
                            reason="runs inside the Mooncake namespace, from "
                                   "test_suite_inside_the_namespace")


@pytest.mark.skipif(mooncake_contract_enabled(), reason="the outer run only")
@pytest.mark.timeout(240)
def test_suite_inside_the_namespace():
    store = Mooncake()
    store.start()
    try:
        opts = store.options
        env = store.client_env(UCM_MOONCAKE_MASTER=opts["master"],
                               UCM_MOONCAKE_METADATA=opts["metadata"])
        done = subprocess.run(
            store.python_cmd("-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                             "tests/contract", "-k", "mooncake",
                             "tests/backends/test_mooncake.py"),
            cwd=REPO, env=env, capture_output=True, text=True, timeout=230)
        tail = "\n".join(line for line in done.stdout.splitlines()[-40:])
        assert done.returncode == 0, f"inner pytest failed:\n{tail}\n{done.stderr[-3000:]}"
        print(tail.splitlines()[-1])
        assert " passed" in tail and "failed" not in tail
    finally:
        store.stop()
        run_script("netns.sh", store.env, "down", store.netns)  # leave no namespace behind


# --- inside the namespace --------------------------------------------------------------------


def _shared_options() -> dict:
    return {"master": os.environ["UCM_MOONCAKE_MASTER"],
            "metadata": os.environ["UCM_MOONCAKE_METADATA"], "staging_bytes": "32MiB"}


@inside
async def test_unreachable_master_fails_at_open():
    with pytest.raises(StorageUnavailable, match=r"cannot reach the Mooncake master at "
                                                 r"127.0.0.1:9: Connection refused"):
        await MooncakeDriver.open({**_shared_options(), "master": "127.0.0.1:9"},
                                  namespace="x")


@pytest.fixture
def own_store():
    """A second store in this namespace, without a holder: clients lend what it has."""
    store = Mooncake(rpc=50261, meta=8281, metrics=9281, segment="0",
                     netns=os.environ.get("UCM_MOONCAKE_NETNS", "ucm-mc-test"))
    store.start()
    yield store
    store.stop()


@inside
async def test_pool_without_memory_fails_at_open_and_full_pool_refuses(own_store):
    with pytest.raises(NoCapacity, match=r"refuses puts: it is full or no client lends"):
        await MooncakeDriver.open(own_store.options, namespace="x")
    drv = await MooncakeDriver.open({**own_store.options, "segment_bytes": "24MiB",
                                     "staging_bytes": "8MiB"}, namespace="full")
    try:
        keys = [b"f%d" % i for i in range(24)]
        block = memoryview(os.urandom(2 * MiB))
        sizes = []
        for key in keys:
            sizes += await drv.store([key], [block])
        assert 0 in sizes and any(sizes), sizes  # some refused, some stored
        assert drv.statistics()["refused_full"] > 0
        outs = [memoryview(bytearray(2 * MiB)) for _ in keys]
        states = await drv.load(keys, outs)
        assert {s.name for s in states} <= {"OK", "MISSING"}
        assert all(bytes(o) == block for o, s in zip(outs, states, strict=True)
                   if s.name == "OK")
    finally:
        await drv.aclose()


class _PeerLeft:
    """A store client whose transfers all fail, as when the client holding the replicas
    leaves in the middle of a read."""

    def __init__(self, client) -> None:
        self.client = client

    def batch_get_into(self, names, addrs, sizes):
        return [-800] * len(names)  # TRANSFER_FAIL

    def __getattr__(self, name: str):
        return getattr(self.client, name)


@inside
async def test_failed_transfers_are_read_again_or_missing_without_a_reconnect():
    drv = await MooncakeDriver.open(_shared_options(), namespace="peer-left")
    try:
        block = os.urandom(MiB)
        assert await drv.store([b"here"], [memoryview(block)]) == [4096 + MiB]
        drv.backend._client = _PeerLeft(drv.backend.client)
        outs = [memoryview(bytearray(MiB)) for _ in range(2)]
        states = await drv.load([b"here", b"gone"], outs)
        assert [s.name for s in states] == ["OK", "MISSING"] and outs[0] == block
        stats = drv.statistics()  # the master answered all along: the client stays
        assert stats["transfer_failed"] == 2 and stats["reconnects"] == 0, stats
    finally:
        await drv.aclose()


def _kernel(store_options: dict) -> Kernel:
    tier = {"driver": "mooncake", "name": "mc", **store_options, "staging_bytes": "16MiB"}
    kernel = Kernel({"tiers": [{"driver": "memory", "name": "mem"}, tier],
                     "namespace": "faults", "durability": "all", "promote": False})
    kernel.start()
    return kernel


@inside
@pytest.mark.timeout(120)
def test_paused_then_killed_master():
    store = Mooncake(rpc=50271, meta=8291, metrics=9291, segment="64 MB",
                     netns=os.environ.get("UCM_MOONCAKE_NETNS", "ucm-mc-test"))
    store.start()
    kernel = _kernel(store.options)
    try:
        block = os.urandom(2 * MiB)
        assert kernel.submit(Store([b"both"], buffers=[block])).result(10).ok
        hot = b"mem-only"
        kernel.submit(Store([hot], buffers=[block], durability="memory")).result(10)

        store.signal(signal.SIGSTOP)  # the master's RPCs would wait 30 s
        try:
            start = time.monotonic()
            failed = kernel.submit(Store([b"during-pause"], buffers=[block], deadline=1.0))
            assert failed.exception(10) is not None or not failed.result().ok
            out = bytearray(2 * MiB)
            loaded = kernel.submit(Load([b"both"], buffers=[out], deadline=1.0))
            assert loaded.exception(10) is not None or not loaded.result().ok \
                or bytes(out) == block  # a loss or a whole block, never bytes of another
            assert time.monotonic() - start < 4, "deadlines did not cut the calls"
            out = bytearray(2 * MiB)  # the memory tier keeps serving meanwhile
            mem = kernel.submit(Load([hot], buffers=[out], deadline=1.0)).result(5)
            assert mem.ok and bytes(out) == block
        finally:
            store.signal(signal.SIGCONT)
        _until_ok(kernel, b"after-pause", block)

        store.signal(signal.SIGKILL)  # the master dies; a new store comes up
        failed = kernel.submit(Store([b"while-dead"], buffers=[block], deadline=2.0))
        assert failed.exception(10) is not None or not failed.result().ok
        store.stop()
        store.start()
        _until_ok(kernel, b"after-restart", block)  # same kernel and driver
        out = bytearray(2 * MiB)
        assert kernel.submit(Load([b"after-restart"], buffers=[out])).result(20).ok
        assert bytes(out) == block
    finally:
        kernel.close()
        store.stop()


def _until_ok(kernel: Kernel, key: bytes, block: bytes) -> None:
    deadline = time.monotonic() + 40
    while True:
        future = kernel.submit(Store([key], buffers=[block], deadline=5.0))
        error = future.exception(20)
        if error is None and future.result().ok:
            return
        assert time.monotonic() < deadline, f"the driver did not recover: {error or future}"
        time.sleep(0.3)


def _host(**job) -> subprocess.Popen:
    job["tier"] = {"driver": "mooncake", **_shared_options()}
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, str(HOST), json.dumps(job)],
                            stdout=subprocess.PIPE, text=True, env=env)


@inside
@pytest.mark.timeout(120)
def test_two_hosts_share_one_store():
    size = 3 * MiB
    stored = _host(mode="store", count=4, seed=1, size=size)  # host A stores, B hits
    keys = stored.stdout.readline().split()
    assert stored.wait(60) == 0 and len(keys) == 4
    hit = _host(mode="load", keys=keys, seed=1, size=size)
    assert hit.stdout.readline().strip() == "ok" and hit.wait(60) == 0

    same = b"same".hex()  # both write one key while B watches: one whole block per load
    assert _host(mode="hammer", key=same, seed=1, count=1, size=size).wait(60) == 0
    watcher = _host(mode="watch", keys=[same], seeds=[1, 2, 3], seconds=4, size=size)
    writers = [_host(mode="hammer", key=same, seed=s, count=10, size=size) for s in (2, 3)]
    report = json.loads(watcher.stdout.readlines()[-1])
    assert [w.wait(60) for w in writers] == [0, 0] and watcher.wait(60) == 0
    assert report["mixed"] == 0 and report["states"].get("OK", 0) > 0, report
    assert set(report["states"]) <= {"OK", "MISSING"}, report

    # A evicts (deletes) what B is loading: whole blocks or misses, never corrupt
    watcher = _host(mode="watch", keys=keys, seeds=[1], seconds=2, size=size)
    assert watcher.stdout.readline().strip() == "ready"
    assert _host(mode="delete", keys=keys, size=size).wait(60) == 0
    report = json.loads(watcher.stdout.readline())
    assert watcher.wait(60) == 0
    assert report["mixed"] == 0 and set(report["states"]) <= {"OK", "MISSING"}, report
