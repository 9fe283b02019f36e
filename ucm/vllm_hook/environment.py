"""The environment vLLM engines on the CPU should run in: OpenMP's spin and tcmalloc. Used by
`ucm serve` and by the benchmarks' engine runner. Standard library only: scripts/setup.sh
imports it before ucm is installed."""

from __future__ import annotations

import os
from collections.abc import Mapping

# OpenMP threads that finish a parallel region spin before they sleep (300,000 rounds by
# default in libgomp, torch's OpenMP) and slow a KV load that starts just after one (vLLM
# calls start_load_kv after its own tensor work); GOMP_SPINCOUNT=3000 keeps the spin inside a
# forward pass and ends it soon after (figures: docs/performance.md, Engine environment).
# Every engine the runner starts gets it, with or without a connector, unless the environment
# already says how OpenMP should wait.
OPENMP_SPIN = "3000"

# vLLM's CPU backend asks for tcmalloc in LD_PRELOAD ("libtcmalloc is not found in LD_PRELOAD"
# in its log, and its CPU install guide): with glibc's malloc a long prefill's tensors (above
# its mmap ceiling) are mapped and faulted in again every forward pass; tcmalloc keeps freed
# memory for the next pass (figures: docs/performance.md, Engine environment). Every engine
# the runner starts gets it where the system has it
# (`libtcmalloc-minimal4`, which scripts/setup.sh installs), unless LD_PRELOAD already names an
# allocator or UCM_ENGINE_MALLOC=system asks for glibc's.
TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib64/libtcmalloc_minimal.so.4",
                  "/usr/lib/libtcmalloc_minimal.so.4")
_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def find_tcmalloc(paths: tuple[str, ...] = TCMALLOC_PATHS) -> str | None:
    return next((p for p in paths if os.path.exists(p)), None)


def engine_env(environ: Mapping[str, str], *, tcmalloc: str | None = None) -> dict[str, str]:
    """`environ` plus GOMP_SPINCOUNT (see OPENMP_SPIN) where it sets no OpenMP wait policy, and
    `tcmalloc` (a library path; see TCMALLOC_PATHS) first in LD_PRELOAD where it names no
    allocator and UCM_ENGINE_MALLOC is not "system"."""
    env = dict(environ)
    if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
        env["GOMP_SPINCOUNT"] = OPENMP_SPIN
    preload = env.get("LD_PRELOAD", "")
    if (tcmalloc and env.get("UCM_ENGINE_MALLOC", "") != "system"
            and not any(name in preload for name in _ALLOCATORS)):
        env["LD_PRELOAD"] = f"{tcmalloc}:{preload}" if preload else tcmalloc
    return env
