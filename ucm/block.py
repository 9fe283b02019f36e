"""The on-storage block format, shared by every driver that keeps bytes of its own.

A stored block is a 4 KiB header followed by the payload, so the payload starts 4 KiB-aligned
(O_DIRECT reads land straight in an aligned caller buffer). The header is self-describing:

    offset  size  field
    0       4     magic b"UCMB"
    4       2     format version (1; 2 when the codec has parameters)
    6       1     codec (0 = none, 1 = zstd, 2 = shuffle_zstd, 3 = int8, 4 = int4)
    7       1     flags (reserved, 0)
    8       2     key length      (<= 255)
    10      2     namespace length (<= 255)
    12      4     payload offset  (4096)
    16      8     stored payload length
    24      8     raw length (bytes the caller gets back)
    32      8     xxh3-64 of the stored payload
    40      4     xxh32 of the header bytes before this field, key and namespace included
                  (version 2: the parameter length and parameters too)
    44      .     key bytes, then namespace bytes, then (version 2) the codec parameters'
                  length (u16) and bytes, then zero padding up to 4096

Codecs none and zstd write version 1 (they have no parameters); the codecs of `ucm.codecs`
(shuffle_zstd, int8, int4) keep their parameters (element size, KV layout, group size) in the
header and write version 2.

Every load checks the header checksum, the key and namespace the header names, the raw size
against the caller's buffer, and the payload checksum before the block counts as loaded; a
mismatch raises `BlockCorrupt`, which drivers report as a corrupt miss. Nothing on storage is
trusted: lengths are checked before anything is allocated for them, and decompression is
bounded by the raw size, which equals the caller's buffer.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, final, overload

import xxhash

from ucm.codecs import Codec as Codec
from ucm.codecs import Encoded, check_params, decode_into, decode_verified, encode, zstd
from ucm.codecs import KVLayouts as KVLayouts
from ucm.errors import BlockCorrupt, InvalidRequest

if TYPE_CHECKING:  # collections.abc.Buffer is new in Python 3.12; annotations only
    from typing_extensions import Buffer

MAGIC = b"UCMB"
FORMAT_VERSION = 1
FORMAT_VERSION_PARAMS = 2  # a header with codec parameters
PAYLOAD_OFFSET = 4096
MAX_KEY_BYTES = 255
MAX_NAMESPACE_BYTES = 255

_FIXED = struct.Struct("<4sHBBHHIQQQ")
_HEADER_CRC = struct.Struct("<I")
_FIXED_END = _FIXED.size + _HEADER_CRC.size  # 44
_PARAMS_LEN = struct.Struct("<H")


@dataclass(frozen=True, slots=True)
class BlockHeader:
    key: bytes
    namespace: str
    codec: Codec
    payload_len: int
    raw_len: int
    checksum: int
    params: bytes = b""  # the codec's parameters (version 2 headers)

    @property
    def stored_len(self) -> int:
        """Bytes the block takes on storage, header included."""
        return PAYLOAD_OFFSET + self.payload_len


zstd_bound = zstd.bound  # the most bytes a zstd payload of `raw_len` raw bytes may take


def check_key(key: object) -> bytes:
    """Returns `key` if it is a valid block key, else raises InvalidRequest naming the problem."""
    if not isinstance(key, bytes):
        raise InvalidRequest(f"block key must be bytes, not {type(key).__name__}")
    if not key:
        raise InvalidRequest("block key must not be empty")
    if len(key) > MAX_KEY_BYTES:
        raise InvalidRequest(f"block key is {len(key)} bytes; the limit is {MAX_KEY_BYTES}")
    return key


# -- copies outside the GIL ---------------------------------------------------------------------
#
# A memoryview slice assignment holds the GIL while it copies, stopping every other Python
# thread (loader threads, the kernel's trio thread, a vLLM step) for a 2 MiB copy; ctypes
# releases the GIL around a foreign call, so large copies go through memmove (figures:
# docs/performance.md, Python-side copies). python-xxhash already hashes inputs over 64 KiB
# with the GIL released.

NATIVE_MIN = 64 * 1024  # smaller copies: a ctypes call costs more than the GIL it frees

HASH_COPY_MAX_PIECES = 4096  # MAX_PIECES in native/hostcopy.c

_hash_copy: Callable[[memoryview | tuple[memoryview, ...], Buffer], int] | None
try:  # native/hostcopy.c: copy + xxh3 in one pass over the source (setup.py builds it)
    from ucm._hostcopy import hash_copy as _hash_copy
except ImportError:  # pragma: no cover - a host without a C compiler or xxhash.h
    _hash_copy = None

_np = None


def buffer_address(view: memoryview) -> int:
    """The address of a contiguous byte view, read-only ones included."""
    global _np
    if not view.readonly:  # ctypes is several times cheaper than numpy here
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    if _np is None:  # imported once: an import statement per call is not free
        import numpy

        _np = numpy
    return int(_np.frombuffer(view, _np.uint8).ctypes.data)


_libc = None
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14+; older kernels: EINVAL


def key_digest(key: bytes) -> bytes:
    """A key's 16-byte BLAKE2b digest: what fixed-size index entries (pmem pool, shared
    arena) store in place of the key, which the block's own header then confirms."""
    return hashlib.blake2b(key, digest_size=16).digest()


