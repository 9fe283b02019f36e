"""The drivers' first-fit free list: allocation, coalescing, gaps."""

from __future__ import annotations

from ucm.drivers._extents import Extents


def test_first_fit_and_coalescing():
    free = Extents([(0, 100)])
    a, b, c = free.allocate(30), free.allocate(30), free.allocate(30)
    assert (a, b, c) == (0, 30, 60)
    assert free.allocate(20) is None and free.free_bytes == 10
    free.release(a, 30)
    free.release(c, 30)  # merges with the tail
    assert free.allocate(40) == 60
    free.release(b, 30)  # merges with [0, 30) on the left
    assert free.allocate(60) == 0
    assert free.free_bytes == 0


def test_gaps_around_used_extents():
    free = Extents.gaps([(10, 10), (40, 20), (15, 10)], start=0, end=100)
    assert free.free_bytes == 100 - 15 - 20
    assert free.allocate(15) == 25  # [0, 10) is too small; [25, 40) fits
    assert free.allocate(40) == 60
