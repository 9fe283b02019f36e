"""No circles in the house: no module of ucm/ (or tools/, shipped as ucm.tools) imports a module
that imports it back, directly or through others. Read from the source with `ast`
(test_layering's walk), so imports inside functions and under `if TYPE_CHECKING:` are edges too:
a lazy or type-only import still ties the two modules together.

An edge goes to the module an import names: `from ucm.kernel._core import KernelCore` to
ucm.kernel._core, `from ucm.kernel import Kernel` to ucm.kernel's `__init__`. The parent
packages Python runs first are not edges (else every package whose `__init__` imports its
submodules would be a circle). That leaves one way to close a circle through a package, and
test_no_module_imports_its_own_package forbids it: a module never imports a name from the
`__init__` of a package that holds it; it imports the submodule that defines the name
(docs/architecture.md, "Layers")."""

from __future__ import annotations

from test_layering import ROOT, module_imports, source_modules


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}, for the source
    modules (compiled ones and other packages import nothing of ucm)."""
    found = source_modules()
    known = set(found)
    graph: dict[str, dict[str, int]] = {name: {} for name in found}
    for name, path in found.items():
        for line, target, _ in module_imports(path, name, known):
            if target in known and target != name:
                graph[name].setdefault(target, line)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without
    recursion), each sorted; sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    members = set(component)
    paths = source_modules()
    edges = [f"    {a} ({paths[a].relative_to(ROOT.parent)}:{line}) imports {b}"
             for a in component for b, line in sorted(graph[a].items()) if b in members]
    return " <-> ".join(component) + "\n" + "\n".join(edges)


def test_circles_are_found_through_lazy_and_type_only_imports():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"e": 1},
             "f": {"g": 1}, "g": {"f": 1}}
    assert circles(graph) == [["a", "b", "c"], ["f", "g"]]


def test_the_graph_holds_every_module_and_the_imports_inside_functions():
    graph = import_graph()
    assert len(graph) > 100
    assert "ucm.tools.trace_cli" in graph  # tools/, as shipped
    # ucm.cli dispatches to the benchmarks inside main(): an edge all the same
    assert "ucm.bench.command" in graph["ucm.cli"]


def test_no_module_imports_a_module_that_imports_it():
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(describe(c, graph) for c in found)


def test_no_module_imports_its_own_package():
    """A module imports the sibling that defines a name, never its package's `__init__` (which
    may import the module back: a circle through the package)."""
    graph = import_graph()
    bad = [f"{name} imports {target} (line {line}), a package that holds it"
           for name, targets in graph.items() for target, line in targets.items()
           if name.startswith(target + ".")]
    assert not bad, "\n".join(bad)

