"""posix driver specifics: layout, striping, temp-file sweeping, O_DIRECT, error translation.
The shared behaviour is in tests/contract."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ucm.config import load_config
from ucm.drivers import LoadState, _files
from ucm.drivers.posix import PosixDriver
from ucm.errors import ConfigError, NoCapacity, StorageUnavailable


async def open_posix(path, **options) -> PosixDriver:
    return await PosixDriver.open({"path": path, **options}, name="disk", namespace="ns")


async def test_layout_shards_by_key_hex(tmp_path: Path):
    drv = await open_posix(str(tmp_path))
    key = bytes.fromhex("abcdef0123")
    await drv.store([key], [memoryview(b"x" * 10)])
    assert drv.block_path(key) == str(tmp_path / "ns" / "ab" / "cd" / "abcdef0123.blk")
    assert os.path.getsize(drv.block_path(key)) == 4096 + 10
    assert drv.persistent is True
    await drv.aclose()


async def test_long_keys_are_named_by_digest_and_listed(tmp_path: Path):
    drv = await open_posix(str(tmp_path), shard_depth=0)
    key = bytes(range(200))
    await drv.store([key], [memoryview(b"long")])
    assert drv.block_path(key).endswith(".lblk")
    assert [k async for k, _ in drv.list_blocks()] == [key]
    out = memoryview(bytearray(4))
    assert await drv.load([key], [out]) == [LoadState.OK] and out == b"long"
    await drv.aclose()


async def test_striping_spreads_keys_and_is_stable(tmp_path: Path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    drv = await open_posix(roots)
    keys = [i.to_bytes(8, "big") for i in range(64)]
    await drv.store(keys, [memoryview(b"v")] * 64)
    counts = [sum(1 for _ in Path(r).rglob("*.blk")) for r in roots]
    assert sum(counts) == 64 and min(counts) > 10
    again = await open_posix(roots)
    assert [again.block_path(k) for k in keys] == [drv.block_path(k) for k in keys]
    await drv.aclose()
    await again.aclose()


async def test_open_sweeps_only_dead_writers_temp_files(tmp_path: Path):
    drv = await open_posix(str(tmp_path))
    await drv.aclose()
    tmp = tmp_path / "ns" / ".tmp"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    host = _files._HOST
    dead_file = tmp / f"{host}.{dead.stdout.strip()}.1.abc.tmp"
    live_file = tmp / f"{host}.{os.getppid()}.1.abc.tmp"
    other_host = tmp / f"elsewhere.{dead.stdout.strip()}.1.abc.tmp"
    for f in (dead_file, live_file, other_host):
        f.write_bytes(b"partial")
    drv = await open_posix(str(tmp_path))
    assert not dead_file.exists()
    assert live_file.exists() and other_host.exists()
    assert [k async for k, _ in drv.list_blocks()] == []
    await drv.aclose()


async def test_direct_rejects_filesystems_without_o_direct(tmp_path: Path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(_files.os, "open", no_direct)
    with pytest.raises(ConfigError, match=rf"direct: the filesystem of {tmp_path}/ns does not"):
        await open_posix(str(tmp_path), direct=True)


async def test_direct_uses_aligned_caller_buffers(tmp_path: Path):
    import mmap

    drv = await open_posix(str(tmp_path), direct=True)
    src, dst = mmap.mmap(-1, 8192), mmap.mmap(-1, 8192)
    src[:] = os.urandom(8192)
    await drv.store([b"k"], [memoryview(src)])
    assert await drv.load([b"k"], [memoryview(dst)]) == [LoadState.OK]
    assert dst[:] == src[:]
    await drv.aclose()


def test_options_are_checked():
    with pytest.raises(ConfigError, match="path must name at least one directory"):
        load_config({"tiers": [{"driver": "posix", "path": []}]})
    with pytest.raises(ConfigError, match="lists a directory twice"):
        load_config({"tiers": [{"driver": "posix", "path": ["/a", "/a"]}]})
    with pytest.raises(ConfigError, match="unknown key"):
        load_config({"tiers": [{"driver": "posix", "path": "/a", "fsycn": True}]})


async def test_unknown_codec_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="codec: unknown codec 'lz4'"):
        await PosixDriver.open({"path": str(tmp_path)}, name="d", namespace="n", codec="lz4")


async def test_unusable_path_is_storage_unavailable(tmp_path: Path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StorageUnavailable, match="disk: "):
        await open_posix(str(tmp_path / "file"))


async def test_enospc_is_no_capacity(tmp_path: Path, monkeypatch):
    drv = await open_posix(str(tmp_path))
    real_write_all = _files._write_all

    def full(fd, parts, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_files, "_write_all", full)
    with pytest.raises(NoCapacity, match="no space left"):
        await drv.store([b"a", b"b"], [memoryview(b"1"), memoryview(b"2")])
    assert list((tmp_path / "ns" / ".tmp").iterdir()) == []  # temp files cleaned up
    calls = []

    def full_once(fd, parts, offset):  # the first key fails, the second is stored
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write_all(fd, parts, offset)

    monkeypatch.setattr(_files, "_write_all", full_once)
    sizes = await drv.store([b"a", b"b"], [memoryview(b"1"), memoryview(b"2")])
    assert sizes == [0, 4097]
    assert drv.statistics()["store_failed"] == 1  # the raised batch counts nothing
    await drv.aclose()


async def test_read_errors_are_failed_and_vanished_files_missing(tmp_path: Path, monkeypatch):
    drv = await open_posix(str(tmp_path))
    await drv.store([b"a", b"b"], [memoryview(b"1"), memoryview(b"2")])
    os.unlink(drv.block_path(b"a"))  # deleted between lookup and load
    real_read = _files._read_into

    def eio(fd, parts, offset, *, once=False):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_files, "_read_into", eio)
    outs = [memoryview(bytearray(1)), memoryview(bytearray(1))]
    assert await drv.load([b"a", b"b"], outs) == [LoadState.MISSING, LoadState.FAILED]
    with pytest.raises(StorageUnavailable, match="all 1 reads failed"):
        await drv.load([b"b"], outs[1:])
    monkeypatch.setattr(_files, "_read_into", real_read)
    assert await drv.load([b"b"], outs[1:]) == [LoadState.OK]
    assert drv.statistics()["failed"] == 2
    await drv.aclose()


async def test_fsync_option_syncs_file_and_directory(tmp_path: Path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(_files.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    drv = await open_posix(str(tmp_path), fsync=True)
    await drv.store([b"k"], [memoryview(b"v")])
    assert len(synced) == 2
    plain = await open_posix(str(tmp_path / "p"))
    await plain.store([b"k"], [memoryview(b"v")])
    assert len(synced) == 2
    await drv.aclose()
    await plain.aclose()
