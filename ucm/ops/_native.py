"""Locating the CUDA C sources in `native/` and compiling them with CuPy (GPU process only).

The sources live in the repository's top-level `native/` directory. An editable install finds
them next to the package (`<repo>/native`); an installed wheel finds them as the package data
`ucm/native/*.cu` when the build maps them there. `UCM_NATIVE_DIR` overrides both.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
from pathlib import Path
from typing import Any

_ENV = "UCM_NATIVE_DIR"


def native_dir() -> Path:
    """The directory of the `.cu` sources; FileNotFoundError names the places tried."""
    tried: list[str] = []
    override = os.environ.get(_ENV)
    if override:
        path = Path(override)
        if path.is_dir():
            return path
        tried.append(f"${_ENV}={override}")
    packaged = importlib.resources.files("ucm") / "native"
    if packaged.is_dir():
        return Path(str(packaged))
    tried.append(str(packaged))
    repo = Path(__file__).resolve().parents[2] / "native"
    if repo.is_dir():
        return repo
    tried.append(str(repo))
    raise FileNotFoundError(f"CUDA sources not found; tried {', '.join(tried)}")


def native_sources() -> list[Path]:
    """Every `.cu` file that ships with ucm, sorted by name."""
    return sorted(native_dir().glob("*.cu"))


def kernel_source(name: str) -> str:
    """The text of `native/<name>.cu`."""
    path = native_dir() / f"{name}.cu"
    if not path.is_file():
        raise FileNotFoundError(f"no CUDA source {path}")
    return path.read_text()


def cupy_unavailable_reason() -> str | None:
    """None when CuPy can run kernels here, else a short reason (for skips and errors)."""
    try:
        import cupy
    except ImportError:
        return "cupy is not installed (pip install 'ucm[cupy]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "cupy found no CUDA device"
    except Exception as exc:  # CUDARuntimeError when no driver is loaded
        return f"cupy cannot reach a CUDA device: {exc}"
    return None


@functools.cache
def raw_module(name: str) -> Any:
    """`cupy.RawModule` for `native/<name>.cu`, compiled once per process."""
    reason = cupy_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    import cupy

    return cupy.RawModule(code=kernel_source(name), options=("--std=c++17",))


def kernel(module: str, function: str) -> Any:
    """One `extern "C"` function of `native/<module>.cu`."""
    return raw_module(module).get_function(function)


def launch_1d(n: int, threads: int = 256) -> tuple[tuple[int], tuple[int]]:
    """Grid and block shapes that cover n items with a grid-stride loop."""
    blocks = max(1, min((n + threads - 1) // threads, 65535))
    return (blocks,), (threads,)
