"""A writer process for the cross-process contract checks (run as a module, not collected).

    python -m ucm.testing._worker '<json>'

JSON: driver (a registered name or "module:Class"), options, codec, namespace, mode, size, and
for mode "hammer" (store one key's own full pattern `count` times) key + seed; for mode "flood"
(store fresh large blocks until killed, printing each stored batch's key hexes) prefix.
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

import trio

from ucm.testing._spec import driver_class


async def main(job: dict[str, Any]) -> None:
    factory = driver_class(job["driver"])
    drv = await factory.open(factory.Options(**job["options"]), name="worker",
                             namespace=job["namespace"], codec=job["codec"])
    size = job["size"]
    if job["mode"] == "hammer":
        pattern = memoryview(random.Random(job["seed"]).randbytes(size))
        key = bytes.fromhex(job["key"])
        print("ready", flush=True)
        for _ in range(job["count"]):
            await drv.store([key], [pattern])
    else:
        prefix = bytes.fromhex(job["prefix"])
        data = [memoryview(os.urandom(size)) for _ in range(4)]
        for i in range(100_000):  # bounded: the test kills it long before
            keys = [prefix + i.to_bytes(4, "big") + bytes([j]) for j in range(4)]
            await drv.store(keys, data)
            print(" ".join(k.hex() for k in keys), flush=True)
    await drv.aclose()


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
