"""Where keys and values sit in a block: what a quantizing codec needs to interpret its bytes.

A `KVLayout` is the block's parts in order, each a [tokens, channels] matrix of keys ("k"),
values ("v"), or bytes to keep as they are ("raw": `tokens` bytes, `channels` 1), all of one
element dtype. A part's elements are stored in one of two tiled orders (`Order`): with the
tokens split into outer x `ti` inner and the channels into outer x `ci` inner, row-major over
[tokens/ti, channels/ci, ti, ci] ("t-major"), or over [channels/ci, tokens/ti, ci, ti]
("c-major"). Plain [T, C] is t-major with ti = ci = 1; [C, T] is c-major with 1, 1; vLLM's CPU
attention packs keys for AMX as t-major 16 x 2 and values as c-major 2 x 16
(ucm/codecs/vllm.py). An engine hook gives its kernel the layouts of the blocks it stores
(`KVLayouts`: one layout per block size, for the kernel's namespace), and the kernel gives them
to each quantizing tier; a tier quantizes a block only when it holds a layout of exactly its
size, and stores any other block losslessly: bytes it cannot interpret are never quantized.
The layout travels in every quantized block's header (`pack`), so a load needs nothing but
the block.

Packed (little-endian): format u8 (FORMAT | dtype) | group u16 | repeat u32 | runs u16 |
per run: kind u8, tokens u32, channels u32, count u32, c-major u8, ti u16, ci u16. The parts
are the runs expanded, the whole repeated. Parameters of an earlier format (top bits 0: fp16
scales per group; 0x80: two-level scales, codes in logical order) are refused as corrupt:
such a block is a miss.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from ucm.errors import BlockCorrupt, ConfigError

DTYPES = {"fp16": 1, "bf16": 2, "fp32": 3}
ITEMSIZE = {"fp16": 2, "bf16": 2, "fp32": 4}
KINDS = {"raw": 0, "k": 1, "v": 2}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_KIND_NAMES = {v: k for k, v in KINDS.items()}

_HEAD = struct.Struct("<BHIH")
_RUN = struct.Struct("<BIIIBHH")
# the format bits of the first byte: two-level scales, runs with an order, codes in stored order
FORMAT = 0xC0
_FORMAT_MASK = 0xF0
MAX_PARTS = 1 << 16  # a decoder expands at most this many parts (a forged header gets no more)
# Values are grouped per token along up to 64 channels (a head of most models), keys per channel
# along up to 64 tokens (a vLLM block): two scale bytes a group (figures: docs/compression.md).
DEFAULT_GROUP = 64


class Order(NamedTuple):
    """A part's element order: c_major False is [T/ti, C/ci, ti, ci], True [C/ci, T/ti, ci, ti]."""

    c_major: bool = False
    ti: int = 1
    ci: int = 1


TC = Order()
Part = tuple  # (kind, tokens, channels[, order]); KVLayout keeps (kind, tokens, channels, order)


