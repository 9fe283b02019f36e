"""Block keys for the vLLM hook: the engine-neutral ones of `ucm.engine.keys`, importable from
the hook's own package without vLLM (`ucm.vllm_hook` imports the connector lazily), for code
that computes the hook's keys."""

from __future__ import annotations

from ucm.engine.keys import (
    DIGEST_BYTES,
    KEY_SCHEME_VERSION,
    MAX_HEADER_BYTES,
    SAMPLE_BYTES,
    WEIGHT_SUFFIXES,
    RequestChain,
    chain_digests,
    chain_seed,
    layer_key,
    make_namespace,
    model_identity,
    rank_key,
    weights_fingerprint,
)


def group_key(key: bytes, group: int, kind: str) -> bytes:
    """The storage key of a block's part in one KV cache group (vLLM's hybrid KV cache
    manager keeps a block table per group): the group's index and its layers' kind, so a
    sliding-window group's block never answers for a full-attention one."""
    return key + b"/G" + group.to_bytes(2, "little") + kind.encode()


__all__ = [
    "DIGEST_BYTES",
    "KEY_SCHEME_VERSION",
    "MAX_HEADER_BYTES",
    "SAMPLE_BYTES",
    "WEIGHT_SUFFIXES",
    "RequestChain",
    "chain_digests",
    "chain_seed",
    "group_key",
    "layer_key",
    "make_namespace",
    "model_identity",
    "rank_key",
    "weights_fingerprint",
]
