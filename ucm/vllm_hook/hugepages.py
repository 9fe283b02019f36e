"""Backs a host-memory KV cache with transparent huge pages.

vLLM on CPU allocates its KV cache as ordinary 4 KiB pages (transparent huge pages are
"madvise" on many hosts, and nothing asks for them). A load copies each block into the cache,
and with 4 KiB pages every page of the copy misses the TLB, so copies into huge pages run
faster (figures: docs/performance.md, Huge pages for the KV cache).

The cache already holds its pages when the connector sees it, so they are collapsed in place
(`MADV_COLLAPSE`, Linux 6.1+): the contents stay, the page tables change. That costs seconds of
CPU per GiB, paid once while the worker registers its cache, before it serves: the first
COLLAPSE_LIMIT bytes (vLLM hands out low block ids first). `MADV_HUGEPAGE` on the whole cache
lets the kernel's khugepaged collapse the rest over time. Collapsing in a background thread was
not chosen: at low priority it can be preempted while holding the process's memory-map lock,
stalling the engine's own allocations, and at normal priority it takes the cores from the
first requests. A kernel without these calls leaves the cache as it was.

Off by default (`"hugepages": true` turns it on): making huge pages free can compact memory and
reclaim page cache, the block files included, so a host whose storage tier lives in the page
cache may lose more than the copies gain.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from ucm.block import madvise

log = logging.getLogger("ucm.vllm_hook")

HUGE = 2 << 20
STEP = 32 << 20  # bytes collapsed per call
COLLAPSE_LIMIT = 4 << 30  # collapsed at registration (seconds of CPU); the rest: khugepaged
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25

def huge_ranges(regions: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole 2 MiB pages inside each (address, bytes) region, overlapping ones merged."""
    spans = sorted((-(-a // HUGE) * HUGE, (a + n) // HUGE * HUGE) for a, n in regions)
    merged: list[list[int]] = []
    for start, end in spans:
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]


def collapse(ranges: list[tuple[int, int]], limit: int = COLLAPSE_LIMIT) -> int:
    """Asks for huge pages over `ranges` and collapses up to `limit` bytes of them, in order;
    returns the bytes collapsed. Stops when the kernel refuses (EINVAL: no such call)."""
    for addr, length in ranges:
        madvise(addr, length, MADV_HUGEPAGE)
    done = 0
    for addr, length in ranges:
        for at in range(addr, addr + length, STEP):
            n = min(STEP, addr + length - at, limit - done)
            if n <= 0:
                return done
            err = madvise(at, n, MADV_COLLAPSE)
            if err == 0:
                done += n
            elif err == 22:  # EINVAL: this kernel cannot collapse
                return done
    return done


def collapse_cache(regions: Iterable[tuple[int, int]], limit: int = COLLAPSE_LIMIT) -> int:
    """`collapse` over the whole 2 MiB pages of (address, bytes) regions, logged."""
    ranges = huge_ranges(regions)
    if not ranges:
        return 0
    t0 = time.monotonic()
    done = collapse(ranges, limit)
    total = sum(n for _, n in ranges)
    log.info("ucm: %d of %d MiB of the KV cache collapsed into huge pages in %.1f s",
             done >> 20, total >> 20, time.monotonic() - t0)
    return done
