"""A host-memory KV cache collapsed into transparent huge pages in place: contents kept."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

from ucm.vllm_hook.hugepages import HUGE, collapse, collapse_cache, huge_ranges


def test_huge_ranges_are_whole_aligned_pages_merged():
    assert huge_ranges([(1, 3 * HUGE)]) == [(HUGE, 2 * HUGE)]  # the pages fully inside
    assert huge_ranges([(0, HUGE - 1)]) == []
    assert huge_ranges([(0, 2 * HUGE), (2 * HUGE, 2 * HUGE), (10 * HUGE, HUGE)]) == [
        (0, 4 * HUGE), (10 * HUGE, HUGE)]
    assert huge_ranges([(0, 4 * HUGE), (HUGE, HUGE)]) == [(0, 4 * HUGE)]  # one inside another


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def test_collapse_keeps_the_contents_and_backs_them_with_huge_pages():
    size = 16 * HUGE
    region = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(region)
    base = ctypes.addressof(anchor)
    del anchor  # (an exported pointer would keep the mapping from closing)
    try:
        data = np.frombuffer(region, np.uint8)
        data[:] = np.random.default_rng(0).integers(0, 255, data.size, np.uint8)
        expected = data.copy()
        before = _anon_huge_kib()
        ranges = huge_ranges([(base, size + HUGE)])
        done = collapse(ranges)
        if done == 0:
            pytest.skip("this kernel does not collapse (MADV_COLLAPSE)")
        assert done == sum(n for _, n in ranges) >= size  # the whole 2 MiB pages inside
        assert _anon_huge_kib() - before >= size // 1024
        assert np.array_equal(data, expected)
        assert collapse(ranges, limit=HUGE) == HUGE  # no more than the limit
        assert collapse_cache([(base, HUGE // 2)]) == 0  # no whole page: nothing to do
        del data
    finally:
        region.close()
