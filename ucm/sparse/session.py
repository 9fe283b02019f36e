"""Per-request sparse state: representatives, the resident set, and each decode step's plan.

Runs in the worker process on the host thread (torch, on the device the keys are on). A
session sees the keys of every layer at prefill and of each new token at decode, keeps only
block representatives (the full KV lives in the paged cache and in storage), and per decode
step says which blocks attention reads and which of them must be loaded or prefetched.

Each step the selection is sinks + local window + the top-k blocks of the last refresh; the
top-k is refreshed every `stride` steps from the newest queries of every layer (per-layer
importances are added, so one block set serves all layers: a stored block holds all layers).
Blocks that the decode itself produced are resident from birth and never loaded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ucm.sparse.config import SparseConfig
from ucm.sparse.methods import BlockReps, SparseMethod, make_method


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one decode step needs. Block ids are sorted lists."""

    step: int
    refreshed: bool
    selected: list[int]
    load: list[int]  # selected, not resident: load before attention reads them
    evict: list[int]  # resident, no longer selected
    prefetch: list[int] = field(default_factory=list)  # predicted for the next refresh
    budget: int = 0  # blocks picked by score at the last refresh


@dataclass
class PrefetchStats:
    issued: int = 0  # blocks prefetched
    needed: int = 0  # blocks that refreshes had to bring in
    hits: int = 0  # of those, blocks that a prefetch had announced

    @property
    def hit_rate(self) -> float:
        return self.hits / self.needed if self.needed else 1.0


def select_blocks(
    scores: torch.Tensor, k: int, sink_blocks: int, local_blocks: int
) -> torch.Tensor:
    """Sorted ids: the first `sink_blocks`, the last `local_blocks`, and the k best in between."""
    nb = scores.shape[-1]
    lo, hi = min(sink_blocks, nb), max(min(sink_blocks, nb), nb - local_blocks)
    k = max(0, min(k, hi - lo))
    middle = torch.topk(scores[lo:hi], k).indices + lo if k else scores.new_zeros(0).long()
    fixed = torch.cat((torch.arange(lo), torch.arange(hi, nb)))
    chosen: torch.Tensor = torch.unique(torch.cat((fixed, middle.cpu())), sorted=True)
    return chosen


