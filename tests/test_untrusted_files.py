"""Nothing on storage is trusted (issue 23), tried as an attacker with write access to a posix
store would: blocks copied in from another namespace, symlinks, FIFOs and directories planted
at a block's path, forged headers with implausible lengths, zstd bombs, blocks of another
size, colliding namespace directories; and the modes of what the store creates. Each one is a
CORRUPT miss for its key (removed by the kernel), never data, a hang or a failed batch.
The tests run as root in CI: hostile state is planted, never simulated with chmod."""

from __future__ import annotations

import grp
import os
import random
import shutil
import stat
import struct
import tracemalloc
from pathlib import Path

import pytest
import trio
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucm.block import (
    PAYLOAD_OFFSET,
    BlockHeader,
    Codec,
    decode_header,
    encode_header,
    encode_payload,
)
from ucm.config import load_config
from ucm.drivers import LoadState, _blockfiles
from ucm.drivers._blockfiles import BlockFiles, FileLayout
from ucm.drivers._mapped import MapCache
from ucm.drivers.kit import safe_dir_name
from ucm.drivers.posix import PosixDriver
from ucm.errors import BlockCorrupt, ConfigError
from ucm.kernel import KernelCore, Load, Store

FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
FIXED = struct.Struct("<4sHBBHHIQQQ")


async def open_posix(path: Path, namespace: str = "ns", codec: str = "none",
                     **options) -> PosixDriver:
    return await PosixDriver.open({"path": str(path), **options}, name="disk",
                                  namespace=namespace, codec=codec)


def block_bytes(key: bytes, namespace: str, raw: bytes, codec: Codec = Codec.NONE) -> bytes:
    payload = bytes(encode_payload(codec, raw))
    return encode_header(key, namespace, codec, payload, len(raw)) + payload


def forge(key: bytes, namespace: str, *, codec: Codec, payload_len: int, raw_len: int,
          digest: int = 0) -> bytes:
    """A header with a valid header checksum naming any lengths (an attacker's)."""
    ns = namespace.encode()
    fixed = FIXED.pack(b"UCMB", 1, int(codec), 0, len(key), len(ns), PAYLOAD_OFFSET,
                       payload_len, raw_len, digest)
    head = fixed + struct.pack("<I", xxhash.xxh32_intdigest(fixed + key + ns)) + key + ns
    return head + bytes(PAYLOAD_OFFSET - len(head))


