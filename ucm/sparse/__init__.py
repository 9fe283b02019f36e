"""Sparse attention for ucm: block-selection methods, the per-request session, and the fetcher
that turns selections into kernel events. (The KV codecs of the store path are `ucm.codecs`.)

Names resolve lazily, so `from ucm.sparse import SparseConfig` (scheduler side) does not import
torch; everything else imports torch on first use. `ucm bench sparse` prints the
selection latency, fetched bytes per step and the table of the store path's codecs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "SparseConfig": "config",
    "BlockReps": "methods",
    "SparseMethod": "methods",
    "Quest": "methods",
    "Adaptive": "methods",
    "ESA": "methods",
    "GSA": "methods",
    "KVStar": "methods",
    "Random": "methods",
    "METHODS": "methods",
    "make_method": "methods",
    "SparseSession": "session",
    "StepPlan": "session",
    "PrefetchStats": "session",
    "select_blocks": "session",
    "BlockFetcher": "fetch",
    "FetchStats": "fetch",
    "PendingLoad": "fetch",
    "dense_attention": "attention",
    "sparse_attention": "attention",
    "masked_attention": "attention",
    "block_mass": "attention",
    "block_token_mask": "attention",
    "mass_recall": "attention",
}

__all__ = [
    "ESA",
    "GSA",
    "METHODS",
    "Adaptive",
    "BlockFetcher",
    "BlockReps",
    "FetchStats",
    "KVStar",
    "PendingLoad",
    "PrefetchStats",
    "Quest",
    "Random",
    "SparseConfig",
    "SparseMethod",
    "SparseSession",
    "StepPlan",
    "block_mass",
    "block_token_mask",
    "dense_attention",
    "make_method",
    "masked_attention",
    "mass_recall",
    "select_blocks",
    "sparse_attention",
]

if TYPE_CHECKING:
    from ucm.sparse.attention import (
        block_mass,
        block_token_mask,
        dense_attention,
        masked_attention,
        mass_recall,
        sparse_attention,
    )
    from ucm.sparse.config import SparseConfig
    from ucm.sparse.fetch import BlockFetcher, FetchStats, PendingLoad
    from ucm.sparse.methods import (
        ESA,
        GSA,
        METHODS,
        Adaptive,
        BlockReps,
        KVStar,
        Quest,
        Random,
        SparseMethod,
        make_method,
    )
    from ucm.sparse.session import PrefetchStats, SparseSession, StepPlan, select_blocks


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ucm.sparse' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ucm.sparse.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