def madvise(addr: int, length: int, advice: int) -> int:
    """madvise(2) on an address range: 0, or the errno."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    if _libc.madvise(addr, length, advice) == 0:
        return 0
    return ctypes.get_errno()


def checksum(data: Buffer | Scatter) -> int:
    """xxh3-64 of the bytes (a Scatter's pieces in order)."""
    if type(data) is Scatter:
        h = xxhash.xxh3_64()
        for part in data.parts:
            h.update(part)
        return h.intdigest()
    return xxhash.xxh3_64_intdigest(data)


def encode_header(
    key: bytes, namespace: str, codec: Codec, payload: Buffer | Scatter, raw_len: int, *,
    digest: int | None = None,
) -> bytes:
    """Builds the 4 KiB header for `payload` (the bytes as stored, after the codec);
    `digest`: its xxh3-64 when the caller has it already (`copy_hashed`). A payload that
    `encode_payload` made for a codec of `ucm.codecs` names its own codec and parameters."""
    ns = namespace.encode()
    if len(ns) > MAX_NAMESPACE_BYTES:
        raise InvalidRequest(f"namespace is {len(ns)} bytes; the limit is {MAX_NAMESPACE_BYTES}")
    # a Scatter payload: codec NONE, stored piece after piece (its checksum covers them all)
    nbytes = payload.nbytes if type(payload) is Scatter else memoryview(payload).nbytes
    params = b""
    if codec > Codec.ZSTD:  # a Scatter is no Encoded payload: _encoded_as refuses it
        codec, params = _encoded_as(payload if type(payload) is Scatter
                                    else memoryview(payload).obj)
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION_PARAMS if params else FORMAT_VERSION, int(codec), 0, len(key),
        len(ns), PAYLOAD_OFFSET, nbytes, raw_len,
        checksum(payload) if digest is None else digest,
    )
    tail = key + ns + (_PARAMS_LEN.pack(len(params)) + params if params else b"")
    if _FIXED_END + len(tail) > PAYLOAD_OFFSET:
        raise InvalidRequest("codec parameters do not fit in the block header")
    crc = xxhash.xxh32_intdigest(fixed + tail)
    head = fixed + _HEADER_CRC.pack(crc) + tail
    return head + bytes(PAYLOAD_OFFSET - len(head))


def _encoded_as(obj: object) -> tuple[Codec, bytes]:
    """The codec and parameters of a payload `encode_payload` made with ucm.codecs."""
    if type(obj) is not Encoded:
        raise InvalidRequest("a payload of this codec must come from encode_payload")
    return obj.codec, obj.params


def stored_codec(codec: Codec, payload: Buffer) -> tuple[Codec, bytes]:
    """(codec, parameters) a header must name for `payload`, made by `encode_payload(codec)`
    (a quantizing codec may have stored a block losslessly)."""
    if codec <= Codec.ZSTD:
        return codec, b""
    return _encoded_as(memoryview(payload).obj)