def plant(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def one_posix_tier(path: Path, namespace: str = "ns", **options):
    return load_config({"namespace": namespace,
                        "tiers": [{"driver": "posix", "path": str(path), **options}]})


# -- namespaces --------------------------------------------------------------------------------

def test_decode_header_checks_the_namespace():
    header = encode_header(b"key", "tenant-a", Codec.NONE, b"x", 1)
    assert decode_header(header, expect_namespace=b"tenant-a").namespace == "tenant-a"
    assert decode_header(header, expect_namespace="tenant-a").key == b"key"  # str works too
    for other in (b"tenant-b", "tenant-b", b"tenant-a\x00", b""):
        with pytest.raises(BlockCorrupt, match="names another namespace"):
            decode_header(header, expect_namespace=other)


@pytest.mark.parametrize("map_bytes", [0, 2**20], ids=["preadv", "mapped"])
async def test_a_block_copied_into_another_namespace_is_corrupt(tmp_path: Path, map_bytes):
    victim = await open_posix(tmp_path, "tenant-b", map_bytes=map_bytes)
    attacker = await open_posix(tmp_path, "tenant-a", map_bytes=map_bytes)
    key, mine, theirs = b"k" * 16, b"victim's own data", b"attacker's payload"
    await victim.store([key], [memoryview(mine)])
    await attacker.store([key], [memoryview(theirs)])
    shutil.copyfile(attacker.block_path(key), victim.block_path(key))  # a whole valid block
    long_key = bytes(range(200))
    await attacker.store([long_key], [memoryview(theirs)])
    plant(victim.block_path(long_key), Path(attacker.block_path(long_key)).read_bytes())
    await victim.aclose()
    await attacker.aclose()
    victim = await open_posix(tmp_path, "tenant-b", map_bytes=map_bytes)  # lists and maps
    listed = [k async for k, _ in victim.list_blocks()]
    assert long_key not in listed  # its header names the other namespace
    out = memoryview(bytearray(len(theirs)))
    assert await victim.load([key], [out]) == [LoadState.CORRUPT]
    assert bytes(out) != theirs or map_bytes == 0  # preadv lands in `out`, but never counts
    assert victim.statistics()["corrupt"] == 1
    assert victim.statistics().get("mapped_loads", 0) == (1 if map_bytes else 0)
    await victim.aclose()


async def test_the_kernel_removes_a_block_from_another_namespace(tmp_path: Path):
    key, theirs = b"k" * 16, b"planted by tenant-a"
    async with KernelCore.open(one_posix_tier(tmp_path, "tenant-a")) as core:
        await core.run(Store([key], buffers=[theirs]))
    src = tmp_path / safe_dir_name("tenant-a")
    dst = tmp_path / safe_dir_name("tenant-b")
    shutil.copytree(src, dst)
    async with KernelCore.open(one_posix_tier(tmp_path, "tenant-b")) as core:
        out = bytearray(len(theirs))
        result = await core.run(Load([key], buffers=[out]))
        assert result.states == (LoadState.CORRUPT,)
        await core.wait_background_idle()
    assert not any(p.suffix == ".blk" for p in dst.rglob("*"))
    assert any(p.suffix == ".blk" for p in src.rglob("*"))  # tenant-a's own copy is kept


def test_safe_dir_names_never_collide_with_escaped_ones():
    escaped = safe_dir_name("tenant/a")
    assert escaped.startswith("tenant_a-") and escaped != "tenant/a"
    assert safe_dir_name(escaped) != escaped  # the plain-looking twin is escaped in turn
    assert len({safe_dir_name(n) for n in ("tenant/a", escaped, "tenant_a", "tenant a")}) == 4
    for plain in ("default", "model-ns", "llama.3-8b_bf16", "x-0123456789abcde"):
        assert safe_dir_name(plain) == plain  # simple namespaces stay readable
    for odd in ("", ".", "..", ".tmp", "a/b", "é" * 127, "x" * 255):
        name = safe_dir_name(odd)
        assert name not in ("", ".", "..") and "/" not in name
        assert len(name.encode()) <= 255


@FUZZ
@given(st.lists(st.text(min_size=0, max_size=80) | st.sampled_from(
    ["tenant/a", safe_dir_name("tenant/a"), "a-0123456789abcdef", ".", ".."]),
    min_size=2, max_size=6, unique=True))
def test_safe_dir_name_is_injective_and_a_valid_component(namespaces):
    names = [safe_dir_name(n) for n in namespaces]
    assert len(set(names)) == len(names)
    for name in names:
        assert name and name not in (".", "..") and "/" not in name and "\x00" not in name
        assert len(name.encode()) <= 255


# -- untrusted files ---------------------------------------------------------------------------

async def test_a_symlink_at_a_blocks_path_is_corrupt_and_never_followed(tmp_path: Path):
    drv = await open_posix(tmp_path, map_bytes=2**20)
    secret = tmp_path / "secret.blk"
    key, data = b"s" * 16, b"the symlink's target"
    plant(str(secret), block_bytes(key, "ns", data))  # even a valid block is not served
    path = drv.block_path(key)
    os.makedirs(os.path.dirname(path))
    os.symlink(secret, path)
    out = memoryview(bytearray(len(data)))
    assert await drv.load([key], [out]) == [LoadState.CORRUPT]
    assert bytes(out) != data
    await drv.aclose()
    drv = await open_posix(tmp_path, map_bytes=2**20)
    assert [k async for k, _ in drv.list_blocks()] == []  # the listing passes over it
    assert drv.statistics()["mapped_blocks"] == 0
    assert MapCache(2**20).adopt(key, path) is False
    await drv.aclose()
    async with KernelCore.open(one_posix_tier(tmp_path)) as core:
        result = await core.run(Load([key], buffers=[bytearray(len(data))]))
        assert result.states == (LoadState.CORRUPT,)
        await core.wait_background_idle()
    assert not os.path.lexists(path) and secret.exists()  # the link went, not its target


async def test_a_mapped_block_replaced_by_a_symlink_is_not_served(tmp_path: Path):
    drv = await open_posix(tmp_path, map_bytes=2**20)
    key, data = b"m" * 16, b"mapped block"
    await drv.store([key], [memoryview(data)])
    await drv.aclose()
    drv = await open_posix(tmp_path, map_bytes=2**20)
    assert [k async for k, _ in drv.list_blocks()] == [key]  # maps it, as a kernel's start
    assert drv.statistics()["mapped_blocks"] == 1
    path = drv.block_path(key)
    moved = tmp_path / "moved.blk"
    os.rename(path, moved)
    os.symlink(moved, path)  # the same inode behind a link: still not followed
    assert await drv.load([key], [memoryview(bytearray(len(data)))]) == [LoadState.CORRUPT]
    await drv.aclose()


@pytest.mark.parametrize("name", ["blk", "lblk"])
async def test_a_fifo_never_hangs_a_load_the_listing_or_close(tmp_path: Path, name):
    drv = await open_posix(tmp_path, map_bytes=2**20)
    key = b"f" * 16 if name == "blk" else bytes(range(200))
    await drv.store([b"good"], [memoryview(b"ok")])
    path = drv.block_path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path)
    with trio.fail_after(60):  # a guard against a hang, not a timing assertion
        assert await drv.load([key, b"good"], [memoryview(bytearray(2))] * 2) == [
            LoadState.CORRUPT, LoadState.OK]
        await drv.aclose()
        drv = await open_posix(tmp_path, map_bytes=2**20)  # lists (and maps) at start
        assert [k async for k, _ in drv.list_blocks()] == [b"good"]
        assert MapCache(2**20).adopt(key, path) is False
        await drv.aclose()
        async with KernelCore.open(one_posix_tier(tmp_path)) as core:
            assert (await core.run(Load([key], buffers=[bytearray(2)]))).states == (
                LoadState.CORRUPT,)
            await core.wait_background_idle()
    assert not os.path.lexists(path)


