"""The engine-neutral layer every engine hook stands on (vLLM's, SGLang's, and any next one).

    keys   page keys from token ids: a chain seeded by a namespace (model identity, dtype,
           page size, KV layout), one key per TP rank's shard
    pages  lookup, load and store of pages through the kernel, blocking or not (PendingPages);
           failures are misses, counted

It imports no engine and no torch; what is engine-specific (vLLM's scheduler and worker roles,
SGLang's host pool) stays in that engine's hook.
"""

from __future__ import annotations

from ucm.engine.keys import (
    RequestChain,
    chain_digests,
    chain_seed,
    foreign_key,
    layer_key,
    make_namespace,
    model_identity,
    rank_key,
    weights_fingerprint,
)
from ucm.engine.pages import Counters, PageIO, PendingPages

__all__ = [
    "Counters",
    "PageIO",
    "PendingPages",
    "RequestChain",
    "chain_digests",
    "chain_seed",
    "foreign_key",
    "layer_key",
    "make_namespace",
    "model_identity",
    "rank_key",
    "weights_fingerprint",
]