def decode_header(data: Buffer, *, expect_key: bytes | None = None,
                  expect_namespace: bytes | str | None = None) -> BlockHeader:
    """Parses and checks a header. Raises BlockCorrupt on any inconsistency, and when it names
    another key than `expect_key` or another namespace than `expect_namespace` (a driver
    passes its namespace encoded once, as bytes: a block copied in from another namespace's
    store is never served)."""
    view = memoryview(data)
    if view.nbytes < _FIXED_END:
        raise BlockCorrupt(f"header truncated to {view.nbytes} bytes")
    (magic, version, codec, _flags, key_len, ns_len, offset, payload_len, raw_len,
     payload_sum) = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise BlockCorrupt("bad magic: not a ucm block")
    if version != FORMAT_VERSION and version != FORMAT_VERSION_PARAMS:
        raise BlockCorrupt(f"unsupported block format version {version}")
    if offset != PAYLOAD_OFFSET or key_len > MAX_KEY_BYTES or ns_len > MAX_NAMESPACE_BYTES:
        raise BlockCorrupt("header fields out of range")
    end = _FIXED_END + key_len + ns_len
    if view.nbytes < end:
        raise BlockCorrupt("header truncated")
    key = bytes(view[_FIXED_END : _FIXED_END + key_len])
    ns = bytes(view[_FIXED_END + key_len : end])
    params = b""
    if version == FORMAT_VERSION_PARAMS:
        if view.nbytes < end + _PARAMS_LEN.size:
            raise BlockCorrupt("header truncated")
        (params_len,) = _PARAMS_LEN.unpack_from(view, end)
        if view.nbytes < end + _PARAMS_LEN.size + params_len:
            raise BlockCorrupt("header truncated")
        params = bytes(view[end + _PARAMS_LEN.size : end + _PARAMS_LEN.size + params_len])
        ns_tail = ns + _PARAMS_LEN.pack(params_len) + params
    else:
        ns_tail = ns
    (crc,) = _HEADER_CRC.unpack_from(view, _FIXED.size)
    if crc != xxhash.xxh32_intdigest(bytes(view[: _FIXED.size]) + key + ns_tail):
        raise BlockCorrupt("header checksum mismatch")
    if expect_key is not None and key != expect_key:
        raise BlockCorrupt("header names another key")
    if (expect_namespace is not None and ns != expect_namespace
            and (type(expect_namespace) is not str or ns != expect_namespace.encode())):
        raise BlockCorrupt("header names another namespace")
    try:
        codec_value = Codec(codec)
    except ValueError:
        raise BlockCorrupt(f"unknown codec {codec}") from None
    # Every later allocation is bounded by raw_len, which loads compare with their buffer.
    if payload_len != raw_len if codec_value is Codec.NONE else payload_len > zstd_bound(raw_len):
        raise BlockCorrupt(f"a payload of {payload_len} bytes cannot hold {raw_len} raw bytes")
    header = BlockHeader(key, ns.decode(errors="replace"), codec_value, payload_len, raw_len,
                         payload_sum, params)
    if codec > 1 or version != FORMAT_VERSION:  # codecs with parameters (plain ints: cheap)
        if (codec > 1) != (version == FORMAT_VERSION_PARAMS):
            raise BlockCorrupt(f"codec {codec_value.name.lower()} in a version {version} header")
        check_params(header)
    return header


@overload
def encode_payload(codec: Codec, raw: Buffer, layouts: KVLayouts | None = None) -> Buffer: ...
@overload
def encode_payload(codec: Codec, raw: Buffer | Scatter, layouts: KVLayouts | None = None,
                   ) -> Buffer | Scatter: ...
def encode_payload(codec: Codec, raw: Buffer | Scatter, layouts: KVLayouts | None = None,
                   ) -> Buffer | Scatter:
    """The bytes to store for `raw`. For codec NONE this is `raw` itself (no copy, a Scatter
    too). The codecs of `ucm.codecs` return an `Encoded` payload, which names the codec and
    parameters its header gets (`encode_header`, `stored_codec`); they read the whole block
    anyway, so a Scatter is joined first. `layouts`: the tier's KV layouts (int8 and int4
    quantize a block only when they hold one of its size)."""
    if codec is Codec.NONE:
        return raw
    if type(raw) is Scatter:
        raw = raw.gather()
    if codec is Codec.ZSTD:
        return zstd.compress(raw)
    return encode(codec, as_byte_view(raw), layouts=layouts)


def verify_payload(header: BlockHeader, stored: Buffer | Scatter) -> None:
    """Raises BlockCorrupt unless `stored` has the length and checksum the header names."""
    nbytes = stored.nbytes if type(stored) is Scatter else memoryview(stored).nbytes
    if nbytes != header.payload_len:
        raise BlockCorrupt(f"payload is {nbytes} bytes, header says {header.payload_len}")
    if checksum(stored) != header.checksum:
        raise BlockCorrupt("payload checksum mismatch")


