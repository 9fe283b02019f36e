"""Where each block's bytes live in vLLM's KV cache tensors, and the copies in and out of a
contiguous staging buffer. Runs in the worker process.

A ucm block is the KV of one engine block for every layer of this rank, layer-major:
[layer 0 | layer 1 | ...], each layer's part being that layer's bytes of the block, taken as
opaque bytes (on CPU the order inside a block changes with dtype and ISA; we never look
inside). vLLM allocates the cache layer-major (one tensor per layer, `[num_blocks, ...]` on CPU,
`[2, num_blocks, ...]` for K and V on most CUDA backends), so one ucm block is not contiguous
in the cache. When the cache is in host memory, a load goes straight into it: each block's
target is a `Scatter` of its per-layer pieces, which the storage reads fill in order (no
staging, no extra copy). Saves, and loads into a GPU cache, go through a staging buffer of
whole ucm blocks (pinned host memory when the cache is on a GPU), and the copies between
staging and cache go per layer segment, one torch copy per run of consecutive block ids. On
CUDA those copies are host<->device `copy_`s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ucm.block import Scatter


@dataclass(frozen=True)
class Segment:
    """One layer's bytes of every block: `view[block_id]` is a contiguous byte row."""

    layer: str
    view: torch.Tensor  # uint8 [num_blocks, nbytes]
    offset: int  # where this segment starts inside a ucm block
    nbytes: int

    def copy_out(self, block_ids: Sequence[int], staging: torch.Tensor, first_row: int = 0,
                 ) -> None:
        """staging[first_row + i, segment] = cache[block_ids[i]] (a save's snapshot)."""
        cols = slice(self.offset, self.offset + self.nbytes)
        for start, row, n in runs(block_ids):
            dst = staging[first_row + row:first_row + row + n, cols]
            dst.copy_(self.view[start:start + n], non_blocking=True)

    def copy_in(self, block_ids: Sequence[int], staging: torch.Tensor, first_row: int = 0,
                ) -> None:
        """cache[block_ids[i]] = staging[first_row + i, segment] (after a load)."""
        cols = slice(self.offset, self.offset + self.nbytes)
        for start, row, n in runs(block_ids):
            src = staging[first_row + row:first_row + row + n, cols]
            self.view[start:start + n].copy_(src, non_blocking=True)


