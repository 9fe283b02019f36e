"""The `ucm bench` baseline of the `nfs` driver: its client library called directly."""

from __future__ import annotations

from typing import Any

from ucm.block import PAYLOAD_OFFSET
from ucm.drivers._blockfiles import tmp_name
from ucm.drivers.kit import safe_dir_name
from ucm.drivers.nfs import NfsOptions
from ucm.errors import ConfigError


class RawNfs:
    """For `ucm bench`: nfs-rs called directly doing the driver's transfers (client mode):
    a write of a 4 KiB header plus the payload to a temp name and a rename; a read of the
    whole file into a buffer. No checksums, no copies into the caller's buffer."""

    label = "raw nfs-rs write+rename/readinto"

    def __init__(self, options: dict[str, Any], namespace: str) -> None:
        from nfs_rs import Client

        opts = NfsOptions.model_validate(options)
        if opts.mode != "client":
            raise ConfigError("the raw nfs baseline needs client mode")
        self.client = Client.connect(opts.url, operation_timeout=opts.timeout,
                                     connect_timeout=opts.connect_timeout)
        self.dir = f"{opts.root.strip('/')}/raw-{safe_dir_name(namespace)}"
        self.client.mkdir(self.dir, parents=True, exist_ok=True)
        self.header = bytes(PAYLOAD_OFFSET)

    def store(self, keys: list[bytes], bufs: list[memoryview]) -> None:
        for key, buf in zip(keys, bufs, strict=True):
            tmp = f"{self.dir}/{tmp_name()}"
            with self.client.open(tmp, "wb") as f:
                f.write(self.header + buf)
            self.client.rename(tmp, f"{self.dir}/{key.hex()}")

    def load(self, keys: list[bytes], outs: list[memoryview], batch: int) -> None:
        # Header and payload in one read, as the driver reads them; the network bounds both.
        size = outs[0].nbytes
        staged = [memoryview(bytearray(PAYLOAD_OFFSET + size)) for _ in range(batch)]
        for i, key in enumerate(keys):
            with self.client.open(f"{self.dir}/{key.hex()}", "rb") as f:
                f.readinto(staged[i % batch])

    def delete(self, keys: list[bytes]) -> None:
        for key in keys:
            self.client.remove(f"{self.dir}/{key.hex()}", missing_ok=True)

    def close(self) -> None:
        self.client.close()


def raw_baseline(options: dict[str, Any], namespace: str) -> RawNfs | None:
    """For `ucm bench`: the raw client next to which the driver is measured."""
    if options.get("mode", "client") != "client":
        return None
    return RawNfs(options, namespace)
