"""The `ucm bench` baseline of the `mooncake` driver: its client library called directly."""

from __future__ import annotations

import threading
from typing import Any

from ucm.drivers.kit import safe_dir_name
from ucm.drivers.mooncake import _ALIGN, MooncakeDriver, StagingPool, _open_client


class RawMooncake:
    """For `ucm bench`: the Mooncake store API called directly, at its best: blocks in
    registered memory (as a KV cache registered once would be), moved with
    batch_upsert_from / batch_get_into; no header, no checksum, no staging copy."""

    label = "raw mooncake batch_upsert_from/get_into"

    def __init__(self, options: dict[str, Any], namespace: str) -> None:
        opts = MooncakeDriver.Options.model_validate(options)
        self.client = _open_client(opts, StagingPool(2**20), name="raw")
        self.prefix = f"ucm-raw/{safe_dir_name(namespace)}/"
        self._local = threading.local()
        self._arenas: list[StagingPool] = []  # registered for good: never reused memory

    def _arena(self, kind: str, size: int) -> tuple[StagingPool, dict[int, Any]]:
        arena, sources = getattr(self._local, kind, (None, {}))
        if arena is None or arena.size < size:
            arena, sources = StagingPool(-(-size // _ALIGN) * _ALIGN), {}
            assert self.client.register_buffer(arena.addr, arena.size) == 0
            self._arenas.append(arena)
            setattr(self._local, kind, (arena, sources))
        return arena, sources

    def store(self, keys: list[bytes], bufs: list[memoryview]) -> None:
        size = bufs[0].nbytes
        batch = max(1, min(64, (16 * 2**20) // max(1, size)))
        arena, sources = self._arena("put", batch * size)
        for i in range(0, len(keys), batch):
            part = bufs[i:i + batch]
            for j, buf in enumerate(part):  # every bench block has the same bytes: placed once
                if j not in sources:
                    arena.view[j * size:(j + 1) * size] = buf
                    sources[j] = True
            rcs = self.client.batch_upsert_from(
                [self.prefix + k.hex() for k in keys[i:i + batch]],
                [arena.addr + j * size for j in range(len(part))], [size] * len(part))
            if any(rcs):
                raise RuntimeError(f"raw mooncake store failed: {rcs}")

    def load(self, keys: list[bytes], outs: list[memoryview], batch: int) -> None:
        size = outs[0].nbytes  # read into registered memory, never copied out: at its best
        arena, _ = self._arena("get", batch * size)
        for i in range(0, len(keys), batch):
            part = keys[i:i + batch]
            got = self.client.batch_get_into([self.prefix + k.hex() for k in part],
                                             [arena.addr + j * size for j in range(len(part))],
                                             [size] * len(part))
            if any(n != size for n in got):
                raise RuntimeError(f"raw mooncake load failed: {got}")

    def delete(self, keys: list[bytes]) -> None:
        self.client.batch_remove([self.prefix + k.hex() for k in keys], True)

    def close(self) -> None:
        self.client.close()


def raw_baseline(options: dict[str, Any], namespace: str) -> RawMooncake:
    """For `ucm bench`: the raw client next to which the driver is measured."""
    return RawMooncake(options, namespace)
