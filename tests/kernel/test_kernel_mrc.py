"""The kernel's sampled miss-ratio curve: its estimator, its config, its metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ucm.config import load_config
from ucm.kernel import Kernel, Load, Lookup, Store
from ucm.kernel._mrc import SPACE, MissRatioCurve, sample_hash, uniform_key

BLOCK = 4096
DASHBOARD = Path(__file__).resolve().parents[2] / "tools" / "grafana" / "ucm-mrc.json"


def _keys(prefix: int, n: int) -> list[bytes]:
    return [bytes([prefix]) + i.to_bytes(2, "big") + b"r" * 13 for i in range(n)]


def test_at_rate_one_each_miniature_is_the_full_cache():
    mrc = MissRatioCurve("lru", [4, 8], rate=1.0)
    for _ in range(3):
        for i in range(6):  # a loop of 6 blocks: LRU of 4 never hits, of 8 always after one
            mrc.access(bytes([i]))
    assert mrc.sampled == [18, 18] and mrc.accesses == 18
    assert mrc.curve() == [(4, 0.0), (8, 12 / 18)]


def test_the_sample_is_the_keys_below_the_threshold():
    mrc = MissRatioCurve("shadow", [2000, 20_000], rate=0.25, min_blocks=1000)
    keys = [uniform_key(i.to_bytes(8, "little")) for i in range(4000)]
    for key in keys:
        mrc.access(key)
    # the small capacity samples half the keys (1000 blocks of 2000), the large a quarter
    assert mrc.threshold == SPACE // 2
    assert mrc.top_sampled == mrc.sampled[0] == sum(sample_hash(k) < SPACE // 2 for k in keys)
    assert mrc.sampled[1] == sum(sample_hash(k) < SPACE // 4 for k in keys)
    assert 1800 < mrc.sampled[0] < 2200 and 800 < mrc.sampled[1] < 1200


def test_over_the_budget_the_rate_drops_and_the_miniatures_shrink():
    mrc = MissRatioCurve("lru", [1000, 4000], rate=1.0, max_keys=500, min_blocks=1)
    for i in range(20_000):
        mrc.access(uniform_key(i.to_bytes(8, "little")))
    snap = mrc.snapshot()
    assert mrc.lowered > 0 and mrc.rate < 0.2
    assert snap["held_keys"] <= 500
    assert snap["held_keys"] == sum(mrc.front.lengths())
    python = MissRatioCurve("lru", [1000, 4000], rate=1.0, max_keys=500, min_blocks=1,
                            native=False)
    for i in range(20_000):
        python.access(uniform_key(i.to_bytes(8, "little")))
    assert python.front.lengths() == mrc.front.lengths()
    minis = python.front.minis.minis  # type: ignore[attr-defined]
    assert all(sample_hash(k) < python.threshold for m in minis for k in m)


def test_the_sample_is_decided_by_the_keys_own_bytes():
    """The kernel's keys are digests: a key is sampled when its first four bytes (big-endian)
    are below the threshold, one comparison; 100,000 seeded digests at the kernel's rate
    give about 1 %, and a reference outside the sample only counts."""
    import hashlib

    keys = [hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest()
            for i in range(100_000)]
    mrc = MissRatioCurve("lru", [100, 1000], rate=0.01)
    for key in keys:
        mrc.access(key, 1)
    want = sum(sample_hash(k) < mrc.threshold for k in keys)
    assert mrc.threshold == int(0.01 * SPACE)
    assert mrc.top_sampled == mrc.sampled[0] == mrc.sampled[1] == want
    # 1,000 expected, sd 31: these seeded keys are fixed, the bounds are 5 sd wide
    assert 850 <= want <= 1150, want
    assert mrc.accesses == 100_000 and mrc.hits == [0, 0]
    batched = MissRatioCurve("lru", [100, 1000], rate=0.01)
    for start in range(0, len(keys), 10):
        batched.access_many(keys[start:start + 10])
    assert batched.top_sampled == want and batched.accesses == 100_000


def test_readers_hash_keys_that_are_not_hashes_and_each_seed_samples_anew():
    numbers = [i.to_bytes(8, "little") for i in range(20_000)]  # a trace's block numbers
    draws = [{k for k in numbers if sample_hash(uniform_key(k, seed)) < SPACE // 10}
             for seed in range(3)]
    assert all(1700 <= len(d) <= 2300 for d in draws), [len(d) for d in draws]
    assert len(draws[0] & draws[1]) < 400  # about 200: independent samples


@pytest.mark.parametrize("bad", [{"sample_rate": 0}, {"sample_rate": 1.5}, {"max_keys": 3},
                                 {"capacities": [0]}])
def test_bad_mrc_config_names_the_key(bad):
    with pytest.raises(ValueError, match="mrc"):
        load_config({"tiers": [{"driver": "memory", "capacity": "1MiB"}], "mrc": bad})


def test_bad_estimator_arguments_are_refused():
    with pytest.raises(ValueError, match="capacities"):
        MissRatioCurve("lru", [])
    with pytest.raises(ValueError, match="rate"):
        MissRatioCurve("lru", [4], rate=0)


def test_a_kernel_keeps_a_curve_per_tier_and_exports_it():
    prometheus_client = pytest.importorskip("prometheus_client")
    from ucm.trace.metrics import MetricsSink

    config = {"tiers": [{"driver": "memory", "capacity": "1MiB", "name": "fast"},
                        {"driver": "memory", "name": "big"}],
              "eviction": "lru",
              "mrc": {"sample_rate": 1.0, "capacities": [8 * BLOCK, 1 << 20]}}
    keys = _keys(1, 32)
    with Kernel(config) as kernel:
        kernel.submit(Store(keys, buffers=[bytes(BLOCK)] * 32)).result(10)
        kernel.submit(Load(keys, buffers=[bytearray(BLOCK) for _ in keys])).result(10)
        kernel.submit(Lookup(keys[:1])).result(10)  # the loads' touches apply before it
        stats = kernel.statistics()
        registry = prometheus_client.CollectorRegistry()
        MetricsSink(registry).watch(kernel)
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in registry.collect() for s in family.samples}
    fast = stats["tier.fast.mrc"]
    # 32 stores then 32 loads of the same keys: a cache of under 8 blocks never hits, one of
    # 1 MiB hits every load
    assert fast["sampled"] == fast["accesses"] == 64
    assert fast["curve"] == [[8 * BLOCK, 0.0], [1 << 20, 0.5]]
    assert stats["tier.big.mrc"]["sampled"] == 32  # stores only: the fast tier served loads
    labels = (("capacity_bytes", str(1 << 20)), ("policy", "lru"), ("tier", "fast"))
    assert samples[("ucm_mrc_hit_ratio", labels)] == 0.5
    assert samples[("ucm_mrc_sample_rate", (("tier", "fast"),))] == 1.0
    assert samples[("ucm_mrc_sampled_references", (("tier", "big"),))] == 32

    doc = json.loads(DASHBOARD.read_text())
    used = {name for panel in doc["panels"] for target in panel["targets"]
            for name in re.findall(r"\bucm_[a-z_]+", target["expr"])}
    assert used and used <= {name for name, _ in samples}, used


def test_without_mrc_config_no_curve():
    with Kernel({"tiers": [{"driver": "memory", "capacity": "1MiB"}]}) as kernel:
        kernel.submit(Store(_keys(2, 2), buffers=[bytes(BLOCK)] * 2)).result(10)
        assert not any(k.endswith(".mrc") for k in kernel.statistics())


@pytest.mark.parametrize("eviction", ["shadow", "lru", "s3fifo"])
def test_the_default_floor_is_the_c_curves_where_it_runs(eviction):
    """`min_blocks: null`: a floor of 1,000 blocks where the curve runs in C (lru and shadow
    with ucm._mrcsim built), none where it runs in Python (about 30 times the CPU); an
    explicit value wins."""
    from ucm.kernel._core import _mrc_of
    from ucm.kernel._mrc import NATIVE_MIN_BLOCKS, NATIVE_POLICIES, _NativeCurve

    tiers = [{"driver": "memory", "capacity": "64MiB"}]
    mrc = _mrc_of(load_config({"tiers": tiers, "eviction": eviction, "mrc": {}}), 64 << 20)
    native = eviction in NATIVE_POLICIES and _NativeCurve is not None
    assert mrc is not None and mrc.min_blocks == (NATIVE_MIN_BLOCKS if native else 0)
    assert (type(mrc.front).__module__ == "ucm._mrcsim") == native
    chosen = _mrc_of(load_config({"tiers": tiers, "eviction": eviction,
                                  "mrc": {"min_blocks": 7}}), 64 << 20)
    assert chosen is not None and chosen.min_blocks == 7
