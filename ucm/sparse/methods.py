"""Sparse block-selection methods: block representatives at prefill, block scores per step.

Runs in the worker process, on whatever device the keys are on (torch; the CPU in tests and in
the benchmark). Shapes: keys are (Hkv, N, D) for one layer, N a multiple of the block size
(the session pads the last partial block by repeating its last key); queries are (W, Hq, D),
the W most recent decode queries, newest last. `block_scores` returns (nb,) non-negative
importances on a common scale (roughly an attention-mass estimate), so the session can add
them across layers and rank.

- quest:    per-channel key box (min/max); upper bound of q.k per block (never below the true
            max); per head a softmax over blocks, max over heads. Needle-safe.
- esa:      mean key per block; one dot product (summed over heads, as ESA concatenates heads).
            Cheap, but averaging a block hides a single outstanding key: weak on needles.
- gsa:      UCM's GSA: every key hashed to `hash_bits` sign bits of a fixed random Gaussian
            projection (seeded by `seed`; the same for all layers and heads), packed 8 to a
            byte; a block's representative is its tokens' codes. A block's similarity per query
            head is the best Hamming similarity (bits equal) of its keys' codes to the newest
            query's code, which estimates 1 - angle/pi of the closest key; per head a softmax
            over blocks of similarity * GSA.TEMPERATURE / hash_bits, max over heads. Angles
            only (no key norms); one outstanding key decides its block. The prefetch predictor
            is on by default (see SparseSession).
- kvstar:   sub-block means of `sub_block` tokens on the `channel_fraction` channels with the
            largest mean |K|; every recent query votes with its softmax mass over them.
- adaptive: Quest's box and score, and the budget is the smallest one whose estimated mass
            (softmax of the upper bounds) reaches `mass_target`, per step; the configured
            budget is the ceiling (mass_target 1.0 means the ceiling).
- random:   uniform random scores (a baseline that shows a recall test can fail).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from ucm.ops.score import mean_scores, quest_scores
from ucm.sparse.config import SparseConfig

Static = dict[str, torch.Tensor]  # per-layer state fixed at prefill (kvstar's channels)


@dataclass
class BlockReps:
    """Representatives of one layer's blocks: `per_block` tensors have blocks on dim 1."""

    per_block: dict[str, torch.Tensor]
    static: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n_blocks(self) -> int:
        return next(iter(self.per_block.values())).shape[1]

    def extend(self, more: BlockReps) -> BlockReps:
        merged = {k: torch.cat((v, more.per_block[k]), dim=1) for k, v in self.per_block.items()}
        return BlockReps(merged, self.static)


