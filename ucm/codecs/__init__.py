"""The payload codecs of the block format, below it (`ucm.block` calls them; they never import
it): encode a block's raw bytes into a payload plus the parameters its header keeps, and decode
a checked payload back into the caller's buffer, bounded by the raw size the header declares.

    none, zstd    the bytes as given; one zstd frame of them (ucm.codecs.zstd)
    shuffle_zstd  lossless: each element's byte planes stored together, then zstd
    int8, int4    KIVI quantization of KV blocks whose layout the tier was given
                  (`KVLayouts`, one layout per block size of the tier's namespace); any other
                  block is stored shuffle_zstd and counted in `stats`

The header's codec byte says what a block holds: a quantizing tier's blocks that could not be
quantized say shuffle_zstd (or zstd), so loads never guess; the layout a block was quantized
with travels in its header's parameters, so a load needs nothing but the block.

Stored bytes are untrusted. `check_params` (from `decode_header`) checks a header's parameters
against its raw size and payload length by arithmetic over their packed runs, expanding
nothing; decoding builds anything only for a header whose raw size equals the caller's buffer.
Any error while checking or decoding a stored block is `BlockCorrupt` (a per-key miss): one
that is not already is counted in `decode_errors` by its type and logged once per type with its
traceback, since it names a check that is missing.
"""

from __future__ import annotations

import enum
import functools
import logging
import struct
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, Protocol, TypeVar

from ucm.codecs import zstd
from ucm.codecs.layout import DEFAULT_GROUP, KVLayout, KVLayouts, pack, parsed
from ucm.errors import BlockCorrupt, InvalidRequest

if TYPE_CHECKING:
    import numpy as np

__all__ = ["DEFAULT_GROUP", "Codec", "Encoded", "Header", "KVLayout", "KVLayouts",
           "check_params", "decode_errors", "decode_into", "decode_verified", "encode", "stats"]

log = logging.getLogger("ucm.codecs")


class Codec(enum.IntEnum):
    """The codec byte of a block header."""

    NONE = 0
    ZSTD = 1
    SHUFFLE_ZSTD = 2  # lossless: byte planes, then zstd
    INT8 = 3  # KIVI quantization of KV blocks of a known layout
    INT4 = 4

    @classmethod
    def parse(cls, name: str | int | Codec) -> Codec:
        if isinstance(name, Codec):
            return name
        if isinstance(name, int):
            return cls(name)
        try:
            return cls[name.upper()]
        except KeyError:
            choices = ", ".join(c.name.lower() for c in cls)
            raise InvalidRequest(f"unknown codec {name!r}; choose one of {choices}") from None

    @property
    def quantizes(self) -> bool:
        """Whether this codec quantizes KV blocks (and so takes a tier's KV layouts)."""
        return self is Codec.INT8 or self is Codec.INT4


class Header(Protocol):
    """The fields of a block header the codecs read (`ucm.block.BlockHeader` has them)."""

    @property
    def codec(self) -> Codec: ...
    @property
    def params(self) -> bytes: ...
    @property
    def payload_len(self) -> int: ...
    @property
    def raw_len(self) -> int: ...
    @property
    def checksum(self) -> int: ...


# Blocks a quantizing tier stored losslessly, by reason; a warning is logged the first time.
stats: Counter[str] = Counter()
# Stored blocks whose checks or decoding raised something other than BlockCorrupt, by type.
decode_errors: Counter[str] = Counter()

P = ParamSpec("P")
R = TypeVar("R")


def _stored_bytes(fn: Callable[P, R]) -> Callable[P, R]:
    """Runs `fn` over a stored block's bytes: whatever it raises is BlockCorrupt, and what was
    not BlockCorrupt already is counted and logged once. MemoryError, and BufferError (the
    caller's buffers, not the block's bytes), stay themselves."""
    @functools.wraps(fn)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (BlockCorrupt, MemoryError, BufferError):
            raise
        except Exception as exc:
            name = type(exc).__name__
            if not decode_errors[name]:
                log.warning("a stored block failed a check with %s: a corrupt miss (counted "
                            "in ucm.codecs.decode_errors[%r])", name, name, exc_info=True)
            decode_errors[name] += 1
            raise BlockCorrupt(f"the block does not decode ({name}: {exc})") from None
    return checked

_SHUFFLE = struct.Struct("<B")  # shuffle_zstd parameters: the element size


class Encoded(bytes):
    """A payload, with the codec and parameters its header must name (`ucm.block`
    `encode_header` finds them through a view of it)."""

    codec: Codec
    params: bytes


