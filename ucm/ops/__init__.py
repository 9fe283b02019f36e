"""Device ops under ucm's sparse methods (block scores, top-k).

Every op has a torch reference that runs on the CPU (and on any torch device) and, where a
kernel exists, a CuPy twin (`*_cupy`) that compiles `native/*.cu` with `cupy.RawModule` on first
use. Importing this package imports neither torch nor CuPy; the op modules import torch when
they are imported, CuPy only when a `*_cupy` function is called.
"""

from __future__ import annotations

from ucm.ops._native import cupy_unavailable_reason, kernel_source, native_dir, native_sources

__all__ = ["cupy_unavailable_reason", "kernel_source", "native_dir", "native_sources"]
