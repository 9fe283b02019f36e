"""Session hints a request carries in vLLM's `kv_transfer_params` (docs/vllm.md, Sessions):

    extra_body={"kv_transfer_params": {"ucm": {"session": "chat-42", "retain_s": 300}}}

`retain_s`: after the request, its stored full blocks stay in the fastest tier that long;
`end`: the session's hold is released; `prefetch`: its blocks are promoted to the fastest tier
ahead of its next request. A malformed hint is ignored with a counted warning (`parse_hint`),
never an error into the engine.

Where: vLLM hands `kv_transfer_params` to the scheduler side (`request_finished`), but the
blocks live in the worker side's kernel (the scheduler process's own kernel only looks up, and
holds no process-local memory tier). So the scheduler side turns a hint into a `SessionOp` of
the request's block digests and sends it to the workers in the next step's metadata (in one
process, straight to the worker side); each worker holds, releases or prefetches its own
shard's keys in its kernel. With several KV cache groups the op names each group's stored
blocks, so a hold keeps every group's blocks of the hit the session's next turn needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

HINT_KEYS = frozenset({"session", "retain_s", "end", "prefetch"})
MAX_SESSION_CHARS = 256


@dataclass(slots=True)
class SessionOp:
    """What one finished request's hint asks of the workers' kernels."""

    session: str
    retain_s: float | None = None  # hold the digests' blocks this long
    end: bool = False  # release the session's hold
    prefetch: bool = False  # promote the digests' blocks to the fastest tier
    digests: list[bytes] = field(default_factory=list)
    # with several KV cache groups: each group's digests of those blocks that it stored (a
    # sliding-window group stores only the window before the prompt's hit boundary)
    group_digests: list[list[bytes]] = field(default_factory=list)


def parse_hint(params: Any, *, max_retain_s: float) -> tuple[SessionOp | None, str | None]:
    """A request's `kv_transfer_params` -> (its session op, None), (None, None) when it
    carries no "ucm" hint, or (None, what is wrong) for a malformed one."""
    if not isinstance(params, dict) or "ucm" not in params:
        return None, None
    hint = params["ucm"]
    if not isinstance(hint, dict):
        return None, f"'ucm' must be a mapping, not {type(hint).__name__}"
    unknown = sorted(str(k) for k in hint if k not in HINT_KEYS)
    if unknown:
        return None, f"unknown keys {unknown[:4]} (known: {sorted(HINT_KEYS)})"
    session = hint.get("session")
    if not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_CHARS:
        return None, f"'session' must be a string of 1 to {MAX_SESSION_CHARS} characters"
    for flag in ("end", "prefetch"):
        if flag in hint and not isinstance(hint[flag], bool):
            return None, f"'{flag}' must be true or false"
    retain = hint.get("retain_s")
    if retain is not None:
        if isinstance(retain, bool) or not isinstance(retain, int | float):
            return None, "'retain_s' must be a number of seconds"
        if not (math.isfinite(retain) and 0 < retain <= max_retain_s):
            return None, f"'retain_s' must be > 0 and at most {max_retain_s:g} s"
    end = bool(hint.get("end"))
    if end and retain is not None:
        return None, "'end' and 'retain_s' contradict each other"
    prefetch = bool(hint.get("prefetch"))
    if retain is None and not end and not prefetch:
        return None, "a hint needs 'retain_s', 'end' or 'prefetch'"
    return SessionOp(session, float(retain) if retain is not None else None, end,
                     prefetch), None
