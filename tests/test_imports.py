"""The import graph of packtool, read from the sources with ``ast`` (every import statement, those inside functions
and under ``if TYPE_CHECKING:`` too): the families and the runtime do not import each other in a cycle, the
runtime imports no family module but through its registry door (:mod:`packtool.runtime.registry`), and nothing
from the build side (:mod:`packtool.packer`)."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The one runtime module that imports the family registry (see its docstring), and the one module it imports.
REGISTRY_DOOR = ("packtool.runtime.registry", "packtool.families")


def package_sources(root: Path = ROOT, package: str = "packtool") -> dict[str, str]:
    """Module name -> source of every module under ``root / package`` (a package's ``__init__`` as the package)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path.read_text()
    return out


def module_imports(sources: Mapping[str, str]) -> dict[str, set[str]]:
    """Module name -> the modules of ``sources`` it imports, wherever the statement stands (module level, inside a
    function or a class, under a condition). ``from P import n`` imports ``P`` and, where ``P.n`` is a module of
    ``sources``, ``P.n`` too; relative imports are resolved against the importing module."""
    known = set(sources)
    graph: dict[str, set[str]] = {}
    for name, source in sources.items():
        is_package = any(other.startswith(name + ".") for other in known)
        base = name.split(".") if is_package else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                stem = ".".join(base[:len(base) - node.level + 1] if node.level else [])
                module = ".".join(p for p in (stem, node.module or "") if p)
                targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                # the module itself, or the nearest enclosing module the sources hold
                parts = target.split(".")
                while parts and ".".join(parts) not in known:
                    parts.pop()
                if parts and ".".join(parts) != name:
                    found.add(".".join(parts))
        graph[name] = found
    return graph


def group(module: str, groups: tuple[str, ...]) -> str:
    """The group (one of ``groups``, a package) that holds ``module``, else the module itself."""
    return next((g for g in groups if module == g or module.startswith(g + ".")), module)


def group_graph(graph: Mapping[str, set[str]], groups: tuple[str, ...],
                skip: tuple[tuple[str, str], ...] = ()) -> dict[str, set[str]]:
    """The import graph between groups (packages): an edge where a module of one imports a module of another,
    leaving out the module edges in ``skip``."""
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        a = group(module, groups)
        for target in targets:
            b = group(target, groups)
            if a != b and (module, target) not in skip:
                out.setdefault(a, set()).add(b)
    return out


def path(graph: Mapping[str, set[str]], start: str, end: str) -> list[str] | None:
    """An import path from ``start`` to ``end`` (breadth first), or None."""
    previous: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        node = queue.pop(0)
        if node == end:
            out = [node]
            while previous[out[-1]] is not None:
                out.append(previous[out[-1]])  # type: ignore[arg-type]
            return out[::-1]
        for nxt in sorted(graph.get(node, ())):
            if nxt not in previous:
                previous[nxt] = node
                queue.append(nxt)
    return None


def cycle_between(graph: Mapping[str, set[str]], a: str, b: str) -> list[str] | None:
    """A cycle through both ``a`` and ``b`` (``a -> … -> b -> … -> a``), or None."""
    there, back = path(graph, a, b), path(graph, b, a)
    return None if there is None or back is None else there + back[1:]


GROUPS = ("packtool.families", "packtool.runtime", "packtool.packer", "packtool.verify", "packtool.media")


def test_the_graph_finds_a_cycle_through_a_function_level_import():
    """The control: a synthetic pair of packages importing each other, one side only inside a function (and one
    relatively), is reported as a cycle; without that import it is not."""
    sources = {
        "pkg": "", "pkg.a": "", "pkg.b": "",
        "pkg.a.x": "from pkg.b.y import helper\n",
        "pkg.b.y": "def helper():\n    from ..a import x\n    return x\n",
        "pkg.b.z": "import os\n",
    }
    graph = module_imports(sources)
    assert graph["pkg.b.y"] == {"pkg.a", "pkg.a.x"}
    groups = ("pkg.a", "pkg.b")
    assert cycle_between(group_graph(graph, groups), "pkg.a", "pkg.b") == ["pkg.a", "pkg.b", "pkg.a"]
    assert cycle_between(group_graph(graph, groups, skip=(("pkg.b.y", "pkg.a"), ("pkg.b.y", "pkg.a.x"))),
                         "pkg.a", "pkg.b") is None
    assert cycle_between(group_graph(module_imports({**sources, "pkg.b.y": "def helper():\n    return 1\n"}),
                                     groups), "pkg.a", "pkg.b") is None


def test_families_and_the_runtime_import_each_other_in_no_cycle():
    """A family's reader code imports the runtime's shared pieces; the runtime imports no family module (not even
    inside a function), only the registry package, from :mod:`packtool.runtime.registry` alone. Without that one
    edge there is no import path from the runtime to the families at all, so no cycle."""
    graph = module_imports(package_sources())
    assert {"packtool.runtime.read", "packtool.families.qwen2_vl.reader", "packtool.runtime.registry"} <= set(graph)
    into_families = sorted((m, t) for m, targets in graph.items() if m.startswith("packtool.runtime")
                           for t in targets if group(t, GROUPS) == "packtool.families")
    assert into_families == [REGISTRY_DOOR]
    groups = group_graph(graph, GROUPS, skip=(REGISTRY_DOOR,))
    assert "packtool.runtime" in groups["packtool.families"]  # the families do use the runtime's shared pieces
    assert cycle_between(groups, "packtool.families", "packtool.runtime") is None
    assert path(groups, "packtool.runtime", "packtool.families") is None
    # The control: the registry door is the edge that would close the cycle.
    assert cycle_between(group_graph(graph, GROUPS), "packtool.families", "packtool.runtime") is not None


def test_the_runtime_imports_nothing_from_the_build_side():
    """No runtime module imports a module of :mod:`packtool.packer`, directly or through the modules it imports
    (the families' imports of it are for type checking, so it is the runtime's own edges that count here)."""
    graph = module_imports(package_sources())
    direct = sorted((m, t) for m, targets in graph.items() if m.startswith("packtool.runtime")
                    for t in targets if t.startswith("packtool.packer"))
    assert direct == []
    # The control: the build side's entry point does import it.
    assert any(t.startswith("packtool.packer") for t in graph["packtool.api"])
