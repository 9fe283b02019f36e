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
from ucm.drivers import LoadState, _blockfiles, _mapped
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
    host = _blockfiles._HOST
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


@pytest.mark.parametrize("option", ["direct", "direct_writes"])
async def test_direct_rejects_filesystems_without_o_direct(tmp_path: Path, monkeypatch, option):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(_blockfiles.os, "open", no_direct)
    with pytest.raises(ConfigError,
                       match=rf"^{option}: the filesystem of {tmp_path}/ns does not.*"
                             rf"set {option}: false"):
        await open_posix(str(tmp_path), **{option: True})


async def test_direct_writes_leave_stores_out_of_the_page_cache_and_reads_as_usual(
        tmp_path: Path):
    data = os.urandom((1 << 20) + 100)  # not a whole number of pages: the bounce buffer
    drv = await open_posix(str(tmp_path), direct_writes=True)
    try:
        assert drv.files.maps is not None  # reads stay buffered, listed blocks mapped
        await drv.store([b"k"], [memoryview(data)])
        path = drv.block_path(b"k")
        assert os.path.getsize(path) == 4096 + len(data)
        if _resident_pages(path) > 0:
            pytest.skip("this filesystem caches O_DIRECT writes")
        out = memoryview(bytearray(len(data)))
        assert await drv.load([b"k"], [out]) == [LoadState.OK] and out == data
        assert _resident_pages(path) == 256 + 2  # read in by the buffered load
    finally:
        await drv.aclose()
    again = await open_posix(str(tmp_path), direct_writes=True)
    try:
        assert [k async for k, _ in again.list_blocks()] == [b"k"]
        assert len(again.files.maps) == 1
        out = memoryview(bytearray(len(data)))
        assert await again.load([b"k"], [out]) == [LoadState.OK] and out == data
        assert again.files.maps.loads == 1
    finally:
        await again.aclose()


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
    real_write_all = _blockfiles._write_all

    def full(fd, parts, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_blockfiles, "_write_all", full)
    with pytest.raises(NoCapacity, match="no space left"):
        await drv.store([b"a", b"b"], [memoryview(b"1"), memoryview(b"2")])
    assert list((tmp_path / "ns" / ".tmp").iterdir()) == []  # temp files cleaned up
    calls = []

    def full_once(fd, parts, offset):  # the first key fails, the second is stored
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write_all(fd, parts, offset)

    monkeypatch.setattr(_blockfiles, "_write_all", full_once)
    sizes = await drv.store([b"a", b"b"], [memoryview(b"1"), memoryview(b"2")])
    assert sizes == [0, 4097]
    assert drv.statistics()["store_failed"] == 1  # the raised batch counts nothing
    await drv.aclose()


async def test_read_errors_are_failed_and_vanished_files_missing(tmp_path: Path, monkeypatch):
    drv = await open_posix(str(tmp_path), map_bytes=0)  # reads (mapped loads: further down)
    await drv.store([b"a", b"b"], [memoryview(b"1"), memoryview(b"2")])
    os.unlink(drv.block_path(b"a"))  # deleted between lookup and load
    real_read = _blockfiles._read_into

    def eio(fd, parts, offset, *, once=False):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_blockfiles, "_read_into", eio)
    outs = [memoryview(bytearray(1)), memoryview(bytearray(1))]
    assert await drv.load([b"a", b"b"], outs) == [LoadState.MISSING, LoadState.FAILED]
    with pytest.raises(StorageUnavailable, match="all 1 reads failed"):
        await drv.load([b"b"], outs[1:])
    monkeypatch.setattr(_blockfiles, "_read_into", real_read)
    assert await drv.load([b"b"], outs[1:]) == [LoadState.OK]
    assert drv.statistics()["failed"] == 2
    await drv.aclose()