def wrong_size(out: memoryview | Scatter, header: BlockHeader) -> BlockCorrupt:
    """A stored block whose raw size differs from the caller's buffer: storage that lies, or
    a block of another layout. Corrupt for that key, never a failed batch."""
    return BlockCorrupt(f"buffer is {out.nbytes} bytes; the stored block says it holds "
                        f"{header.raw_len}")


def native_copy_available() -> bool:
    """Whether `copy_verified` copies and checks in one pass (ucm._hostcopy is built)."""
    return _hash_copy is not None


def copy_hashed(dst: memoryview, src: Buffer | Scatter) -> int:
    """dst[:] = src for views of one size (`src` may be a Scatter); returns the xxh3-64 of
    the bytes, taken in the same pass over a contiguous src when ucm._hostcopy is built.
    Nothing may write `src` meanwhile."""
    if type(src) is Scatter:  # pieces copied in order, then hashed where they now lie
        copy_bytes(dst, src)
        return checksum(dst)
    if _hash_copy is not None and dst.nbytes >= NATIVE_MIN:
        return _hash_copy(dst, src)
    digest = checksum(src)
    copy_bytes(dst, src)
    return digest


def copy_verified(header: BlockHeader, out: memoryview | Scatter, stored: Buffer) -> None:
    """out[:] = stored (a codec-NONE payload); raises BlockCorrupt unless `stored` has the
    length and checksum `header` names. Nothing may write `stored` meanwhile.

    Large blocks (into one buffer or a Scatter's pieces) are hashed and copied in one pass
    over `stored` (ucm._hostcopy): the checksum is taken as the bytes go by, so on
    BlockCorrupt `out` holds the bad bytes and the caller must treat it as unloaded (as after
    a read straight into it). Otherwise `stored` is checked first and `out` is written only
    when it is good."""
    if out.nbytes != header.raw_len:
        raise wrong_size(out, header)
    pieces = out.parts if type(out) is Scatter else out
    if (_hash_copy is not None and out.nbytes >= NATIVE_MIN
            and header.payload_len == out.nbytes
            and (pieces is out or len(pieces) <= HASH_COPY_MAX_PIECES)):
        try:
            digest = _hash_copy(pieces, stored)
        except ValueError:  # the sizes differ
            raise BlockCorrupt(f"payload is {memoryview(stored).nbytes} bytes, header says "
                               f"{header.payload_len}") from None
        if digest != header.checksum:
            raise BlockCorrupt("payload checksum mismatch")
        return
    verify_payload(header, stored)
    copy_bytes(out, stored)


def decode_payload_into(header: BlockHeader, stored: Buffer, out: memoryview | Scatter,
                        ) -> None:
    """Verifies `stored` against `header` and writes the raw bytes into `out`.

    int8/int4 payloads are decoded straight into `out` (each piece of a Scatter) by the native
    loops, which take the checksum in the same pass: on BlockCorrupt `out` holds bad bytes and
    the caller must treat it as unloaded, as with copy_verified.

    A driver that read a codec-NONE payload straight into the caller's buffer calls
    `verify_payload(header, out)` instead: no copy.
    """
    if header.codec is Codec.NONE:
        copy_verified(header, out, stored)  # checks the buffer's size itself
        return
    if out.nbytes != header.raw_len:
        raise wrong_size(out, header)
    if header.codec is Codec.INT8 or header.codec is Codec.INT4:
        target = out.parts if type(out) is Scatter else out
        if decode_verified(header, as_byte_view(stored), target):
            return  # decoded and checked in one pass
    verify_payload(header, stored)
    if header.codec is not Codec.ZSTD:
        _decode_codec(header, stored, out)
        return
    # bounded by raw_len, which equals the caller's buffer (checked above)
    copy_bytes(out, zstd.decompress(stored, header.raw_len))


def _decode_codec(header: BlockHeader, stored: Buffer, out: memoryview | Scatter) -> None:
    """A verified payload of a `ucm.codecs` codec, decoded into `out` (raw_len bytes)."""
    import numpy

    if isinstance(out, memoryview) and not out.readonly:
        decode_into(header, as_byte_view(stored), numpy.frombuffer(out, numpy.uint8))
        return
    target = memoryview(bytearray(header.raw_len))  # a Scatter: decoded, then copied in
    decode_into(header, as_byte_view(stored), numpy.frombuffer(target, numpy.uint8))
    copy_bytes(out, target)


