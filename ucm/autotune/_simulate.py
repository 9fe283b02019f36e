"""A trace-driven cache simulator over the kernel's own eviction policies.

Requests are replayed with the prefix semantics of the vLLM connector: a request hits the
longest run of its leading blocks that some tier holds (the blocks are loaded from the
fastest tier holding each, and touched there), then its other blocks are stored. Stores go
into every tier (the kernel writes the first and copies to the rest); a hit in a slower tier
is promoted into the faster ones. The policies are `ucm.kernel._policy`'s, called as the
kernel calls them (a Load touches its hits with their index in the batch, a Store inserts
with theirs), with a virtual clock.

With `kernel_stores` a tier counts bytes as the kernel does: its capacity is in bytes
(`SimTier.capacity_bytes`), a block counts `block_bytes` (what the driver reports stored), and
a request's store reserves `block_bytes + header_bytes` a block (`Tier.estimate`) for the
whole batch before it inserts any, blocks already held included (the kernel stores them
again). That is exactly what one kernel tier does with a store at a time
(docs/autotune.md, Validation on vLLM).

With `retention` the first tier keeps session holds as the kernel does (`ucm.kernel._holds`,
the very class): after each request its session's blocks are held for `retain_s` of the
trace's clock, eviction skips them, the held blocks are capped at a share of the tier
(`sessions.max_pinned`) with the oldest holds released first, and expiry is checked before
each eviction and each hold.

Belady's offline optimum (evict the block whose next use is farthest; a block never used
again is not admitted) is the reference for one tier; it knows the future, so it is computed
separately (`belady`).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field

from ucm.autotune._traces import Request
from ucm.kernel._holds import Holds
from ucm.kernel._policy import Policy, make_policy


def chain_session(request: Request) -> str | None:
    """A request's session: the trace's own (`Request.session`), else its chain, named by its
    second block (the first past a prompt every request shares, as in Mooncake's traces);
    None for a request of one block."""
    if request.session is not None:
        return request.session
    return request.blocks[1].hex() if len(request.blocks) > 1 else None


@dataclass(frozen=True)
class Retention:
    """Session holds in the first tier (`simulate(..., retention=)`): after each request, the
    blocks of it (but its last with `skip_last`: a hash-id trace's last block is partial, and
    the kernel holds full blocks only) are held for its session for `retain_s` seconds,
    within `max_pinned` of the tier's capacity (a share, as `sessions.max_pinned: 50%`)."""

    retain_s: float
    max_pinned: float = 0.5
    skip_last: bool = True
    session_of: Callable[[Request], str | None] = chain_session

    def __post_init__(self) -> None:
        if not (self.retain_s > 0 and 0 < self.max_pinned <= 1):
            raise ValueError("retain_s > 0 and 0 < max_pinned <= 1")


@dataclass(frozen=True)
class SimTier:
    """One simulated tier: its policy and its capacity in blocks (None: unbounded). With
    `capacity_bytes` (and `simulate(..., kernel_stores=True)`) the capacity is in bytes and
    each block counts `block_bytes`, plus `header_bytes` while its store is in flight."""

    policy: str
    blocks: int | None
    name: str = ""
    capacity_bytes: int | None = None
    block_bytes: int = 1
    header_bytes: int = 0


@dataclass
class SimResult:
    """What a replay counted. Ratios are of block accesses (every block of every request)."""

    requests: int = 0
    accesses: int = 0
    hits: int = 0
    hits_by_tier: list[int] = field(default_factory=list)
    requests_with_hit: int = 0
    prefetched: int = 0  # blocks the prefetcher copied into the first tier
    prefetch_hits: int = 0  # first-tier hits on blocks that the prefetcher brought there
    # prefetched blocks evicted from the first tier before any hit (moved for nothing);
    # the rest of `prefetched - prefetch_hits` were still waiting at the end
    prefetch_evicted: int = 0
    held: list[set[bytes]] = field(default_factory=list)  # each tier's blocks at the end
    per_request: list[int] = field(default_factory=list)  # hits of each request (kernel_stores)
    # with retention: the kernel's counters (session_holds, session_releases.<expired|cap>)
    sessions: dict[str, int] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    def tier_ratio(self, depth: int) -> float:
        return self.hits_by_tier[depth] / self.accesses if self.accesses else 0.0

    @property
    def hit_blocks_per_request(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def request_hit_ratio(self) -> float:
        """The share of requests with at least one block hit."""
        return self.requests_with_hit / self.requests if self.requests else 0.0


def _clock() -> float:
    return 0.0


def simulate(requests: Sequence[Request], tiers: Sequence[SimTier], *,
             promote: bool = True, prefetch: object | None = None,
             kernel_stores: bool = False, retention: Retention | None = None) -> SimResult:
    """Replays `requests` through `tiers` (fastest first). `prefetch`, if given, is asked
    before each request, with its arrival time only, for blocks due now (`due(now)`, if it
    has one) and after each request (`after(request)`) for blocks to copy from a slower tier
    into the first (`ucm.autotune._prefetch`). `kernel_stores`: byte accounting and batch
    reservation as the kernel's store does them (the module's docstring). `retention`:
    session holds in the first tier (`Retention`)."""
    if not tiers:
        raise ValueError("at least one tier")
    if kernel_stores and (prefetch is not None or retention is not None):
        raise ValueError("kernel_stores replays stores only; no prefetch nor retention")
    if kernel_stores:
        return _simulate_kernel(requests, tiers, promote=promote)
    policies = [make_policy(t.policy, t.blocks, clock=_clock) for t in tiers]
    indexes = [p.index for p in policies]
    result = SimResult(hits_by_tier=[0] * len(tiers))
    top, top_index = policies[0], indexes[0]
    prefetched: set[bytes] = set()
    hits_by_tier = result.hits_by_tier
    single = len(policies) == 1
    now = [0.0]  # the trace's clock, for the holds' expiry
    holds: Holds | None = None
    hold_stats: Counter[str] = Counter()
    if retention is not None:
        cap = (None if top.capacity is None
               else int(top.capacity * retention.max_pinned))
        holds = Holds(top, cap, hold_stats, clock=lambda: now[0])

    def insert_top(key: bytes, depth: int) -> list[bytes]:
        if holds is None:
            return _insert(top, key, depth)
        holds.expire()  # as `Tier.reserve` does before it evicts
        victims = _insert(top, key, depth)
        holds.added(key, None)
        return victims

    def _evicted(victims: list[bytes], depth: int) -> None:
        if depth == 0 and prefetched:
            for victim in victims:
                if victim in prefetched:
                    prefetched.discard(victim)
                    result.prefetch_evicted += 1
    due = getattr(prefetch, "due", None)

    def promote_ahead(keys: Iterable[bytes]) -> None:
        for key in keys:
            if key not in top_index and any(key in ix for ix in indexes[1:]):
                for victim in insert_top(key, 0):
                    if victim in prefetched:
                        prefetched.discard(victim)
                        result.prefetch_evicted += 1
                prefetched.add(key)
                result.prefetched += 1

    for request in requests:
        now[0] = request.timestamp
        if due is not None:
            promote_ahead(due(request.timestamp))
        blocks = request.blocks
        n = len(blocks)
        looked = blocks if request.lookup is None else blocks[:request.lookup]
        result.requests += 1
        result.accesses += len(looked)
        hit = 0
        if single:
            for key in looked:
                if key not in top_index:
                    break
                hit += 1
            if hit:
                hits_by_tier[0] += hit
                for i in range(hit):
                    top.touch(blocks[i], i)
        else:
            sources = _sources(looked, indexes)
            hit = len(sources)
            for i, depth in enumerate(sources):
                hits_by_tier[depth] += 1
                policies[depth].touch(blocks[i], i)
                if depth == 0 and prefetched and blocks[i] in prefetched:
                    result.prefetch_hits += 1
                    prefetched.discard(blocks[i])
            if promote:
                for i, depth in enumerate(sources):
                    if depth:
                        for above in range(depth):
                            _evicted(insert_top(blocks[i], i) if above == 0
                                     else _insert(policies[above], blocks[i], i), above)
        if hit:
            result.hits += hit
            result.requests_with_hit += 1
        # The store: the blocks past the hit, indexed within the Store batch.
        for policy, index in zip(policies, indexes, strict=True):
            for j in range(hit, n):
                key = blocks[j]
                if key in index:
                    policy.touch(key, j - hit)
                elif policy is top:
                    _evicted(insert_top(key, j - hit), 0)
                else:
                    _insert(policy, key, j - hit)
        if holds is not None and retention is not None:
            session = retention.session_of(request)
            kept = blocks[:-1] if retention.skip_last else blocks
            if session is not None and kept:
                holds.hold(session, kept, retention.retain_s)
        if prefetch is not None:
            promote_ahead(prefetch.after(request))  # type: ignore[attr-defined]
    result.held = [set(index) for index in indexes]
    if holds is not None:
        holds.expire()
        result.sessions = dict(hold_stats)
        result.sessions["held_sessions"] = len(holds)
        result.sessions["held_blocks"] = holds.held_bytes
    return result


def _sources(looked: Sequence[bytes], indexes: Sequence[Container[bytes]]) -> list[int]:
    """The tier (depth) that holds each block of the leading run of `looked` found in any."""
    sources = []
    for key in looked:
        depth = next((d for d, index in enumerate(indexes) if key in index), None)
        if depth is None:
            break
        sources.append(depth)
    return sources


def _simulate_kernel(requests: Sequence[Request], tiers: Sequence[SimTier], *,
                     promote: bool) -> SimResult:
    """`simulate` with the kernel's store (byte capacities, a batch's room made before any of
    it is inserted, held blocks stored again) and its load (hits touched in order, in the
    tier that served them; with `promote`, copied into the faster tiers)."""
    policies = [make_policy(t.policy, t.capacity_bytes if t.capacity_bytes is not None
                            else t.blocks, clock=_clock) for t in tiers]
    indexes = [p.index for p in policies]
    result = SimResult(hits_by_tier=[0] * len(tiers))
    for request in requests:
        blocks = request.blocks
        looked = blocks if request.lookup is None else blocks[:request.lookup]
        result.requests += 1
        result.accesses += len(looked)
        sources = _sources(looked, indexes)
        hit = len(sources)
        result.per_request.append(hit)
        for i, depth in enumerate(sources):
            result.hits_by_tier[depth] += 1
            policies[depth].touch(blocks[i], i)
        if promote:  # one copy of a source tier's hits into the tiers above (`promote`)
            for depth, keys in _by_source(sources, blocks).items():
                for above in range(depth):
                    _store_batch(policies[above], tiers[above], keys)
        if hit:
            result.hits += hit
            result.requests_with_hit += 1
        if hit < len(blocks):
            for policy, tier in zip(policies, tiers, strict=True):
                _store_batch(policy, tier, blocks[hit:])
    result.held = [set(index) for index in indexes]
    return result


def _store_batch(policy: Policy, tier: SimTier, keys: Sequence[bytes]) -> None:
    """One kernel Store into one tier (`Movement._store_into`): room for every block's
    estimate first (cumulative, as `Tier.reserve` asks), then each block inserted with its
    stored size (a held one re-inserted: a hit in the policy)."""
    need = tier.block_bytes + tier.header_bytes
    reserved = 0
    chosen = []
    for key in keys:
        if policy.make_room(need + reserved) is None:
            continue  # no room at all: the kernel counts a failed store
        reserved += need
        chosen.append(key)
    for key in chosen:
        policy.insert(key, tier.block_bytes)  # `Tier.add` passes no depth


def _insert(policy: Policy, key: bytes, depth: int) -> list[bytes]:
    """Inserts one block; returns the blocks evicted for it."""
    victims = policy.make_room(1)
    if victims is None:
        raise ValueError("a tier with no room for one block")
    policy.insert(key, 1, depth)
    return victims


def next_uses(requests: Sequence[Request]) -> tuple[list[bytes], list[int]]:
    """The flattened block accesses and, for each, the position of the same block's next
    access (len(accesses) when none)."""
    flat = [key for r in requests for key in r.blocks]
    end = len(flat)
    nxt = [end] * end
    last: dict[bytes, int] = {}
    for pos in range(end - 1, -1, -1):
        key = flat[pos]
        nxt[pos] = last.get(key, end)
        last[key] = pos
    return flat, nxt


def belady(requests: Sequence[Request], capacity: int | None,
           uses: tuple[list[bytes], list[int]] | None = None) -> SimResult:
    """With `retention` the first tier keeps session holds as the kernel does (`ucm.kernel._holds`,
the very class): after each request its session's blocks are held for `retain_s` of the
trace's clock, eviction skips them, the held blocks are capped at a share of the tier
(`sessions.max_pinned`) with the oldest holds released first, and expiry is checked before
each eviction and each hold.

Belady's offline optimum under prefix semantics, for one tier of `capacity` blocks:
    on a miss the block is admitted unless its next use is farther than every held block's,
    and the held block whose next use is farthest is evicted. A max-heap of next uses with
    lazy deletion makes each access O(log n)."""
    flat, nxt = uses if uses is not None else next_uses(requests)
    end = len(flat)
    held: dict[bytes, int] = {}  # key -> its next use
    heap: list[tuple[int, bytes]] = []  # (-next use, key), stale entries skipped
    result = SimResult(hits_by_tier=[0])
    pos = 0
    for request in requests:
        blocks = request.blocks
        n = len(blocks)
        hit = 0
        for key in blocks:
            if key not in held:
                break
            hit += 1
        result.requests += 1
        result.accesses += n
        if hit:
            result.hits += hit
            result.requests_with_hit += 1
        for j in range(n):
            key = blocks[j]
            use = nxt[pos + j]
            if key in held:
                held[key] = use
                heapq.heappush(heap, (-use, key))
                continue
            if use == end:
                continue  # never used again: not worth a slot
            if capacity is not None and len(held) >= capacity:
                while True:
                    far, victim = heap[0]
                    if held.get(victim) == -far:
                        break
                    heapq.heappop(heap)
                if -far <= use:
                    continue  # the newcomer is the farthest: bypass it
                heapq.heappop(heap)
                del held[victim]
            held[key] = use
            heapq.heappush(heap, (-use, key))
        pos += n
        if len(heap) > 4 * (len(held) + 64):  # drop stale entries now and then
            heap = [(-u, k) for k, u in held.items()]
            heapq.heapify(heap)
    result.hits_by_tier[0] = result.hits
    return result


def _by_source(sources: Sequence[int], blocks: Sequence[bytes]) -> dict[int, list[bytes]]:
    """A request's hits from below the top tier, by the tier that served them (promotion's
    sources: each is copied into the tiers above it)."""
    by_source: dict[int, list[bytes]] = {}
    for i, depth in enumerate(sources):
        if depth:
            by_source.setdefault(depth, []).append(blocks[i])
    return by_source
