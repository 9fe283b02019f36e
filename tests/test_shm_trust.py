"""The shared-memory tier on a host with other users (ucm/drivers/_shm_trust.py), tried as an
attacker would: directories and arena files planted in advance, made writable to all, replaced
by symlinks or FIFOs, truncated; and two honest users, each under its own uid (`setpriv`).
The attacker is uid 65534 (nobody): as root, the test gives it the planted files (`os.chown`)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from ucm.block import Codec
from ucm.drivers import LoadState
from ucm.drivers._shm_arena import ShmArena
from ucm.drivers._shm_trust import PRIVATE, Sharing, default_shm_dir
from ucm.drivers.memory import MemoryDriver
from ucm.drivers.posix import PosixDriver
from ucm.errors import ConfigError

MiB = 2**20
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: gives files to uid 65534")


@pytest.fixture
def shm_dir():
    path = Path("/dev/shm") / f"ucm-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def open_arena(shm_dir: Path, sharing: Sharing = PRIVATE) -> ShmArena:
    return ShmArena.open(str(shm_dir / "ns.arena"), size=8 * MiB, namespace="ns",
                         codec=Codec.NONE, sharing=sharing)


def planted_arena(shm_dir: Path) -> bytes:
    """An arena written by "the attacker" (here: this process, before handing it over)."""
    arena = open_arena(shm_dir)
    arena.store([b"k"], [memoryview(b"planted" * 100)])
    arena.close()
    return (shm_dir / "ns.arena").read_bytes()


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_new_directory_and_files_are_private_whatever_the_umask(shm_dir: Path):
    old = os.umask(0)
    try:
        open_arena(shm_dir).close()
    finally:
        os.umask(old)
    assert mode_of(shm_dir) == 0o700
    assert mode_of(shm_dir / "ns.arena") == 0o600
    assert mode_of(shm_dir / "ns.arena.lock") == 0o600


@as_root
def test_a_directory_another_user_owns_is_refused(shm_dir: Path):
    shm_dir.mkdir(mode=0o700)
    os.chown(shm_dir, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=rf"{shm_dir}: the directory is owned by uid 65534"):
        open_arena(shm_dir)
    assert list(shm_dir.iterdir()) == []  # nothing of the victim's went into it


@as_root
@pytest.mark.parametrize("name", ["ns.arena", "ns.arena.lock"])
def test_an_arena_file_another_user_owns_is_refused(shm_dir: Path, name: str):
    planted = planted_arena(shm_dir)
    os.chown(shm_dir / name, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=rf"{shm_dir / name}: the file is owned by uid 65534"):
        open_arena(shm_dir)
    assert (shm_dir / "ns.arena").read_bytes() == planted  # neither read as data nor written


async def test_the_driver_refuses_a_planted_arena_and_loads_nothing_from_it(shm_dir: Path):
    planted_arena(shm_dir)
    (shm_dir / "ns.arena").chmod(0o666)  # "so that the victim can write it too"
    with pytest.raises(ConfigError, match="the file is writable by every user"):
        await MemoryDriver.open({"shared": True, "shm_dir": str(shm_dir)}, name="m",
                                namespace="ns")


@pytest.mark.parametrize("mode, reason", [(0o777, "writable by every user"),
                                          (0o1777, "writable by every user"),
                                          (0o770, "writable by group 0")])
def test_a_directory_others_can_write_is_refused(shm_dir: Path, mode: int, reason: str):
    shm_dir.mkdir()
    shm_dir.chmod(mode)
    with pytest.raises(ConfigError, match=rf"{shm_dir}: the directory is {reason}"):
        open_arena(shm_dir)


def test_a_group_writable_file_is_refused_unless_shared_with_that_group(shm_dir: Path):
    planted_arena(shm_dir)
    os.chown(shm_dir / "ns.arena", -1, NOBODY)
    (shm_dir / "ns.arena").chmod(0o660)
    with pytest.raises(ConfigError, match="writable by group 65534"):
        open_arena(shm_dir)
    with pytest.raises(ConfigError, match="writable by group 65534"):
        open_arena(shm_dir, Sharing(0o660, gid=NOBODY + 1))


def test_a_symlinked_directory_is_refused(shm_dir: Path, tmp_path: Path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    shm_dir.symlink_to(target)
    with pytest.raises(ConfigError, match=rf"{shm_dir}: the directory is a symlink"):
        open_arena(shm_dir)
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("name", ["ns.arena", "ns.arena.lock"])
def test_a_symlinked_file_is_refused_and_its_target_untouched(shm_dir: Path, tmp_path: Path,
                                                              name: str):
    shm_dir.mkdir(mode=0o700)
    target = tmp_path / "victim-file"
    target.write_bytes(b"precious")
    (shm_dir / name).symlink_to(target)
    with pytest.raises(ConfigError, match=rf"{shm_dir / name}: the file is a symlink"):
        open_arena(shm_dir)
    assert target.read_bytes() == b"precious"
    dangling = shm_dir / "dangling"
    (shm_dir / name).unlink()
    (shm_dir / name).symlink_to(dangling)  # O_CREAT would create the target through it
    with pytest.raises(ConfigError, match="the file is a symlink"):
        open_arena(shm_dir)
    assert not dangling.exists()


def test_racing_creators_share_one_arena(shm_dir: Path):
    """Threads opening a fresh arena at once: one creates each file, the others open it (and
    check it); all see one arena."""
    import threading

    arenas: list[ShmArena] = []
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def opener() -> None:
        start.wait()
        try:
            arenas.append(open_arena(shm_dir))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=opener) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert errors == [] and len(arenas) == 6
        arenas[0].store([b"k"], [memoryview(b"v" * 100)])
        assert all(arena.lookup([b"k"]) == [True] for arena in arenas)
    finally:
        for arena in arenas:
            arena.close()


def test_a_file_removed_between_the_two_opens_is_created_again(shm_dir: Path, monkeypatch):
    import ucm.drivers._shm_trust as trust

    planted_arena(shm_dir)
    real_open = os.open
    removed: list[str] = []

    def racing_open(name, flags, *args, **kwargs):
        if flags & os.O_EXCL and name == "ns.arena" and not removed:
            try:
                return real_open(name, flags, *args, **kwargs)
            finally:  # the other process removes its file right after our create failed
                os.unlink(shm_dir / name)
                removed.append(name)
        return real_open(name, flags, *args, **kwargs)

    monkeypatch.setattr(trust.os, "open", racing_open)
    arena = open_arena(shm_dir)
    try:
        assert removed == ["ns.arena"] and arena.lookup([b"k"]) == [False]  # a fresh arena
    finally:
        arena.close()


def test_a_fifo_at_the_arena_path_is_refused_without_hanging(shm_dir: Path):
    shm_dir.mkdir(mode=0o700)
    os.mkfifo(shm_dir / "ns.arena", 0o600)
    with pytest.raises(ConfigError, match="not a file"):
        open_arena(shm_dir)


def test_a_truncated_arena_is_refused_at_open(shm_dir: Path):
    """A mapping of the missing tail would raise SIGBUS on the first load that touched it."""
    planted_arena(shm_dir)
    os.truncate(shm_dir / "ns.arena", 4 * MiB)
    with pytest.raises(ConfigError, match=r"is 4194304 bytes, but its header says 8388608"):
        open_arena(shm_dir)


def test_a_header_whose_layout_disagrees_with_its_size_is_refused(shm_dir: Path):
    import ucm.drivers._shm_arena as arena_module
    from ucm.drivers._slots import seal

    planted_arena(shm_dir)
    pages, buckets, table, owners, data = arena_module.geometry(8 * MiB)
    forged = arena_module._HEAD.pack(arena_module._HEAD_MAGIC, arena_module._VERSION,
                                     arena_module.WAYS, pages * 4, buckets, table, owners,
                                     data, 8 * MiB)  # owners and pages far past the file
    with open(shm_dir / "ns.arena", "r+b") as f:
        f.write(seal(forged))
    with pytest.raises(ConfigError, match="the header's layout does not match its size"):
        open_arena(shm_dir)


@as_root
def test_sharing_with_a_group_trusts_its_members_only(shm_dir: Path):
    group = Sharing(0o660, gid=NOBODY)  # nobody's primary group: it counts as a member
    arena = open_arena(shm_dir, group)
    arena.store([b"k"], [memoryview(b"v" * 100)])
    arena.close()
    assert mode_of(shm_dir) == 0o2770 and os.stat(shm_dir).st_gid == NOBODY
    assert mode_of(shm_dir / "ns.arena") == 0o660
    assert os.stat(shm_dir / "ns.arena").st_gid == NOBODY
    # A member of the group created the files: trusted when sharing, refused otherwise.
    for path in (shm_dir, shm_dir / "ns.arena", shm_dir / "ns.arena.lock"):
        os.chown(path, NOBODY, NOBODY)
    arena = open_arena(shm_dir, group)
    try:
        out = memoryview(bytearray(100))
        assert arena.load([b"k"], [out]) == [LoadState.OK] and out == b"v" * 100
    finally:
        arena.close()
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        open_arena(shm_dir)


def test_mode_and_group_options_are_checked():
    options = MemoryDriver.Options
    assert options(shared=True, mode="0640").sharing() == Sharing(0o640)
    assert options(shared=True, group=NOBODY).sharing() == Sharing(0o660, NOBODY)
    assert options(shared=True).sharing() == Sharing(0o600)
    for bad, reason in (({"mode": 0o666, "group": 0}, "lets every user write"),
                        ({"mode": 0o660}, "lets a group write the arena: name it"),
                        ({"mode": 0o400}, "must be permission bits that include 0600")):
        with pytest.raises(ValueError, match=reason):
            options(shared=True, **bad)


async def test_group_and_mode_apply_to_shared_mode_only():
    for options in ({"group": 0}, {"mode": 0o600}):
        with pytest.raises(ConfigError, match="applies to shared mode only"):
            await MemoryDriver.open(options, name="m", namespace="ns")


# -- other uids, for real --------------------------------------------------------------------

def _as_nobody(python: bool = True) -> list[str]:
    """The command prefix that runs a child as uid/gid 65534 with no supplementary groups
    (and, for a `python` child, the means to reach this interpreter)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a child under another uid")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    prefix = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    if python and subprocess.run([*prefix, sys.executable, "-c", "pass"],
                                 capture_output=True).returncode != 0:
        # The interpreter lies under a directory only root may search (/root/.pyenv): the
        # child may read and search past that, which gives it no write access anywhere.
        prefix += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    return prefix


