"""What may import what (DESIGN.md: drivers below the kernel, the kernel below the hook and the
sparse methods; ucm.bench on top of everything), read from the source with `ast`: nothing is
imported, so lazy imports inside functions count as much as those at the top."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "ucm"
PRODUCT = ("kernel", "drivers", "engine", "vllm_hook", "sglang_hook", "sparse", "trace", "ops",
           "__init__.py", "_version.py", "block.py", "config.py", "errors.py")
# A string that is a bench module path: kv_connector_module_path values, import_module names.
BENCH_PATH = re.compile(r"ucm\.bench(\.\w+)*")


def modules(*parts: str) -> list[Path]:
    files = []
    for part in parts:
        path = ROOT / part
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved; a
    `from X import Y` also yields X.Y, since Y may be a module."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and BENCH_PATH.fullmatch(node.value)):
            found.append((node.lineno, node.value))
    return found


def offenders(files: list[Path], banned: tuple[str, ...], root: Path = ROOT) -> list[str]:
    return [f"{path.relative_to(root.parent)}:{line} imports {target}"
            for path in files for line, target in imports(path, root)
            if any(target == b or target.startswith(b + ".") for b in banned)]


def test_the_walk_resolves_relative_imports_and_sees_module_path_strings(tmp_path):
    pkg = tmp_path / "ucm" / "drivers"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("from .. import bench\nfrom ..kernel import Kernel\n"
                              "def f():\n    import ucm.vllm_hook.worker\n"
                              "PATH = 'ucm.bench.null_connector'\n")
    banned = ("ucm.bench", "ucm.kernel", "ucm.vllm_hook")
    assert offenders([pkg / "x.py"], banned, tmp_path / "ucm") == [
        "ucm/drivers/x.py:1 imports ucm.bench",
        "ucm/drivers/x.py:2 imports ucm.kernel",
        "ucm/drivers/x.py:2 imports ucm.kernel.Kernel",
        "ucm/drivers/x.py:4 imports ucm.vllm_hook.worker",
        "ucm/drivers/x.py:5 imports ucm.bench.null_connector",
    ]


def test_every_listed_product_part_exists():
    assert all((ROOT / part).exists() for part in PRODUCT)
    assert len(modules(*PRODUCT)) > 40  # the walk finds the packages' modules


@pytest.mark.parametrize(("parts", "banned"), [
    (PRODUCT, ("ucm.bench", "ucm.cli")),
    (("drivers",), ("ucm.kernel", "ucm.vllm_hook", "ucm.sparse")),
    (("kernel",), ("ucm.vllm_hook", "ucm.sglang_hook", "ucm.engine", "ucm.sparse")),
    # The engine-neutral layer knows no engine: neither their hooks nor the engines.
    (("engine",), ("ucm.vllm_hook", "ucm.sglang_hook", "vllm", "sglang", "torch")),
    (("sglang_hook",), ("ucm.vllm_hook", "vllm")),
    # The payload codecs sit under the block format: ucm.block calls them, never back.
    (("codecs",), ("ucm.block", "ucm.drivers", "ucm.config", "ucm.kernel", "ucm.engine",
                   "ucm.vllm_hook", "ucm.sglang_hook", "ucm.sparse", "ucm.ops")),
], ids=["product-not-bench", "drivers-below-kernel", "kernel-below-hook-and-sparse",
        "engine-layer-knows-no-engine", "sglang-hook-not-vllm", "codecs-below-block"])
def test_imports_run_one_way(parts, banned):
    bad = offenders(modules(*parts), banned)
    assert not bad, "imports against the layering:\n" + "\n".join(bad)
