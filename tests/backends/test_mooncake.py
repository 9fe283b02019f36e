"""The mooncake driver against a real Mooncake Store (metadata server, mooncake_master, a
segment holder), TCP transport.

Mooncake clients listen on every interface, so everything runs inside private network
namespaces. `test_suite_inside_the_namespace` starts the store in a lo-only one and runs, in a
pytest that itself runs inside the namespace, the contract suite's mooncake specs and the
tests of this file marked `inside` (they skip in the outer run, which reports their result).

The two "hosts" run in two namespaces of their own, on one private LAN (`netns.sh lan`): a
bridge in a third namespace, which runs the master and the metadata server, with a veth leg
to each host. Mooncake moves data peer to peer (a client reading an object connects to the
transfer engine of the client whose memory holds it), so the hosts must reach each other, not
only the master: bridged, they do, without routes or forwarding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ucm.drivers.mooncake import MooncakeDriver
from ucm.errors import DeadlineExceeded, NoCapacity, StorageUnavailable
from ucm.kernel import Load

from ._faults import memory_over, paused_then_killed
from ._mooncake_nfs import REPO, Mooncake, kill_quietly, mooncake_contract_enabled, run_script

MiB = 2**20
HOST = Path(__file__).with_name("_host.py")
inside = pytest.mark.skipif(not mooncake_contract_enabled(),
                            reason="runs inside the Mooncake namespace, from "
                                   "test_suite_inside_the_namespace")


# The inner run is mostly waiting, not computing: a store client's close() takes about a second
# (once per contract test). So it runs as three pytests at once, each on a store of its own
# (own master, metadata server and holder, on ports of its own): together they select what one
# `pytest tests/contract -k mooncake tests/backends/test_mooncake.py` would. They start when
# the session's collection ends (tests/backends/conftest.py), so their minute of waiting
# overlaps the tests that run before this one; the test collects their results.
INNER_RUNS = [
    (["tests/contract", "-k", "mooncake and not mooncake-zstd"], {}),
    (["tests/contract", "-k", "mooncake-zstd"], {"rpc": 50161, "meta": 8190, "metrics": 9113}),
    (["tests/backends/test_mooncake.py"], {"rpc": 50171, "meta": 8200, "metrics": 9123}),
]
INNER_TEST = "tests/backends/test_mooncake.py::test_suite_inside_the_namespace"


class InnerRuns:
    """The inner pytests, each started in a thread of its own on a store of its own."""

    def __init__(self, out_dir: Path) -> None:
        self.stores = [Mooncake(**ports) for _, ports in INNER_RUNS]
        self.procs: list[subprocess.Popen | None] = [None] * len(INNER_RUNS)
        self.outs = [out_dir / f"inner{i}" for i in range(len(INNER_RUNS))]
        self.errors: list[BaseException | None] = [None] * len(INNER_RUNS)
        self._closed = False
        self._lock = threading.Lock()
        # the namespace first: three `ip netns add` of one name at once race
        run_script("netns.sh", self.stores[0].env, "up", self.stores[0].netns)
        self.threads = [threading.Thread(target=self._start, args=(i,), daemon=True)
                        for i in range(len(INNER_RUNS))]
        for t in self.threads:
            t.start()

    def _start(self, i: int) -> None:
        (selection, _), store = INNER_RUNS[i], self.stores[i]
        try:
            store.start()
            opts = store.options
            env = store.client_env(UCM_MOONCAKE_MASTER=opts["master"],
                                   UCM_MOONCAKE_METADATA=opts["metadata"])
            with open(f"{self.outs[i]}.out", "w") as stdout, \
                    open(f"{self.outs[i]}.err", "w") as stderr, self._lock:
                if not self._closed:
                    self.procs[i] = subprocess.Popen(
                        store.python_cmd("-m", "pytest", "-q", "-p", "no:cacheprovider",
                                         "-x", *selection),
                        cwd=REPO, env=env, stdout=stdout, stderr=stderr)
        except BaseException as exc:  # reported by results()
            self.errors[i] = exc

    def results(self, timeout: float) -> list[tuple[list[str], int, str, str]]:
        """(selection, return code, stdout, stderr tail) of each run, once all have ended."""
        end = time.monotonic() + timeout
        out = []
        for i, ((selection, _), thread) in enumerate(zip(INNER_RUNS, self.threads,
                                                          strict=True)):
            thread.join(max(0.0, end - time.monotonic()))
            if self.errors[i] is not None:
                raise AssertionError(f"inner run {selection} did not start") from self.errors[i]
            proc = self.procs[i]
            assert proc is not None, f"inner run {selection} did not start in time"
            code = proc.wait(timeout=max(1.0, end - time.monotonic()))
            out.append((selection, code, Path(f"{self.outs[i]}.out").read_text(),
                        Path(f"{self.outs[i]}.err").read_text()[-3000:]))
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for t in self.threads:
            t.join(120)
        for proc in self.procs:
            if proc is not None:
                kill_quietly(proc)
        for store in self.stores:
            store.stop()
        run_script("netns.sh", self.stores[0].env, "down", self.stores[0].netns)


AHEAD: dict[str, InnerRuns] = {}  # the session's inner runs, started by the conftest


@pytest.mark.skipif(mooncake_contract_enabled(), reason="the outer run only")
@pytest.mark.timeout(300)
def test_suite_inside_the_namespace(tmp_path):
    runs = AHEAD.pop("runs", None) or InnerRuns(tmp_path)  # alone: started here
    try:
        for selection, returncode, stdout, stderr in runs.results(timeout=280):
            lines = stdout.splitlines()
            tail = "\n".join(lines[-40:])
            assert returncode == 0, f"inner pytest {selection} failed:\n{tail}\n{stderr}"
            print(selection, lines[-1])
            assert " passed" in tail and "failed" not in tail
    finally:
        runs.close()


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


@inside
@pytest.mark.timeout(120)
def test_paused_then_killed_master():
    store = Mooncake(rpc=50271, meta=8291, metrics=9291, segment="64 MB",
                     netns=os.environ.get("UCM_MOONCAKE_NETNS", "ucm-mc-test"))
    store.start()
    tier = {"driver": "mooncake", "name": "mc", **store.options, "staging_bytes": "16MiB"}
    kernel = memory_over(tier)

    def loads_whole_or_lost(block: bytes) -> None:
        # The master's RPCs would wait 30 s: the load's deadline cuts it (DeadlineExceeded,
        # where the client's own timeout would be another error, after the wait below).
        out = bytearray(len(block))
        loaded = kernel.submit(Load([b"both"], buffers=[out], deadline=1.0))
        error = loaded.exception(10)
        assert error is None or isinstance(error, DeadlineExceeded), error
        assert error is not None or not loaded.result().ok \
            or bytes(out) == block  # a loss or a whole block, never bytes of another

    def restart() -> None:  # the master died: a new store comes up
        store.stop()
        store.start()

    try:
        paused_then_killed(kernel, store, restart=restart, while_paused=loads_whole_or_lost,
                           recover_within=40)
    finally:
        kernel.close()
        store.stop()


# --- two hosts, outer run ---------------------------------------------------------------------

# The master and metadata server sit in a namespace of their own, not in a host's: they are
# shared, and a host's processes coming and going (or its namespace) must not take them along.
NS_SERVER, NS_A, NS_B = "ucm-mc-srv", "ucm-mc-a", "ucm-mc-b"
SERVER, ADDR_A, ADDR_B = "10.79.0.1", "10.79.0.2", "10.79.0.3"  # br0 in NS_SERVER, A, B
LEG = f"v-{NS_SERVER}"  # each host's end of its veth pair


@pytest.fixture
def mooncake_lan():
    """The master and metadata server in NS_SERVER, bridged to NS_A and NS_B; no holder, so the
    pool has only the memory that the hosts lend. Yields the store and a list that the test
    appends its host processes to: they, the servers and the namespaces go even on failure."""
    env = dict(os.environ)
    store = Mooncake(netns=NS_SERVER, host=SERVER, rpc=50281, meta=8301, metrics=9301,
                     segment="0")
    hosts: list[subprocess.Popen] = []
    try:
        run_script("netns.sh", env, "lan", NS_SERVER, SERVER, NS_A, ADDR_A, NS_B, ADDR_B)
        store.start()
        yield store, hosts
    finally:
        for proc in hosts:
            kill_quietly(proc)
        store.running = True  # stop even a half-started store
        store.stop()
        for ns in (NS_A, NS_B, NS_SERVER):
            run_script("netns.sh", env, "down", ns)


def _host(hosts: list[subprocess.Popen], ns: str, address: str, store: Mooncake,
          lend: str = "0", **job) -> subprocess.Popen:
    """A process with its own kernel in namespace `ns`, advertising `address`, lending `lend`
    bytes of its memory to the pool."""
    job["tier"] = {"driver": "mooncake", **store.options, "local_hostname": address,
                   "segment_bytes": lend, "staging_bytes": "32MiB"}
    # The driver advertises local_hostname only where MC_TCP_BIND_ADDRESS is unset.
    env = {k: v for k, v in os.environ.items() if k != "MC_TCP_BIND_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), MC_LOG_LEVEL="ERROR")
    proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(HOST),
                             json.dumps(job)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    hosts.append(proc)
    return proc


def _netns_of(pid: int) -> str:
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True,
                          text=True, check=True).stdout.strip()


def _link_bytes(ns: str, dev: str = LEG) -> tuple[int, int]:
    """(received, sent) bytes so far on interface `dev` of namespace `ns`."""
    out = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev],
                         capture_output=True, text=True, check=True).stdout
    stats = json.loads(out)[0]["stats64"]
    return stats["rx"]["bytes"], stats["tx"]["bytes"]


@pytest.mark.skipif(mooncake_contract_enabled(), reason="the outer run only")
@pytest.mark.timeout(150)
def test_two_hosts_in_two_namespaces_share_one_store(mooncake_lan):
    store, hosts = mooncake_lan
    size = 3 * MiB
    a = lambda **job: _host(hosts, NS_A, ADDR_A, store, size=size, **job)  # noqa: E731
    b = lambda **job: _host(hosts, NS_B, ADDR_B, store, size=size, **job)  # noqa: E731

    # host A stores into memory it lends (the pool's only memory) and keeps it lent
    holder = a(mode="store", count=4, seed=1, hold=True, lend="128MiB")
    keys = holder.stdout.readline().split()
    assert len(keys) == 4, "host A did not store"
    before = [_link_bytes(NS_A), _link_bytes(NS_B), _link_bytes(NS_SERVER, "br0")]
    hit = b(mode="load", keys=keys, seed=1)  # host B hits
    assert hit.stdout.readline().strip() == "ok" and hit.wait(60) == 0
    # B read the blocks from the transfer engine in A's namespace: they left A by its veth
    # and entered B by its own, bridged through the server's namespace, not delivered there.
    after = [_link_bytes(NS_A), _link_bytes(NS_B), _link_bytes(NS_SERVER, "br0")]
    sent_by_a, got_by_b, got_by_server = (after[0][1] - before[0][1],
                                          after[1][0] - before[1][0], after[2][0] - before[2][0])
    assert sent_by_a >= 4 * size and got_by_b >= 4 * size and got_by_server < size, (
        before, after)

    # both write one key at once while B watches it: one whole block per load
    same = b"same".hex()
    assert a(mode="hammer", key=same, seed=1, count=1).wait(60) == 0
    watcher = b(mode="watch", keys=[same], seeds=[1, 2, 3], seconds=4)
    assert watcher.stdout.readline().strip() == "ready"
    writers = [a(mode="hammer", key=same, seed=2, count=10),
               b(mode="hammer", key=same, seed=3, count=10)]
    assert [w.stdout.readline().strip() for w in writers] == ["ready", "ready"]
    # each host really is a process in its own namespace, and so is the master
    assert [_netns_of(p.pid) for p in (holder, writers[0], watcher, writers[1])] \
        == [NS_A, NS_A, NS_B, NS_B]
    assert _netns_of(store.pid()) == NS_SERVER
    report = json.loads(watcher.stdout.readline())
    assert [w.wait(60) for w in writers] == [0, 0] and watcher.wait(60) == 0
    assert report["mixed"] == 0 and report["states"].get("OK", 0) > 0, report
    assert set(report["states"]) <= {"OK", "MISSING"}, report

    # A evicts (deletes) what B is loading: whole blocks or misses, never corrupt
    watcher = b(mode="watch", keys=keys, seeds=[1], seconds=2)
    assert watcher.stdout.readline().strip() == "ready"
    assert a(mode="delete", keys=keys).wait(60) == 0
    report = json.loads(watcher.stdout.readline())
    assert watcher.wait(60) == 0
    assert report["mixed"] == 0 and set(report["states"]) <= {"OK", "MISSING"}, report

    # A leaves, and its memory with it, while B loads a block that lives there: whole blocks,
    # then misses; a read that A's going cuts while the master still lists the block fails.
    # Never corrupt.
    watcher = b(mode="watch", keys=[same], seeds=[1, 2, 3], seconds=4)
    assert watcher.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    holder.stdin.close()  # its kernel closes the client: the segment is unmounted
    assert holder.wait(30) == 0
    report = json.loads(watcher.stdout.readline())
    assert watcher.wait(60) == 0
    assert report["mixed"] == 0 and set(report["states"]) <= {"OK", "MISSING", "FAILED"}, report
    assert report["states"].get("MISSING", 0) > 0, report
