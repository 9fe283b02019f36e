"""Reference attention for one decode query: dense, masked, over selected blocks, and the
oracle block masses that recall is measured against. Torch, any device; used by tests, the
benchmark and the evaluation of methods, not on the serving path.

Shapes: q (Hq, D); k, v (Hkv, N, D); query head h reads KV head h // (Hq // Hkv).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def _expand(x: torch.Tensor, hq: int) -> torch.Tensor:
    return x.repeat_interleave(hq // x.shape[0], dim=0)


def attention_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(Hq, N) scaled logits q.k / sqrt(D)."""
    kk = _expand(k, q.shape[0]).to(q.dtype)
    return torch.einsum("hd,hnd->hn", q, kk) / math.sqrt(q.shape[-1])


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q.k / sqrt(D)) v over every key, (Hq, D). Grouped products, no KV expansion."""
    hkv, _, d = k.shape
    qg = q.reshape(hkv, q.shape[0] // hkv, d).to(k.dtype)
    p = torch.softmax(torch.bmm(qg, k.transpose(1, 2)) / math.sqrt(d), dim=-1)
    return torch.bmm(p, v.to(p.dtype)).reshape(q.shape[0], d)


def block_token_mask(
    block_ids: Sequence[int] | torch.Tensor, n_tokens: int, block_size: int
) -> torch.Tensor:
    """(N,) bool: the tokens of the listed blocks (the last block may be partial)."""
    ids = torch.as_tensor(block_ids, dtype=torch.long)
    owner = torch.arange(n_tokens) // block_size
    return torch.isin(owner, ids)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Dense attention with the logits of unmasked keys set to -inf (the reference)."""
    logits = attention_logits(q, k).masked_fill(~mask.to(q.device), float("-inf"))
    p = torch.softmax(logits, dim=-1)
    return torch.einsum("hn,hnd->hd", p, _expand(v, q.shape[0]).to(p.dtype))


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Attention that reads only the tokens of the selected blocks (what a decode step runs)."""
    tokens = torch.nonzero(block_token_mask(block_ids, k.shape[1], block_size)).flatten()
    tokens = tokens.to(k.device)
    return dense_attention(q, k.index_select(1, tokens), v.index_select(1, tokens))


def block_mass(q: torch.Tensor, k: torch.Tensor, block_size: int) -> torch.Tensor:
    """(Hq, nb) true attention probability mass of each block (the oracle's ranking)."""
    p = torch.softmax(attention_logits(q, k).double(), dim=-1)
    n = p.shape[-1]
    nb = -(-n // block_size)
    p = torch.nn.functional.pad(p, (0, nb * block_size - n))
    return p.reshape(p.shape[0], nb, block_size).sum(-1)


def mass_recall(mass: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """(Hq,) attention mass inside the selected blocks, given `block_mass` output."""
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=mass.device)
    return mass.index_select(-1, ids).sum(-1)
