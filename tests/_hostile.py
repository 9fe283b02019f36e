"""What a hostile store answers, for the codec trust tests: blocks forged with valid checksums
(header and payload) around any codec parameters, and a Redis server on 127.0.0.1 that serves
whatever the test put under a name. Also the pieces the codec trust, fuzz and sanitizer tests
share: random KV bytes of a layout, and kernels over a posix or a lying redis tier with a way to
plant any bytes under a key.

`HostileRedis` speaks enough RESP2 for ucm's redis driver (redis-py): AUTH, CLIENT, SELECT,
PING, SET, GET, MGET, EXISTS, UNLINK, DEL, SCAN; it keeps values in a dict the test reads and
rewrites, so a load gets exactly the bytes the test chose, as from a server that lies.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import numpy as np
import xxhash

from ucm.block import PAYLOAD_OFFSET
from ucm.codecs import quant
from ucm.codecs.layout import KVLayout
from ucm.drivers.kit import safe_dir_name

_FIXED = struct.Struct("<4sHBBHHIQQQ")
HEAD = struct.Struct("<BHIH")  # ucm.codecs.layout's packed parameters
RUN = struct.Struct("<BIIIBHH")


def params_of(dtype_id: int, group: int, repeat: int,
              runs: list[tuple[int, int, int, int, int, int, int]], *, first: int = 0xC0,
              ) -> bytes:
    """Packed int8/int4 parameters: runs of (kind id, tokens, channels, count, c-major, ti,
    ci), any values the fields hold."""
    return HEAD.pack(first | dtype_id, group, repeat, len(runs)) + b"".join(
        RUN.pack(*run) for run in runs)


def forge_block(key: bytes, namespace: str, codec: int, params: bytes, payload: bytes,
                raw_len: int, *, payload_len: int | None = None) -> bytes:
    """A whole stored block (header, then payload) whose header checksum and payload checksum
    are right, naming any codec, parameters and lengths."""
    ns = namespace.encode()
    fixed = _FIXED.pack(b"UCMB", 2, codec, 0, len(key), len(ns), PAYLOAD_OFFSET,
                        len(payload) if payload_len is None else payload_len, raw_len,
                        xxhash.xxh3_64_intdigest(payload))
    tail = key + ns + struct.pack("<H", len(params)) + params
    head = fixed + struct.pack("<I", xxhash.xxh32_intdigest(fixed + tail)) + tail
    assert len(head) <= PAYLOAD_OFFSET
    return head + bytes(PAYLOAD_OFFSET - len(head)) + payload


def kv_values(lay: KVLayout, rng: np.random.Generator, *, spread: bool = False) -> np.ndarray:
    """Random bytes of each part of `lay`, written part by part (a part may start at an odd
    byte): raw parts any bytes, k/v parts normal values in the layout's dtype, each part
    scaled by a random factor in [0.01, 100] when `spread`."""
    raw = np.empty(lay.raw_bytes, np.uint8)
    pos = 0
    for part in lay.parts:
        n = lay.part_bytes(part)
        if part[0] == "raw":
            raw[pos:pos + n] = rng.integers(0, 256, n, np.uint8)
        else:
            x = rng.standard_normal(n // lay.itemsize)
            if spread:
                x = x * rng.uniform(0.01, 100)
            quant.from_f32(x.astype(np.float32), lay.dtype, raw[pos:pos + n])
        pos += n
    return raw


Plant = Callable[[bytes, bytes], None]


@contextlib.contextmanager
def posix_kernel(root: str, namespace: str) -> Iterator[tuple[object, Plant]]:
    """A started kernel over one posix tier in `root`, and plant(key, bytes) writing a stored
    block's file directly (plant.present(key) tells whether it is there)."""
    from ucm.kernel import Kernel

    kernel = Kernel({"namespace": namespace, "promote": False,
                     "tiers": [{"driver": "posix", "path": root}]})
    kernel.start()
    driver = kernel._core.tiers[0].driver
    while hasattr(driver, "inner"):
        driver = driver.inner

    def plant(key: bytes, block: bytes) -> None:
        path = driver.block_path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(block)

    plant.present = lambda key: os.path.exists(driver.block_path(key))  # type: ignore[attr-defined]
    try:
        yield kernel, plant
    finally:
        kernel.close()


@contextlib.contextmanager
def redis_kernel(namespace: str) -> Iterator[tuple[object, Plant]]:
    """A started kernel over one redis tier whose server (HostileRedis) serves what plant(key,
    bytes) put under the key's name."""
    from ucm.kernel import Kernel

    server = HostileRedis()
    kernel = Kernel({"namespace": namespace, "promote": False,
                     "tiers": [{"driver": "redis", **server.options()}]})
    kernel.start()

    def plant(key: bytes, block: bytes) -> None:
        server.values[server.name_of(key, namespace)] = block

    plant.present = lambda key: server.name_of(key, namespace) in server.values  # type: ignore[attr-defined]
    try:
        yield kernel, plant
    finally:
        kernel.close()
        server.close()


class HostileRedis:
    """A RESP2 server on 127.0.0.1 (an ephemeral port), one thread a connection."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}
        self.commands: list[bytes] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def options(self, prefix: str = "ucm") -> dict[str, object]:
        return {"url": f"redis://127.0.0.1:{self.port}/0", "prefix": prefix, "retries": 0}

    @staticmethod
    def name_of(key: bytes, namespace: str, prefix: str = "ucm") -> bytes:
        """The Redis key the driver asks for (ucm.drivers.redis: <prefix>:<namespace>:<hex>)."""
        return f"{prefix}:{safe_dir_name(namespace)}:{key.hex()}".encode()

    def close(self) -> None:
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        with conn, reader:
            try:
                while True:
                    args = _read_command(reader)
                    if args is None:
                        return
                    conn.sendall(self._answer(args))
            except (OSError, ValueError):
                return

    def _answer(self, args: list[bytes]) -> bytes:
        name = args[0].upper()
        self.commands.append(name)
        if name in (b"AUTH", b"CLIENT", b"SELECT"):
            return b"+OK\r\n"
        if name == b"PING":
            return b"+PONG\r\n"
        if name == b"SET":
            self.values[args[1]] = args[2]
            return b"+OK\r\n"
        if name == b"GET":
            return _bulk(self.values.get(args[1]))
        if name == b"MGET":
            return b"*%d\r\n" % (len(args) - 1) + b"".join(
                _bulk(self.values.get(a)) for a in args[1:])
        if name == b"EXISTS":
            return b":%d\r\n" % sum(a in self.values for a in args[1:])
        if name in (b"UNLINK", b"DEL"):
            return b":%d\r\n" % sum(self.values.pop(a, None) is not None for a in args[1:])
        if name == b"SCAN":
            return b"*2\r\n$1\r\n0\r\n*0\r\n"
        return b"-ERR unknown command '" + name + b"'\r\n"


def _bulk(value: bytes | None) -> bytes:
    if value is None:
        return b"$-1\r\n"
    return b"$%d\r\n" % len(value) + value + b"\r\n"


def _read_command(reader) -> list[bytes] | None:
    line = reader.readline()
    if not line:
        return None
    if not line.startswith(b"*"):
        raise ValueError("not a RESP array")
    args = []
    for _ in range(int(line[1:])):
        size = int(reader.readline()[1:])
        args.append(reader.read(size + 2)[:size])
    return args
