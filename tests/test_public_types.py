"""The public API type-checks as callers use it: `mypy --strict` over the README's kernel
snippet, with the names it leaves undefined given the types a caller has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What the README's snippet uses but does not define, typed as a caller would have it.
PREAMBLE = """\
key: bytes = b"k" * 16
keys: list[bytes] = [key]
block_bytes: bytes = bytes(64)
views: list[memoryview] = [memoryview(bytearray(64))]
"""

# Other shapes callers pass: tuples, bytearrays, Scatters; the fields stay normalized tuples.
MORE_CALLS = """\
from ucm.block import Scatter
from ucm.kernel import Delete, Prefetch, Unpin

Load((key,), buffers=[bytearray(64)], deadline=1.0, request_id="r")
Load(keys, buffers=[Scatter([bytearray(32), bytearray(32)])])
Store(keys, buffers=(memoryview(block_bytes),), durability="all")
Prefetch(keys, block_bytes=64)
Delete(keys)
Unpin(keys)
stored_keys: tuple[bytes, ...] = Store(keys, buffers=[block_bytes]).keys
load_views: tuple[memoryview | Scatter, ...] = Load(keys, buffers=views).buffers
"""

# A wrong call, so the check cannot pass by resolving ucm to Any.
WRONG = """\
from ucm.kernel import Store

Store([b"k"], buffers=[1])
"""


def _readme_kernel_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"## Using the kernel\n+```python\n(.*?)```", readme, re.S)
    assert found, "README.md has no python block under 'Using the kernel'"
    return found.group(1)


def test_readme_kernel_snippet_passes_mypy_strict(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from mypy import api

    snippet = _readme_kernel_snippet()
    assert "Store(" in snippet and "Load(" in snippet, snippet
    lines = snippet.splitlines(keepends=True)
    imports = "".join(line for line in lines if line.startswith(("from ", "import ")))
    body = "".join(line for line in lines if not line.startswith(("from ", "import ")))
    good = tmp_path / "readme_kernel.py"
    good.write_text(imports + PREAMBLE + body + MORE_CALLS)
    wrong = tmp_path / "wrong_buffer.py"
    wrong.write_text(WRONG)

    monkeypatch.chdir(ROOT)  # this checkout's ucm, not an installed one
    stdout, stderr, status = api.run([
        "--config-file", str(ROOT / "pyproject.toml"), "--strict",
        "--cache-dir", str(tmp_path / "cache"), "--no-error-summary",
        str(good), str(wrong)])

    errors = [line for line in stdout.splitlines() if ": error:" in line]
    assert not [e for e in errors if "readme_kernel.py" in e], stdout + stderr
    assert [e for e in errors if "wrong_buffer.py:3:" in e and "incompatible type" in e], (
        "mypy did not reject Store(buffers=[1]):\n" + stdout + stderr)
    assert status == 1, stdout + stderr
