"""The public exports: each package's `__all__`, and what importing a package pulls in."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from types import ModuleType

import pytest

PACKAGES = ["ucm", "ucm.kernel", "ucm.drivers", "ucm.drivers.kit"]
HEAVY = ("torch", "vllm", "cupy")


def _exports(package: str) -> list[str]:
    module = importlib.import_module(package)
    names = getattr(module, "__all__", None)
    assert isinstance(names, list | tuple), f"{package} defines no __all__"
    assert all(isinstance(n, str) for n in names), package
    return list(names)


@pytest.mark.parametrize("package", PACKAGES)
def test_all_names_are_importable(package: str) -> None:
    module = importlib.import_module(package)
    missing = [n for n in _exports(package) if not hasattr(module, n)]
    assert not missing, f"{package}.__all__ names what it lacks: {missing}"


@pytest.mark.parametrize("package", PACKAGES)
def test_all_has_no_duplicates(package: str) -> None:
    names = _exports(package)
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"{package}.__all__ exports {twice} more than once"


@pytest.mark.parametrize("package", PACKAGES)
def test_all_has_no_private_names(package: str) -> None:
    private = [n for n in _exports(package) if n.startswith("_") and n != "__version__"]
    assert not private, f"{package}.__all__ exports private names {private}"


def _defining_module(obj: object) -> ModuleType | None:
    name = getattr(obj, "__module__", None)
    return sys.modules.get(name) if isinstance(name, str) else None


def test_reexports_are_the_same_object() -> None:
    """A name exported by several packages is one object, the one its own module defines."""
    seen: dict[str, tuple[str, object]] = {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in _exports(package):
            obj = getattr(module, name)
            if name in seen:
                first, other = seen[name]
                assert obj is other, f"{package}.{name} is not {first}.{name}"
            else:
                seen[name] = (package, obj)
            home = _defining_module(obj)
            qualname = getattr(obj, "__qualname__", None)
            if home is not None and qualname == name and hasattr(home, name):
                assert getattr(home, name) is obj, (
                    f"{package}.{name} is a copy of {home.__name__}.{name}")
    # the ones a driver or a user meets from two sides
    assert seen["LoadState"][1] is importlib.import_module("ucm.drivers.contract").LoadState
    assert seen["Scatter"][1] is importlib.import_module("ucm.block").Scatter


@pytest.mark.parametrize("package", PACKAGES)
def test_import_is_light(package: str) -> None:
    """A fresh interpreter (clean sys.modules) imports the package without torch, vLLM or
    CuPy."""
    code = (f"import sys, {package}\n"
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
            "print(','.join(heavy))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=os.environ.copy(), timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"import {package} imported {done.stdout.strip()}"
