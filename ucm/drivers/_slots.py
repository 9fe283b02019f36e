"""The slot index shared by the pmem pool and the shared-memory arena: a table of 64-byte
entries in a mapped file, each naming one stored block, and a checksummed geometry header.

An entry is {magic, word, seq, place, length, key digest} followed by an xxh32 of those
fields, so a torn entry (a writer died mid-write, or a lock-free reader raced one) reads as
absent. `word` and `place` are the owner's to define (the pool: 0 and a byte offset; the arena:
pages and a first page). A cleared entry is all zeros. A block an entry names is in the
`ucm.block` format, and `names_block` checks that its header agrees with the entry.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from ucm.block import PAYLOAD_OFFSET, decode_header, key_digest
from ucm.errors import BlockCorrupt

ENTRY = struct.Struct("<IIQQQ16s")  # magic, word, seq, place, length, key digest
ENTRY_SIZE = 64
SEQ_OFFSET = 8  # of the seq field in an entry
DIGEST_OFFSET = 32  # of the key digest: a lock-free probe compares it before parsing
_CRC = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SEALED = ENTRY.size + _CRC.size  # the bytes of an entry that are written


class Entry(NamedTuple):
    digest: bytes
    word: int
    seq: int
    place: int
    length: int


def pack_entry(magic: int, word: int, seq: int, place: int, length: int,
               digest: bytes) -> bytes:
    """An entry's bytes, checksum included."""
    body = ENTRY.pack(magic, word, seq, place, length, digest)
    return body + _CRC.pack(xxhash.xxh32_intdigest(body))


def parse_entry(raw: bytes, magic: int) -> Entry | None:
    """The entry in `raw` (at least `entry_bytes` long), or None: cleared, another magic, or
    torn (its checksum fails)."""
    fields = ENTRY.unpack_from(raw)
    if fields[0] != magic:
        return None
    if _CRC.unpack_from(raw, ENTRY.size)[0] != xxhash.xxh32_intdigest(raw[:ENTRY.size]):
        return None
    _, word, seq, place, length, digest = fields
    return Entry(digest, word, seq, place, length)


class SlotTable:
    """The entries at `offset` of a mapped `view`, one per slot."""

    __slots__ = ("magic", "offset", "view")

    def __init__(self, view: memoryview, offset: int, magic: int) -> None:
        self.view, self.offset, self.magic = view, offset, magic

    def at(self, slot: int) -> int:
        """The byte offset of `slot`'s entry in the view."""
        return self.offset + slot * ENTRY_SIZE

    def raw(self, slot: int) -> bytes:
        at = self.offset + slot * ENTRY_SIZE
        return bytes(self.view[at:at + _SEALED])

    def read(self, slot: int) -> Entry | None:
        return parse_entry(self.raw(slot), self.magic)

    def write(self, slot: int, word: int, seq: int, place: int, length: int,
              digest: bytes) -> None:
        """Writes an entry into the mapping (durable only once its owner persists it)."""
        at = self.offset + slot * ENTRY_SIZE
        self.view[at:at + _SEALED] = pack_entry(self.magic, word, seq, place, length, digest)

    def clear(self, slot: int) -> None:
        at = self.offset + slot * ENTRY_SIZE
        self.view[at:at + ENTRY_SIZE] = bytes(ENTRY_SIZE)

    def seq(self, slot: int) -> int:
        seq: int = _U64.unpack_from(self.view, self.offset + slot * ENTRY_SIZE + SEQ_OFFSET)[0]
        return seq


def seal(head: bytes) -> bytes:
    """A geometry header followed by its checksum."""
    return head + _CRC.pack(xxhash.xxh32_intdigest(head))


def unseal(view: memoryview, size: int) -> bytes | None:
    """The `size`-byte header at the start of `view` when its checksum holds, else None."""
    head = bytes(view[:size])
    return head if _CRC.unpack_from(view, size)[0] == xxhash.xxh32_intdigest(head) else None


def names_block(view: memoryview, start: int, digest: bytes,
                length: int | None = None) -> bytes | None:
    """The key of the block at `start` when its header agrees with an entry (the key digest,
    and the stored length when given), else None."""
    try:
        header = decode_header(view[start:start + PAYLOAD_OFFSET])
    except BlockCorrupt:
        return None
    if (length is not None and header.stored_len != length) or key_digest(header.key) != digest:
        return None
    return header.key
