"""A block as stored: the self-describing `ucm.block` format (header, then payload), and the
gate that keeps an abandoned call's thread from writing into a caller's buffer.

A driver whose calls a deadline can abandon (`RemoteDriver`) runs each backend call under a
`Gate`: the backend reads into memory it owns, then checks and copies into the caller's buffer
with `unframe_into`, which does the copy under the call's gate. Once the trio side was
cancelled the gate is shut and the copy is skipped (`Abandoned` is raised in the worker, where
nobody waits for it). Outside a gated call, `unframe_into` simply copies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, overload

from ucm.block import (
    PAYLOAD_OFFSET,
    Codec,
    KVLayouts,
    Scatter,
    as_buffer_view,
    decode_header,
    decode_payload_into,
    encode_header,
    encode_payload,
    wrong_size,
)
from ucm.drivers.contract import LoadState
from ucm.errors import BlockCorrupt


@overload
def frame_block(key: bytes, namespace: str, codec: Codec, raw: memoryview,
                layouts: KVLayouts | None = None) -> tuple[bytes, memoryview]: ...
@overload
def frame_block(key: bytes, namespace: str, codec: Codec, raw: memoryview | Scatter,
                layouts: KVLayouts | None = None) -> tuple[bytes, memoryview | Scatter]: ...
def frame_block(key: bytes, namespace: str, codec: Codec, raw: memoryview | Scatter,
                layouts: KVLayouts | None = None) -> tuple[bytes, memoryview | Scatter]:
    """A block as stored: its header (PAYLOAD_OFFSET bytes) and its payload (`raw` encoded
    with `codec`; `raw` itself for Codec.NONE, a Scatter too: write its pieces in order).
    `layouts`: the KV layouts the driver was opened with (int8 and int4 need one of the
    block's size to quantize it). Store the two back to back."""
    payload = as_buffer_view(encode_payload(codec, raw, layouts))
    return encode_header(key, namespace, codec, payload, raw.nbytes), payload


def unframe_into(key: bytes, stored: memoryview, out: memoryview, *,
                 namespace: bytes | str | None = None) -> LoadState:
    """Checks a stored block (header + payload) against `key`, `namespace` (the driver's, best
    encoded once as bytes; None skips the check) and its checksum, and decodes its raw bytes
    into `out`, under the current call's gate: OK or CORRUPT. A block that names another key
    or namespace, or holds another size than `out`, is CORRUPT."""
    try:
        header = decode_header(stored[:PAYLOAD_OFFSET], expect_key=key,
                               expect_namespace=namespace)
        if header.raw_len != out.nbytes:
            raise wrong_size(out, header)
        payload = stored[PAYLOAD_OFFSET:]
        # Checked and copied in one pass (ucm.block.copy_verified), outside the GIL.
        gate(lambda: decode_payload_into(header, payload, out))
    except BlockCorrupt:
        return LoadState.CORRUPT
    return LoadState.OK


class Abandoned(Exception):
    """The trio side gave up on this call; its results go nowhere."""


class Gate:
    """Shared by one backend call and its trio waiter."""

    __slots__ = ("_lock", "open")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.open = True

    def shut(self) -> None:
        with self._lock:  # waits for a copy in progress: after this none starts
            self.open = False

    def run(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if not self.open:
                raise Abandoned
            return fn()


_current = threading.local()


def gate(fn: Callable[[], Any]) -> Any:
    """Runs `fn` (which writes into caller memory) under the current call's gate."""
    current: Gate | None = getattr(_current, "gate", None)
    if current is None:
        return fn()
    return current.run(fn)


def call_gated(gate_: Gate, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) with `gate_` as the calling thread's current gate."""
    _current.gate = gate_
    try:
        return fn(*args)
    finally:
        _current.gate = None
