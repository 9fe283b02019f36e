"""Every native/*.cu compiles to PTX with nvcc, so a kernel that does not compile fails CI."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from ucm.ops import kernel_source, native_dir, native_sources

_DEFAULT_NVCC = "/usr/local/bin/nvcc"
NVCC = shutil.which("nvcc") or (_DEFAULT_NVCC if os.path.exists(_DEFAULT_NVCC) else None)
EXPECTED = {"score"}


def test_sources_are_found_next_to_the_package():
    names = {p.stem for p in native_sources()}
    assert names >= EXPECTED, f"missing kernels in {native_dir()}"
    assert 'extern "C"' in kernel_source("score")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH or at /usr/local/bin/nvcc")
@pytest.mark.parametrize("source", native_sources(), ids=lambda p: p.name)
def test_compiles_to_ptx(source, tmp_path):
    out = tmp_path / (source.stem + ".ptx")
    proc = subprocess.run(
        [NVCC, "-ptx", "--std=c++17", "-o", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert ".entry" in out.read_text()