def as_byte_view(buf: Buffer) -> memoryview:
    """A flat, writable-or-not, byte-format view of any contiguous buffer."""
    view = memoryview(buf)
    if not view.contiguous:
        raise InvalidRequest("buffer must be contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


@final  # the kernel tells a Scatter from a buffer by `type(b) is Scatter`
class Scatter:
    """One block's buffer in pieces, in order, as if it were one buffer.

    A caller whose block is not contiguous in its own memory (the vLLM hook: one piece per
    layer of the KV cache; SGLang's MHA host pool: K and V in separate pools) passes a Scatter
    instead of a buffer. A load: a driver with the `ScatterLoads` capability reads straight
    into the pieces (`preadv` takes them as they are); the kernel gives any other driver a
    contiguous buffer and copies it into the pieces after a verified load. A store
    (`writable=False` accepts read-only pieces): a driver with `ScatterStores` writes from
    the pieces (`pwritev`, or a copy into its slot); the kernel joins them once for any other.
    """

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: Iterable[Buffer], *, writable: bool = True) -> None:
        views = []
        for part in parts:
            try:
                view = as_byte_view(part)
            except TypeError:
                raise InvalidRequest(f"scatter part is a {type(part).__name__}, not a buffer"
                                     ) from None
            if view.readonly and writable:
                raise InvalidRequest("scatter parts must be writable")
            views.append(view)
        if not views:
            raise InvalidRequest("a Scatter needs at least one part")
        self.parts: tuple[memoryview, ...] = tuple(views)
        self.nbytes = sum(v.nbytes for v in views)

    readonly = False

    @classmethod
    def of_views(cls, views: tuple[memoryview, ...]) -> Scatter:
        """A Scatter of views the caller vouches for: writable, flat, byte-format, at least
        one. No checks (a vLLM step builds one per block it loads: the checks cost more than
        the rest of building it)."""
        scatter = object.__new__(cls)
        scatter.parts = views
        scatter.nbytes = sum(v.nbytes for v in views)
        return scatter

    def __repr__(self) -> str:
        return f"Scatter({len(self.parts)} parts, {self.nbytes} bytes)"

    def gather(self) -> bytearray:
        """The pieces' bytes, contiguous (a copy)."""
        out = bytearray(self.nbytes)
        copy_bytes(memoryview(out), self)
        return out


def copy_bytes(dst: memoryview | Scatter, src: Buffer | Scatter) -> None:
    """dst[:] = src, where either side may be a Scatter; InvalidRequest unless the sizes
    match."""
    dst_parts = dst.parts if type(dst) is Scatter else (dst,)
    src_parts = src.parts if type(src) is Scatter else (as_byte_view(src),)
    size, src_size = sum(p.nbytes for p in dst_parts), sum(p.nbytes for p in src_parts)
    if size != src_size:
        raise InvalidRequest(f"buffer is {size} bytes; the block holds {src_size}")
    if len(dst_parts) == 1 and len(src_parts) == 1:
        _copy(dst_parts[0], src_parts[0])
        return
    si, s_off = 0, 0
    for d in dst_parts:
        d_off = 0
        while d_off < d.nbytes:
            s = src_parts[si]
            n = min(d.nbytes - d_off, s.nbytes - s_off)
            _copy(d[d_off:d_off + n], s[s_off:s_off + n])
            d_off += n
            s_off += n
            if s_off == s.nbytes:
                si, s_off = si + 1, 0


def _copy(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src for views of one size; large ones with memmove, outside the GIL."""
    if dst.nbytes >= NATIVE_MIN:
        ctypes.memmove(buffer_address(dst), buffer_address(src), dst.nbytes)
    else:
        dst[:] = src


@overload
def as_buffer_view(buf: Buffer) -> memoryview: ...
@overload
def as_buffer_view(buf: Buffer | Scatter) -> memoryview | Scatter: ...
def as_buffer_view(buf: Buffer | Scatter) -> memoryview | Scatter:
    """A Scatter as it is, anything else as a flat byte view (see `as_byte_view`)."""
    return buf if type(buf) is Scatter else as_byte_view(buf)
