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
are the runs expanded, the whole repeated. Parameters whose top bits are not FORMAT's (0: fp16
scales per group; 0x80: two-level scales, codes in logical order) are refused as corrupt:
such a block is a miss.

A header's parameters are untrusted: `parse` checks them run by run, in time bounded by their
length (a header holds at most about 220 runs), and gives a `Packed`, which answers the block's
raw size, payload length and part count by arithmetic over the runs and yields its parts lazily;
nothing is expanded until a load has compared the raw size with its buffer. The rules a part
must meet are the same for a `KVLayout` a kernel is given and for a header.
"""

from __future__ import annotations

import functools
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

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
MAX_DIM = 1 << 24  # tokens or channels of a k/v part (native/kvcodec.c checks the same bound)
MAX_RAW = (1 << 32) - 1  # bytes of a raw part (a u32 in the packed form)
# Values are grouped per token along up to 64 channels (a head of most models), keys per channel
# along up to 64 tokens (a vLLM block): two scale bytes a group (figures: docs/compression.md).
DEFAULT_GROUP = 64


class Order(NamedTuple):
    """A part's element order: c_major False is [T/ti, C/ci, ti, ci], True [C/ci, T/ti, ci, ti]."""

    c_major: bool = False
    ti: int = 1
    ci: int = 1


TC = Order()
OrderedPart = tuple[str, int, int, Order]  # (kind, tokens, channels, order): what KVLayout keeps
Part = tuple[str, int, int] | OrderedPart  # (kind, tokens, channels[, order]): what it is given


class _PartSizes:
    """Bytes of a part, for a layout and for a header's parsed parameters alike."""

    __slots__ = ()
    dtype: str

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def part_bytes(self, part: Part) -> int:
        kind, tokens, channels = part[:3]
        return tokens * channels * (1 if kind == "raw" else self.itemsize)


@dataclass(frozen=True, slots=True)
class KVLayout(_PartSizes):
    dtype: str  # fp16 | bf16 | fp32
    parts: tuple[OrderedPart, ...]

    if TYPE_CHECKING:  # given parts may leave out their order: __post_init__ adds it
        def __init__(self, dtype: str, parts: tuple[Part, ...]) -> None: ...

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        parts = tuple(_full(p) for p in self.parts)
        object.__setattr__(self, "parts", parts)  # every part with its order
        for part in parts:
            problem = part_problem(*part)
            if problem is not None:
                raise ValueError(f"bad layout part {part!r}: {problem}")
        if not parts or len(parts) > MAX_PARTS:
            raise ValueError(f"a layout has 1 to {MAX_PARTS} parts")

    @property
    def raw_bytes(self) -> int:
        return sum(self.part_bytes(p) for p in self.parts)


def _full(part: Part) -> OrderedPart:
    if len(part) == 3:
        return (*part, TC)
    kind, tokens, channels, order = part
    return (kind, tokens, channels, Order(*order))


def part_problem(kind: object, tokens: int, channels: int, order: Order) -> str | None:
    """What is wrong with a part, or None: one rule for the layouts kernels hold and headers."""
    if kind not in KINDS:
        return f"kind must be one of {', '.join(KINDS)}"
    if tokens < 1 or channels < 1:
        return "tokens and channels must be at least 1"
    if kind == "raw":  # `tokens` bytes kept as they are: the codecs know no channels there
        if channels != 1 or order != TC:
            return "a raw part is (\"raw\", bytes, 1), in plain order"
        if tokens > MAX_RAW:
            return f"a raw part holds at most {MAX_RAW} bytes"
        return None
    if tokens > MAX_DIM or channels > MAX_DIM:
        return f"a k or v part has at most {MAX_DIM} tokens and channels"
    c_major, ti, ci = order
    if (c_major not in (False, True) or not 1 <= ti < 1 << 16 or not 1 <= ci < 1 << 16
            or tokens % ti or channels % ci):
        return "its element order's tile does not divide its tokens and channels"
    return None


