"""A sampled miss-ratio curve of one tier's reference stream, for the tier's own policy.

Spatial sampling (SHARDS, Waldspurger et al., FAST'15): a key is in the sample when a hash of
it falls below a threshold, so every reference of a sampled key is seen and none of the
others. Each capacity of the curve gets a miniature cache (Waldspurger et al., ATC'17): the
tier's policy class (`make_policy`, any policy, not only LRU) at the capacity times the
sampling rate, fed the sampled references; its hit ratio estimates the full-size cache's.
A small `shadow` miniature chooses its weight part of the time (`_MiniatureShadow`).

The memory is bounded (SHARDS' fixed-size variant): when the miniatures together hold more
than `max_keys` keys, the threshold drops by a quarter, sampled keys above it leave every
miniature and the miniatures shrink to the new rate.

The sample is decided from the key's own first four bytes, read as a big-endian number: the
kernel's keys are already hashes (the engines' BLAKE2b digests; a rank's, layer's or group's
key starts with its block's digest, so all of a block's parts are sampled together). So a
reference that is not sampled costs one bytes comparison against the threshold (as bytes) and
a look into the hot keys, no hashing and no allocation. Keys that are not hashes (a trace's
block numbers) must be hashed first (`uniform_key`, which the readers use); `shadow` samples
its own keys by CRC-32, which this sample is independent of.

Hot keys are counted outside the sample: a key that begins requests (a chain's head: in a
prefix cache the most reused blocks are the shared prompts' first ones) and takes 1 % of a
window's references is hot, and its references are hits. A sample either holds such a key or
not, and a key with 4 % of the references moves the estimate by 4 points either way. The
other references count with SHARDS_adj (`curve`).

References are per key: a key the miniature holds is a hit. The kernel's lookups are prefix
lookups (a request stops at its first miss), which this does not model; on the Mooncake
conversation trace the per-key curve at rate 1 equals the prefix simulator's within 0.1
points (docs/autotune.md).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from ucm.kernel._policy import Policy, ShadowLRUPolicy, _Group, _WeightCaches, make_policy

if TYPE_CHECKING:
    from ucm._mrcsim import Curve

try:  # the front and the miniatures in C (native/mrcsim.c), an optional extension
    from ucm._mrcsim import Curve as _NativeCurve
except ImportError:  # pragma: no cover - built where a C compiler is
    _NativeCurve = None  # type: ignore[assignment,misc]

SPACE = 1 << 32
SHRINK = 0.75  # the threshold's factor each time the sample outgrows its budget
HOT_WINDOW = 4096  # references between two reviews of the hot keys
HOT_SHARE = 0.01  # a first key with this share of a window's references is hot
MAX_HOT = 16
_FIBONACCI = 0x9E3779B1
# The threshold of a rate of 1, as bytes: above every key (no key starts with 32 bytes 0xff
# but with probability 2**-256).
_EVERY = b"\xff" * 32
NATIVE_POLICIES = ("lru", "shadow")  # the policies ucm._mrcsim runs


def sample_hash(key: bytes) -> int:
    """The key's place in [0, 2**32): its first four bytes, big-endian (sampled when below
    the threshold; a key of fewer bytes is padded with zeros)."""
    return int.from_bytes(key[:4].ljust(4, b"\0"), "big")


def threshold_key(threshold: int) -> bytes:
    """A threshold as the bytes a key is compared with: `key < threshold_key(t)` is
    `sample_hash(key) < t` for keys of four bytes or more."""
    return _EVERY if threshold >= SPACE else max(0, threshold).to_bytes(4, "big")


def multiplier(seed: int) -> int:
    """The odd factor of a seed's hash (`uniform_key`). CRC-32 is linear, so seeding the CRC
    itself only XORs a constant into every key's value and draws nearly the same sample;
    another factor draws another one (for measuring the estimate's spread)."""
    return (_FIBONACCI + 2 * seed * 0x2545F491) & (SPACE - 1) | 1


def uniform_key(key: bytes, seed: int = 0) -> bytes:
    """A key that is not a hash (a trace's block number) made one for the sample: CRC-32 of it
    times a Fibonacci constant (`shadow` samples its keys by plain CRC-32; the product draws an
    independent sample), as four big-endian bytes, then the key itself. Each seed draws
    another sample."""
    return ((zlib.crc32(key) * multiplier(seed)) & (SPACE - 1)).to_bytes(4, "big") + key


def _no_time() -> float:
    return 0.0


class _MiniatureShadow(ShadowLRUPolicy):
    """`shadow` as a miniature of the curve. Where its weight miniatures would see every
    reference (a miniature under SAMPLE_BLOCKS blocks: the kernel's case, rate 0.01), they
    run for ACTIVE of each CYCLE periods and the weight they chose stays the rest of the
    time; each time they start again, they take this cache's own state (all weights alike,
    so one group of `_policy._WeightCaches`) and their hit counts from where they stopped.
    Fed every sampled reference, eight weight miniatures made a `shadow` miniature cost
    about five times an LRU one; this costs about twice (docs/autotune.md, **Cost**).
    Where they see a sample of the keys (a miniature of SAMPLE_BLOCKS blocks or more: the
    readers' `min_blocks` 1000), they run as in the tier's own policy, reference for
    reference."""

    ACTIVE = 2
    CYCLE = 8

    def __init__(self, capacity: int | None, **kwargs: Any) -> None:
        super().__init__(capacity, **kwargs)
        self._periods = 0  # periods of the cycle gone
        self._idle = 0  # sampled references while idle

    def resize(self, capacity: int) -> list[bytes]:
        self._periods = self._idle = 0  # the weight miniatures start again, active
        return super().resize(capacity)

    def _sample(self, key: bytes) -> None:
        shadows = self._shadows
        if shadows is None or self._threshold < SPACE:
            super()._sample(key)  # sampled weight miniatures: as the tier's own
            return
        if self._periods < self.ACTIVE:
            sampled = self._sampled
            super()._sample(key)
            if self._sampled < sampled:  # a period ended
                self._periods += 1
                if self._periods >= self.CYCLE:  # never idle (ACTIVE == CYCLE)
                    self._periods = 0
            return
        self._idle += 1
        if self._idle < self._period:
            return
        self._idle = 0
        self._periods += 1
        if self._periods >= self.CYCLE:
            self._periods = 0
            self._restart(shadows)

    def _restart(self, shadows: _WeightCaches) -> None:
        """The weight miniatures take this cache's state (after the current reference)."""
        sizes = self._sizes
        ghost: OrderedDict[bytes, None] = OrderedDict.fromkeys(
            list(self._ghost)[-shadows.ghost_limit:])
        shadows.groups = [_Group(
            OrderedDict((k, (t, sizes[k])) for k, t in self._fresh.items()),
            OrderedDict((k, (t, sizes[k])) for k, t in self._main.items()),
            ghost, self.used, sorted(range(len(shadows.weights)),
                                     key=shadows.weights.__getitem__))]
        shadows.clock = self._tick
        self._sampled = 0


def _make_miniature(policy: str, capacity: int) -> Policy:
    if policy == "shadow":
        return _MiniatureShadow(capacity, clock=_no_time)
    return make_policy(policy, capacity, clock=_no_time)


class PolicyMiniatures:
    """The curve's miniature caches as Python policies: any policy (`make_policy`); for `lru`
    and `shadow` the reference `ucm._mrcsim.Curve` is checked against. Each miniature has a
    sample threshold: a key reaches it when its sample place is below."""

    def __init__(self, policy: str, capacities: Sequence[int]) -> None:
        self.minis = [_make_miniature(policy, c) for c in capacities]
        self._indexes = [mini.index for mini in self.minis]  # their keys, for membership
        self._bounds = [_EVERY] * len(self.minis)
        self.hits = [0] * len(self.minis)
        self.sampled = [0] * len(self.minis)
        self.held = 0  # keys held by all the miniatures

    def access(self, key: bytes, size: int) -> int:
        """One sampled reference to each miniature the key's place is under; the keys held
        after it."""
        hits, sampled, bounds, held = self.hits, self.sampled, self._bounds, self._indexes
        for i, mini in enumerate(self.minis):
            if not key < bounds[i]:
                continue
            sampled[i] += 1
            if key in held[i]:
                mini.touch(key)
                hits[i] += 1
                continue
            victims = mini.make_room(size)
            if victims is None:
                continue  # larger than the miniature: a miss, not kept
            mini.insert(key, size)
            self.held += 1 - len(victims)
        return self.held

    def remove(self, key: bytes) -> None:
        for mini in self.minis:
            if key in mini:
                mini.remove(key)
                self.held -= 1

    def configure(self, thresholds: Sequence[int], capacities: Sequence[int]) -> int:
        """New thresholds (keys at or above one leave its miniature) and capacities; the keys
        held after."""
        self._bounds = [threshold_key(t) for t in thresholds]
        held = 0
        for mini, bound, capacity in zip(self.minis, self._bounds, capacities, strict=True):
            for key in [k for k in mini if not k < bound]:
                mini.remove(key)
            mini.resize(capacity)
            held += len(mini)
        self.held = held
        return held

    def lengths(self) -> list[int]:
        return [len(mini) for mini in self.minis]

    def weights(self) -> list[float]:
        return [getattr(mini, "weight", 1.0) for mini in self.minis]


class _PyFront:
    """The curve's front in Python: every reference counted, the sample test (a key's first
    four bytes against the top threshold), the hot keys, and the miniatures
    (`PolicyMiniatures`, any policy). `ucm._mrcsim.Curve` is the same in C for `lru` and
    `shadow`, count for count (tests/kernel/test_mrc_native.py). `events(code, size)` asks
    the curve to size the rates (0, at the first sampled reference), to lower them (1, over
    `max_keys`) or to make room for a changed set of hot keys (2)."""

    def __init__(self, policy: str, capacities: Sequence[int], max_keys: int,
                 events: Callable[[int, int], None]) -> None:
        self.minis = PolicyMiniatures(policy, capacities)
        self.max_keys = max_keys
        self._events = events
        self.sized = False
        self.accesses = 0  # every reference offered
        self.sampled_bytes = 0  # of references under the top threshold
        self.top_sampled = 0
        self.hot_refs = 0  # references of hot keys (counted exactly, outside the sample)
        self.hot_hits = 0
        # Until the first reference sizes the rates, every key takes the sampled path.
        self._top_key = _EVERY
        self._hot: dict[bytes, int] = {}  # hot key -> its references in the current window
        self._candidates: dict[bytes, int] = {}  # first keys -> references this window
        self._review_at = HOT_WINDOW

    @property
    def hits(self) -> list[int]:
        return self.minis.hits

    @property
    def sampled(self) -> list[int]:
        return self.minis.sampled

    @property
    def held(self) -> int:
        return self.minis.held

    @property
    def hot_count(self) -> int:
        return len(self._hot)

    def configure(self, thresholds: Sequence[int], capacities: Sequence[int]) -> int:
        self._top_key = threshold_key(max(thresholds))
        return self.minis.configure(thresholds, capacities)

    def lengths(self) -> list[int]:
        return self.minis.lengths()

    def weights(self) -> list[float]:
        return self.minis.weights()

    def access(self, key: bytes, size: int = 1, first: bool = False) -> None:
        self.accesses += 1
        if first:
            self._first(key)
        if key < self._top_key:
            self._sampled(key, size)
        elif key in self._hot:
            self._hot[key] += 1
            self.hot_refs += 1
            self.hot_hits += 1

    def access_many(self, keys: Sequence[bytes], size: int = 1) -> None:
        if not keys:
            return
        self.accesses += len(keys)
        self._first(keys[0])
        hot = self._hot
        for key in keys:
            if key < self._top_key:
                self._sampled(key, size)
            elif key in hot:
                hot[key] += 1
                self.hot_refs += 1
                self.hot_hits += 1

    def _first(self, key: bytes) -> None:
        """A chain's head: a candidate hot key; the hot keys are reviewed at batch starts,
        once a window has passed."""
        if key not in self._hot:
            self._candidates[key] = self._candidates.get(key, 0) + 1
        if self.accesses >= self._review_at:
            self._review()

    def _sampled(self, key: bytes, size: int) -> None:
        """A key under the top threshold (every key before the first sizes the rates)."""
        hot = self._hot
        if key in hot:
            hot[key] += 1
            self.hot_refs += 1
            self.hot_hits += 1
            return
        if not self.sized:
            self.sized = True
            self._events(0, size)
            if not key < self._top_key:
                return
        self.top_sampled += 1
        self.sampled_bytes += size
        if self.minis.access(key, size) > self.max_keys:
            self._events(1, 0)

    def _review(self) -> None:
        """Each window: first keys with HOT_SHARE of the window's references become hot (and
        leave the miniatures); a hot key goes back to the sample only after a window without
        a reference, since each move between the two costs the miniatures a false miss."""
        self._review_at = self.accesses + HOT_WINDOW
        keep = HOT_SHARE * HOT_WINDOW
        before = set(self._hot)
        self._hot = {k: 0 for k, n in self._hot.items() if n > 0}
        for key, n in sorted(self._candidates.items(), key=lambda kv: -kv[1]):
            if n < keep or len(self._hot) >= MAX_HOT:
                break
            self._hot[key] = 0
            self.minis.remove(key)
        self._candidates.clear()
        if set(self._hot) != before and self.sized:
            self._events(2, 0)


# What the curve asks of its front: `_PyFront`, or the C `ucm._mrcsim.Curve` (its stub
# ucm/_mrcsim.pyi lists the same attributes and methods).
Front: TypeAlias = "_PyFront | Curve"


NATIVE_MIN_BLOCKS = 1000  # `mrc.min_blocks` where the curve runs in C (docs/autotune.md)


def default_min_blocks(policy: str) -> int:
    """`mrc.min_blocks` when the config leaves it null: NATIVE_MIN_BLOCKS where `policy`'s
    curve runs in C, else 0 (the Python miniatures cost about 30 times the C ones)."""
    return NATIVE_MIN_BLOCKS if policy in NATIVE_POLICIES and _NativeCurve is not None else 0


def make_front(policy: str, capacities: Sequence[int], max_keys: int,
               events: Callable[[int, int], None], native: bool | None = None) -> Front:
    """`ucm._mrcsim.Curve` (C) for `lru` and `shadow` where it is built and `native` is not
    False; else `_PyFront`. True insists on the C one (ValueError without)."""
    if native is not False and policy in NATIVE_POLICIES and _NativeCurve is not None:
        return _NativeCurve(policy, list(capacities), max_keys, events)
    if native:
        raise ValueError(f"no native miniatures for {policy!r}: ucm._mrcsim "
                         f"{'is not built' if _NativeCurve is None else 'runs lru, shadow'}")
    return _PyFront(policy, capacities, max_keys, events)


class MissRatioCurve:
    """Hit ratios at `capacities` (bytes, or blocks when every size is 1) of `policy`, from
    the references passed to `access`. Not thread-safe: one caller (the kernel's trio thread).
    Keys must be hashes (module docstring).

    Each miniature samples at `rate`, or more where that would leave it under `min_blocks`
    blocks (sized by the first reference): a miniature of a few dozen blocks misjudges a
    small cache. The thresholds nest (a key sampled for a large capacity is sampled for every
    smaller one), so one comparison decides for all.

    `access` and `access_many` are the front's own (`make_front`): for `lru` and `shadow`
    the C ones of `ucm._mrcsim` where built (`native` None or True), so a reference costs
    one call into C; this class keeps the rates."""

    def __init__(self, policy: str, capacities: Sequence[int], *, rate: float = 0.1,
                 max_keys: int = 16384, min_blocks: int = 0, native: bool | None = None) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"mrc sample rate must be in (0, 1], got {rate}")
        if max_keys < 1:
            raise ValueError(f"mrc max_keys must be >= 1, got {max_keys}")
        caps = sorted({int(c) for c in capacities})
        if not caps or caps[0] <= 0:
            raise ValueError("mrc capacities must be a non-empty list of positive sizes")
        self.policy = policy
        self.capacities = caps
        self.max_keys = max_keys
        self.min_blocks = min_blocks
        self.base_rate = rate  # before any lowering
        self.scale = 1.0  # the rates' factor after lowering for the budget
        self._rates = [rate] * len(caps)  # each miniature's rate at scale 1
        self._thresholds = [int(rate * SPACE)] * len(caps)
        self._top = self._thresholds[0]  # the highest threshold: above it, no miniature
        self.lowered = 0  # times the rates dropped
        self._scaled_cold = 0.0  # sum over earlier epochs of their cold references x scale
        self._epoch_cold = 0  # cold references when the current scale began
        self.front = make_front(policy, [self._scaled(i, 0, 0.0) for i in range(len(caps))],
                                max_keys, self._event, native)
        self.access = self.front.access
        self.access_many = self.front.access_many

    # the front's counts
    @property
    def hits(self) -> list[int]:
        """Each miniature's hits."""
        return self.front.hits

    @property
    def sampled(self) -> list[int]:
        """The references each miniature saw."""
        return self.front.sampled

    @property
    def accesses(self) -> int:
        """Every reference offered."""
        return self.front.accesses

    @property
    def hot_refs(self) -> int:
        """References of hot keys (counted exactly, outside the sample)."""
        return self.front.hot_refs

    @property
    def hot_hits(self) -> int:
        return self.front.hot_hits

    @property
    def top_sampled(self) -> int:
        """References under the top threshold (not of hot keys)."""
        return self.front.top_sampled

    @property
    def sampled_bytes(self) -> int:
        return self.front.sampled_bytes

    @property
    def rate(self) -> float:
        """The sampling rate of the largest capacities (smaller ones may sample more)."""
        return self.base_rate * self.scale

    @property
    def threshold(self) -> int:
        """Keys whose hash is below it reach some miniature (the smallest capacity's)."""
        return self._top

    def _scaled(self, i: int, hot: int, mean_size: float) -> int:
        # the hot keys, held at any capacity, leave the rest of it to the sampled keys
        room = self.capacities[i] - hot * mean_size
        return max(1, round(room * self._rates[i] * self.scale))

    def _event(self, code: int, size: int) -> None:
        """The front's calls: size the rates at the first sampled reference (0), lower them
        over `max_keys` (1), make room for a changed set of hot keys (2)."""
        if code == 0:
            self._size_rates(size)
        elif code == 1:
            self._lower()
        else:
            self._apply_scale()

    def _size_rates(self, size: int) -> None:
        """Raises the rate of miniatures that would hold under `min_blocks` blocks."""
        for i, capacity in enumerate(self.capacities):
            floor = self.min_blocks * max(1, size) / capacity
            self._rates[i] = min(1.0, max(self.base_rate, floor))
        self._apply_scale()

    def _apply_scale(self) -> None:
        self._thresholds = [min(SPACE, int(r * self.scale * SPACE)) for r in self._rates]
        self._top = max(self._thresholds)
        hot, mean = self.front.hot_count, self.mean_size
        self.front.configure(self._thresholds,
                             [self._scaled(i, hot, mean) for i in range(len(self._rates))])

    def _lower(self) -> None:
        while self.front.held > self.max_keys and self._top > 1:
            cold = self.accesses - self.hot_refs
            self._scaled_cold += (cold - self._epoch_cold) * self.scale
            self._epoch_cold = cold
            self.scale *= SHRINK
            self.lowered += 1
            self._apply_scale()

    def expected(self, i: int) -> float:
        """The cold references miniature `i` would have sampled in expectation."""
        cold = self.accesses - self.hot_refs
        scaled = self._scaled_cold + (cold - self._epoch_cold) * self.scale
        return min(float(cold), self._rates[i] * scaled)

    def curve(self) -> list[tuple[int, float]]:
        """(capacity, hit ratio) at each capacity; 0.0 before any reference.

        Hot keys are hits (each had a share of a whole window's references when it became
        hot: no cache evicts it). The other references hit as often as each miniature's did,
        with SHARDS_adj: the miniature's references minus those its rate leads to expect
        are, mostly, those of a few warm keys the sample took or missed, which hit at any
        capacity the curve is useful at; so the difference corrects the hits, over the
        expected count."""
        if not self.accesses:
            return [(c, 0.0) for c in self.capacities]
        cold = self.accesses - self.hot_refs
        out = []
        for i, capacity in enumerate(self.capacities):
            expected = self.expected(i)
            ratio = 0.0
            if self.sampled[i] and expected > 0:
                ratio = min(1.0, max(0.0, (self.hits[i] + expected - self.sampled[i])
                                     / expected))
            out.append((capacity, (self.hot_hits + ratio * cold) / self.accesses))
        return out

    @property
    def mean_size(self) -> float:
        """The sampled references' mean size (a tier's block bytes)."""
        return self.sampled_bytes / self.top_sampled if self.top_sampled else 0.0

    def snapshot(self) -> dict[str, Any]:
        """Plain data for statistics and metrics."""
        return {"policy": self.policy, "rate": self.rate, "accesses": self.accesses,
                "sampled": self.top_sampled, "block_bytes": self.mean_size,
                "held_keys": self.front.held, "curve": [list(p) for p in self.curve()]}
