"""Measuring selection quality: recall of attention mass against the oracle top-k, on
synthetic keys (locally smooth, optional planted needle) or on real q/k (see `realkv`).

CPU, torch, seeded. Used by the tests and by `python -m ucm.bench.sparse`; not on the serving
path. Recall is a ratio to the oracle: the attention mass inside the method's selection divided
by the mass inside the best selection of the same size (same sinks and local window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ucm.sparse.attention import block_mass
from ucm.sparse.config import SparseConfig
from ucm.sparse.methods import SparseMethod, make_method
from ucm.sparse.session import select_blocks


@dataclass(frozen=True)
class Recall:
    mass: float  # attention mass inside the selection (mean over heads)
    oracle: float  # the same for the oracle's selection of the same size
    budget: int  # blocks picked by score
    fixed: float = 0.0  # mass inside the sinks and the local window (selected by everyone)

    @property
    def ratio(self) -> float:
        """Selection mass / oracle mass."""
        return self.mass / self.oracle if self.oracle > 0 else 1.0

    @property
    def scored_ratio(self) -> float:
        """The same, counting only the blocks chosen by score (sinks and window excluded)."""
        room = self.oracle - self.fixed
        return (self.mass - self.fixed) / room if room > 1e-12 else 1.0


def _padded(keys: torch.Tensor, block_size: int) -> torch.Tensor:
    extra = -keys.shape[1] % block_size
    if not extra:
        return keys
    return torch.cat((keys, keys[:, -1:].expand(-1, extra, -1)), dim=1)


def selection(
    method: SparseMethod, queries: torch.Tensor, keys: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Blocks a method selects for the newest of `queries` (W, Hq, D) over keys (Hkv, N, D)."""
    cfg = method.config
    reps = method.prepare(_padded(keys, cfg.block_size))
    scores = method.block_scores(reps, queries[-method.queries_needed :])
    nb = reps.n_blocks
    fixed = torch.zeros(nb, dtype=torch.bool)
    fixed[: cfg.sink_blocks] = True
    fixed[max(0, nb - cfg.local_blocks) :] = True
    budget = method.choose_budget(reps, queries[-method.queries_needed :], fixed)
    if budget is None:
        budget = cfg.budget_blocks(int((~fixed).sum()))
    return select_blocks(scores, budget, cfg.sink_blocks, cfg.local_blocks), budget


def recall(method: SparseMethod, queries: torch.Tensor, keys: torch.Tensor) -> Recall:
    """Mass recall of the method's selection vs the oracle's, for the newest query."""
    cfg = method.config
    chosen, budget = selection(method, queries, keys)
    mass = block_mass(queries[-1].float(), keys.float(), cfg.block_size).mean(0)
    oracle = select_blocks(mass, budget, cfg.sink_blocks, cfg.local_blocks)
    fixed = select_blocks(mass, 0, cfg.sink_blocks, cfg.local_blocks)
    return Recall(
        float(mass[chosen].sum()), float(mass[oracle].sum()), budget, float(mass[fixed].sum())
    )


def method_for(name: str, **overrides: object) -> SparseMethod:
    return make_method(SparseConfig(method=name, **overrides))  # type: ignore[arg-type]


# ----- synthetic keys -----
def _rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    n, d = x.shape
    inv = base ** (-torch.arange(d // 2, dtype=torch.float64) / (d // 2))
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    x1, x2 = x[:, : d // 2].double(), x[:, d // 2 :].double()
    return torch.cat((x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()), -1)


def smooth_keys(
    n: int, d: int, generator: torch.Generator, rho: float = 0.7, rope: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Locally smooth keys (N, D): topic segments of 64-512 tokens share a center, plus a
    shared bias, log-normal channel scales and 4 outlier channels; post-RoPE. Returns the keys
    and the per-channel scales."""
    scale = torch.exp(torch.randn(d, generator=generator) * 0.4)
    scale[torch.randperm(d, generator=generator)[:4]] *= 6.0
    bias = torch.randn(d, generator=generator) * 1.5
    lengths = torch.randint(64, 512, (n // 64 + 1,), generator=generator)
    segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)[:n]
    centers = torch.randn(lengths.numel(), d, generator=generator)
    z = rho * centers[segment] + math.sqrt(1 - rho * rho) * torch.randn(n, d, generator=generator)
    keys = (bias + scale * z).double()
    return (_rope(keys) if rope else keys).float(), scale


def focused_query(
    keys: torch.Tensor, scale: torch.Tensor, generator: torch.Generator, focus: int, temp: float
) -> torch.Tensor:
    """A query (D,) aimed at `focus` random tokens away from the ends; `temp` sets the logit
    spread over tokens (higher = sparser attention)."""
    n, d = keys.shape
    mu = keys.mean(0)
    idx = torch.randint(n // 8, n - n // 8, (focus,), generator=generator)
    direction = ((keys[idx] - mu) / scale).mean(0)
    direction = direction / direction.norm().clamp_min(1e-9)
    spread = float(((keys - mu) @ direction).std()) + 1e-9
    return direction * (temp * math.sqrt(d) / spread)


def plant_needle(
    keys: torch.Tensor, query: torch.Tensor, generator: torch.Generator, sigma: float, temp: float
) -> tuple[torch.Tensor, int]:
    """A copy of keys where one token's scaled logit sits `sigma * temp` above the mean."""
    n, d = keys.shape
    pos = int(torch.randint(n // 10, n - n // 10, (1,), generator=generator))
    mu = keys.mean(0)
    have = float((keys[pos] - mu) @ query) / math.sqrt(d)
    qn = float(query.norm())
    out = keys.clone()
    out[pos] += query / qn * ((sigma * temp - have) * math.sqrt(d) / qn)
    return out, pos
