"""The on-storage block format: headers, checksums and codecs."""

from __future__ import annotations

import itertools
import os
import struct

import pytest
import xxhash

from ucm.block import (
    NATIVE_MIN,
    PAYLOAD_OFFSET,
    BlockHeader,
    Codec,
    Scatter,
    check_key,
    checksum,
    copy_bytes,
    copy_hashed,
    copy_verified,
    decode_header,
    decode_payload_into,
    encode_header,
    encode_payload,
    native_copy_available,
    verify_payload,
)
from ucm.errors import BlockCorrupt, InvalidRequest

KEY, NS = b"\x01key-bytes\xff", "model-ns"
FIXED = struct.Struct("<4sHBBHHIQQQ")


def make(payload: bytes = b"payload" * 100, codec: Codec = Codec.NONE) -> tuple[bytes, bytes]:
    stored = bytes(encode_payload(codec, payload))
    return encode_header(KEY, NS, codec, stored, len(payload)), stored


def reseal(fields: list) -> bytes:
    """A header with `fields` changed but a valid header checksum: tests semantic checks."""
    fixed = FIXED.pack(*fields)
    key_len, ns_len = fields[4], fields[5]
    key, ns = KEY[:key_len], NS.encode()[:ns_len]
    crc = xxhash.xxh32_intdigest(fixed + key + ns)
    head = fixed + struct.pack("<I", crc) + key + ns
    return head + bytes(PAYLOAD_OFFSET - len(head))


def test_header_round_trip():
    header, stored = make()
    assert len(header) == PAYLOAD_OFFSET
    parsed = decode_header(header, expect_key=KEY)
    assert parsed == BlockHeader(KEY, NS, Codec.NONE, len(stored), len(stored),
                                 xxhash.xxh3_64_intdigest(stored))
    assert parsed.stored_len == PAYLOAD_OFFSET + len(stored)
    verify_payload(parsed, stored)


def test_every_header_byte_is_covered():
    header, _ = make()
    covered = FIXED.size + 4 + len(KEY) + len(NS)
    for offset in range(covered):
        bad = bytearray(header)
        bad[offset] ^= 0x01
        with pytest.raises(BlockCorrupt):
            decode_header(bad, expect_key=KEY)


@pytest.mark.parametrize(("index", "value", "match"), [
    (0, b"XXXX", "bad magic"),
    (1, 3, "unsupported block format version 3"),
    (2, 9, "unknown codec 9"),
    (4, 256, "out of range"),
    (5, 256, "out of range"),
    (6, 8192, "out of range"),
])
def test_semantic_header_checks(index, value, match):
    fields = list(FIXED.unpack_from(make()[0]))
    fields[index] = value
    with pytest.raises(BlockCorrupt, match=match):
        decode_header(reseal(fields))


def test_header_truncated_and_wrong_key():
    header, _ = make()
    with pytest.raises(BlockCorrupt, match="truncated to 10 bytes"):
        decode_header(header[:10])
    with pytest.raises(BlockCorrupt, match="header truncated"):
        decode_header(header[:50])
    with pytest.raises(BlockCorrupt, match="names another key"):
        decode_header(header, expect_key=b"other")


def test_payload_length_and_checksum_fields_are_checked():
    header, stored = make()
    parsed = decode_header(header)
    with pytest.raises(BlockCorrupt, match="payload is"):
        verify_payload(parsed, stored[:-1])
    bad = bytearray(stored)
    bad[3] ^= 0x80
    with pytest.raises(BlockCorrupt, match="checksum mismatch"):
        verify_payload(parsed, bad)


def test_zstd_round_trip():
    raw = os.urandom(1000) * 50  # compressible
    header, stored = make(raw, Codec.ZSTD)
    assert len(stored) < len(raw)
    parsed = decode_header(header, expect_key=KEY)
    assert parsed.codec is Codec.ZSTD and parsed.raw_len == len(raw)
    out = memoryview(bytearray(len(raw)))
    decode_payload_into(parsed, stored, out)
    assert out == raw


