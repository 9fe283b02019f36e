"""`ucm bench` (storage): every tier is measured next to its baseline over the same memory, and
the bench leaves nothing behind on the tiers it measured."""

from __future__ import annotations

import itertools
import os

import pytest

from ucm.bench.storage import KiB, MiB, TierBench, run_storage_bench
from ucm.config import TierConfig, UCMConfig


def _address(view: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@pytest.fixture
def config(tmp_path) -> UCMConfig:
    return UCMConfig.model_validate({"tiers": [
        {"driver": "memory", "name": "mem"},
        {"driver": "posix", "name": "disk", "path": str(tmp_path / "posix")},
        {"driver": "pmem", "name": "pool", "path": str(tmp_path / "pmem"), "size": "256MiB"},
    ]})


def test_every_tier_gets_each_cell_next_to_its_baseline(config, tmp_path):
    records = run_storage_bench(config, sizes=(64 * KiB, MiB), concurrency=(1, 2),
                                total_bytes=4 * MiB, repeat=1, drivers=None)
    verified = [r for r in records if r.baseline == "raw preadv + xxh3 verify"]
    cells = {(r.driver, r.op, r.block_bytes, r.concurrency): r for r in records
             if r not in verified}
    for name, baseline in (("mem", "driver direct"), ("disk", "raw pwritev/preadv"),
                           ("pool", "raw libpmem memcpy")):
        for size in (64 * KiB, MiB):
            for conc in (1, 2):
                for op in ("store", "load"):
                    record = cells[(name, op, size, conc)]
                    assert record.baseline == baseline
                    assert record.gbps > 0 and record.baseline_gbps > 0
                    assert record.ratio == pytest.approx(record.gbps / record.baseline_gbps)
        lookup = cells[(name, "lookup", 0, 1)]
        assert lookup.keys_per_s > 0 and lookup.baseline_keys_per_s > 0
        assert cells[(name, "load-batch64", 2 * MiB, 1)].gbps > 0
    assert {(r.driver, r.block_bytes, r.concurrency) for r in verified} == {
        ("disk", s, c) for s in (64 * KiB, MiB) for c in (1, 2)}
    # Nothing left on the tiers: no block files, no pool files.
    leftovers = [os.path.join(root, f) for root, _, files in os.walk(tmp_path) for f in files]
    assert leftovers == []


def test_each_block_has_memory_of_its_own(tmp_path):
    """One buffer stored or loaded over and over stays in the CPU cache, so both sides would
    measure cache copies; every block gets its own source and its own load buffer."""
    tier = TierConfig.model_validate({"driver": "memory", "name": "mem"})
    bench = TierBench(tier, total_bytes=MiB, repeat=1)
    try:
        keys, sources = bench._blocks(64 * KiB, "t")
        outs = bench._destinations(len(keys), 64 * KiB)
    finally:
        bench.close()
    assert len(keys) == len(set(keys)) == len(sources) == len(outs) == 16
    for views in (sources, outs):
        starts = sorted(_address(v) for v in views)
        assert all(v.nbytes == 64 * KiB for v in views)
        assert all(b - a >= 64 * KiB for a, b in itertools.pairwise(starts))  # no overlap
    assert len({bytes(v) for v in sources}) == 1  # one random block's bytes, copied
    assert all(v.readonly is False for v in outs)


@pytest.mark.parametrize(("batch_bytes", "per_event"), [(256 * KiB, 4), (MiB, 16), (64 * MiB, 16)])
def test_batch_sets_the_blocks_per_event(batch_bytes, per_event):
    """`--batch`: each submitter's blocks go in events of that many bytes (1 to 64 blocks)."""
    tier = TierConfig.model_validate({"driver": "memory", "name": "mem"})
    bench = TierBench(tier, total_bytes=2 * MiB, repeat=1, batch_bytes=batch_bytes)
    sizes: dict[str, list[int]] = {"Store": [], "Load": []}
    submit = bench.kernel.submit

    def counting(event):
        sizes.setdefault(type(event).__name__, []).append(len(event.keys))
        return submit(event)

    bench.kernel.submit = counting
    try:
        bench.run_size(64 * KiB, 2)  # 32 blocks, 16 per submitter
    finally:
        bench.kernel.submit = submit
        bench.close()
    for op in ("Store", "Load"):  # each of 2 submitters sends its 16 blocks
        assert sizes[op] == [per_event] * (2 * 16 // per_event), op