def _encoded(payload: bytes, codec: Codec, params: bytes) -> Encoded:
    out = Encoded(payload)
    out.codec, out.params = codec, params
    return out


def _fallback(reason: str) -> None:
    if not stats[reason]:
        log.warning("a quantizing tier stores a block losslessly: %s (counted in "
                    "ucm.codecs.stats[%r])", reason, reason)
    stats[reason] += 1


def encode(codec: Codec, raw: memoryview, *, layouts: KVLayouts | None = None,
           group: int = DEFAULT_GROUP) -> Encoded:
    """The payload of `raw` for a codec with parameters (shuffle_zstd, int8, int4): int8 and
    int4 quantize a block whose size `layouts` (the tier's) holds a layout of, and store any
    other block shuffle_zstd."""
    import numpy as np

    layout = layouts.for_size(raw.nbytes) if layouts is not None else None
    if codec in (Codec.INT8, Codec.INT4):
        if layout is None:
            _fallback("no_layout")
        else:
            from ucm.codecs import quant

            bits = 8 if codec is Codec.INT8 else 4
            try:
                payload = quant.encode(layout, group, bits, raw)
            except quant.Unquantizable as exc:
                _fallback(f"unquantizable ({exc})")
            else:
                return _encoded(payload, codec, pack(layout, group))
    itemsize = layout.itemsize if layout is not None else 2
    if raw.nbytes % itemsize:
        itemsize = 1
    payload = zstd.compress(np.frombuffer(raw, np.uint8).reshape(-1, itemsize).T.tobytes())
    if len(payload) > zstd.bound(raw.nbytes):  # pragma: no cover - zstd stays within it
        raise AssertionError("zstd exceeded its bound")
    return _encoded(payload, Codec.SHUFFLE_ZSTD, _SHUFFLE.pack(itemsize))


@_stored_bytes
def check_params(header: Header) -> None:
    """Raises BlockCorrupt unless the header's parameters fit its codec and lengths (called
    by decode_header, before anything is allocated for the payload). Quantized parameters are
    checked run by run, in time bounded by their length: nothing is expanded."""
    if header.codec is Codec.SHUFFLE_ZSTD:
        if len(header.params) != _SHUFFLE.size:
            raise BlockCorrupt("shuffle parameters have the wrong length")
        (itemsize,) = _SHUFFLE.unpack(header.params)
        if itemsize not in (1, 2, 4, 8) or header.raw_len % itemsize:
            raise BlockCorrupt("shuffle element size does not fit the block")
        return
    packed = parsed(header.params)
    if packed.raw_bytes != header.raw_len:
        raise BlockCorrupt("codec parameters do not describe the block's raw size")
    if packed.payload_bytes(8 if header.codec is Codec.INT8 else 4) != header.payload_len:
        raise BlockCorrupt("quantized payload length does not match its layout")


@_stored_bytes
def decode_verified(header: Header, stored: memoryview,
                    out: memoryview | tuple[memoryview, ...]) -> bool:
    """An int8/int4 payload decoded straight into `out` (one buffer, or the pieces of a
    Scatter in order) in one pass that also takes its xxh3-64: True once it matches the
    header's checksum; BlockCorrupt when it does not (`out` then holds bad bytes: the caller
    treats it as unloaded, as with copy_verified). False, with nothing written, where that
    pass is not available (see quant.decode_hashed)."""
    from ucm.codecs import quant

    if stored.nbytes != header.payload_len:
        raise BlockCorrupt(f"payload is {stored.nbytes} bytes, header says {header.payload_len}")
    if isinstance(out, memoryview) and out.readonly:
        return False
    bits = 8 if header.codec is Codec.INT8 else 4
    packed = parsed(header.params)
    digest = quant.decode_hashed(packed, packed.group, bits, stored, out)
    if digest is None:
        return False
    if digest != header.checksum:
        raise BlockCorrupt("payload checksum mismatch")
    return True


@_stored_bytes
def decode_into(header: Header, stored: memoryview, out: np.ndarray) -> None:
    """out (uint8, header.raw_len bytes) = the raw bytes of a verified payload."""
    if header.codec is Codec.SHUFFLE_ZSTD:
        import numpy as np

        (itemsize,) = _SHUFFLE.unpack(header.params)
        planes = zstd.decompress(stored, header.raw_len)
        src = np.frombuffer(planes, np.uint8).reshape(itemsize, -1)
        out.reshape(-1, itemsize)[...] = src.T
        return
    from ucm.codecs import quant

    bits = 8 if header.codec is Codec.INT8 else 4
    packed = parsed(header.params)
    quant.decode_into(packed, packed.group, bits, stored, out)
