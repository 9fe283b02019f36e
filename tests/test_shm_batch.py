"""A batch of blocks loaded from the memory tier's shared arena (`memory`, `shared: true`) as
a vLLM step loads them: one Load of every block, each into a Scatter of its pieces in the KV
cache. Counted, not timed: the load runs off the trio thread (the kernel's fast path), and
each block's bytes are read once, by one pass that checks and copies them straight into its
pieces (`copy_verified`'s hash_copy): no staging buffer, no second pass to check or copy, no
lock taken. The posix tier's mapped blocks, the path the arena is compared with in
docs/performance.md (issue 38), are counted the same way."""

from __future__ import annotations

import shutil
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

import ucm.block as block_module
from ucm.block import PAYLOAD_OFFSET, Scatter
from ucm.drivers import LoadState
from ucm.drivers._shm_arena import ShmArena
from ucm.kernel import Kernel, Load, Store

PIECES, PIECE = 4, 128 * 1024  # a block: one piece per layer (K and V), as the vLLM hook's
BLOCK = PIECES * PIECE
N = 24  # blocks in the batch: 12 MiB, enough for both copy threads


@pytest.fixture
def shm_dir():
    path = Path("/dev/shm") / f"ucm-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def config(tier: str, tmp_path: Path, shm_dir: Path) -> dict:
    if tier == "shm":
        return {"tiers": [{"driver": "memory", "name": "shm", "options": {
            "shared": True, "shm_dir": str(shm_dir), "size": 4 * N * BLOCK}}]}
    return {"tiers": [{"driver": "posix", "name": "posix", "path": str(tmp_path / "posix")}]}


class Passes:
    """Every pass over stored bytes during a load: hash_copy (check and copy in one pass)
    with the bytes it read, and the two-pass routines (check, then copy) by name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lock = threading.Lock()
        self.hash_copies: list[int] = []
        self.other: list[str] = []
        real = block_module._hash_copy
        assert real is not None, "the native hash_copy is built with the package"

        def hash_copy(pieces, stored):  # on the copy threads
            with self.lock:
                self.hash_copies.append(memoryview(stored).nbytes)
            return real(pieces, stored)

        monkeypatch.setattr(block_module, "_hash_copy", hash_copy)
        for name in ("copy_bytes", "verify_payload", "checksum"):
            monkeypatch.setattr(block_module, name, self._counted(name, getattr(block_module,
                                                                                  name)))

    def _counted(self, name, fn):
        def counted(*args, **kwargs):
            with self.lock:
                self.other.append(name)
            return fn(*args, **kwargs)
        return counted

    def reset(self) -> None:
        with self.lock:
            self.hash_copies.clear()
            self.other.clear()


def blocks() -> list[np.ndarray]:
    rng = np.random.default_rng(38)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(N)]


def cache() -> tuple[list[np.ndarray], list[Scatter]]:
    """A KV cache of PIECES layers of N blocks each, and each block's Scatter of its pieces
    (one per layer, as the hook builds them)."""
    layers = [np.zeros((N, PIECE), np.uint8) for _ in range(PIECES)]
    scatters = [Scatter.of_views(tuple(memoryview(layer[b]) for layer in layers))
                for b in range(N)]
    return layers, scatters


@pytest.mark.parametrize("tier", ["shm", "posix"])
def test_a_batched_load_reads_each_block_once_straight_into_its_pieces(
        tier, tmp_path, shm_dir, monkeypatch):
    cfg = config(tier, tmp_path, shm_dir)
    data = blocks()
    keys = [b"batch-%d" % i for i in range(N)]
    with Kernel(cfg) as kernel:  # the store pass: an engine of its own
        assert kernel.submit(Store(keys, buffers=data)).result(30).ok
    passes = Passes(monkeypatch)
    locks = []
    if tier == "shm":
        real_locked = ShmArena._locked

        def locked(self):
            locks.append(threading.get_ident())
            return real_locked(self)

        monkeypatch.setattr(ShmArena, "_locked", locked)
    layers, scatters = cache()
    with Kernel(cfg) as kernel:  # the hit engine: the arena opened, the files mapped
        assert kernel.wait_indexed(30)
        before = kernel.statistics()
        passes.reset()
        locks.clear()
        result = kernel.submit(Load(keys, buffers=scatters)).result(30)
        stats = kernel.statistics()
    assert result.states == (LoadState.OK,) * N
    for b, expected in enumerate(data):
        assert all(np.array_equal(layer[b], expected[i * PIECE:(i + 1) * PIECE])
                   for i, layer in enumerate(layers))
    # one event, served off the trio thread, every block a hit of the tier
    assert stats["loads_from_memory"] - before.get("loads_from_memory", 0) == 1
    assert stats["load_keys"] - before.get("load_keys", 0) == N
    assert stats["bytes_loaded"] - before.get("bytes_loaded", 0) == N * BLOCK
    # each block read once: one checked copy of its payload into its pieces, nothing else
    assert sorted(passes.hash_copies) == [BLOCK] * N
    assert passes.other == []
    assert locks == []  # readers take no lock (a store or delete does)
    if tier == "posix":
        driver = stats["tier.posix.driver"]
        assert driver["mapped_loads"] == N  # every block copied from its mapping


def test_a_batch_with_a_corrupt_block_still_reads_every_good_block_once(
        tmp_path, shm_dir, monkeypatch):
    """A block whose bytes went bad in the arena: found by its own pass (CORRUPT, handed to
    the trio thread, which finds it corrupt again and removes it); every other block is still
    one pass."""
    cfg = config("shm", tmp_path, shm_dir)
    data = blocks()
    keys = [b"batch-%d" % i for i in range(N)]
    with Kernel(cfg) as kernel:
        assert kernel.submit(Store(keys, buffers=data)).result(30).ok
    bad = 5
    arena = ShmArena.open(str(shm_dir / "default.arena"), size=4 * N * BLOCK,
                          namespace="default", codec=block_module.Codec.NONE)
    try:
        region = arena.block_region(keys[bad])
        assert region is not None
        first = region[0]
        arena.view[first + PAYLOAD_OFFSET + 100] ^= 0xFF
    finally:
        arena.close()
    passes = Passes(monkeypatch)
    layers, scatters = cache()
    with Kernel(cfg) as kernel:
        assert kernel.wait_indexed(30)
        passes.reset()
        result = kernel.submit(Load(keys, buffers=scatters)).result(30)
        stats = kernel.statistics()
    assert result.states[bad] is LoadState.CORRUPT
    assert [s for i, s in enumerate(result.states) if i != bad] == [LoadState.OK] * (N - 1)
    for b, expected in enumerate(data):
        if b != bad:
            assert all(np.array_equal(layer[b], expected[i * PIECE:(i + 1) * PIECE])
                       for i, layer in enumerate(layers))
    assert stats["loads_from_memory"] == 1
    # the good blocks once each; the bad one on the fast path and again on the trio thread
    assert sorted(passes.hash_copies) == [BLOCK] * (N + 1)
    assert passes.other == []
