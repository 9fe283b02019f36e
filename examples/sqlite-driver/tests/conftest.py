"""The ucm contract suite runs against this driver (tests/test_contract.py); the spec below
says how to open it and how to damage a stored block."""

from __future__ import annotations

import sqlite3

import pytest

from ucm.testing import DriverSpec


def _rewrite(driver, key: bytes, change) -> None:
    """Rewrites one stored block, through a connection of its own, as damage on disk would."""
    backend = driver.backend
    with sqlite3.connect(backend.path, timeout=30) as db:
        (block,) = db.execute("SELECT block FROM blocks WHERE namespace = ? AND key = ?",
                              (backend.namespace, key)).fetchone()
        db.execute("UPDATE blocks SET block = ? WHERE namespace = ? AND key = ?",
                   (change(bytearray(block)), backend.namespace, key))


def flip_payload_byte(driver, key: bytes) -> None:
    def flip(block: bytearray) -> bytes:
        block[4096 + (len(block) - 4096) // 2] ^= 0x40  # the header is 4096 bytes
        return bytes(block)

    _rewrite(driver, key, flip)


def truncate_block(driver, key: bytes) -> None:
    _rewrite(driver, key, lambda block: bytes(block[: 4096 + (len(block) - 4096) // 2]))


SPECS = [
    DriverSpec("sqlite", "sqlite", {"path": "{tmp}/blocks.db"}, corrupt=flip_payload_byte,
               truncate=truncate_block, cross_process=True),
    DriverSpec("sqlite-zstd", "sqlite", {"path": "{tmp}/blocks.db"}, corrupt=flip_payload_byte,
               truncate=truncate_block, cross_process=True, codec="zstd"),
]


@pytest.fixture(params=SPECS, ids=[spec.id for spec in SPECS])
def ucm_driver_spec(request: pytest.FixtureRequest) -> DriverSpec:
    return request.param
