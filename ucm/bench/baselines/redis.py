"""The `ucm bench` baseline of the `redis` driver: its client library called directly."""

from __future__ import annotations

from typing import Any

from ucm.block import PAYLOAD_OFFSET
from ucm.drivers.kit import safe_dir_name
from ucm.drivers.redis import _SCAN_COUNT, RedisOptions, _address, _client


class RawRedis:
    """redis-py called directly doing the driver's transfers: per batch a pipeline of SETs of a
    4 KiB header plus the payload, and one MGET copied into the caller's buffers. No
    checksums."""

    label = "raw redis-py pipeline SET/MGET"

    def __init__(self, options: dict[str, Any], namespace: str) -> None:
        opts = RedisOptions.model_validate(options)
        kwargs, _, _ = _address(opts)
        self.client = _client(opts, kwargs)
        prefix = (f"{opts.prefix}:" if opts.prefix else "") + "raw-" + safe_dir_name(namespace)
        self.prefix = (prefix + ":").encode()
        self.header = bytes(PAYLOAD_OFFSET)

    def store(self, keys: list[bytes], bufs: list[memoryview]) -> None:
        batch = max(1, min(64, (16 * 2**20) // max(1, bufs[0].nbytes)))
        for i in range(0, len(keys), batch):
            pipe = self.client.pipeline(transaction=False)
            for key, buf in zip(keys[i:i + batch], bufs[i:i + batch], strict=True):
                pipe.set(self.prefix + key.hex().encode(), self.header + buf)
            if not all(r is True for r in pipe.execute()):
                raise RuntimeError("raw redis store failed")

    def load(self, keys: list[bytes], outs: list[memoryview], batch: int) -> None:
        for i in range(0, len(keys), batch):
            values = self.client.mget([self.prefix + k.hex().encode()
                                       for k in keys[i:i + batch]])
            for out, value in zip(outs[i:i + batch], values, strict=True):
                out[:] = memoryview(value)[PAYLOAD_OFFSET:]

    def delete(self, keys: list[bytes]) -> None:
        for i in range(0, len(keys), _SCAN_COUNT):
            self.client.unlink(*[self.prefix + k.hex().encode()
                                 for k in keys[i:i + _SCAN_COUNT]])

    def close(self) -> None:
        self.client.connection_pool.disconnect()


def raw_baseline(options: dict[str, Any], namespace: str) -> RawRedis:
    """For `ucm bench`: the raw client next to which the driver is measured."""
    return RawRedis(options, namespace)
