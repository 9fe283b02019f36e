"""Synthetic recall against the oracle top-k by attention mass (seeded, CPU).

At a budget of 1/16 of the blocks, Quest keeps at least 90% of the oracle's attention mass and
ESA's block means 85% on smooth keys, GSA's hashed keys 70% (measured 0.78: angles only, and
these keys share a large bias), and Quest and GSA find a planted needle 99 times in 100 where
ESA's means miss it; the random baseline (at most 20%) shows the measurement can fail.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from ucm.bench.sparse_eval import (
    focused_query,
    method_for,
    plant_needle,
    recall,
    selection,
    smooth_keys,
)

N, D, BLOCK = 8192, 128, 32


def _contexts(seed: int, trials: int, focus: int = 2, temp: float = 3.5):
    g = torch.Generator().manual_seed(seed)
    for _ in range(trials):
        keys, scale = smooth_keys(N, D, g)
        yield keys, focused_query(keys, scale, g, focus, temp), g


def _mean_ratio(method: str, seed: int, trials: int = 10) -> float:
    ratios = []
    for keys, q, _ in _contexts(seed, trials):
        m = method_for(method, budget=1 / 16, block_size=BLOCK)
        ratios.append(recall(m, q[None, None], keys[None]).ratio)
    return statistics.fmean(ratios)


def test_quest_reaches_90_percent_of_oracle_mass_at_one_sixteenth():
    assert _mean_ratio("quest", seed=11) >= 0.90


def test_esa_mean_representative_is_close_on_smooth_keys():
    assert _mean_ratio("esa", seed=11) >= 0.85


def test_gsa_hashed_keys_keep_most_of_the_oracle_mass_on_smooth_keys():
    assert _mean_ratio("gsa", seed=11) >= 0.70


def test_random_selection_stays_low():
    assert _mean_ratio("random", seed=11) <= 0.2


@pytest.mark.parametrize("method,floor", [("quest", 0.99), ("gsa", 0.99), ("esa", None)])
def test_planted_needles(method, floor):
    found = []
    g = torch.Generator().manual_seed(12)
    for _ in range(100):
        keys, scale = smooth_keys(2048, 64, g)
        q = focused_query(keys, scale, g, 2, 3.0)
        keys, pos = plant_needle(keys, q, g, sigma=8.0, temp=3.0)
        m = method_for(method, budget=1 / 16, block_size=BLOCK)
        chosen, _ = selection(m, q[None, None], keys[None])
        found.append(pos // BLOCK in chosen.tolist())
    rate = sum(found) / len(found)
    if floor is not None:
        assert rate >= floor
    else:  # documented weakness: a block mean hides one outstanding key
        assert rate <= 0.6


def test_gsa_finds_the_needle_block_that_esa_misses():
    """One outstanding key: its code is close to the query's, so the best Hamming similarity
    in its block stands out (default hash_bits, seed 0); the block's mean key does not."""
    g = torch.Generator().manual_seed(13)
    keys, scale = smooth_keys(2048, 64, g)
    q = focused_query(keys, scale, g, 2, 3.0)
    keys, pos = plant_needle(keys, q, g, sigma=8.0, temp=3.0)
    picks = {}
    for method in ("gsa", "esa"):
        m = method_for(method, budget=1 / 16, block_size=BLOCK)
        picks[method] = selection(m, q[None, None], keys[None])[0].tolist()
    assert pos // BLOCK in picks["gsa"]
    assert pos // BLOCK not in picks["esa"]
    assert picks["gsa"] != picks["esa"]
