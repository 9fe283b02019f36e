"""Configuration of a sparse method: which method, how many blocks, what stays resident.

Pure data (pydantic, no torch): the scheduler and the worker both read it.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MethodName = Literal["quest", "esa", "kvstar", "gsa", "adaptive", "random"]


class SparseConfig(BaseModel):
    """How a request's KV blocks are selected for each decode step.

    budget: a float in (0, 1] is the fraction of the selectable blocks (those that are neither
    sinks nor local window) to keep; an int >= 0 is a block count. Sinks and the local window
    are always resident on top of the budget. 1.0 keeps every block (dense attention).
    For `adaptive` the budget is a ceiling: each step picks the fewest blocks whose estimated
    attention mass reaches `mass_target`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: MethodName = Field(default="quest", description="the block-selection method")
    budget: float | int = Field(default=1 / 8, description=(
        "blocks kept per step beyond sinks and window: a fraction in (0, 1] or a count"))
    block_size: int = Field(default=32, ge=1, description="tokens per block (the engine's)")
    sink_blocks: int = Field(default=1, ge=0, description="leading blocks always resident")
    local_blocks: int = Field(default=2, ge=0,
                              description="most recent blocks always resident")
    stride: int = Field(default=8, ge=1, description="re-select every `stride` decode steps")
    # KVStar
    vote_queries: int = Field(default=8, ge=1, description="recent queries that vote (kvstar)")
    channel_fraction: float = Field(default=0.25, gt=0, le=1, description="kvstar channels")
    sub_block: int = Field(default=2, ge=1, description="tokens per sub-representative (kvstar)")
    # GSA
    hash_bits: int = Field(default=128, ge=8, description=(
        "gsa: sign bits per key and query hash (a multiple of 8; UCM's default 128)"))
    # GSA-style prefetch (any method; on by default for "gsa")
    prefetch: bool | None = Field(default=None, description=(
        "predict and load the next selection early; null: on for gsa only"))
    prefetch_lead: int = Field(default=2, ge=1, description="steps before a refresh to predict")
    prefetch_margin: float = Field(default=0.25, ge=0, description="extra predicted blocks")
    # adaptive budget
    mass_target: float = Field(default=0.9, gt=0, le=1, description=(
        "adaptive: the estimated attention mass the chosen blocks must reach"))
    min_budget: int = Field(default=1, ge=0, description="adaptive: blocks chosen at least")
    seed: int = Field(default=0, description=(
        "seed of the random method's scores and of gsa's hash projection"))
    # on since the SmolLM2 runs (bf16, AMX order): budget 1 from ucm equals dense on every token
    prefix: bool = Field(default=True, description=(
        "vLLM: run a request whose prefix came from ucm or vLLM's prefix cache sparse too, "
        "its keys read from vLLM's paged cache (where ucm knows the cache's layout: a cache "
        "in the model's dtype; else dense, counted); off: such a request runs dense, counted "
        "(sparse_dense.prefix)"))
    # what vLLM's sparse adapter keeps for statistics(); its counters stay exact
    step_records: int = Field(default=256, ge=0, description=(
        "per-step records kept per request, the newest (older ones are dropped, counted)"))
    request_records: int = Field(default=64, ge=0, description=(
        "ended requests whose step records are kept, the newest (older ones are dropped, "
        "counted)"))

    @model_validator(mode="after")
    def _check(self) -> SparseConfig:
        if isinstance(self.budget, float) and not 0 < self.budget <= 1:
            raise ValueError("a fractional budget must be in (0, 1]")
        if isinstance(self.budget, int) and self.budget < 0:
            raise ValueError("a block-count budget must be >= 0")
        if self.block_size % self.sub_block:
            raise ValueError("block_size must be a multiple of sub_block")
        if self.hash_bits % 8:
            raise ValueError(f"hash_bits must be a multiple of 8 (whole bytes), got "
                             f"{self.hash_bits}")
        return self

    @property
    def prefetch_enabled(self) -> bool:
        return self.method == "gsa" if self.prefetch is None else self.prefetch

    def budget_blocks(self, selectable: int) -> int:
        """Blocks chosen by score among `selectable` ones (sinks and local window excluded)."""
        if isinstance(self.budget, float):
            return min(selectable, max(1, math.ceil(self.budget * selectable - 1e-9)))
        return min(selectable, self.budget)