async def test_fsync_option_syncs_file_and_directory(tmp_path: Path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(_blockfiles.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    drv = await open_posix(str(tmp_path), fsync=True)
    await drv.store([b"k"], [memoryview(b"v")])
    assert len(synced) == 2
    plain = await open_posix(str(tmp_path / "p"))
    await plain.store([b"k"], [memoryview(b"v")])
    assert len(synced) == 2
    await drv.aclose()
    await plain.aclose()


# --- blocks kept mapped (ucm/drivers/_mapped.py) ------------------------------------------


async def _restarted(path: str, datas: list[bytes], **options) -> tuple[PosixDriver, list]:
    """Stores the blocks, then opens a second driver that lists them (as a kernel does at
    start), which maps those in the page cache."""
    keys = [f"key{i}".encode() for i in range(len(datas))]
    first = await open_posix(path)
    await first.store(keys, [memoryview(d) for d in datas])
    await first.aclose()
    drv = await open_posix(path, **options)
    assert {k async for k, _ in drv.list_blocks()} == set(keys)
    return drv, keys


def _no_reads(monkeypatch) -> None:
    """A load that reads a file instead of copying from its mapping fails the test."""
    def fail(*args):
        raise AssertionError("read the file instead of the mapping")

    monkeypatch.setattr(_blockfiles.BlockFiles, "_load_fd", fail)


async def test_listed_blocks_in_the_page_cache_load_from_their_mappings(tmp_path: Path,
                                                                         monkeypatch):
    datas = [os.urandom(2 * 2**20), os.urandom(70_000), os.urandom(5)]
    drv, keys = await _restarted(str(tmp_path), datas)
    try:
        assert len(drv.files.maps) == 3
        _no_reads(monkeypatch)
        outs = [memoryview(bytearray(len(d))) for d in datas]
        assert await drv.load(keys, outs) == [LoadState.OK] * 3
        assert [bytes(o) for o in outs] == datas
        # A byte flipped in the file shows through the shared mapping. The write changed the
        # file's times, which drops the mapping; with them as they were, the copy out of the
        # mapping finds the block corrupt.
        path = drv.block_path(keys[0])
        with open(path, "r+b") as f:
            f.seek(4096 + 1000)
            byte = f.read(1)
            f.seek(4096 + 1000)
            f.write(bytes([byte[0] ^ 1]))
        drv.files.maps._maps[keys[0]].identity = _mapped.identity(os.stat(path))
        assert await drv.load(keys[:1], outs[:1]) == [LoadState.CORRUPT]
        assert keys[0] not in drv.files.maps  # a corrupt block's mapping is dropped
        # mapped again by the next load: corrupt again, and dropped again
        assert await drv.load(keys[:1], outs[:1]) == [LoadState.CORRUPT]
        assert keys[0] not in drv.files.maps and drv.statistics()["mapped_on_load"] == 1
        monkeypatch.undo()
        plain = await open_posix(str(tmp_path), map_bytes=0)
        assert await plain.load(keys[:1], outs[:1]) == [LoadState.CORRUPT]  # read: corrupt too
        await plain.aclose()
    finally:
        await drv.aclose()


async def _replace_delete_truncate(drv: PosixDriver, other: PosixDriver,
                                   keys: list[bytes]) -> bytes:
    """Another process's driver replaces keys[0] (returns its new bytes) and deletes keys[1];
    keys[2]'s file is cut short in place."""
    new = os.urandom(100_000)
    await other.store(keys[:1], [memoryview(new)])
    await other.delete(keys[1:2])
    path = drv.block_path(keys[2])
    os.truncate(path, os.path.getsize(path) - 10)
    return new


async def test_a_replaced_deleted_or_truncated_file_is_not_read_from_its_old_mapping(
        tmp_path: Path):
    datas = [os.urandom(100_000) for _ in range(3)]
    drv, keys = await _restarted(str(tmp_path), datas)
    other = await open_posix(str(tmp_path))  # another process's driver
    try:
        assert len(drv.files.maps) == 3
        new = await _replace_delete_truncate(drv, other, keys)
        outs = [memoryview(bytearray(100_000)) for _ in keys]
        assert await drv.load(keys, outs) == [LoadState.OK, LoadState.MISSING,
                                              LoadState.CORRUPT]
        assert bytes(outs[0]) == new
        # the old mappings are gone; the load of the replaced block mapped its new file, and
        # the truncated one's new mapping was dropped when its header failed
        assert list(drv.files.maps._maps) == keys[:1]
        assert drv.files.maps._maps[keys[0]].identity == _mapped.identity(
            os.stat(drv.block_path(keys[0])))
        assert drv.statistics()["mapped_on_load"] == 2
    finally:
        await drv.aclose()
        await other.aclose()


async def test_mapping_stays_within_its_budget_and_off_when_asked(tmp_path: Path):
    datas = [os.urandom(1 << 20) for _ in range(4)]
    drv, _ = await _restarted(str(tmp_path), datas, map_bytes=2 * (1 << 20) + 2 * 4096)
    assert len(drv.files.maps) == 2 and drv.files.maps.mapped_bytes <= drv.files.maps.limit_bytes
    await drv.aclose()
    for options in ({"map_bytes": 0}, {"direct": True}):
        drv = await open_posix(str(tmp_path), **options)
        assert len([k async for k, _ in drv.list_blocks()]) == 4
        assert drv.files.maps is None
        await drv.aclose()


async def test_blocks_not_in_the_page_cache_are_read_in_when_mapped(tmp_path: Path,
                                                                   monkeypatch):
    data = os.urandom(1 << 20)
    first = await open_posix(str(tmp_path))
    await first.store([b"cold"], [memoryview(data)])
    path = first.block_path(b"cold")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _resident_pages(path) == 256 + 1:
        pytest.skip("this filesystem kept the pages")
    drv = await open_posix(str(tmp_path))
    try:
        assert len([k async for k, _ in drv.list_blocks()]) == 1
        assert _resident_pages(path) == 256 + 1  # payload and header, read in at listing
        _no_reads(monkeypatch)
        out = memoryview(bytearray(1 << 20))
        assert await drv.load([b"cold"], [out]) == [LoadState.OK] and out == data
    finally:
        await drv.aclose()
        await first.aclose()


async def test_a_block_stored_after_start_is_mapped_by_its_first_load(tmp_path: Path,
                                                                       monkeypatch):
    drv = await open_posix(str(tmp_path))  # map_bytes: auto
    try:
        assert drv.files.maps is not None and drv.files.maps.limit_bytes > 0
        assert [k async for k, _ in drv.list_blocks()] == []  # the kernel's listing at start
        datas = [os.urandom(2 * 2**20), os.urandom(70_000), os.urandom(5000)]
        keys = [b"k0", b"k1", b"k2"]
        await drv.store(keys, [memoryview(d) for d in datas])
        assert len(drv.files.maps) == 0 and not drv.files.in_memory(keys)
        _no_reads(monkeypatch)  # not one preadv: the first load maps, the next ones copy
        for _ in range(2):
            outs = [memoryview(bytearray(len(d))) for d in datas]
            assert await drv.load(keys, outs) == [LoadState.OK] * 3
            assert [bytes(o) for o in outs] == datas
            assert drv.files.in_memory(keys)  # from now on the kernel's fast path may take it
        stats = drv.statistics()
        assert stats["mapped_on_load"] == 3 and stats["mapped_loads"] == 6
        assert stats["mapped_blocks"] == 3 and stats["maps_dropped"] == 0
        assert stats["mapped_bytes"] == sum(os.path.getsize(drv.block_path(k)) for k in keys)
    finally:
        await drv.aclose()


async def test_loads_map_within_the_budget_dropping_the_least_recently_loaded(
        tmp_path: Path):
    size = 1 << 20
    drv = await open_posix(str(tmp_path), map_bytes=2 * (size + 4096))  # room for two
    try:
        keys = [b"k0", b"k1", b"k2"]
        datas = [os.urandom(size) for _ in keys]
        await drv.store(keys, [memoryview(d) for d in datas])
        out = memoryview(bytearray(size))
        for key in (b"k0", b"k1", b"k0", b"k2"):  # k1 is then the least recently loaded
            assert await drv.load([key], [out]) == [LoadState.OK]
            assert out == datas[keys.index(key)]
            maps = drv.files.maps
            assert maps.mapped_bytes <= maps.limit_bytes and len(maps) <= 2
        assert set(drv.files.maps._maps) == {b"k0", b"k2"}
        stats = drv.statistics()
        assert stats["mapped_on_load"] == 3 and stats["maps_dropped"] == 1
        assert stats["mapped_loads"] == 4
        # a block larger than the whole budget is read, never mapped, and drops nothing
        big = os.urandom(3 * size)
        await drv.store([b"big"], [memoryview(big)])
        out = memoryview(bytearray(3 * size))
        assert await drv.load([b"big"], [out]) == [LoadState.OK] and out == big
        assert set(drv.files.maps._maps) == {b"k0", b"k2"}
        assert drv.statistics()["mapped_loads"] == 4
    finally:
        await drv.aclose()


def test_the_mapping_count_stays_within_its_limit(tmp_path: Path):
    cache = _mapped.MapCache(2**30, limit_maps=2)
    for i in range(4):
        path = tmp_path / f"{i}.blk"
        path.write_bytes(os.urandom(8192))
        fd = os.open(path, os.O_RDONLY)
        try:
            assert cache.map_opened(b"%d" % i, fd, os.fstat(fd)) is not None
        finally:
            os.close(fd)
        assert len(cache) <= 2
    assert list(cache._maps) == [b"2", b"3"] and cache.evicted == 2
    assert cache.adopt(b"4", str(tmp_path / "0.blk")) is False  # the listing drops nothing


async def test_a_block_mapped_by_a_load_then_replaced_deleted_or_truncated(tmp_path: Path):
    drv = await open_posix(str(tmp_path))
    other = await open_posix(str(tmp_path))  # another process's driver
    try:
        keys = [b"a", b"b", b"c"]
        await drv.store(keys, [memoryview(os.urandom(100_000)) for _ in keys])
        outs = [memoryview(bytearray(100_000)) for _ in keys]
        assert await drv.load(keys, outs) == [LoadState.OK] * 3
        assert len(drv.files.maps) == 3
        new = await _replace_delete_truncate(drv, other, keys)
        assert await drv.load(keys, outs) == [LoadState.OK, LoadState.MISSING,
                                              LoadState.CORRUPT]
        assert bytes(outs[0]) == new
        assert list(drv.files.maps._maps) == keys[:1]  # the new file, mapped by that load
    finally:
        await drv.aclose()
        await other.aclose()


async def test_a_mapping_that_would_fault_is_not_used(tmp_path: Path, monkeypatch):
    """Where MADV_POPULATE_READ says that an access would fault (a file truncated under the
    new mapping, an I/O error), the block is read with preadv instead, and the listing leaves
    it unmapped: never a SIGBUS."""
    data = os.urandom(1 << 20)
    drv = await open_posix(str(tmp_path))
    try:
        await drv.store([b"k"], [memoryview(data)])
        monkeypatch.setattr(_mapped, "madvise", lambda addr, length, advice: errno.EFAULT)
        reads = []
        real = _blockfiles.BlockFiles._load_fd
        monkeypatch.setattr(_blockfiles.BlockFiles, "_load_fd",
                            lambda self, *a: reads.append(1) or real(self, *a))
        out = memoryview(bytearray(1 << 20))
        assert await drv.load([b"k"], [out]) == [LoadState.OK] and out == data
        assert reads == [1] and len(drv.files.maps) == 0
        assert drv.statistics()["mapped_on_load"] == 0
        lister = await open_posix(str(tmp_path))
        assert [k async for k, _ in lister.list_blocks()] == [b"k"]
        assert len(lister.files.maps) == 0
        await lister.aclose()
    finally:
        await drv.aclose()


async def test_a_planted_file_longer_than_the_block_is_not_mapped(tmp_path: Path):
    drv = await open_posix(str(tmp_path))
    try:
        await drv.store([b"k"], [memoryview(os.urandom(4096))])
        with open(drv.block_path(b"k"), "ab") as f:
            f.write(bytes(8 << 20))  # the header says 4 KiB: corrupt, and never 8 MiB mapped
        out = memoryview(bytearray(4096))
        assert await drv.load([b"k"], [out]) == [LoadState.CORRUPT]
        assert drv.statistics()["mapped_on_load"] == 0 and len(drv.files.maps) == 0
    finally:
        await drv.aclose()


def test_map_bytes_auto_is_a_quarter_of_the_memory_this_process_may_use(monkeypatch):
    options = PosixDriver.Options(path="/tmp/x")
    assert options.map_bytes == "auto"
    assert options.map_limit == _mapped.usable_memory() // 4 > 0
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert _mapped.usable_memory() <= host
    limits = {"/sys/fs/cgroup/memory.max": 8 * 2**30, "/proc/sys/vm/max_map_count": 1000}
    monkeypatch.setattr(_mapped, "_read_int", limits.get)
    assert options.map_limit == min(host, 8 * 2**30) // 4  # a cgroup's limit counts
    assert _mapped.max_maps() == 250 and _mapped.MapCache(1).limit_maps == 250
    assert PosixDriver.Options(path="/tmp/x", map_bytes="2GiB").map_limit == 2**31


def test_the_schedulers_posix_tier_maps_nothing_by_default():
    from ucm.vllm_hook.settings import scheduler_config

    cfg = load_config({"tiers": [{"driver": "posix", "path": "/tmp/x"}]})
    assert cfg.tiers[0].options.map_bytes == "auto"
    assert scheduler_config(cfg).tiers[0].options.map_bytes == 0


def _resident_pages(path: str) -> int:
    """Pages of the file in the page cache (mincore over a mapping of our own)."""
    import ctypes
    import mmap

    from ucm.block import buffer_address

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ)
    view = memoryview(mm)
    try:
        pages = -(-view.nbytes // 4096)
        vec = ctypes.create_string_buffer(pages)
        assert libc.mincore(buffer_address(view), view.nbytes, vec) == 0
        return sum(b & 1 for b in vec.raw[:pages])
    finally:
        view.release()
        mm.close()
