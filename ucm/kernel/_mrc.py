"""A sampled miss-ratio curve of one tier's reference stream, for the tier's own policy.

Spatial sampling (SHARDS, Waldspurger et al., FAST'15): a key is in the sample when a hash of
it falls below a threshold, so every reference of a sampled key is seen and none of the
others. Each capacity of the curve gets a miniature cache (Waldspurger et al., ATC'17): the
tier's policy class (`make_policy`, any policy, not only LRU) at the capacity times the
sampling rate, fed the sampled references; its hit ratio estimates the full-size cache's.

The memory is bounded (SHARDS' fixed-size variant): when the miniatures together hold more
than `max_keys` keys, the threshold drops by a quarter, sampled keys above it leave every
miniature and the miniatures shrink to the new rate. The hash is CRC-32 times a Fibonacci
constant: the `shadow` policy samples its own keys by plain CRC-32, and a miniature fed only
keys of low CRC would see its own sample as the whole stream.

References are per key: a key the miniature holds is a hit. The kernel's lookups are prefix
lookups (a request stops at its first miss), which this does not model; docs/autotune.md
measures what that costs against the prefix simulator.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from ucm.kernel._policy import Policy, make_policy

SPACE = 1 << 32
_FIBONACCI = 0x9E3779B1
SHRINK = 0.75  # the threshold's factor each time the sample outgrows its budget


def sample_hash(key: bytes) -> int:
    """The key's place in [0, 2**32): sampled when below the threshold."""
    return (zlib.crc32(key) * _FIBONACCI) & (SPACE - 1)


def _no_time() -> float:
    return 0.0


class MissRatioCurve:
    """Hit ratios at `capacities` (bytes, or blocks when every size is 1) of `policy`, from
    the references passed to `access`. Not thread-safe: one caller (the kernel's trio thread).
    """

    def __init__(self, policy: str, capacities: Sequence[int], *, rate: float = 0.01,
                 max_keys: int = 16384) -> None:
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
        self.threshold = min(SPACE, int(rate * SPACE))
        self.accesses = 0  # every reference offered
        self.sampled = 0  # references of sampled keys
        self.sampled_bytes = 0
        self.hits = [0] * len(caps)
        self.lowered = 0  # times the threshold dropped
        self._expected = 0.0  # sampled references expected at the rates of earlier epochs
        self._epoch_start = 0  # `accesses` when the current rate began
        self._held = 0
        self._minis: list[Policy] = [make_policy(policy, self._scaled(c), clock=_no_time)
                                     for c in caps]

    @property
    def rate(self) -> float:
        return self.threshold / SPACE

    def _scaled(self, capacity: int) -> int:
        return max(1, round(capacity * self.rate))

    def access(self, key: bytes, size: int = 1) -> None:
        """One reference of `key` (a lookup hit loaded, or a block stored)."""
        self.accesses += 1
        if (zlib.crc32(key) * _FIBONACCI) & (SPACE - 1) >= self.threshold:
            return
        self.sampled += 1
        self.sampled_bytes += size
        hits = self.hits
        for i, mini in enumerate(self._minis):
            if key in mini:
                mini.touch(key)
                hits[i] += 1
                continue
            victims = mini.make_room(size)
            if victims is None:
                continue  # larger than the miniature: a miss, not kept
            mini.insert(key, size)
            self._held += 1 - len(victims)
        if self._held > self.max_keys:
            self._lower()

    def _lower(self) -> None:
        while self._held > self.max_keys and self.threshold > 1:
            self._expected += (self.accesses - self._epoch_start) * self.rate
            self._epoch_start = self.accesses
            self.threshold = max(1, int(self.threshold * SHRINK))
            self.lowered += 1
            held = 0
            for capacity, mini in zip(self.capacities, self._minis, strict=True):
                for key in [k for k in mini if sample_hash(k) >= self.threshold]:
                    mini.remove(key)
                mini.resize(self._scaled(capacity))
                held += len(mini)
            self._held = held

    @property
    def expected(self) -> float:
        """References a sample at the rates used would hold in expectation."""
        return self._expected + (self.accesses - self._epoch_start) * self.rate

    def curve(self) -> list[tuple[int, float]]:
        """(capacity, hit ratio) at each capacity; 0.0 before any sampled reference.

        SHARDS_adj: the sample's references minus those expected at its rate are, nearly
        all, those of a few hot keys the sample took or missed (a shared system prompt's
        block is in every request); they are hits at any capacity that the miniatures
        counted or missed, so the difference corrects every point's hits, over the
        expected count."""
        expected = self.expected
        if not self.sampled or expected <= 0:
            return [(c, 0.0) for c in self.capacities]
        extra = expected - self.sampled
        return [(c, min(1.0, max(0.0, (h + extra) / expected)))
                for c, h in zip(self.capacities, self.hits, strict=True)]

    @property
    def mean_size(self) -> float:
        """The sampled references' mean size (a tier's block bytes)."""
        return self.sampled_bytes / self.sampled if self.sampled else 0.0

    def snapshot(self) -> dict[str, Any]:
        """Plain data for statistics and metrics."""
        return {"policy": self.policy, "rate": self.rate, "accesses": self.accesses,
                "sampled": self.sampled, "block_bytes": self.mean_size,
                "held_keys": self._held, "curve": [list(p) for p in self.curve()]}
