"""The shared-memory arena behind `memory` with `shared: true` (ucm/drivers/_shm_arena.py):
eviction, races between a load and another process's writes, crashed writers, recovery.
What every driver must do (cross-process stores, killed writers, corruption) is in
tests/contract."""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import ucm.drivers._shm_arena as arena_module
from ucm.block import MADV_POPULATE_WRITE, Codec, key_digest
from ucm.drivers import LoadState
from ucm.drivers._shm_arena import IN_FLIGHT, PAGE, WAYS, ShmArena
from ucm.drivers.memory import MemoryDriver
from ucm.errors import ConfigError, NoCapacity

MiB = 2**20


@pytest.fixture
def shm_dir():
    path = Path("/dev/shm") / f"ucm-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def open_arena(shm_dir: Path, size: int = 8 * MiB, codec: Codec = Codec.NONE) -> ShmArena:
    return ShmArena.open(str(shm_dir / "ns.arena"), size=size, namespace="ns", codec=codec)


def block(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def load(arena: ShmArena, key: bytes, size: int) -> tuple[LoadState, bytes]:
    out = memoryview(bytearray(size))
    [state] = arena.load([key], [out])
    return state, bytes(out)


def test_a_full_arena_evicts_the_oldest_blocks(shm_dir: Path):
    arena = open_arena(shm_dir)  # 8 MiB: room for seven 1 MiB blocks
    try:
        keys = [f"k{i}".encode() for i in range(12)]
        for i, key in enumerate(keys):
            assert arena.store([key], [memoryview(block(i, MiB))]) == [MiB + PAGE]
        present = arena.lookup(keys)
        assert present[-6:] == [True] * 6 and present[:5] == [False] * 5
        assert arena.statistics()["evicted"] >= 5
        for i, key in enumerate(keys):
            state, data = load(arena, key, MiB)
            assert state is (LoadState.OK if present[i] else LoadState.MISSING)
            if present[i]:
                assert data == block(i, MiB)
    finally:
        arena.close()


def test_a_full_bucket_evicts_its_oldest_entry(shm_dir: Path):
    arena = open_arena(shm_dir)
    try:
        def bucket(key: bytes) -> int:
            return int.from_bytes(key_digest(key)[:8], "little") % arena.buckets

        same = [k for k in (f"b{i}".encode() for i in range(100_000)) if bucket(k) == 0]
        keys = same[:WAYS + 1]
        for i, key in enumerate(keys):
            arena.store([key], [memoryview(block(i, 1000))])
        assert arena.lookup(keys) == [False] + [True] * WAYS
        assert arena.statistics()["evicted"] == 1
        # A replace stays in its way and evicts nothing.
        arena.store([keys[3]], [memoryview(block(99, 1000))])
        assert load(arena, keys[3], 1000) == (LoadState.OK, block(99, 1000))
        assert arena.lookup(keys) == [False] + [True] * WAYS
    finally:
        arena.close()


@pytest.mark.parametrize("rewrite", [False, True])
def test_a_load_racing_another_process_delete_is_a_miss(shm_dir: Path, monkeypatch,
                                                        rewrite: bool):
    """Another process deletes the block (and, with `rewrite`, its pages are written over)
    between the load finding the entry and copying: a miss, never a corrupt block or data."""
    reader, writer = open_arena(shm_dir), open_arena(shm_dir)
    try:
        key, data = b"raced", block(1, 256 * 1024)
        writer.store([key], [memoryview(data)])
        offset, length = writer.block_region(key)
        real = arena_module.decode_payload_into  # the copy out of the arena

        def racing(header, stored, out):
            writer.delete([key])
            if rewrite:
                writer.view[offset + PAGE:offset + length] = block(2, length - PAGE)
            real(header, stored, out)

        monkeypatch.setattr(arena_module, "decode_payload_into", racing)
        assert load(reader, key, len(data))[0] is LoadState.MISSING
        monkeypatch.setattr(arena_module, "decode_payload_into", real)
        writer.store([key], [memoryview(data)])  # a replace racing the load: a miss too
        monkeypatch.setattr(arena_module, "decode_payload_into",
                            lambda h, s, o: (writer.store([key], [memoryview(data)]),
                                             real(h, s, o)))
        assert load(reader, key, len(data))[0] is LoadState.MISSING
    finally:
        reader.close()
        writer.close()


def test_a_flipped_byte_without_a_race_is_corrupt(shm_dir: Path):
    arena = open_arena(shm_dir)
    try:
        arena.store([b"k"], [memoryview(block(1, 100_000))])
        offset, _ = arena.block_region(b"k")
        arena.view[offset + PAGE + 500] ^= 1
        assert load(arena, b"k", 100_000)[0] is LoadState.CORRUPT
    finally:
        arena.close()


def test_a_torn_entry_reads_as_absent_and_is_cleared_at_recovery(shm_dir: Path):
    arena = open_arena(shm_dir)
    arena.store([b"a", b"b"], [memoryview(b"x" * 5000), memoryview(b"y" * 5000)])
    slot, _ = arena._find(key_digest(b"a"))
    arena.view[arena._table.at(slot) + 20] ^= 1  # the entry's `first page` field
    assert arena.lookup([b"a", b"b"]) == [False, True]
    assert load(arena, b"a", 5000)[0] is LoadState.MISSING
    arena.close()
    again = open_arena(shm_dir)  # alone with the arena: recovery
    try:
        assert again.statistics()["recovered_dropped"] == 1
        assert not any(again._table.raw(slot))
        assert again.lookup([b"a", b"b"]) == [False, True]
        assert load(again, b"b", 5000) == (LoadState.OK, b"y" * 5000)
    finally:
        again.close()


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_pages_in_flight_are_skipped_while_their_writer_lives(shm_dir: Path):
    arena = open_arena(shm_dir)
    try:
        need = (MiB + PAGE) // PAGE
        arena.owners[:need + 10] = IN_FLIGHT | os.getpid()  # a store of this process
        arena.store([b"k"], [memoryview(block(1, MiB))])
        offset, _ = arena.block_region(b"k")
        assert offset >= arena.data_offset + (need + 10) * PAGE
        # The same pages marked by a writer that has died are taken back.
        arena.owners[:] = 0
        arena.owners[:need] = IN_FLIGHT | _dead_pid()
        arena_module._U64.pack_into(arena.view, arena_module._CURSOR_AT, 0)
        arena.store([b"j"], [memoryview(block(2, MiB))])
        assert arena.block_region(b"j")[0] == arena.data_offset
        assert load(arena, b"j", MiB) == (LoadState.OK, block(2, MiB))
    finally:
        arena.close()


def test_recovery_runs_only_when_no_other_process_has_the_arena(shm_dir: Path):
    first = open_arena(shm_dir)
    first.owners[:8] = IN_FLIGHT | os.getpid()  # a store in flight in a live process
    second = open_arena(shm_dir)  # not alone: the marks stay
    assert (second.owners[:8] == (IN_FLIGHT | os.getpid())).all()
    first.close()
    second.close()
    third = open_arena(shm_dir)  # alone: a crashed writer's marks are freed
    try:
        assert not third.owners[:8].any()
    finally:
        third.close()


def test_recovered_blocks_are_mapped_at_open(shm_dir: Path):
    first = open_arena(shm_dir, size=64 * MiB)
    first.store([f"k{i}".encode() for i in range(8)],
                [memoryview(block(i, 2 * MiB)) for i in range(8)])
    first.close()
    for populate, expect in ((True, True), (False, False)):
        again = ShmArena.open(str(shm_dir / "ns.arena"), size=64 * MiB, namespace="ns",
                              codec=Codec.NONE, populate=populate)
        try:
            resident = _mapped_kib(again.addr)
            assert (resident >= 16 * 1024) is expect, resident
        finally:
            again.close()


def _mapped_kib(addr: int) -> int:
    """Rss (KiB) of this process's mapping that starts at `addr` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-")[0] == f"{addr:x}":
            for field in lines[i + 1:]:
                if field.startswith("Rss:"):
                    return int(field.split()[1])
    raise AssertionError("mapping not found")


def test_zstd_blocks_round_trip(shm_dir: Path):
    arena = open_arena(shm_dir, codec=Codec.ZSTD)
    try:
        [size] = arena.store([b"z"], [memoryview(b"\0" * MiB)])
        assert size == PAGE * 2  # header page + a few compressed bytes
        assert load(arena, b"z", MiB) == (LoadState.OK, b"\0" * MiB)
    finally:
        arena.close()


def test_not_an_arena_is_a_clear_error(shm_dir: Path):
    shm_dir.mkdir()
    (shm_dir / "ns.arena").write_bytes(b"\1" * (4 * MiB))
    with pytest.raises(ConfigError, match="is not a ucm shared-memory arena"):
        open_arena(shm_dir)


async def test_a_block_larger_than_the_arena_is_refused_with_a_reason(shm_dir: Path):
    drv = await MemoryDriver.open({"shared": True, "shm_dir": str(shm_dir), "size": "1MiB"},
                                  name="m", namespace="ns")
    try:
        with pytest.raises(NoCapacity, match="no room for a block of 2097152 bytes"):
            await drv.store([b"big"], [memoryview(bytes(2 * MiB))])
        assert await drv.store([b"small"], [memoryview(b"s" * 100)]) == [2 * PAGE]
        assert drv.statistics()["store_failed"] == 0
    finally:
        await drv.aclose()


async def test_a_full_tmpfs_fails_the_store_instead_of_killing_the_process(shm_dir: Path,
                                                                          monkeypatch):
    """Pages are allocated with MADV_POPULATE_WRITE before the copy touches them: on a full
    tmpfs that returns an error (here injected) where a write fault would raise SIGBUS."""
    drv = await MemoryDriver.open({"shared": True, "shm_dir": str(shm_dir), "size": "8MiB"},
                                  name="m", namespace="ns")
    try:
        real = arena_module.madvise
        monkeypatch.setattr(arena_module, "madvise", lambda addr, length, advice: (
            errno.EFAULT if advice == MADV_POPULATE_WRITE
            else real(addr, length, advice)))
        with pytest.raises(NoCapacity, match=r"cannot allocate .* is its tmpfs full"):
            await drv.store([b"k"], [memoryview(bytes(MiB))])
        assert not drv.arena.owners.any()  # the pages it took are given back
        monkeypatch.undo()
        assert await drv.store([b"k"], [memoryview(bytes(MiB))]) == [MiB + PAGE]
    finally:
        await drv.aclose()


def test_an_existing_arena_keeps_its_size(shm_dir: Path, caplog):
    open_arena(shm_dir, size=8 * MiB).close()
    arena = open_arena(shm_dir, size=16 * MiB)
    try:
        assert arena.size == 8 * MiB
        assert "not the 16777216 configured" in caplog.text
    finally:
        arena.close()


def test_a_real_full_tmpfs_fails_the_store_cleanly(tmp_path: Path):
    """On a 3 MiB tmpfs mounted for the test, an arena of 64 MiB (sparse) takes a 1 MiB block,
    then refuses a 2 MiB one with an error: the process is not killed by SIGBUS."""
    mnt = tmp_path / "small-tmpfs"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        script = (
            "from ucm.drivers._shm_arena import ShmArena\n"
            "from ucm.block import Codec\n"
            f"a = ShmArena.open({str(mnt / 'ucm' / 'ns.arena')!r}, size=64 << 20, namespace='ns',"
            " codec=Codec.NONE)\n"
            "assert a.store([b'a'], [memoryview(bytes(1 << 20))]) == [(1 << 20) + 4096]\n"
            "try:\n"
            "    a.store([b'b'], [memoryview(bytes(2 << 20))])\n"
            "except OSError as exc:\n"
            "    print('refused:', exc)\n"
            "assert a.lookup([b'a', b'b']) == [True, False]\n"
            "a.close()\n")
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0, run.stderr  # -7 would be SIGBUS
        assert "refused: [Errno 28] cannot allocate" in run.stdout
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_block_of_another_namespace_is_corrupt(shm_dir: Path):
    """An arena file of one namespace put where another's belongs (copied or renamed) serves
    nothing: every load checks the namespace its header names."""
    arena = open_arena(shm_dir)
    data = block(7, 64 * 1024)
    assert all(arena.store([b"k"], [memoryview(data)]))
    assert load(arena, b"k", len(data)) == (LoadState.OK, data)
    arena.close()
    os.rename(shm_dir / "ns.arena", shm_dir / "other.arena")
    other = ShmArena.open(str(shm_dir / "other.arena"), size=8 * MiB, namespace="other",
                          codec=Codec.NONE)
    try:
        assert load(other, b"k", len(data))[0] is LoadState.CORRUPT
    finally:
        other.close()