def group_for(group: int, n: int) -> int:
    """The group size used along an axis of `n` values: the largest divisor of `n` that
    divides `group`, or the whole axis when that is under 4 (encoder and decoder agree)."""
    g = _gcd(group, n)
    return g if g >= 4 else n


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def part_geometry(part: Part | Run, group: int) -> tuple[int, int]:
    """(group along the quantized axis, number of groups) of a k or v part."""
    kind, tokens, channels = part[:3]
    if kind == "k":
        g = group_for(group, tokens)
        return g, (tokens // g) * channels
    g = group_for(group, channels)
    return g, tokens * (channels // g)


def part_payload(part: Part | Run, group: int, bits: int) -> int:
    """A part's bytes in an int8 (`bits` 8) or int4 payload (ucm.codecs.quant's format)."""
    kind, tokens, channels = part[:3]
    if kind == "raw":
        return tokens
    n = tokens * channels
    return 4 + 2 * part_geometry(part, group)[1] + (n if bits == 8 else (n + 1) // 2)


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


class Run(NamedTuple):
    """`copies` parts alike, in a row."""

    kind: str
    tokens: int
    channels: int
    order: Order
    copies: int  # a field named `count` would hide tuple.count


@dataclass(frozen=True, slots=True)
class Packed(_PartSizes):
    """A header's codec parameters, checked (`parse`) but not expanded: the parts are the runs
    in order, the whole `repeat` times. Sizes come from the runs; `parts` yields the parts one
    at a time. It stands for a `KVLayout` wherever ucm.codecs.quant decodes."""

    params: bytes
    dtype: str
    group: int
    repeat: int
    runs: tuple[Run, ...]
    nparts: int
    raw_bytes: int
    payload8: int  # the payload's bytes for int8, and for int4
    payload4: int


    def payload_bytes(self, bits: int) -> int:
        return self.payload8 if bits == 8 else self.payload4

    @property
    def parts(self) -> Iterator[OrderedPart]:
        for _ in range(self.repeat):
            for kind, tokens, channels, order, count in self.runs:
                part = (kind, tokens, channels, order)
                for _ in range(count):
                    yield part

    def layout(self) -> KVLayout:
        """The parts as a KVLayout (expanded: up to MAX_PARTS of them)."""
        return KVLayout(self.dtype, tuple(self.parts))


def parse(params: bytes) -> Packed:
    """The parameters of a header, checked run by run (time bounded by their length, nothing
    expanded); BlockCorrupt unless they are well formed, every part meets the rules of a
    `KVLayout` and there are at most MAX_PARTS parts."""
    if len(params) < _HEAD.size:
        raise BlockCorrupt("codec parameters truncated")
    first, group, repeat, nruns = _HEAD.unpack_from(params)
    if first & _FORMAT_MASK != FORMAT:
        raise BlockCorrupt("quantized block of another parameter format (not 0xC0)")
    dtype_id = first & ~_FORMAT_MASK
    if dtype_id not in _DTYPE_NAMES or group < 1 or repeat < 1 or nruns < 1:
        raise BlockCorrupt("codec parameters out of range")
    if len(params) != _HEAD.size + nruns * _RUN.size:
        raise BlockCorrupt("codec parameters have the wrong length")
    runs, nparts = [], 0
    for i in range(nruns):
        kind_id, tokens, channels, count, c_major, ti, ci = _RUN.unpack_from(
            params, _HEAD.size + i * _RUN.size)
        if kind_id not in _KIND_NAMES or count < 1 or c_major > 1:
            raise BlockCorrupt("codec parameters out of range")
        kind, order = _KIND_NAMES[kind_id], Order(bool(c_major), ti, ci)
        problem = part_problem(kind, tokens, channels, order)
        if problem is not None:
            raise BlockCorrupt("codec parameters name a part that does not fit (its size or "
                               f"element order): {problem}")
        runs.append(Run(kind, tokens, channels, order, count))
        nparts += count
    if nparts * repeat > MAX_PARTS:
        raise BlockCorrupt(f"codec parameters describe {nparts * repeat} parts, more than "
                           f"{MAX_PARTS}: not the block's raw size")
    dtype = _DTYPE_NAMES[dtype_id]
    itemsize = ITEMSIZE[dtype]
    raw = sum(r.copies * r.tokens * r.channels * (1 if r.kind == "raw" else itemsize)
              for r in runs)
    sizes = [sum(r.copies * part_payload(r, group, bits) for r in runs) for bits in (8, 4)]
    return Packed(bytes(params), dtype, group, repeat, tuple(runs), nparts * repeat,
                  raw * repeat, sizes[0] * repeat, sizes[1] * repeat)


def unpack(params: bytes, raw_len: int) -> tuple[KVLayout, int]:
    """(layout, group) from a header's parameters; BlockCorrupt unless they are well formed
    and describe exactly `raw_len` bytes. Sizes are checked before anything is expanded."""
    packed = parse(params)
    if packed.raw_bytes != raw_len:
        raise BlockCorrupt("codec parameters do not describe the block's raw size")
    return packed.layout(), packed.group


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteBoundedCache(Generic[K, V]):
    """A thread-safe LRU map whose entries' sizes (as `size_of` counts them) add up to at most
    `budget` bytes; a value larger than a quarter of it is never kept."""

    def __init__(self, budget: int, size_of: Callable[[K, V], int]) -> None:
        self.budget = budget
        self.bytes = 0
        self._size_of = size_of
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            return found[0]

    def put(self, key: K, value: V) -> None:
        size = self._size_of(key, value)
        if size > self.budget // 4:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._entries[key] = (value, size)
            self.bytes += size
            while self.bytes > self.budget:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.bytes -= dropped

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0


# parsed parameters by their bytes: every block of a store has the same few; each entry is a
# few hundred bytes per run, and a header holds at most about 220 runs
_PARSED: ByteBoundedCache[bytes, Packed] = ByteBoundedCache(
    1 << 20, lambda params, packed: 256 + 160 * len(packed.runs) + len(params))


def parsed(params: bytes) -> Packed:
    """`parse`, cached by the parameters' bytes (a refused one raises again, uncached)."""
    key = bytes(params)
    found = _PARSED.get(key)
    if found is None:
        found = parse(key)
        _PARSED.put(key, found)
    return found


def _part_text(part: OrderedPart) -> str:
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
