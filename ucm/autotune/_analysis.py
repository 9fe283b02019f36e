"""What a trace says about reuse, and bounds on what a policy that knows more could reach.

`reuse_stats` counts, for the blocks a trace stores for the first time, how many are ever
used again, how far away, and how that share varies with the signals an online policy sees
at the store (index in the request's new segment, request length, whether the request's
conversation returned, the request's partial last block), and for blocks seen before, by
how many earlier accesses. `oracle_lru` and `semi_oracle` are the two bounds docs/autotune.md
cites: perfect knowledge of *whether* a block is used again (with LRU order), and perfect
knowledge of the future of every block seen before (Belady over them) with fresh blocks in an
uninformed FIFO. Both replay with prefix semantics, as `simulate` and `belady` do.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ucm.autotune._simulate import next_uses
from ucm.autotune._traces import Request

Uses = tuple[list[bytes], list[int]]


@dataclass
class Share:
    """Blocks counted under one signal value, and how many of them were used again."""

    blocks: int = 0
    reused: int = 0

    def add(self, reused: bool) -> None:
        self.blocks += 1
        self.reused += reused

    @property
    def ratio(self) -> float:
        return self.reused / self.blocks if self.blocks else 0.0


@dataclass
class ReuseStats:
    accesses: int = 0
    first_time: Share = field(default_factory=Share)
    # reuse distances of the first-time blocks used again: in block accesses, and in
    # first-time blocks stored in between (what an LRU of that many blocks turns over)
    distances: list[int] = field(default_factory=list)
    new_between: list[int] = field(default_factory=list)
    # first-time blocks other than their request's last, by signal
    by_new_index: dict[str, Share] = field(default_factory=dict)
    by_request_blocks: dict[str, Share] = field(default_factory=dict)
    by_return: dict[str, Share] = field(default_factory=dict)
    last_block: Share = field(default_factory=Share)  # a request's last block, first time
    by_seen: dict[str, Share] = field(default_factory=dict)  # seen before, by earlier accesses

    @property
    def median_distance(self) -> int:
        return _median(self.distances)

    @property
    def median_new_between(self) -> int:
        return _median(self.new_between)


def _median(values: list[int]) -> int:
    return sorted(values)[len(values) // 2] if values else 0


def _bucket(value: int, width: int, top: int) -> str:
    if value >= top:
        return f">={top}"
    low = value // width * width
    return f"{low}-{low + width - 1}"


def _ordered(d: dict[str, Share]) -> dict[str, Share]:
    return dict(sorted(d.items(), key=lambda kv: (kv[0].startswith(">="),
                                                   int(kv[0].lstrip(">=").split("-")[0]))))


def reuse_stats(requests: Sequence[Request], uses: Uses | None = None) -> ReuseStats:
    """Reuse counted over the whole trace (an unbounded cache's view: a block is first-time at
    its first access, and a request's hit is its leading run of blocks seen before)."""
    flat, nxt = uses if uses is not None else next_uses(requests)
    end = len(flat)
    first_before = [0] * (end + 1)  # first_before[p]: first-time accesses before position p
    seen_count: dict[bytes, int] = {}
    for p, key in enumerate(flat):
        first_before[p + 1] = first_before[p] + (key not in seen_count)
        seen_count[key] = 0
    seen_count.clear()
    stats = ReuseStats(accesses=end)
    by_index: dict[str, Share] = {}
    by_len: dict[str, Share] = {}
    by_return: dict[str, Share] = {}
    by_seen: dict[str, Share] = {}
    pos = 0
    for request in requests:
        blocks = request.blocks
        n = len(blocks)
        hit = 0
        for key in blocks:
            if key not in seen_count:
                break
            hit += 1
        # the shared first block (a system prompt) is not a sign of a conversation returning
        returned = "returning (hit > 1 block)" if hit > 1 else "first turn (hit <= 1 block)"
        for j, key in enumerate(blocks):
            p = pos + j
            reused = nxt[p] < end
            earlier = seen_count.get(key, 0)
            if earlier:
                by_seen.setdefault(str(earlier) if earlier < 3 else ">=3", Share()).add(reused)
            else:
                stats.first_time.add(reused)
                if reused:
                    stats.distances.append(nxt[p] - p)
                    stats.new_between.append(first_before[nxt[p]] - first_before[p + 1])
                if j == n - 1:
                    stats.last_block.add(reused)
                else:
                    by_index.setdefault(_bucket(j - hit, 5, 40), Share()).add(reused)
                    by_len.setdefault(_bucket(n, 10, 120), Share()).add(reused)
                    by_return.setdefault(returned, Share()).add(reused)
            seen_count[key] = earlier + 1
        pos += n
    stats.by_new_index = _ordered(by_index)
    stats.by_request_blocks = _ordered(by_len)
    stats.by_return = dict(sorted(by_return.items()))
    stats.by_seen = dict(sorted(by_seen.items()))
    return stats


def oracle_lru(requests: Sequence[Request], capacity: int, uses: Uses | None = None) -> float:
    """Block hit ratio of LRU that knows whether each access is a block's last: blocks never
    used again are not admitted, and a block is dropped after its last use."""
    flat, nxt = uses if uses is not None else next_uses(requests)
    end = len(flat)
    held: OrderedDict[bytes, None] = OrderedDict()
    hits = pos = 0
    for request in requests:
        blocks = request.blocks
        hit = 0
        for key in blocks:
            if key not in held:
                break
            hit += 1
        hits += hit
        for j, key in enumerate(blocks):
            last = nxt[pos + j] == end
            if key in held:
                if last:
                    del held[key]
                else:
                    held.move_to_end(key)
            elif not last:
                if len(held) >= capacity:
                    held.popitem(last=False)
                held[key] = None
        pos += len(blocks)
    return hits / end if end else 0.0


def semi_oracle(requests: Sequence[Request], capacity: int, fifo_blocks: int,
                uses: Uses | None = None) -> float:
    """Block hit ratio of a cache that knows the whole future of every block seen before
    (Belady over them in `capacity - fifo_blocks` slots) and nothing of a fresh block, which
    waits in an uninformed FIFO of `fifo_blocks` (a request's last block is not admitted: it
    is partial and almost never reused, which an online policy can tell)."""
    if not 0 <= fifo_blocks <= capacity:
        raise ValueError(f"fifo_blocks {fifo_blocks} outside 0..{capacity}")
    flat, nxt = uses if uses is not None else next_uses(requests)
    end = len(flat)
    main_cap = capacity - fifo_blocks
    fifo: OrderedDict[bytes, None] = OrderedDict()
    main: dict[bytes, int] = {}  # key -> its next use
    heap: list[tuple[int, bytes]] = []  # (-next use, key), stale entries skipped
    seen: set[bytes] = set()

    def keep(key: bytes, use: int) -> None:
        nonlocal heap
        if use == end or main_cap == 0:
            return
        if len(main) >= main_cap:
            while True:
                far, victim = heap[0]
                if main.get(victim) == -far:
                    break
                heapq.heappop(heap)
            if -far <= use:
                return  # the block is the farthest: not kept
            heapq.heappop(heap)
            del main[victim]
        main[key] = use
        heapq.heappush(heap, (-use, key))
        if len(heap) > 4 * (len(main) + 64):
            heap = [(-u, k) for k, u in main.items()]
            heapq.heapify(heap)

    hits = pos = 0
    for request in requests:
        blocks = request.blocks
        n = len(blocks)
        hit = 0
        for key in blocks:
            if key not in fifo and key not in main:
                break
            hit += 1
        hits += hit
        for j, key in enumerate(blocks):
            use = nxt[pos + j]
            if key in fifo or key in main:
                fifo.pop(key, None)
                main.pop(key, None)
                keep(key, use)
            elif key in seen:
                keep(key, use)
            else:
                seen.add(key)
                if j == n - 1 or fifo_blocks == 0:
                    continue
                if len(fifo) >= fifo_blocks:
                    fifo.popitem(last=False)
                fifo[key] = None
        pos += n
    return hits / end if end else 0.0


FIFO_SHARES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def best_semi_oracle(requests: Sequence[Request], capacity: int,
                     uses: Uses | None = None) -> tuple[float, float]:
    """The semi-oracle's best hit ratio over the FIFO's share of the capacity, and that share."""
    uses = uses if uses is not None else next_uses(requests)
    return max((semi_oracle(requests, capacity, int(capacity * f), uses), f)
               for f in FIFO_SHARES)
