"""The payload codecs beyond none and zstd, as `ucm.block` calls them: encode a block's raw
bytes into a payload plus the parameters its header keeps, and decode a checked payload back
into the caller's buffer, bounded by the raw size the header declares.

    shuffle_zstd  lossless: each element's byte planes stored together, then zstd
    int8, int4    KIVI quantization of KV blocks of a registered layout (ucm.codecs.layout);
                  any other block is stored shuffle_zstd and counted in `stats`

The header's codec byte says what a block holds: a quantizing tier's blocks that could not be
quantized say shuffle_zstd (or zstd), so loads never guess.

Stored bytes are untrusted. `check_params` (from `decode_header`) checks a header's parameters
against its raw size and payload length by arithmetic over their packed runs, expanding
nothing; decoding builds anything only for a header whose raw size equals the caller's buffer.
Any error while checking or decoding a stored block is `BlockCorrupt` (a per-key miss): one
that is not already is counted in `decode_errors` by its type and logged once per type with its
traceback, since it names a check that is missing.
"""

from __future__ import annotations

import functools
import logging
import struct
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import numpy as np

from ucm.codecs.layout import (
    DEFAULT_GROUP,
    KVLayout,
    layout_for,
    pack,
    parsed,
    register_layout,
    unregister_layout,
)
from ucm.errors import BlockCorrupt

if TYPE_CHECKING:
    from ucm.block import BlockHeader, Codec, Scatter

__all__ = ["DEFAULT_GROUP", "Encoded", "KVLayout", "decode_errors", "decode_into",
           "decode_verified", "encode", "layout_for", "register_layout", "stats",
           "unregister_layout"]

log = logging.getLogger("ucm.codecs")

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


def encode(codec: Codec, raw: memoryview, *, group: int = DEFAULT_GROUP) -> Encoded:
    from ucm.block import Codec, zstd_bound

    layout = layout_for(raw.nbytes)
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
    payload = _compress(np.frombuffer(raw, np.uint8).reshape(-1, itemsize).T.tobytes())
    if len(payload) > zstd_bound(raw.nbytes):  # pragma: no cover - zstd stays within it
        raise AssertionError("zstd exceeded its bound")
    return _encoded(payload, Codec.SHUFFLE_ZSTD, _SHUFFLE.pack(itemsize))


def _compress(data: bytes) -> bytes:
    from ucm.block import _compressor

    return bytes(_compressor().compress(data))


@_stored_bytes
def check_params(header: BlockHeader) -> None:
    """Raises BlockCorrupt unless the header's parameters fit its codec and lengths (called
    by decode_header, before anything is allocated for the payload). Quantized parameters are
    checked run by run, in time bounded by their length: nothing is expanded."""
    from ucm.block import Codec

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
def decode_verified(header: BlockHeader, stored: memoryview, out: memoryview | Scatter) -> bool:
    """An int8/int4 payload decoded straight into `out` (or each piece of a Scatter) in one
    pass that also takes its xxh3-64: True once it matches the header's checksum; BlockCorrupt
    when it does not (`out` then holds bad bytes: the caller treats it as unloaded, as with
    copy_verified). False, with nothing written, where that pass is not available (see
    quant.decode_hashed)."""
    from ucm.block import Codec, Scatter
    from ucm.codecs import quant

    if stored.nbytes != header.payload_len:
        raise BlockCorrupt(f"payload is {stored.nbytes} bytes, header says {header.payload_len}")
    if type(out) is Scatter:
        target: memoryview | tuple[memoryview, ...] = out.parts
    elif out.readonly:
        return False
    else:
        target = out
    bits = 8 if header.codec is Codec.INT8 else 4
    packed = parsed(header.params)
    digest = quant.decode_hashed(packed, packed.group, bits, stored, target)
    if digest is None:
        return False
    if digest != header.checksum:
        raise BlockCorrupt("payload checksum mismatch")
    return True


@_stored_bytes
def decode_into(header: BlockHeader, stored: memoryview, out: np.ndarray) -> None:
    """out (uint8, header.raw_len bytes) = the raw bytes of a verified payload."""
    from ucm.block import Codec

    if header.codec is Codec.SHUFFLE_ZSTD:
        import zstandard

        (itemsize,) = _SHUFFLE.unpack(header.params)
        try:
            from ucm.block import _decompressor

            declared = zstandard.frame_content_size(stored)
            if declared >= 0 and declared != header.raw_len:
                raise BlockCorrupt("zstd frame declares another size")
            planes = _decompressor().decompress(stored, max_output_size=max(header.raw_len, 1))
        except zstandard.ZstdError as exc:
            raise BlockCorrupt(f"zstd payload does not decode: {exc}") from None
        if len(planes) != header.raw_len:
            raise BlockCorrupt("decoded payload has the wrong length")
        src = np.frombuffer(planes, np.uint8).reshape(itemsize, -1)
        out.reshape(-1, itemsize)[...] = src.T
        return
    from ucm.codecs import quant

    bits = 8 if header.codec is Codec.INT8 else 4
    packed = parsed(header.params)
    quant.decode_into(packed, packed.group, bits, stored, out)
