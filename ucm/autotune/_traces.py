"""Request traces for the simulator, read from three shapes:

- Mooncake-style JSONL: one object per request with `hash_ids` (prefix-block ids) and
  optionally `timestamp`;
- token-id request lists: full blocks chain-hashed as the engine hooks key them
  (`ucm.engine.keys`);
- ucm's own event traces (`ucm.trace`): the Lookup events' "start" records, which carry the
  short digests of their keys when the kernel traced them (`keys`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple


class Request(NamedTuple):
    """One request: its prefix blocks in order (opaque keys) and its arrival (seconds).
    `lookup`: how many leading blocks a lookup may hit (None: all); vLLM never loads a
    prompt's last token, so a prompt of a whole number of blocks looks up one block fewer
    than it stores. `session`: the session (conversation, agent) the request belongs to, where
    the trace says (None: `ucm.autotune._simulate.Retention` takes its chain)."""

    blocks: tuple[bytes, ...]
    timestamp: float = 0.0
    lookup: int | None = None
    session: str | None = None


def _id_key(block_id: int) -> bytes:
    return block_id.to_bytes(8, "little", signed=True)


def jsonl_records(path: str | os.PathLike[str]) -> Iterator[tuple[list[int], dict[str, Any]]]:
    """Each line of a JSONL trace (Mooncake's format): its `hash_ids` as ints and the whole
    object; ValueError naming the file for a line without a hash_ids list."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            ids = obj.get("hash_ids")
            if not isinstance(ids, list):
                raise ValueError(f"{path}: a line without a hash_ids list")
            yield [int(i) for i in ids], obj


def read_jsonl(path: str | os.PathLike[str], *, limit: int | None = None) -> list[Request]:
    """Requests of a JSONL trace whose lines hold `hash_ids` (Mooncake's format)."""
    out: list[Request] = []
    for ids, obj in jsonl_records(path):
        out.append(Request(tuple(_id_key(i) for i in ids),
                           float(obj.get("timestamp", 0)) / 1000.0))
        if limit is not None and len(out) >= limit:
            break
    return out


def from_token_lists(requests: Iterable[Sequence[int]], block_size: int, *,
                     namespace: str = "ucm-autotune") -> list[Request]:
    """Requests of token-id lists: the digests of their full blocks, chained as the vLLM
    connector computes them (a partial last block is never stored)."""
    from ucm.engine.keys import chain_digests, chain_seed

    seed = chain_seed(namespace)
    out = []
    for tokens in requests:
        n = len(tokens) // block_size
        out.append(Request(tuple(chain_digests(seed, tokens, block_size, n))))
    return out


def read_ucm_trace(path: str | os.PathLike[str]) -> list[Request]:
    """Requests of a ucm event trace: one per traced Lookup, with its keys' short digests.
    Raises ValueError when the trace holds no per-key digests (traces written before the
    kernel recorded them name only each event's first key)."""
    from ucm.trace import read_trace

    out: list[Request] = []
    lookups = 0
    for record in read_trace(path):
        if record.phase != "start" or record.fields.get("type") != "Lookup":
            continue
        lookups += 1
        keys = record.fields.get("keys_hex")
        if isinstance(keys, list):
            out.append(Request(tuple(bytes.fromhex(k) for k in keys), record.t / 1e9))
    if lookups and not out:
        raise ValueError(f"{path}: its Lookup records carry no per-key digests (keys_hex); "
                         "record a new trace with this version of ucm")
    return out


def load_requests(source: str | os.PathLike[str] | Sequence[Sequence[int]], *,
                  block_size: int = 16, limit: int | None = None) -> list[Request]:
    """Requests from a trace path (a JSONL file, a ucm trace file or directory, or a JSON
    list of token-id lists) or from token-id lists given directly."""
    if not isinstance(source, (str, os.PathLike)):
        return from_token_lists(source, block_size)[:limit]
    path = Path(source)
    if path.is_dir() or path.suffix == ".ucmtrace":
        return read_ucm_trace(path)[:limit]
    with open(path, encoding="utf-8") as fh:
        head = fh.read(1)
        fh.seek(0)
        if head == "[":  # a JSON list of token-id lists
            return from_token_lists(json.load(fh), block_size)[:limit]
    return read_jsonl(path, limit=limit)