def _blocks(keys: torch.Tensor, block_size: int) -> torch.Tensor:
    hkv, n, d = keys.shape
    if n % block_size:
        raise ValueError(f"keys ({n} tokens) must be a multiple of block_size ({block_size})")
    return keys.reshape(hkv, n // block_size, block_size, d)


class SparseMethod:
    """Base of every method. Subclasses set `name` and override `prepare` and `block_scores`."""

    name: ClassVar[str]
    queries_needed: int = 1

    def __init__(self, config: SparseConfig) -> None:
        self.config = config

    def prepare(self, keys: torch.Tensor, static: Static | None = None) -> BlockReps:
        raise NotImplementedError

    def block_scores(self, reps: BlockReps, queries: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def choose_budget(
        self, reps: BlockReps, queries: torch.Tensor, resident: torch.Tensor
    ) -> int | None:
        """Blocks to pick by score this step, or None for the configured budget."""
        return None


class Quest(SparseMethod):
    name = "quest"

    def prepare(self, keys: torch.Tensor, static: Static | None = None) -> BlockReps:
        kb = _blocks(keys.float(), self.config.block_size)
        kmax, kmin = kb.amax(2), kb.amin(2)
        return BlockReps({"center": (kmax + kmin) * 0.5, "radius": (kmax - kmin) * 0.5})

    def head_bounds(self, reps: BlockReps, query: torch.Tensor) -> torch.Tensor:
        """(Hq, nb) upper bounds of the scaled logit q.k / sqrt(D)."""
        d = query.shape[-1]
        center, radius = reps.per_block["center"], reps.per_block["radius"]
        return quest_scores(query, center, radius) / math.sqrt(d)

    def block_scores(self, reps: BlockReps, queries: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.head_bounds(reps, queries[-1]), dim=-1).amax(0)


class Adaptive(Quest):
    name = "adaptive"

    def choose_budget(self, reps: BlockReps, queries: torch.Tensor, resident: torch.Tensor) -> int:
        cap = self.config.budget_blocks(int((~resident).sum()))
        if self.config.mass_target >= 1.0 or cap == 0:
            return cap
        mass = torch.softmax(self.head_bounds(reps, queries[-1]), dim=-1)  # (Hq, nb)
        ranked = mass[:, ~resident].sort(dim=-1, descending=True).values.cumsum(-1)
        need = self.config.mass_target - mass[:, resident].sum(-1)  # (Hq,)
        reached = ranked >= (need[:, None] - 1e-7)
        first = reached.float().argmax(-1) + 1.0  # argmax finds the first True
        counts = torch.where(reached.any(-1), first, torch.full_like(first, ranked.shape[1]))
        counts = torch.where(need <= 0, torch.zeros_like(counts), counts)
        return min(cap, max(self.config.min_budget, int(counts.max().item())))


class ESA(SparseMethod):
    name = "esa"

    def prepare(self, keys: torch.Tensor, static: Static | None = None) -> BlockReps:
        return BlockReps({"mean": _blocks(keys.float(), self.config.block_size).mean(2)})

    def block_scores(self, reps: BlockReps, queries: torch.Tensor) -> torch.Tensor:
        q = queries[-1]
        dots = mean_scores(q, reps.per_block["mean"]).mean(0) / math.sqrt(q.shape[-1])
        return torch.softmax(dots, dim=-1)


# popcount of every byte value: Hamming distances on packed codes without unpacking them
_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(..., n) bool -> (..., n / 8) uint8; bit i of byte j is bits[..., 8 j + i]."""
    n = bits.shape[-1]
    if n % 8:
        raise ValueError(f"{n} bits are not whole bytes")
    if bits.device.type == "cpu":  # numpy packs in one call (10x torch's five ops at decode)
        return torch.from_numpy(np.packbits(bits.numpy(), axis=-1, bitorder="little"))
    return pack_bits_reference(bits)


def pack_bits_reference(bits: torch.Tensor) -> torch.Tensor:
    """`pack_bits` in torch's ops: its path off the CPU, and the reference of numpy's."""
    *lead, n = bits.shape
    weights = (1 << torch.arange(8, device=bits.device)).to(torch.uint8)
    by_byte = bits.reshape(*lead, n // 8, 8).to(torch.uint8) * weights
    return by_byte.sum(-1, dtype=torch.uint8)


def popcount(codes: torch.Tensor) -> torch.Tensor:
    """Set bits of each uint8 code, summed over the last dim (int32)."""
    table = _POPCOUNT.to(codes.device)
    return table[codes.int()].sum(-1, dtype=torch.int32)


def _popcount64(words: torch.Tensor) -> torch.Tensor:
    """Set bits of each int64, summed over the last dim (int32): the SWAR bit count, in
    torch's elementwise ops on 8 bytes at a time (2.5x the byte table's speed on a CPU).
    Right shifts are arithmetic on int64; every mask's top bit is 0, so no sign bit leaks."""
    x = words - ((words >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F  # each byte holds its own count (<= 8)
    x = x + (x >> 8)
    x = x + (x >> 16)
    x = x + (x >> 32)
    return (x & 0x7F).sum(-1, dtype=torch.int32)


def hamming_similarity(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bits equal in packed uint8 codes a and b (broadcast; the last dim holds the bytes)."""
    nbytes = a.shape[-1]
    words = all(x.is_contiguous() and x.storage_offset() % 8 == 0 for x in (a, b))
    if nbytes % 8 == 0 and words:  # int64 views of the same bytes
        xor = torch.bitwise_xor(a.view(torch.int64), b.view(torch.int64))
        return 8 * nbytes - _popcount64(xor)
    return 8 * nbytes - popcount(torch.bitwise_xor(a, b))


def best_similarity_reference(query_codes: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """(Hkv, G, nbytes) query codes and (Hkv, nb, bs, nbytes) key codes -> (Hkv, G, nb)
    int32: each block's best Hamming similarity to each query code, in torch's ops (the
    reference of `best_similarity`, and its path off the CPU or on odd byte counts)."""
    return hamming_similarity(query_codes[:, :, None, None], codes[:, None]).amax(-1)


# numpy >= 2.0 counts bits with the CPU's popcount instruction, one ufunc over the codes
_BITWISE_COUNT = hasattr(np, "bitwise_count")


def best_similarity(query_codes: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """`best_similarity_reference`'s result, bit for bit, fast on the CPU: numpy XORs the
    codes as int64 words against the query's words tiled along a block's row (an inner loop
    over bs * nbytes / 8 contiguous words, no per-token broadcast) and counts bits with
    `np.bitwise_count`, where torch took a dozen SWAR passes over a broadcast copy."""
    hkv, nb, bs, nbytes = codes.shape
    on_cpu = codes.device.type == "cpu" and query_codes.device.type == "cpu"
    if not (_BITWISE_COUNT and on_cpu and nbytes % 8 == 0 and nb and bs):
        return best_similarity_reference(query_codes, codes)
    g, nw = query_codes.shape[1], nbytes // 8
    keys = codes.contiguous().numpy().view(np.uint64).reshape(hkv, 1, nb, bs * nw)
    q = query_codes.contiguous().numpy().view(np.uint64).reshape(hkv, g, 1, nw)
    counts = np.bitwise_count(np.bitwise_xor(keys, np.tile(q, bs)))  # uint8, <= 64 each
    counts = counts.reshape(hkv, g, nb, bs, nw)
    # a token's distance sums its words' counts (uint8 holds 3 words' 192 bits), word by word:
    # numpy's sum over a last axis of 2 runs 25x slower than one add of two strided views
    dist = counts[..., 0]
    for w in range(1, nw):
        dist = np.add(dist, counts[..., w], dtype=np.uint8 if nw < 4 else np.int32)
    best = torch.from_numpy(dist).amin(-1).numpy()  # torch's min over bs: 2x numpy's here
    return torch.from_numpy(np.subtract(8 * nbytes, best, dtype=np.int32))


class GSA(SparseMethod):
    """UCM's GSA scoring: keys hashed to sign bits of a fixed random projection at prefill,
    each block ranked by the best Hamming similarity of its tokens' codes to the newest
    query's code (the module docstring has the score's scale)."""

    name = "gsa"
    # Hamming similarity s in [0, hash_bits] -> logit TEMPERATURE * s / hash_bits. With
    # sign-random-projection codes s / hash_bits estimates 1 - angle(q, k) / pi, so a block
    # whose best key is 10% of the bits closer to the query gets e^(0.1 T) = ~25x the weight.
    TEMPERATURE: ClassVar[float] = 32.0

    def __init__(self, config: SparseConfig) -> None:
        super().__init__(config)
        self._projections: dict[tuple[int, torch.device], torch.Tensor] = {}

    def projection(self, dim: int, device: torch.device) -> torch.Tensor:
        """(dim, hash_bits) standard Gaussian, from `config.seed` on a CPU generator: the same
        in every process and on every device, for every layer and head."""
        key = (dim, device)
        if key not in self._projections:
            g = torch.Generator().manual_seed(self.config.seed)
            matrix = torch.randn(dim, self.config.hash_bits, generator=g)
            self._projections[key] = matrix.to(device)
        return self._projections[key]

    def hash(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., hash_bits / 8) uint8: the signs of x @ projection, packed."""
        return pack_bits(x.float() @ self.projection(x.shape[-1], x.device) > 0)

    def prepare(self, keys: torch.Tensor, static: Static | None = None) -> BlockReps:
        # Every token's code, (Hkv, nb, block_size, hash_bits / 8) uint8: hash_bits / 8 bytes
        # per token and KV head against 2 D for bf16 keys (at the default 128 bits 1/8 of the
        # keys for D = 64, 1/16 for D = 128); Quest's fp32 box costs 8 D / block_size per token
        # (16 bytes at D = 64 and 32-token blocks, as much as these codes).
        codes = self.hash(_blocks(keys, self.config.block_size))
        return BlockReps({"codes": codes})

    def block_similarity(self, reps: BlockReps, query: torch.Tensor) -> torch.Tensor:
        """(Hq, nb) best Hamming similarity of a block's keys to each query head's code."""
        codes = reps.per_block["codes"]  # (Hkv, nb, bs, nbytes)
        hkv, nb, _, nbytes = codes.shape
        hq = query.shape[0]
        if hq % hkv:
            raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
        qc = self.hash(query.to(codes.device)).reshape(hkv, hq // hkv, nbytes)
        return best_similarity(qc, codes).reshape(hq, nb)

    def block_scores(self, reps: BlockReps, queries: torch.Tensor) -> torch.Tensor:
        sim = self.block_similarity(reps, queries[-1]).float()
        logits = sim * (self.TEMPERATURE / self.config.hash_bits)
        return torch.softmax(logits, dim=-1).amax(0)


class KVStar(SparseMethod):
    name = "kvstar"

    @property
    def queries_needed(self) -> int:  # type: ignore[override]
        return self.config.vote_queries

    def prepare(self, keys: torch.Tensor, static: Static | None = None) -> BlockReps:
        cfg = self.config
        hkv, _, d = keys.shape
        if static is None:
            n_ch = max(1, round(d * cfg.channel_fraction))
            static = {"channels": keys.float().abs().mean(1).topk(n_ch, dim=-1).indices}
        channels = static["channels"]  # (Hkv, C)
        kb = _blocks(keys.float(), cfg.block_size)
        sub = kb.reshape(hkv, kb.shape[1], cfg.block_size // cfg.sub_block, cfg.sub_block, d)
        sub = sub.mean(3)  # (Hkv, nb, S, D)
        index = channels[:, None, None, :].expand(*sub.shape[:3], channels.shape[1])
        return BlockReps({"sub": torch.gather(sub, 3, index)}, static)

    def block_scores(self, reps: BlockReps, queries: torch.Tensor) -> torch.Tensor:
        sub = reps.per_block["sub"]  # (Hkv, nb, S, C)
        hkv, nb, s, c = sub.shape
        w, hq, d = queries.shape
        channels = reps.static["channels"]  # (Hkv, C)
        q = queries.float().reshape(w, hkv, hq // hkv, d)
        q = torch.gather(q, 3, channels[None, :, None, :].expand(w, hkv, hq // hkv, c))
        logits = torch.einsum("wkgc,kbsc->wkgbs", q, sub) / math.sqrt(d)
        mass = torch.softmax(logits.reshape(w, hkv, hq // hkv, nb * s), dim=-1)
        return mass.reshape(w * hq, nb, s).sum(-1).mean(0)


class Random(SparseMethod):
    name = "random"

    def __init__(self, config: SparseConfig) -> None:
        super().__init__(config)
        self._generator = torch.Generator().manual_seed(config.seed)

    def prepare(self, keys: torch.Tensor, static: Static | None = None) -> BlockReps:
        nb = keys.shape[1] // self.config.block_size
        return BlockReps({"none": torch.zeros(1, nb)})

    def block_scores(self, reps: BlockReps, queries: torch.Tensor) -> torch.Tensor:
        return torch.rand(reps.n_blocks, generator=self._generator)


METHODS: dict[str, type[SparseMethod]] = {
    cls.name: cls for cls in (Quest, Adaptive, ESA, GSA, KVStar, Random)
}


def make_method(config: SparseConfig) -> SparseMethod:
    """The method that `config.method` names."""
    return METHODS[config.method](config)
