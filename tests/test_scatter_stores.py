"""Stores from a Scatter (a page whose K and V lie in separate buffers): the posix and memory
tiers write from the pieces (no joining copy: `store_gathers` stays 0), the kernel joins them
once for a driver without the `ScatterStores` capability, and every page loads back
byte-identical, its checksum covering the bytes as stored."""

from __future__ import annotations

import mmap
import os

import pytest

from ucm.block import Scatter
from ucm.drivers import LoadState, ScatterStores
from ucm.kernel import Kernel, Load, Store

HALF = 8192  # K (or V) bytes of a page
KEYS = [bytes([i]) * 16 for i in range(1, 4)]


def kv_pages(n: int) -> tuple[list[Scatter], list[bytes]]:
    """n pages, each K and V from two separate read-only buffers, and what each should load."""
    pages, whole = [], []
    for _ in range(n):
        k, v = os.urandom(HALF), os.urandom(HALF)
        pages.append(Scatter([k, v], writable=False))
        whole.append(k + v)
    return pages, whole


def store_and_load(config: dict, n: int = 3) -> tuple[dict, list[bytes], list[bytes]]:
    pages, whole = kv_pages(n)
    with Kernel(config) as kernel:
        assert kernel.submit(Store(KEYS[:n], buffers=pages)).result(30).stored == (True,) * n
        out = [bytearray(2 * HALF) for _ in range(n)]
        states = kernel.submit(Load(KEYS[:n], buffers=out)).result(30).states
        assert states == (LoadState.OK,) * n
        stats = kernel.statistics()
    return stats, whole, [bytes(b) for b in out]


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_posix_writes_from_the_pieces_and_a_fresh_kernel_loads_them(tmp_path, codec):
    config = {"tiers": [{"driver": "posix", "path": str(tmp_path), "codec": codec}]}
    stats, whole, loaded = store_and_load(config)
    assert loaded == whole and stats.get("store_gathers", 0) == 0
    with Kernel(config) as kernel:  # read from the files: header and checksum verified
        out = [bytearray(2 * HALF) for _ in whole]
        states = kernel.submit(Load(KEYS[:3], buffers=out)).result(30).states
    assert states == (LoadState.OK,) * 3 and [bytes(b) for b in out] == whole


def test_posix_direct_writes_from_aligned_pieces_and_through_the_bounce(tmp_path):
    """O_DIRECT: page-aligned pieces go to pwritev as they lie; others through the bounce
    buffer (one copy inside the driver, still no join in the kernel)."""
    config = {"tiers": [{"driver": "posix", "path": str(tmp_path), "direct_writes": True}]}
    aligned = mmap.mmap(-1, 2 * HALF)
    aligned[:] = os.urandom(2 * HALF)
    k, v = os.urandom(HALF), os.urandom(HALF)
    pages = [Scatter([memoryview(aligned)[:HALF], memoryview(aligned)[HALF:]]),
             Scatter([k, v], writable=False)]
    with Kernel(config) as kernel:
        assert kernel.submit(Store(KEYS[:2], buffers=pages)).result(30).stored == (True, True)
        assert kernel.statistics().get("store_gathers", 0) == 0
    with Kernel(config) as kernel:
        out = [bytearray(2 * HALF) for _ in pages]
        states = kernel.submit(Load(KEYS[:2], buffers=out)).result(30).states
    assert states == (LoadState.OK,) * 2
    assert [bytes(b) for b in out] == [bytes(aligned), k + v]


@pytest.mark.parametrize("shared", [False, True], ids=["local", "shm"])
def test_memory_copies_the_pieces_into_its_slot(tmp_path, shared):
    tier = {"driver": "memory", "capacity": "64MiB"}
    if shared:
        tier.update(shared=True, shm_dir=str(tmp_path), size="16MiB")
    stats, whole, loaded = store_and_load({"tiers": [tier]})
    assert loaded == whole and stats.get("store_gathers", 0) == 0


def test_a_driver_without_the_capability_gets_each_page_joined_once(tmp_path):
    pytest.importorskip("ucm_sqlite")
    from ucm_sqlite import SqliteDriver

    assert not issubclass(SqliteDriver, ScatterStores)
    sqlite = {"driver": "sqlite", "path": str(tmp_path / "blocks.db")}
    stats, whole, loaded = store_and_load({"tiers": [sqlite]})
    assert loaded == whole and stats["store_gathers"] == 3
    # Two tiers, both required: memory writes from the pieces, sqlite's copy is joined once.
    both = {"tiers": [{"driver": "memory", "capacity": "64MiB"},
                      {"driver": "sqlite", "path": str(tmp_path / "both.db")}],
            "durability": "all"}
    stats, whole, loaded = store_and_load(both)
    assert loaded == whole and stats["store_gathers"] == 3


def test_posix_writes_more_pieces_than_one_pwritev_takes(tmp_path):
    raw = os.urandom(1500 * 16)
    page = Scatter([raw[i:i + 16] for i in range(0, len(raw), 16)], writable=False)
    config = {"tiers": [{"driver": "posix", "path": str(tmp_path)}]}
    with Kernel(config) as kernel:
        assert kernel.submit(Store(KEYS[:1], buffers=[page])).result(30).stored == (True,)
    with Kernel(config) as kernel:
        out = bytearray(len(raw))
        assert kernel.submit(Load(KEYS[:1], buffers=[out])).result(30).ok
    assert bytes(out) == raw
