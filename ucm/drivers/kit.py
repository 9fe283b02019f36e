"""The driver kit: what a storage driver needs besides its own storage code. Public API.

    from ucm.drivers.kit import Backend, ThreadedDriver, check_batch, frame_block

Validation     check_keys, check_batch, size_mismatch: arguments checked as the contract says
Framing        frame_block, unframe_into: a block in the self-describing `ucm.block` format
               (header with key, namespace, codec, lengths and checksum; payload after it)
Errors         os_error: an OSError that failed a batch, as the ucm exception tree
Threaded base  Backend + ThreadedDriver: write a synchronous, batched Backend; ThreadedDriver
               validates each call, runs it on worker threads, counts and translates errors
               RemoteDriver: the same for servers that can stall (calls a deadline abandons)
Statistics     new_statistics, count_loads, count_stores (see `DriverStatistics`)
Naming         safe_dir_name: a directory name for a namespace

docs/writing-a-driver.md walks through a complete driver built on it.
"""

from __future__ import annotations

from ucm.block import PAYLOAD_OFFSET, Codec, Scatter, encode_header, encode_payload
from ucm.drivers._files import (
    Backend,
    ThreadedDriver,
    check_batch,
    check_keys,
    count_loads,
    count_stores,
    os_error,
    parse_codec,
    safe_dir_name,
    size_mismatch,
)
from ucm.drivers._protocol import (
    STATISTICS,
    DriverStatistics,
    LoadState,
    new_statistics,
)
from ucm.drivers._remote import RemoteDriver, verify_into

__all__ = [
    "PAYLOAD_OFFSET",
    "STATISTICS",
    "Backend",
    "Codec",
    "DriverStatistics",
    "LoadState",
    "RemoteDriver",
    "Scatter",
    "ThreadedDriver",
    "check_batch",
    "check_keys",
    "count_loads",
    "count_stores",
    "frame_block",
    "new_statistics",
    "os_error",
    "parse_codec",
    "safe_dir_name",
    "size_mismatch",
    "unframe_into",
]


def frame_block(key: bytes, namespace: str, codec: Codec, raw: memoryview,
                ) -> tuple[bytes, memoryview]:
    """A block as stored: its header (PAYLOAD_OFFSET bytes) and its payload (`raw` encoded
    with `codec`; `raw` itself for Codec.NONE). Store the two back to back."""
    payload = memoryview(encode_payload(codec, raw)).cast("B")
    return encode_header(key, namespace, codec, payload, raw.nbytes), payload


def unframe_into(key: bytes, stored: memoryview, out: memoryview) -> LoadState:
    """Checks a stored block (header + payload) against `key` and its checksum and decodes
    its raw bytes into `out`: OK or CORRUPT. A buffer of the wrong size is InvalidRequest."""
    return verify_into(key, stored, out)
