"""A "host" for the mooncake and nfs sharing tests (run as a script, not collected): a process
with its own Kernel on one tier, started in a network namespace by the test.

    python _host.py '<json>'

JSON: tier (the tier config), size, mode and:
- store: seed, count -> stores keys h-0.. with the seed's pattern, prints their hexes;
  with hold, then stays up (and its tier's client with it) until stdin closes
- load: keys, seed -> every key must load OK with the seed's pattern; prints "ok"
- hammer: key, seed, count -> prints "ready", stores the key `count` times
- watch: keys, seeds, seconds -> loads the keys in a loop; prints a JSON count of states and
  the number of OK loads whose bytes were not one whole pattern of `seeds`
- delete: keys -> deletes them one at a time, slowly
"""

from __future__ import annotations

import collections
import json
import random
import sys
import time

from ucm.kernel import Delete, Kernel, Load, Store


def pattern(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def main(job: dict) -> None:
    kernel = Kernel({"tiers": [job["tier"]], "namespace": "hosts", "promote": False})
    kernel.start()
    size = job["size"]
    try:
        mode = job["mode"]
        if mode == "store":
            keys = [f"h-{i}".encode() for i in range(job["count"])]
            data = pattern(job["seed"], size)
            assert kernel.submit(Store(keys, buffers=[data] * len(keys))).result(60).ok
            print(" ".join(k.hex() for k in keys), flush=True)
            if job.get("hold"):
                sys.stdin.read()
        elif mode == "load":
            keys = [bytes.fromhex(k) for k in job["keys"]]
            outs = [bytearray(size) for _ in keys]
            result = kernel.submit(Load(keys, buffers=outs)).result(60)
            assert result.ok, result.states
            assert all(bytes(o) == pattern(job["seed"], size) for o in outs)
            print("ok", flush=True)
        elif mode == "hammer":
            data = pattern(job["seed"], size)
            key = bytes.fromhex(job["key"])
            print("ready", flush=True)
            for _ in range(job["count"]):
                kernel.submit(Store([key], buffers=[data])).result(60)
        elif mode == "watch":
            keys = [bytes.fromhex(k) for k in job["keys"]]
            wholes = {pattern(s, size) for s in job["seeds"]}
            states: collections.Counter[str] = collections.Counter()
            mixed = 0
            print("ready", flush=True)
            end = time.monotonic() + job["seconds"]
            while time.monotonic() < end:
                outs = [bytearray(size) for _ in keys]
                result = kernel.submit(Load(keys, buffers=outs)).result(60)
                for state, out in zip(result.states, outs, strict=True):
                    states[state.name] += 1
                    if state.name == "OK" and bytes(out) not in wholes:
                        mixed += 1
            print(json.dumps({"states": states, "mixed": mixed}), flush=True)
        elif mode == "delete":
            for key in job["keys"]:
                kernel.submit(Delete([bytes.fromhex(key)])).result(60)
                time.sleep(0.05)
    finally:
        kernel.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