@dataclass(frozen=True, slots=True)
class KVLayout:
    dtype: str  # fp16 | bf16 | fp32
    parts: tuple[Part, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        parts = tuple(_full(p) for p in self.parts)
        object.__setattr__(self, "parts", parts)  # every part with its order
        for kind, tokens, channels, order in parts:
            if (kind not in KINDS or tokens < 1 or channels < 1 or not _order_fits(
                    kind, tokens, channels, order)):
                raise ValueError(f"bad layout part {(kind, tokens, channels, order)!r}")
        if not parts or len(parts) > MAX_PARTS:
            raise ValueError(f"a layout has 1 to {MAX_PARTS} parts")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def part_bytes(self, part: Part) -> int:
        kind, tokens, channels = part[:3]
        return tokens * channels * (1 if kind == "raw" else self.itemsize)

    @property
    def raw_bytes(self) -> int:
        return sum(self.part_bytes(p) for p in self.parts)


def _full(part: Part) -> Part:
    if len(part) == 3:
        return (*part, TC)
    kind, tokens, channels, order = part
    return (kind, tokens, channels, Order(*order))


def _order_fits(kind: str, tokens: int, channels: int, order: Order) -> bool:
    if kind == "raw":
        return order == TC
    return (order.ti >= 1 and order.ci >= 1 and tokens % order.ti == 0
            and channels % order.ci == 0 and order.ti < 1 << 16 and order.ci < 1 << 16)


def group_for(group: int, n: int) -> int:
    """The group size used along an axis of `n` values: the largest divisor of `n` that
    divides `group`, or the whole axis when that is under 4 (encoder and decoder agree)."""
    g = _gcd(group, n)
    return g if g >= 4 else n


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


@functools.lru_cache(maxsize=64)  # the few layouts a process's kernels hold, packed per block
def pack(layout: KVLayout, group: int) -> bytes:
    runs: list[tuple[str, int, int, Order, int]] = []
    for part in layout.parts:
        if runs and runs[-1][:4] == part:
            runs[-1] = (*part, runs[-1][4] + 1)
        else:
            runs.append((*part, 1))
    repeat = 1
    for period in range(1, len(runs) // 2 + 1):  # the shortest run list the whole repeats
        if len(runs) % period == 0 and runs == runs[:period] * (len(runs) // period):
            repeat, runs = len(runs) // period, runs[:period]
            break
    out = [_HEAD.pack(FORMAT | DTYPES[layout.dtype], group, repeat, len(runs))]
    out += [_RUN.pack(KINDS[k], t, c, n, o.c_major, o.ti, o.ci) for k, t, c, o, n in runs]
    return b"".join(out)


def unpack(params: bytes, raw_len: int) -> tuple[KVLayout, int]:
    """(layout, group) from a header's parameters; BlockCorrupt unless they are well formed
    and describe exactly `raw_len` bytes. Sizes are checked before anything is expanded."""
    if len(params) < _HEAD.size:
        raise BlockCorrupt("codec parameters truncated")
    first, group, repeat, nruns = _HEAD.unpack_from(params)
    if first & _FORMAT_MASK != FORMAT:
        raise BlockCorrupt("quantized block of an earlier format (no longer read)")
    dtype_id = first & ~_FORMAT_MASK
    if dtype_id not in _DTYPE_NAMES or group < 1 or repeat < 1 or nruns < 1:
        raise BlockCorrupt("codec parameters out of range")
    if len(params) != _HEAD.size + nruns * _RUN.size:
        raise BlockCorrupt("codec parameters have the wrong length")
    dtype = _DTYPE_NAMES[dtype_id]
    runs, nparts, total = [], 0, 0
    for i in range(nruns):
        kind_id, tokens, channels, count, c_major, ti, ci = _RUN.unpack_from(
            params, _HEAD.size + i * _RUN.size)
        if kind_id not in _KIND_NAMES or tokens < 1 or channels < 1 or count < 1:
            raise BlockCorrupt("codec parameters out of range")
        kind, order = _KIND_NAMES[kind_id], Order(bool(c_major), ti, ci)
        if c_major > 1 or not _order_fits(kind, tokens, channels, order):
            raise BlockCorrupt("codec parameters name an element order that does not fit")
        runs.append((kind, tokens, channels, order, count))
        nparts += count
        total += count * tokens * channels * (1 if kind == "raw" else ITEMSIZE[dtype])
    if nparts * repeat > MAX_PARTS or total * repeat != raw_len:
        raise BlockCorrupt("codec parameters do not describe the block's raw size")
    parts = tuple((k, t, c, o) for k, t, c, o, n in runs for _ in range(n)) * repeat
    return KVLayout(dtype, parts), group


def _part_text(part: Part) -> str:
    kind, tokens, channels, order = part
    tiles = "" if order == TC else f" {'c' if order.c_major else 't'}-major {order.ti}x{order.ci}"
    return f"{kind} {tokens}x{channels}{tiles}"


def describe(layout: KVLayout, shown: int = 6) -> str:
    """A layout in a line: its dtype and parts (the repeating run once, with its count)."""
    parts = [_part_text(p) for p in layout.parts]
    n = len(parts)
    period = next(p for p in range(1, n + 1) if n % p == 0 and parts == parts[:p] * (n // p))
    text = ", ".join(parts[:min(period, shown)]) + (", ..." if period > shown else "")
    return f"{layout.dtype} [{text}]" + (f" x {n // period}" if n > period else "")


def _first_difference(a: KVLayout, b: KVLayout) -> str:
    if a.dtype != b.dtype:
        return ""
    for i, (pa, pb) in enumerate(zip(a.parts, b.parts, strict=False)):
        if pa != pb:
            return f" (part {i}: {_part_text(pa)} against {_part_text(pb)})"
    return f" ({len(a.parts)} parts against {len(b.parts)})"


# -- the layouts of one namespace's blocks ---------------------------------------------------------

class KVLayouts:
    """The KV layouts of the blocks one namespace stores, one per block size: what a quantizing
    tier of that namespace quantizes with (the engine hook gives them to its kernel, which
    gives them to its tiers). Immutable; two different layouts of one size are a ConfigError
    naming both, since a tier could not tell which of them a block of that size holds."""

    __slots__ = ("_by_size", "namespace")

    def __init__(self, layouts: Iterable[KVLayout] = (), *, namespace: str = "") -> None:
        by_size: dict[int, KVLayout] = {}
        for layout in layouts:
            if not isinstance(layout, KVLayout):
                raise TypeError(f"a KVLayout, not {type(layout).__name__}")
            known = by_size.setdefault(layout.raw_bytes, layout)
            if known != layout:
                where = f"namespace {namespace!r}" if namespace else "one namespace"
                raise ConfigError(f"{where} was given two KV layouts of {layout.raw_bytes}-byte "
                                  f"blocks: {describe(known)} and {describe(layout)}"
                                  f"{_first_difference(known, layout)}")
        self._by_size = by_size
        self.namespace = namespace

    def for_size(self, nbytes: int) -> KVLayout | None:
        """The layout of this namespace's blocks of `nbytes` bytes, if it has one."""
        return self._by_size.get(nbytes)

    def with_layouts(self, layouts: Iterable[KVLayout]) -> KVLayouts:
        """These layouts and `layouts` (ConfigError on a conflict, naming both)."""
        return KVLayouts([*self, *layouts], namespace=self.namespace)

    def __iter__(self) -> Iterator[KVLayout]:
        return iter(self._by_size.values())

    def __len__(self) -> int:
        return len(self._by_size)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVLayouts) and self._by_size == other._by_size

    def __hash__(self) -> int:
        return hash(frozenset(self._by_size.items()))

    def __repr__(self) -> str:
        sizes = ", ".join(str(size) for size in sorted(self._by_size))
        return f"KVLayouts({self.namespace!r}: blocks of {sizes or 'no size'} bytes)"
