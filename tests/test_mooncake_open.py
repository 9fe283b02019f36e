"""Fault injection for the Mooncake driver's open: the probe put that tells a pool with memory
from one without. A peer that died lately leaves its segment registered until the master's
client TTL, and puts placed there fail for a while; the real-server tests are in
tests/backends."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

mooncake_store = pytest.importorskip("mooncake.store")

from ucm.drivers import mooncake  # noqa: E402
from ucm.errors import StorageUnavailable  # noqa: E402


class _Store:
    """A store client whose probe puts answer `codes` in turn, then 0."""

    def __init__(self, codes: list[int]) -> None:
        self.codes = list(codes)
        self.puts = 0
        self.closed = False

    def setup(self, *args: Any) -> int:
        return 0

    def register_buffer(self, addr: int, size: int) -> int:
        return 0

    def put(self, name: str, value: bytes) -> int:
        self.puts += 1
        return self.codes.pop(0) if self.codes else 0

    def remove(self, name: str, force: bool) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


def _open(monkeypatch: pytest.MonkeyPatch, codes: list[int]) -> tuple[Any, _Store]:
    store = _Store(codes)
    monkeypatch.setattr(mooncake_store, "MooncakeDistributedStore", lambda: store)
    monkeypatch.setattr(mooncake, "_check_reachable", lambda *args: None)
    monkeypatch.setattr(mooncake.time, "sleep", lambda s: None)
    options = mooncake.MooncakeDriver.Options(local_hostname="127.0.0.1")
    pool = SimpleNamespace(addr=0, size=2**20)
    return mooncake._open_client(options, pool, name="mc"), store  # type: ignore[arg-type]


@pytest.mark.parametrize("code", [mooncake.TRANSFER_FAIL, mooncake.OBJECT_NOT_FOUND])
def test_puts_into_a_dead_peers_segment_do_not_fail_the_open(monkeypatch, code):
    client, store = _open(monkeypatch, [code, code])
    assert client is store and store.puts == 3 and not store.closed


def test_another_probe_error_names_it(monkeypatch):
    with pytest.raises(StorageUnavailable, match=r"probe put .* failed"):
        _open(monkeypatch, [-1])