async def test_a_directory_at_a_blocks_path_is_corrupt(tmp_path: Path):
    drv = await open_posix(tmp_path)
    key = b"d" * 16
    os.makedirs(drv.block_path(key))
    assert await drv.load([key], [memoryview(bytearray(2))]) == [LoadState.CORRUPT]
    await drv.delete([key])  # left in place, and no error
    await drv.aclose()


@pytest.mark.parametrize("codec", ["none", "zstd"])
@pytest.mark.parametrize("payload_len", [512 * 2**20, 2**40])
async def test_a_forged_length_allocates_nothing(tmp_path: Path, codec, payload_len):
    drv = await open_posix(tmp_path, codec=codec, map_bytes=0)
    key, size = b"L" * 16, 64 * 1024
    forged_raw = (forge(key, "ns", codec=Codec.NONE, payload_len=payload_len,
                        raw_len=payload_len),  # claims its own size
                  forge(key, "ns", codec=Codec.ZSTD, payload_len=payload_len, raw_len=size),
                  forge(key, "ns", codec=Codec.ZSTD, payload_len=size, raw_len=size))
    out = memoryview(bytearray(size))
    for head in forged_raw:
        plant(drv.block_path(key), head + b"\x28\xb5\x2f\xfd" + bytes(100))
        tracemalloc.start()
        try:
            states = await drv.load([key], [out])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert states == [LoadState.CORRUPT]
        assert peak < 16 * 2**20  # no buffer of the claimed length, nor of the file's
    await drv.aclose()


async def test_a_zstd_bomb_is_bounded_by_the_raw_size(tmp_path: Path):
    drv = await open_posix(tmp_path, codec="zstd")
    key, size = b"z" * 16, 4096
    declared = zstandard.ZstdCompressor().compress(bytes(64 * 2**20))  # declares 64 MiB
    undeclared = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(64 * 2**20))
    assert zstandard.frame_content_size(undeclared) == -1
    out = memoryview(bytearray(size))
    for frame in (declared, undeclared):
        digest = xxhash.xxh3_64_intdigest(frame)
        head = forge(key, "ns", codec=Codec.ZSTD, payload_len=len(frame), raw_len=size,
                     digest=digest)
        plant(drv.block_path(key), head + frame)
        tracemalloc.start()
        try:
            states = await drv.load([key], [out])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert states == [LoadState.CORRUPT]
        assert peak < 16 * 2**20
    await drv.aclose()


@pytest.mark.parametrize("map_bytes", [0, 2**20], ids=["preadv", "mapped"])
async def test_a_stored_block_of_another_size_is_corrupt_for_that_key_only(tmp_path: Path,
                                                                          map_bytes):
    drv = await open_posix(tmp_path, map_bytes=map_bytes)
    keys = [b"a" * 16, b"b" * 16]
    await drv.store(keys, [memoryview(b"1" * 100), memoryview(b"2" * 64)])
    await drv.aclose()
    drv = await open_posix(tmp_path, map_bytes=map_bytes)
    outs = [memoryview(bytearray(64)), memoryview(bytearray(64))]  # the first holds 100
    assert await drv.load(keys, outs) == [LoadState.CORRUPT, LoadState.OK]
    assert bytes(outs[1]) == b"2" * 64
    assert drv.statistics()["corrupt"] == 1
    await drv.aclose()
    async with KernelCore.open(one_posix_tier(tmp_path)) as core:  # every time: not a batch
        for _ in range(2):
            result = await core.run(Load(keys, buffers=[bytearray(64), bytearray(64)]))
            assert result.states[1] is LoadState.OK
            assert result.states[0] in (LoadState.CORRUPT, LoadState.MISSING)
            await core.wait_background_idle()
    assert not os.path.exists(drv.block_path(keys[0]))  # removed as corrupt