def test_corrupt_zstd_is_detected():
    raw = b"abc" * 10000
    header, stored = make(raw, Codec.ZSTD)
    parsed = decode_header(header)
    bad = bytearray(stored)
    bad[len(bad) // 2] ^= 0x10
    out = memoryview(bytearray(len(raw)))
    with pytest.raises(BlockCorrupt, match="checksum mismatch"):
        decode_payload_into(parsed, bad, out)
    # A frame that passes its checksum but does not decode is still corrupt, never data.
    garbage = b"\x28\xb5\x2f\xfd" + os.urandom(64)
    forged = decode_header(encode_header(KEY, NS, Codec.ZSTD, garbage, len(raw)))
    with pytest.raises(BlockCorrupt, match=r"does not decode|frame declares"):
        decode_payload_into(forged, garbage, out)


def test_decode_into_wrong_size_is_corrupt():
    # The stored block says it holds another size than the caller's buffer: that key is
    # corrupt (storage that lies, or another layout), never an error for the whole batch.
    header, stored = make()
    with pytest.raises(BlockCorrupt, match="buffer is 3 bytes"):
        decode_payload_into(decode_header(header), stored, memoryview(bytearray(3)))


def test_codec_parse_and_keys():
    assert Codec.parse("zstd") is Codec.ZSTD and Codec.parse(0) is Codec.NONE
    with pytest.raises(InvalidRequest, match="unknown codec 'lz4'"):
        Codec.parse("lz4")
    assert check_key(b"k") == b"k"
    with pytest.raises(InvalidRequest, match="limit is 255"):
        check_key(b"x" * 256)
    with pytest.raises(InvalidRequest, match="namespace is 300 bytes"):
        encode_header(KEY, "n" * 300, Codec.NONE, b"", 0)


def test_scatter_checksum_copy_and_checks():
    data = bytes(range(256)) * 40
    pieces = [bytearray(n) for n in (1, 4095, 3000, len(data) - 7096)]
    target = Scatter(pieces)
    assert target.nbytes == len(data) and not target.readonly
    copy_bytes(target, data)
    assert b"".join(pieces) == data == bytes(target.gather())
    assert checksum(target) == checksum(data)  # streamed over the pieces, the same digest
    other = Scatter([bytearray(5000), bytearray(len(data) - 5000)])
    copy_bytes(other, target)  # piece boundaries that do not line up
    assert bytes(other.gather()) == data
    with pytest.raises(InvalidRequest, match="buffer is 10240 bytes; the block holds 10239"):
        copy_bytes(target, data[:-1])
    with pytest.raises(InvalidRequest, match="writable"):
        Scatter([bytearray(4), b"read-only"])
    with pytest.raises(InvalidRequest, match="at least one part"):
        Scatter([])


@pytest.mark.parametrize("size", [0, 1, NATIVE_MIN - 1, NATIVE_MIN, NATIVE_MIN + 4097, 3 << 20])
def test_checksum_is_xxh3_at_every_size_and_shape(size):
    """xxh3-64 of the bytes for read-only and writable buffers and for Scatters cut at any
    place; copies (memmove from NATIVE_MIN up) land every byte."""
    data = os.urandom(size)
    want = xxhash.xxh3_64_intdigest(data)
    assert checksum(data) == checksum(bytearray(data)) == checksum(memoryview(data)) == want
    if size:
        cuts = sorted({0, size // 3, size // 3 + 1, size - 1, size})
        pieces = [bytearray(data[a:b]) for a, b in itertools.pairwise(cuts) if b > a]
        assert checksum(Scatter(pieces)) == want
        copy = Scatter([bytearray(len(p)) for p in reversed(pieces)])  # other boundaries
        copy_bytes(copy, data)
        assert bytes(copy.gather()) == data and checksum(copy) == want


def test_large_checksums_and_copies_leave_the_gil_to_other_threads():
    """Another thread runs Python while a large block is hashed or copied. Held through the
    call (as a slice assignment does), the GIL would stop every other thread: loader threads,
    the kernel's trio thread, a vLLM step."""
    import sys
    import threading
    import time

    big = memoryview(bytearray(os.urandom(64 << 20)))
    out = memoryview(bytearray(64 << 20))
    pieces = Scatter([out[i:i + (1 << 20)] for i in range(0, out.nbytes, 1 << 20)])
    stop, count = threading.Event(), [0]

    def other_thread() -> None:
        while not stop.is_set():
            count[0] += 1
            time.sleep(0)  # gives the GIL back at once: it never holds up the caller

    def ran_meanwhile(call) -> int:
        """How often the other thread ran during one call (the GIL never changes hands
        between the two reads of the count unless the call releases it)."""
        before = count[0]
        call()
        return count[0] - before

    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)  # no forced hand-offs: only a call that releases the GIL
    thread = threading.Thread(target=other_thread)
    try:
        thread.start()
        time.sleep(0.01)
        assert ran_meanwhile(lambda: out.__setitem__(slice(None), big)) == 0  # GIL held

        def releases(call) -> bool:
            # On a busy host the other thread may find no free core during one call: a call
            # that releases the GIL lets it run in at least one of several.
            return any(ran_meanwhile(call) > 0 for _ in range(10))

        assert releases(lambda: checksum(big))
        assert releases(lambda: checksum(pieces))
        assert releases(lambda: copy_bytes(out, big))
        assert releases(lambda: copy_bytes(pieces, big))
        assert releases(lambda: copy_hashed(out, big))
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        thread.join()


# -- one pass: copy and checksum (ucm._hostcopy, native/hostcopy*.c) --------------------------


def test_the_native_copy_helper_is_built():
    """scripts/setup.sh installs gcc and xxhash.h and builds ucm._hostcopy; without it every
    verified load reads its block twice (see native/hostcopy.c for the figures)."""
    assert native_copy_available(), "ucm._hostcopy is missing: rerun scripts/setup.sh"
    from ucm._hostcopy import hash_copy
    from ucm.block import HASH_COPY_MAX_PIECES as most  # the C side's limit, mirrored

    data = bytes(range(256)) * 17
    pieces = [bytearray(1) for _ in range(most - 1)] + [bytearray(len(data) - most + 1)]
    assert hash_copy(pieces, data) == xxhash.xxh3_64_intdigest(data)
    with pytest.raises(ValueError, match="destination pieces"):
        hash_copy([bytearray(1) for _ in range(most + 1)], bytes(most + 1))


def test_the_native_copy_uses_avx2_where_the_cpu_has_it():
    """hostcopy_avx2.c is picked at import when the CPU has AVX2 (about 30% faster here)."""
    import ucm._hostcopy as hostcopy

    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags")
    expected = "avx2" if "avx2" in flags else "portable"
    assert expected == hostcopy.IMPL


@pytest.mark.parametrize("impl", ["hash_copy", "hash_copy_portable"])
@pytest.mark.parametrize("size", [NATIVE_MIN, NATIVE_MIN + 1, 64 * 1024 * 3 + 17, 2 << 20])
@pytest.mark.parametrize("shift", [0, 1, 8, 15, 31])
def test_hash_copy_lands_every_byte_and_gives_xxh3(impl, size, shift):
    """Either loop (AVX2 where the CPU has it, and the portable one), any alignment of either
    side (the streamed stores need 16- or 32-byte alignment: the head and the tail go another
    way), any length around the 64 KiB chunks."""
    import ucm._hostcopy as hostcopy

    hash_copy = getattr(hostcopy, impl)
    data = os.urandom(size + 32)
    src = memoryview(data)[shift:shift + size]
    dst = bytearray(size + 64)
    out = memoryview(dst)[31 - shift:31 - shift + size]
    assert hash_copy(out, src) == xxhash.xxh3_64_intdigest(src)
    assert bytes(out) == bytes(src)
    assert dst[:31 - shift] == bytes(31 - shift) and not any(dst[31 - shift + size:])
    with pytest.raises(ValueError, match="destination is"):
        hash_copy(memoryview(dst)[:size - 1], src)
    pieces = [bytearray(shift + 1), bytearray(size - 2 * shift - 2), bytearray(shift + 1)]
    assert hash_copy(pieces, src) == xxhash.xxh3_64_intdigest(src)  # a list of pieces
    assert b"".join(pieces) == bytes(src)
    with pytest.raises(ValueError, match="destination pieces"):
        hash_copy([], src)
    with pytest.raises((BufferError, TypeError)):
        hash_copy(bytes(size), src)  # read-only destination


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("size", [100, NATIVE_MIN, 2 << 20])
def test_copy_verified_copies_good_blocks_and_rejects_bad_ones(monkeypatch, native, size):
    import ucm.block as block

    if not native:  # the fallback: check the source, then copy
        monkeypatch.setattr(block, "_hash_copy", None)
    payload = os.urandom(size)
    header = decode_header(encode_header(KEY, NS, Codec.NONE, payload, size))
    out = memoryview(bytearray(size))
    copy_verified(header, out, payload)
    assert bytes(out) == payload
    assert copy_hashed(memoryview(bytearray(size)), payload) == header.checksum
    bad = bytearray(payload)
    bad[size // 2] ^= 1
    with pytest.raises(BlockCorrupt, match="checksum"):
        copy_verified(header, memoryview(bytearray(size)), bad)
    with pytest.raises(BlockCorrupt, match="bytes, header says"):
        copy_verified(header, memoryview(bytearray(size)), payload[:-1])
    with pytest.raises(BlockCorrupt, match="buffer is"):
        copy_verified(header, memoryview(bytearray(size + 1)), payload)
    for cuts in ([size // 2], [1, size // 3, size - 7]):  # a Scatter's pieces, any sizes
        bounds = [0, *cuts, size]
        pieces = Scatter([bytearray(b - a) for a, b in itertools.pairwise(bounds)])
        copy_verified(header, pieces, payload)
        assert bytes(pieces.gather()) == payload
        with pytest.raises(BlockCorrupt, match="checksum"):
            copy_verified(header, pieces, bad)
    if size >= 8192:  # more pieces than the native copy takes: the other path, same result
        many = Scatter([bytearray(2) for _ in range(4097)] + [bytearray(size - 8194)])
        copy_verified(header, many, payload)
        assert bytes(many.gather()) == payload