_CHILD = """
import sys, trio
from ucm.drivers import LoadState
from ucm.drivers.memory import MemoryDriver

async def main():
    drv = await MemoryDriver.open({"shared": True, "size": "8MiB"}, name="m",
                                  namespace=sys.argv[1])
    await drv.store([b"k"], [memoryview(b"mine" * 256)])
    out = memoryview(bytearray(1024))
    assert await drv.load([b"k"], [out]) == [LoadState.OK] and out == b"mine" * 256
    print(drv.arena.path)
    await drv.aclose()

trio.run(main)
"""


async def test_two_users_on_one_host_each_get_their_own_arena():
    prefix = _as_nobody()
    namespace = f"ucm-test-{uuid.uuid4().hex[:12]}"
    theirs = Path(default_shm_dir()).with_name(f"ucm-{NOBODY}")
    existed = theirs.exists()
    mine = await MemoryDriver.open({"shared": True, "size": "8MiB"}, name="m",
                                   namespace=namespace)
    try:
        await mine.store([b"k"], [memoryview(b"root" * 256)])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        child = subprocess.run([*prefix, sys.executable, "-c", _CHILD, namespace],
                               capture_output=True, text=True, env=env, timeout=120)
        assert child.returncode == 0, child.stderr
        assert child.stdout.strip() == str(theirs / f"{namespace}.arena")
        assert mine.arena.path == f"{default_shm_dir()}/{namespace}.arena"
        assert os.stat(theirs).st_uid == NOBODY and mode_of(theirs) == 0o700
        assert os.stat(theirs / f"{namespace}.arena").st_uid == NOBODY
        out = memoryview(bytearray(1024))
        assert await mine.load([b"k"], [out]) == [LoadState.OK] and out == b"root" * 256
    finally:
        await mine.aclose()
        for suffix in ("", ".lock"):
            Path(f"{mine.arena.path}{suffix}").unlink(missing_ok=True)
            (theirs / f"{namespace}.arena{suffix}").unlink(missing_ok=True)
        if not existed:
            shutil.rmtree(theirs, ignore_errors=True)


@pytest.fixture
def public_parent():
    """A directory others may search, like /var/cache: privacy must come from ucm's modes."""
    path = Path(tempfile.mkdtemp(prefix="ucm-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_another_user_cannot_read_a_posix_block(public_parent: Path):
    prefix = _as_nobody(python=False)  # no capability: the read is a plain one
    drv = await PosixDriver.open({"path": str(public_parent / "store")}, name="p",
                                 namespace="ns")
    try:
        await drv.store([b"k"], [memoryview(b"secret prompt" * 100)])
        block = drv.block_path(b"k")
    finally:
        await drv.aclose()
    child = subprocess.run([*prefix, "head", "-c", "1", block], capture_output=True,
                           text=True, timeout=60)
    assert child.returncode != 0 and "Permission denied" in child.stderr, child.stdout
