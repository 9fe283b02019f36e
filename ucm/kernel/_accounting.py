"""Counters and trace records that both of the kernel's paths write: the trio thread's
(`_core`) and the one off it (`_fastpath`), so an event counts and traces the same whichever
path served it. Callers own the counter (and any lock it needs)."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from ucm.drivers import LoadState
from ucm.kernel._events import Event, Lookup


def count_lookup(stats: MutableMapping[str, int], keys: int,
                 hits_by_tier: Mapping[str, int]) -> None:
    stats["lookup_keys"] += keys
    for name, count in hits_by_tier.items():
        stats[f"lookup_hits.{name}"] += count


def count_load(stats: MutableMapping[str, int], states: Sequence[LoadState],
               tiers: Sequence[str | None], sizes: Sequence[int]) -> None:
    """One Load's outcomes: per key its state, the tier it came from and its raw bytes."""
    stats["load_keys"] += len(states)
    for state, tier, size in zip(states, tiers, sizes, strict=True):
        if state is LoadState.OK:
            stats[f"load_hits.{tier}"] += 1
            stats["bytes_loaded"] += size
        else:
            stats[f"load_{state.name.lower()}"] += 1


def trace_fields(event: Event, *, start: bool = False) -> dict[str, Any]:
    """The fields of an event's "submit" record, or of its "start" record (ucm-trace reads
    both)."""
    fields = {"type": type(event).__name__, "keys": len(event.keys),
              "request_id": event.request_id}
    if start:
        fields["key"] = event.keys[0][:8].hex()
        if type(event) is Lookup:  # a request's chain: the AutoTuner replays traces by it
            fields["keys_hex"] = [key[:8].hex() for key in event.keys]
    return fields


def lookup_result(keys: int, hits_by_tier: Mapping[str, int], **extra: Any) -> dict[str, Any]:
    """The fields of a lookup's "result" record."""
    return {"op": "lookup", "keys": keys, "hits": dict(hits_by_tier), **extra}


def load_op(tier: str, keys: int, t0: int, hits: int, nbytes: int,
            **extra: Any) -> dict[str, Any]:
    """The fields of the "op" record of one tier's part of a Load."""
    return {"tier": tier, "op": "load", "keys": keys, "t0": t0, "hits": hits, "bytes": nbytes,
            **extra}