def runs(block_ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(first block id, first row, length) for each run of consecutive ids."""
    i, n = 0, len(block_ids)
    while i < n:
        j = i + 1
        while j < n and block_ids[j] == block_ids[j - 1] + 1:
            j += 1
        yield block_ids[i], i, j - i
        i = j


class BlockLayout:
    """The byte layout of a ucm block over the KV cache tensors `register_kv_caches` got."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None = None,
                 ) -> None:
        if not kv_caches:
            raise ValueError("no KV cache tensors to register")
        self.segments: list[Segment] = []
        self.by_layer: dict[str, list[Segment]] = {}
        self._first_segment: dict[str, int] = {}  # layer -> index of its first segment
        seen: set[tuple[int, int]] = set()
        offset = 0
        first = next(iter(kv_caches.values()))
        self.device = first.device
        self.num_blocks = num_blocks or _guess_num_blocks(first)
        for name, tensor in kv_caches.items():
            ident = (tensor.data_ptr(), tensor.numel())
            if ident in seen:  # a layer that reuses another layer's cache (KV sharing)
                continue
            seen.add(ident)
            segs = []
            self._first_segment[name] = len(self.segments)
            for part in _block_major_parts(tensor, self.num_blocks):
                view = _byte_rows(part, name)
                segs.append(Segment(name, view, offset, view.shape[1]))
                offset += view.shape[1]
            self.segments.extend(segs)
            self.by_layer[name] = segs
        self.block_bytes = offset
        # numpy views of the segments, made on first use: (bytes, row stride, row bytes)
        self._rows: list[tuple[memoryview, int, int]] | None = None
        self._scatters: dict[int, Scatter] = {}  # load targets by block id (scatter)

    @property
    def scatters(self) -> bool:
        """Whether loads can go straight into the cache (host memory: see `scatter`)."""
        return self.device.type == "cpu"

    def scatter(self, block_id: int) -> Scatter:
        """Block `block_id`'s pieces in the cache, in ucm block order: a load target that
        skips the staging buffer. Host memory only. Made once per block and kept (the cache
        does not move)."""
        found = self._scatters.get(block_id)
        if found is not None:
            return found
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside the cache's {self.num_blocks} blocks")
        made = self._scatters[block_id] = Scatter.of_views(tuple(
            span[block_id * stride:block_id * stride + n]
            for span, stride, n in self._segment_rows()))
        return made

    def _segment_rows(self) -> list[tuple[memoryview, int, int]]:
        """Per segment, made on first use: a flat byte view from its first block's bytes to
        its last's, the bytes from one block to the next, and a block's bytes. Slicing it is
        cheaper than indexing the segment as an array (figures: docs/performance.md, Load
        targets)."""
        if self._rows is None:
            rows: list[tuple[memoryview, int, int]] = []
            for seg in self.segments:
                n, stride = seg.view.shape[0], seg.view.stride(0)
                span = seg.view.as_strided(((n - 1) * stride + seg.nbytes,), (1,))
                rows.append((span.numpy().data, stride, seg.nbytes))
            self._rows = rows
        return self._rows

    def layer_span(self, layer: str) -> tuple[int, int]:
        """(offset, bytes) of one layer's part of a ucm block (its segments are adjacent)."""
        segs = self.by_layer[layer]
        return segs[0].offset, sum(s.nbytes for s in segs)

    def scatter_layer(self, block_id: int, layer: str) -> Scatter:
        """One layer's pieces of block `block_id` in the cache (see `scatter`)."""
        rows = self._segment_rows()
        first = self._first_segment[layer]
        return Scatter.of_views(tuple(
            span[block_id * stride:block_id * stride + n]
            for span, stride, n in rows[first:first + len(self.by_layer[layer])]))

    def new_staging(self, n_blocks: int) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.empty((n_blocks, self.block_bytes), dtype=torch.uint8, pin_memory=pin)

    def copy_in(self, block_ids: Sequence[int], staging: torch.Tensor, *,
                layer: str | None = None, first_row: int = 0) -> None:
        for seg in self.segments if layer is None else self.by_layer.get(layer, ()):
            seg.copy_in(block_ids, staging, first_row)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def copy_out(self, block_ids: Sequence[int], staging: torch.Tensor, *,
                 layer: str | None = None, first_row: int = 0) -> None:
        for seg in self.segments if layer is None else self.by_layer.get(layer, ()):
            seg.copy_out(block_ids, staging, first_row)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()


def _guess_num_blocks(tensor: torch.Tensor) -> int:
    return tensor.shape[0] if tensor.shape[0] != 2 or tensor.dim() < 2 else tensor.shape[1]


def _block_major_parts(tensor: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """Splits a layer's cache into tensors whose first dimension is the block id."""
    if tensor.shape[0] == num_blocks:
        return [tensor]
    if tensor.dim() >= 2 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks:
        return [tensor[0], tensor[1]]  # K and V halves
    raise ValueError(f"cannot find the block dimension ({num_blocks} blocks) in a KV cache of "
                     f"shape {tuple(tensor.shape)}")


def _byte_rows(part: torch.Tensor, name: str) -> torch.Tensor:
    """`part` as uint8 rows, one per block; each block's bytes must be contiguous."""
    if not part[0].is_contiguous():
        raise ValueError(f"{name}: a block's bytes are not contiguous in the KV cache (strides "
                         f"{part.stride()}); this layout needs a per-token copy, unsupported")
    n = part.shape[0]
    per_block = part[0].numel()
    flat = part.as_strided((n, per_block), (part.stride(0), 1))
    return flat.view(torch.uint8)
