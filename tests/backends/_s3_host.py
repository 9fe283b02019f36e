"""A second "host" for the s3 sharing tests (run as a script, not collected): its own Kernel.

    python _s3_host.py '<json>'   mode: store | hammer | delete
"""

from __future__ import annotations

import json
import random
import sys

from ucm.kernel import Delete, Kernel, Store


def main(job: dict) -> None:
    kernel = Kernel({"tiers": [{"driver": "s3", **job["options"]}], "namespace": "hosts",
                     "promote": False})
    kernel.start()
    try:
        if job["mode"] == "store":
            data = random.Random(job["seed"]).randbytes(job["size"])
            keys = [f"a-{i}".encode() for i in range(job["count"])]
            assert kernel.submit(Store(keys, buffers=[data] * len(keys))).result(60).ok
            print(" ".join(k.hex() for k in keys), flush=True)
        elif job["mode"] == "hammer":
            data = random.Random(job["seed"]).randbytes(job["size"])
            key = bytes.fromhex(job["key"])
            print("ready", flush=True)
            for _ in range(job["count"]):
                kernel.submit(Store([key], buffers=[data])).result(60)
        else:
            for key in job["keys"]:
                kernel.submit(Delete([bytes.fromhex(key)])).result(60)
    finally:
        kernel.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
