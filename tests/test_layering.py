"""What may import what (docs/architecture.md, "Layers": foundations, drivers and config, the
kernel, clients and tools, benchmarks; each layer imports only the layers below it), read from
the source with `ast`: nothing is imported, so lazy imports inside functions and imports under
`if TYPE_CHECKING:` count as much as those at the top. tests/test_import_cycles.py builds its
import graph with the same walk."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent / "ucm"
TOOLS = ROOT.parent / "tools"  # shipped inside the package as ucm.tools
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"
PRODUCT = ("kernel", "drivers", "engine", "vllm_hook", "sglang_hook", "sparse", "trace", "ops",
           "codecs", "autotune", "testing", "__init__.py", "_version.py", "block.py",
           "config.py", "errors.py", "proxy")
# A string that is a bench module path: kv_connector_module_path values, import_module names.
BENCH_PATH = re.compile(r"ucm\.bench(\.\w+)*")

# docs/architecture.md's Layers table: the packages and modules of each layer (the compiled
# ucm._hostcopy, ucm._kvcodec and ucm._mrcsim included).
# test_the_table_of_layers_is_the_documented_one holds the two together.
LAYERS: dict[int, tuple[str, ...]] = {
    1: ("ucm", "ucm._version", "ucm.errors", "ucm.block", "ucm.codecs", "ucm.ops",
        "ucm._hostcopy", "ucm._kvcodec", "ucm._mrcsim"),
    2: ("ucm.drivers", "ucm.config"),
    3: ("ucm.kernel", "ucm.trace"),
    4: ("ucm.engine", "ucm.vllm_hook", "ucm.sglang_hook", "ucm.autotune", "ucm.sparse",
        "ucm.testing", "ucm.proxy", "ucm.cli", "ucm.tools"),
    5: ("ucm.bench",),
}
# The one import that runs up a layer: the `ucm` command dispatches to the benchmarks, lazily
# (inside a function), so that `ucm --help` imports none of them.
LAZY_UPWARD = {("ucm.cli", "ucm.bench")}


class Import(NamedTuple):
    line: int
    target: str  # the module, or for `from X import Y` the module X.Y when Y is one, else X
    lazy: bool  # inside a function: runs when called, not at import


def modules(*parts: str) -> list[Path]:
    files = []
    for part in parts:
        path = ROOT / part
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def module_name(path: Path, root: Path, prefix: tuple[str, ...] | None = None) -> str:
    """The dotted name of a source file under `root` (root's own name first, or `prefix`)."""
    if prefix is None:
        rel = path.relative_to(root.parent).with_suffix("")
    else:
        rel = Path(*prefix, path.relative_to(root).with_suffix(""))
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def source_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the product by dotted name: ucm/ and tools/ (as ucm.tools)."""
    found = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    tools = root.parent / "tools"
    if tools.is_dir():
        found.update((module_name(p, tools, ("ucm", "tools")), p)
                     for p in sorted(tools.rglob("*.py")))
    return found


def _statements(path: Path, name: str) -> Iterator[tuple[ast.AST, bool]]:
    """Each import statement and module-path string of the file, and whether it is inside a
    function."""
    def walk(node: ast.AST, lazy: bool) -> Iterator[tuple[ast.AST, bool]]:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import | ast.ImportFrom | ast.Constant):
                yield child, lazy
            yield from walk(child, inner)

    yield from walk(ast.parse(path.read_text(), str(path)), False)


def _base(node: ast.ImportFrom, path: Path, name: str) -> str:
    """The absolute module a `from ... import` names, relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")
        anchor = anchor[:len(anchor) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return base


def imports(path: Path, root: Path = ROOT, name: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved; a
    `from X import Y` also yields X.Y, since Y may be a module. Strings that are bench module
    paths count as imports of them."""
    name = name or module_name(path, root)
    found = []
    for node, _ in _statements(path, name):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, path, name)
            found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and BENCH_PATH.fullmatch(node.value)):
            found.append((node.lineno, node.value))
    return found


def module_imports(path: Path, name: str, known: set[str]) -> list[Import]:
    """The modules the file imports, as edges of the import graph: `import X` is X, and
    `from X import Y` is X.Y when that is a module in `known`, else X (its `__init__`, which
    defines Y). The packages Python runs first (X's parents) are not edges. Targets outside ucm
    are left out; those inside it but not in `known` (compiled modules) are kept."""
    found = []
    for node, lazy in _statements(path, name):
        if isinstance(node, ast.Import):
            found.extend(Import(node.lineno, alias.name, lazy) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, path, name)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(node.lineno, sub if sub in known else base, lazy))
    return [i for i in found if i.target == "ucm" or i.target.startswith("ucm.")]


def layer_of(module: str) -> int | None:
    for layer, names in LAYERS.items():
        if any(module == n or (n != "ucm" and module.startswith(n + ".")) for n in names):
            return layer
    return None


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


def test_the_graph_walk_names_modules_sees_lazy_and_type_only_imports(tmp_path):
    root = tmp_path / "ucm"
    (root / "kernel").mkdir(parents=True)
    for rel in ("__init__.py", "errors.py", "kernel/__init__.py", "kernel/_core.py",
                "kernel/_tier.py"):
        (root / rel).write_text("")
    (root / "kernel" / "_core.py").write_text(
        "from typing import TYPE_CHECKING\nimport numpy\nfrom . import _tier\n"
        "from ucm.kernel import Kernel\nfrom ucm._hostcopy import hash_copy\n"
        "if TYPE_CHECKING:\n    from ucm.errors import UCMError\n"
        "def f():\n    import ucm.kernel._tier\n")
    known = set(source_modules(root))
    assert known == {"ucm", "ucm.errors", "ucm.kernel", "ucm.kernel._core", "ucm.kernel._tier"}
    assert module_imports(root / "kernel" / "_core.py", "ucm.kernel._core", known) == [
        Import(3, "ucm.kernel._tier", False),
        Import(4, "ucm.kernel", False),  # a name from the package's __init__
        Import(5, "ucm._hostcopy", False),
        Import(7, "ucm.errors", False),
        Import(9, "ucm.kernel._tier", True),
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
    # The simulator keys requests as the engines do, through ucm.engine, not a hook.
    (("autotune",), ("ucm.vllm_hook", "ucm.sglang_hook", "vllm", "sglang")),
    # ucm.cli dispatches to the benchmarks; they never import it back.
    (("bench",), ("ucm.cli",)),
    # The payload codecs sit under the block format: ucm.block calls them, never back.
    (("codecs",), ("ucm.block", "ucm.drivers", "ucm.config", "ucm.kernel", "ucm.engine",
                   "ucm.vllm_hook", "ucm.sglang_hook", "ucm.sparse", "ucm.ops")),
], ids=["product-not-bench", "drivers-below-kernel", "kernel-below-hook-and-sparse",
        "engine-layer-knows-no-engine", "sglang-hook-not-vllm", "autotune-knows-no-hook",
        "bench-not-cli", "codecs-below-block"])
def test_imports_run_one_way(parts, banned):
    bad = offenders(modules(*parts), banned)
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_every_module_has_a_layer():
    missing = sorted(name for name in source_modules() if layer_of(name) is None)
    assert not missing, ("modules in no layer of docs/architecture.md (add their package to "
                         "its table and to LAYERS):\n" + "\n".join(missing))


def test_no_layer_imports_a_higher_one():
    known = set(source_modules())
    bad = []
    for name, path in source_modules().items():
        layer = layer_of(name)
        for line, target, lazy in module_imports(path, name, known):
            above = layer_of(target)
            where = f"{name} ({path.relative_to(ROOT.parent)}:{line}) imports {target}"
            if above is None:
                bad.append(f"{where}, which is in no layer")
            elif layer is not None and above > layer and not (
                    lazy and any(name == low and (target == high or target.startswith(high + "."))
                                 for low, high in LAZY_UPWARD)):
                bad.append(f"{where}: layer {layer} imports layer {above}")
    assert not bad, "imports up the layers:\n" + "\n".join(bad)


def test_the_table_of_layers_is_the_documented_one():
    """docs/architecture.md's Layers table names, row by row, the packages LAYERS holds (each
    backquoted `ucm.NAME...` in a row's modules cell counts as ucm.NAME; the package `ucm`
    itself is the first row's)."""
    rows = re.findall(r"^\| (\d)\. [^|]+\| ([^|]+)\|", ARCHITECTURE.read_text(), re.M)
    documented = {int(n): sorted({".".join(m.split(".")[:2])
                                  for m in re.findall(r"`(ucm(?:\.\w+)+)`", cell)})
                  for n, cell in rows}
    assert documented == {layer: sorted(set(names) - {"ucm"}) for layer, names in LAYERS.items()}
