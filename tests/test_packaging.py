"""The distribution ships every package of the source tree: the package list, package-dir and
package data that setuptools reads from setup.py and pyproject.toml (read, not built: a
subprocess stops setup() after its configuration) cover every directory under ucm/ and tools/
with an __init__.py, and every file of native/ and tools/grafana/. scripts/wheel_check.sh
builds and installs the wheel itself."""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# setup() stopped after reading its configuration: what a build would package, with no build.
CONFIG = """
import json, setuptools
from distutils.core import run_setup
dist = run_setup("setup.py", stop_after="config")
print(json.dumps({"packages": dist.packages, "package_dir": dist.package_dir,
                  "package_data": dist.package_data}))
"""
# Packages that hold data only (no __init__.py): the C/CUDA sources, the Grafana dashboard.
DATA_ONLY = {"ucm.native": "native", "ucm.tools.grafana": "tools/grafana"}


@pytest.fixture(scope="module")
def dist() -> dict:
    pytest.importorskip("setuptools")
    done = subprocess.run([sys.executable, "-c", CONFIG], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def source_dir(package: str, package_dir: dict[str, str]) -> Path:
    """Where setuptools takes `package` from: the longest package-dir prefix that maps it."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in package_dir:
            return ROOT / package_dir[prefix] / Path(*parts[n:])
    return ROOT / package_dir.get("", ".") / Path(*parts)


def packages_in(directory: Path, name: str) -> set[str]:
    return {".".join([name, *init.parent.relative_to(directory).parts])
            for init in directory.rglob("__init__.py")}


def test_every_package_directory_is_in_the_distribution(dist):
    found = set(dist["packages"])
    tree = packages_in(ROOT / "ucm", "ucm") | packages_in(ROOT / "tools", "ucm.tools")
    assert "ucm.drivers.kit" in tree and "ucm.codecs" in tree  # the walk sees nested packages
    assert sorted(tree - found) == []


def test_every_listed_package_is_a_directory_of_the_tree(dist):
    for package in dist["packages"]:
        where = source_dir(package, dist["package_dir"])
        assert where.is_dir(), f"{package} -> {where} is not a directory"
        assert (where / "__init__.py").exists() or package in DATA_ONLY, package


def test_no_directory_of_modules_lacks_an_init(dist):
    # find_packages skips a directory without __init__.py: its modules would not ship
    bare = [str(d.relative_to(ROOT)) for top in ("ucm", "tools") for d in (ROOT / top).rglob("*")
            if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
            and not (d / "__init__.py").exists()]
    assert bare == []


@pytest.mark.parametrize(("package", "directory"), DATA_ONLY.items())
def test_data_files_are_package_data(dist, package, directory):
    assert package in dist["packages"]
    assert source_dir(package, dist["package_dir"]) == ROOT / directory
    patterns = dist["package_data"].get(package, [])
    files = [p.relative_to(source_dir(package, dist["package_dir"])).as_posix()
             for p in (ROOT / directory).iterdir() if p.is_file()]
    assert files
    missing = [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert missing == []