async def test_a_longer_file_than_its_header_says_is_corrupt(tmp_path: Path):
    drv = await open_posix(tmp_path, map_bytes=0)
    key, data = b"t" * 16, b"x" * 100
    await drv.store([key], [memoryview(data)])
    with open(drv.block_path(key), "ab") as f:
        f.write(b"trailing bytes")
    assert await drv.load([key], [memoryview(bytearray(100))]) == [LoadState.CORRUPT]
    await drv.aclose()


# -- file modes --------------------------------------------------------------------------------

def _modes(root: Path) -> tuple[set[int], set[int]]:
    files, dirs = set(), set()
    for p in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        (dirs if p.is_dir() else files).add(mode)
    return files, dirs


@pytest.fixture
def open_umask():
    old = os.umask(0)  # the widest umask: the modes must not depend on it
    yield
    os.umask(old)


async def test_blocks_and_directories_are_private_whatever_the_umask(tmp_path: Path,
                                                                    open_umask, monkeypatch):
    temp_modes = []
    real_replace = os.replace

    def replace(src, dst):
        temp_modes.append(stat.S_IMODE(os.stat(src).st_mode))
        return real_replace(src, dst)

    monkeypatch.setattr(_blockfiles.os, "replace", replace)
    drv = await open_posix(tmp_path / "store", shard_depth=2)
    await drv.store([b"a" * 16, bytes(range(200))], [memoryview(b"1"), memoryview(b"2")])
    await drv.aclose()
    files, dirs = _modes(tmp_path / "store")
    assert files == {0o600} and dirs == {0o700}
    assert set(temp_modes) == {0o600}  # the temp files, before their rename


@pytest.mark.parametrize(("mode", "file_mode", "dir_mode"), [
    ("0640", 0o640, 0o750), ("0o660", 0o660, 0o770), (None, 0o660, 0o770), (0o644, 0o644, 0o755),
])
async def test_a_group_and_mode_share_the_store_on_purpose(tmp_path: Path, mode, file_mode,
                                                           dir_mode):
    old = os.umask(0o077)  # the narrowest usual umask: a chosen mode still holds
    try:
        gid = os.getegid()
        group = grp.getgrgid(gid).gr_name
        options = {"group": group if mode != "0640" else gid}
        if mode is not None:
            options["mode"] = mode
        drv = await open_posix(tmp_path / "store", **options)
        await drv.store([b"a" * 16], [memoryview(b"1")])
        await drv.aclose()
    finally:
        os.umask(old)
    files, dirs = _modes(tmp_path / "store")
    assert files == {file_mode} and dirs == {dir_mode}
    assert {p.stat().st_gid for p in (tmp_path / "store").rglob("*")} == {gid}


def test_mode_and_group_options_are_checked():
    for bad in ("0755", "0400", "0777", "abc", 0o4600, "0604x"):
        with pytest.raises(ValueError, match="mode"):
            PosixDriver.Options.model_validate({"path": "/x", "mode": bad})
    with pytest.raises(ValueError, match="no such group"):
        PosixDriver.Options.model_validate({"path": "/x", "group": "no-such-group-ucm"})
    assert PosixDriver.Options.model_validate({"path": "/x", "mode": "0640"}).file_mode == 0o640
    assert PosixDriver.Options.model_validate({"path": "/x"}).file_mode == 0o600


