"""Blend (CacheBlend): reuse the KV of chunks that are not a prefix, fix it up cheaply.

Runs in the worker process during prefill (torch, the model's device). Two pieces:

1. RoPE re-rotation. A chunk's keys were cached at the positions it had when it was first
   prefilled; in the new prompt it sits elsewhere. RoPE is a rotation by angle pos * freq, so
   rotating a cached key by (new - old) gives the key at its new position. `rerotate` does that
   for the rotate-half convention (Llama, Qwen, Mistral: x = [x1, x2] ->
   [x1 cos - x2 sin, x1 sin + x2 cos]); it is exact up to float rounding.
2. Selective recompute. Reused KV lacks the cross-attention to the chunks before it. A probe
   pass runs layers 0..check_layer densely on every token and ranks the reused tokens by the
   deviation of their fresh KV from the reused KV at `check_layer` (HKVD). The blend pass then
   recomputes, in every layer, the tokens that have no cached KV plus the top `ratio` of the
   reused tokens, with their queries attending to all keys (fresh where recomputed, reused
   elsewhere). ratio 1.0 is a full prefill; ratio 0 is plain reuse.

The model is seen through `BlendLayer`: a token-wise `qkv` (projection + RoPE at the given
positions) and a token-wise `output` (output projection, residual, MLP). Attention is causal
by absolute position and done here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch


def rope_angles(
    positions: torch.Tensor, dim: int, base: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (N, dim // 2), computed in float64."""
    inv_freq = base ** (-torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE of x (..., N, D) at `positions` (N,); positions may be negative."""
    d = x.shape[-1]
    cos, sin = rope_angles(positions.to(x.device), d, base)
    x1, x2 = x[..., : d // 2].double(), x[..., d // 2 :].double()
    cos, sin = cos.to(x.device), sin.to(x.device)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


def rerotate(
    keys: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    base: float = 10000.0,
) -> torch.Tensor:
    """Keys rotated at `old_positions`, moved to `new_positions` (rotation by the difference)."""
    return apply_rope(keys, new_positions - old_positions, base)


class BlendLayer(Protocol):
    def qkv(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, E) hidden -> q (Hq, T, Dh), k and v (Hkv, T, Dh); k and q carry RoPE."""
        ...

    def output(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """(T, E) hidden and (T, Hq * Dh) attention output -> next (T, E) hidden."""
        ...


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
) -> torch.Tensor:
    """Queries (Hq, Tq, Dh) attend to keys at positions <= their own; out (Tq, Hq * Dh)."""
    hq, tq, dh = q.shape
    group = hq // k.shape[0]
    kk, vv = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    logits = q @ kk.transpose(1, 2) / math.sqrt(dh)
    allowed = k_positions[None, :] <= q_positions[:, None]
    p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return (p @ vv).transpose(0, 1).reshape(tq, hq * dh)


@dataclass
class BlendResult:
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), (Hkv, T, Dh)
    recomputed: torch.Tensor  # token indices recomputed in every layer, sorted
    deviation: torch.Tensor  # (T,) deviation at the check layer (0 for tokens without cache)
    hidden: torch.Tensor  # final hidden states of the recomputed tokens


def blend_prefill(
    layers: Sequence[BlendLayer],
    hidden: torch.Tensor,
    positions: torch.Tensor,
    reused: Sequence[tuple[torch.Tensor, torch.Tensor]],
    cached: torch.Tensor,
    ratio: float,
    check_layer: int = 1,
    deviation_on: Literal["k", "v"] = "v",
) -> BlendResult:
    """Prefill that reuses cached KV (already at its new positions) where `cached` (T,) is True.

    `reused[l]` is layer l's (k, v), (Hkv, T, Dh); entries of uncached tokens are ignored.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    check_layer = min(check_layer, len(layers) - 1)
    # probe: dense layers 0..check_layer to measure how far the reused KV is from fresh KV
    h = hidden
    deviation = torch.zeros(hidden.shape[0])
    for index in range(check_layer + 1):
        q, k, v = layers[index].qkv(h, positions)
        if index == check_layer:
            fresh, old = (k, reused[index][0]) if deviation_on == "k" else (v, reused[index][1])
            deviation = (fresh - old).float().pow(2).sum(dim=(0, 2)).cpu()
            deviation[~cached] = 0
        else:
            h = layers[index].output(h, causal_attention(q, k, v, positions, positions))
    n_pick = round(ratio * int(cached.sum()))
    scores = torch.where(cached, deviation, torch.full_like(deviation, -1.0))
    picked = torch.topk(scores, n_pick).indices if n_pick else torch.zeros(0, dtype=torch.long)
    recompute = torch.zeros_like(cached)
    recompute[~cached] = True
    recompute[picked] = True
    index_set = torch.nonzero(recompute).flatten()
    # blend: recompute the chosen tokens in every layer against the mixed KV
    h = hidden[index_set]
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer, (k_old, v_old) in zip(layers, reused, strict=True):
        q, k_new, v_new = layer.qkv(h, positions[index_set])
        k, v = k_old.clone(), v_old.clone()
        k[:, index_set] = k_new.to(k.dtype)
        v[:, index_set] = v_new.to(v.dtype)
        kv.append((k, v))
        h = layer.output(h, causal_attention(q, k, v, positions[index_set], positions))
    return BlendResult(kv, index_set, deviation, h)