class SparseSession:
    """One request's sparse attention state across all layers."""

    def __init__(self, config: SparseConfig, method: SparseMethod | None = None) -> None:
        self.config = config
        self.method = method or make_method(config)
        self.prefetch_stats = PrefetchStats()
        self._reps: list[BlockReps] = []
        self._tails: list[torch.Tensor] = []  # keys of the partial last block, per layer
        self._queries: list[deque[torch.Tensor]] = []
        self._step = 0
        self._topk: set[int] = set()
        self._budget = 0
        self._resident: set[int] = set()
        self._prefetched: set[int] = set()
        self._n_tokens = 0

    # ----- keys -----
    def prefill(self, keys_per_layer: Sequence[torch.Tensor]) -> None:
        """Representatives of the prompt's blocks; every prompt block starts non-resident."""
        b = self.config.block_size
        self._reps, self._tails = [], []
        self._queries = [deque(maxlen=self.method.queries_needed) for _ in keys_per_layer]
        for keys in keys_per_layer:
            full = keys.shape[1] // b * b
            self._reps.append(self.method.prepare(keys[:, :full]))
            self._tails.append(keys[:, full:])
        self._n_tokens = keys_per_layer[0].shape[1]

    def append(self, keys_per_layer: Sequence[torch.Tensor]) -> None:
        """Keys of new tokens (Hkv, t, D) per layer; blocks they fill are resident from birth."""
        b = self.config.block_size
        first_touched = self._n_tokens // b
        for i, keys in enumerate(keys_per_layer):
            tail = torch.cat((self._tails[i], keys), dim=1)
            full = tail.shape[1] // b * b
            if full:
                done = self.method.prepare(tail[:, :full], self._reps[i].static)
                self._reps[i] = self._reps[i].extend(done)
            self._tails[i] = tail[:, full:]
        self._n_tokens += keys_per_layer[0].shape[1]
        self._resident.update(range(first_touched, self.n_blocks))

    @property
    def n_tokens(self) -> int:
        return self._n_tokens

    @property
    def n_blocks(self) -> int:
        return -(-self._n_tokens // self.config.block_size)

    def _layer_reps(self, layer: int) -> BlockReps:
        reps, tail = self._reps[layer], self._tails[layer]
        if tail.shape[1] == 0:
            return reps
        pad = tail[:, -1:].expand(-1, self.config.block_size - tail.shape[1], -1)
        return reps.extend(self.method.prepare(torch.cat((tail, pad), dim=1), reps.static))

    # ----- selection -----
    def block_scores(self) -> torch.Tensor:
        """(nb,) importance summed over layers, from each layer's recent queries."""
        total = None
        for layer, queries in enumerate(self._queries):
            s = self.method.block_scores(self._layer_reps(layer), torch.stack(tuple(queries)))
            total = s if total is None else total + s
        assert total is not None
        return total

    def _fixed_mask(self) -> torch.Tensor:
        nb, cfg = self.n_blocks, self.config
        mask = torch.zeros(nb, dtype=torch.bool)
        mask[: cfg.sink_blocks] = True
        mask[max(0, nb - cfg.local_blocks) :] = True
        return mask

    def _choose_k(self) -> int:
        cfg, nb = self.config, self.n_blocks
        selectable = int((~self._fixed_mask()).sum())
        chosen = []
        for layer, queries in enumerate(self._queries):
            k = self.method.choose_budget(
                self._layer_reps(layer), torch.stack(tuple(queries)), self._fixed_mask()
            )
            if k is None:
                return cfg.budget_blocks(selectable)
            chosen.append(k)
        return min(selectable, max(chosen, default=0)) if nb else 0

    def _top(self, k: int) -> set[int]:
        cfg = self.config
        chosen = select_blocks(self.block_scores(), k, cfg.sink_blocks, cfg.local_blocks)
        return set(chosen.tolist())

    def step(self, queries_per_layer: Sequence[torch.Tensor]) -> StepPlan:
        """Plan one decode step from each layer's newest query (Hq, D)."""
        cfg = self.config
        for layer, q in enumerate(queries_per_layer):
            self._queries[layer].append(q.detach().float())
        refreshed = self._step % cfg.stride == 0
        if refreshed:
            self._budget = self._choose_k()
            self._topk = self._top(self._budget)
        fixed = set(torch.nonzero(self._fixed_mask()).flatten().tolist())
        selected = self._topk | fixed
        load = selected - self._resident
        if refreshed:
            self.prefetch_stats.needed += len(load)
            self.prefetch_stats.hits += len(load & self._prefetched)
            self._prefetched.clear()
        prefetch: set[int] = set()
        if cfg.prefetch_enabled and (self._step + cfg.prefetch_lead) % cfg.stride == 0:
            extra = round(self._budget * cfg.prefetch_margin)
            prefetch = self._top(self._budget + extra) - selected - self._prefetched
            self._prefetched |= prefetch
            self.prefetch_stats.issued += len(prefetch)
        evict = self._resident - selected
        self._resident = set(selected)
        self._step += 1
        return StepPlan(
            step=self._step - 1,
            refreshed=refreshed,
            selected=sorted(selected),
            load=sorted(load),
            evict=sorted(evict),
            prefetch=sorted(prefetch),
            budget=self._budget,
        )

    def mark_resident(self, blocks: Sequence[int]) -> None:
        """Blocks in the cache without a load (a prompt's partial last block, computed)."""
        self._resident.update(blocks)

    def forget(self, blocks: Sequence[int]) -> None:
        """Blocks that failed to load: not resident, so the next step asks for them again."""
        self._resident.difference_update(blocks)