async def test_a_group_the_user_is_not_in_is_refused(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # the check a non-root user gets
    monkeypatch.setattr(os, "getgroups", lambda: [])
    other = os.getegid() + 1
    with pytest.raises(ConfigError, match="not a member"):
        await open_posix(tmp_path, group=other)


# -- fuzzing -----------------------------------------------------------------------------------

_KEY, _NS = b"fuzz-key", "fuzz-ns"
_VALID = {codec: block_bytes(_KEY, _NS, bytes(range(256)) * 8, codec)
          for codec in (Codec.NONE, Codec.ZSTD)}


@FUZZ
@given(st.binary(max_size=4200))
def test_fuzz_decode_header_on_random_bytes(data):
    try:
        header = decode_header(data, expect_key=_KEY, expect_namespace=_NS.encode())
    except BlockCorrupt:
        return
    assert isinstance(header, BlockHeader) and header.key == _KEY  # pragma: no cover


def _mutate(data: bytes, draw) -> bytes:
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "extend", "field"]))
        if kind == "flip" and out:
            i = draw(st.integers(0, len(out) - 1))
            out[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del out[draw(st.integers(0, len(out))):]
        elif kind == "extend":
            out += draw(st.binary(min_size=1, max_size=64))
        elif len(out) >= 44:  # a field changed and the header checksum resealed
            fields = list(FIXED.unpack_from(out))
            i = draw(st.integers(1, 9))
            fields[i] = draw(st.integers(0, 2**16 - 1 if i in (1, 4, 5) else 255
                                         if i in (2, 3) else 2**32 - 1 if i == 6 else 2**64 - 1))
            FIXED.pack_into(out, 0, *fields)
            key_len, ns_len = fields[4], fields[5]
            end = 44 + key_len + ns_len
            if end <= len(out):
                crc = xxhash.xxh32_intdigest(bytes(out[:FIXED.size]) + bytes(out[44:end]))
                struct.pack_into("<I", out, FIXED.size, crc)
    return bytes(out)


@FUZZ
@given(st.data())
def test_fuzz_decode_header_on_mutated_headers(data):
    codec = data.draw(st.sampled_from(list(_VALID)))
    mutated = _mutate(_VALID[codec][:PAYLOAD_OFFSET], data.draw)
    try:
        header = decode_header(mutated, expect_key=_KEY, expect_namespace=_NS.encode())
    except BlockCorrupt:
        return
    assert header.key == _KEY and header.namespace == _NS


@pytest.fixture(scope="module")
def fuzz_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    stores = {}
    for codec in (Codec.NONE, Codec.ZSTD):
        for mapped in (False, True):
            layout = FileLayout((str(root / f"{codec.name}-{mapped}"),), 0)
            stores[codec, mapped] = BlockFiles.open(
                layout, namespace=_NS, codec=codec, fsync=False, direct=False,
                map_bytes=2**20 if mapped else 0)
    return stores


@FUZZ
@given(st.data())
def test_fuzz_the_posix_load_path(fuzz_store, data):
    """Random bytes and mutated valid blocks as block files, loaded by the posix store
    (preadv and mapped, codec none and zstd): a per-key outcome, and data only when it is
    what was stored under that key in this namespace."""
    codec = data.draw(st.sampled_from([Codec.NONE, Codec.ZSTD]))
    mapped = data.draw(st.booleans())
    files: BlockFiles = fuzz_store[codec, mapped]
    raw = bytes(range(256)) * 8
    if data.draw(st.booleans()):
        content = data.draw(st.binary(max_size=4200 + len(raw)))
    else:
        content = _mutate(_VALID[data.draw(st.sampled_from(list(_VALID)))], data.draw)
    path = files.path_for(_KEY)
    plant(path, content)
    if mapped:
        files.maps.adopt(_KEY, path)
    out = memoryview(bytearray(data.draw(st.sampled_from([len(raw), 100, 4096]))))
    state = files.load_one(_KEY, out)
    assert state in (LoadState.OK, LoadState.CORRUPT)
    if state is LoadState.OK:
        assert bytes(out) == raw


def test_the_fuzzer_reaches_good_blocks(fuzz_store):
    """The fuzzed load path does load valid blocks (so the test above can tell)."""
    for (codec, _), files in fuzz_store.items():
        plant(files.path_for(_KEY), _VALID[codec])
        if files.maps is not None:
            files.maps.adopt(_KEY, files.path_for(_KEY))
        out = memoryview(bytearray(2048))
        assert files.load_one(_KEY, out) is LoadState.OK and bytes(out) == bytes(range(256)) * 8


def test_random_blocks_named_by_another_key_are_not_served(fuzz_store):
    files = fuzz_store[Codec.NONE, False]
    rng = random.Random(5)
    for _ in range(20):
        other = rng.randbytes(8)
        plant(files.path_for(_KEY), block_bytes(other, _NS, bytes(2048)))
        assert files.load_one(_KEY, memoryview(bytearray(2048))) is LoadState.CORRUPT
