"""This machine's load bandwidths for the tuner, measured by a short probe and cached.

The probe is the storage benchmark's load cell (`ucm bench`) made small: a one-tier kernel
per candidate driver (memory; posix in a scratch directory of the ucm cache directory, the
embedded default's disk) stores `blocks` blocks of `block_bytes`, then loads them back in one
event, best of `repeat`. Posix loads come from the page cache, as `ucm bench`'s do. Figures
are cached per machine (host name) under the ucm cache directory, so the next tune reads
them; `bench_json` (full `ucm bench --json` records) stays the way to pass figures from
elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROBE_TIERS = ("memory", "posix")


def cache_file(cache_dir: Path) -> Path:
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "localhost"
    return cache_dir / "autotune" / f"bandwidths-{host}.json"


def read_cached(path: Path) -> dict[str, Any] | None:
    """The cache file's content, or None when absent or not ours (then it is measured again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("bandwidths"), dict):
        return None
    return data


def probe_tier(driver: str, scratch: str, *, block_bytes: int, blocks: int,
               repeat: int) -> float:
    """Best load bandwidth (bytes/s) of one driver through a one-tier kernel."""
    from ucm.kernel import Kernel, Load, Store

    if driver == "memory":
        tier: dict[str, Any] = {"driver": "memory"}
    elif driver == "posix":
        tier = {"driver": "posix", "path": scratch}
    else:
        raise ValueError(f"the tuner can probe {', '.join(PROBE_TIERS)}, not {driver!r}: pass "
                         "bench_json with its `ucm bench --json` records")
    keys = [f"ucm-probe-{driver}-{i}".encode().ljust(16, b".") for i in range(blocks)]
    payload = os.urandom(block_bytes)
    best = 0.0
    with Kernel({"tiers": [tier], "namespace": "ucm-autotune-probe"}) as kernel:
        stored = kernel.submit(Store(keys, buffers=[payload] * blocks)).result(120)
        if not stored.ok:
            raise ValueError(f"the {driver} probe could not store its blocks: {stored}")
        buffers = [bytearray(block_bytes) for _ in keys]
        for _ in range(repeat):
            start = time.perf_counter()
            loaded = kernel.submit(Load(keys, buffers=buffers)).result(120)
            seconds = time.perf_counter() - start
            if not loaded.ok:
                raise ValueError(f"the {driver} probe could not load its blocks: {loaded}")
            best = max(best, blocks * block_bytes / max(seconds, 1e-9))
    return best


def machine_bandwidths(tiers: Sequence[str], cache_dir: Path, *, block_bytes: int = 1 << 20,
                       blocks: int = 64, repeat: int = 3, progress: bool = True,
                       ) -> tuple[dict[str, float], str]:
    """Load bandwidths for `tiers`, from the cache or measured now (and cached); and a line
    saying which."""
    path = cache_file(cache_dir)
    cached = read_cached(path)
    known = {k: float(v) for k, v in (cached or {}).get("bandwidths", {}).items()}
    missing = [t for t in tiers if t not in known]
    if not missing:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(cached["measured_at"])) if (
            cached and isinstance(cached.get("measured_at"), int | float)) else "earlier"
        return known, (f"load bandwidths of this machine measured {when}, read from {path} "
                       "(delete it to measure again)")
    start = time.monotonic()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="probe-", dir=path.parent) as scratch:
        for i, driver in enumerate(missing, 1):
            if progress:
                print(f"ucm tune: probing {driver} load bandwidth ({i}/{len(missing)}, "
                      f"{blocks} x {block_bytes >> 10} KiB blocks)...", file=sys.stderr,
                      flush=True)
            known[driver] = probe_tier(driver, scratch, block_bytes=block_bytes,
                                       blocks=blocks, repeat=repeat)
    data = {"machine": socket.gethostname(), "measured_at": time.time(),
            "probe": {"block_bytes": block_bytes, "blocks": blocks, "repeat": repeat},
            "bandwidths": known}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)  # never half-written
    figures = ", ".join(f"{t} {known[t] / 1e9:.2f} GB/s" for t in missing)
    return known, (f"measured this machine's load bandwidths in "
                   f"{time.monotonic() - start:.1f} s ({figures}); cached in {path}")
