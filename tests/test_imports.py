"""The import graph of packtool, read from the sources with ``ast`` (every import statement, those inside functions
and under ``if TYPE_CHECKING:`` too): the families and the runtime do not import each other in a cycle, the
runtime imports no family module but through its registry door (:mod:`packtool.runtime.registry`), and nothing
from the build side (:mod:`packtool.packer`)."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def test_no_cycle_between_packages_and_the_reader_stands_below_the_runtime():
    """No import cycle spans two of packtool's packages (nor the reader kit), counting every import wherever it
    stands (inside a function, under ``TYPE_CHECKING``), with no edge exempted. The direction is one way: the
    runtime reaches the families only through :mod:`packtool.runtime.registry`; the families import nothing of
    the runtime (their readers stand on :mod:`packtool.readkit`); the reader kit imports only the format, the
    media decoders, the errors and the media part (:mod:`packtool.mediapart`, which imports nothing of packtool).
    The control: the one import the families' readers used to make of the runtime (``vision_media`` from
    ``packtool.runtime.read``), put back, closes a cycle the test sees."""
    groups = (*GROUPS, "packtool.readkit")
    sources = package_sources()
    graph = module_imports(sources)
    assert {"packtool.runtime.read", "packtool.families.qwen2_vl.reader", "packtool.readkit"} <= set(graph)
    packages = group_graph(graph, groups)
    cycles = [(a, b) for i, a in enumerate(groups) for b in groups[i + 1:] if cycle_between(packages, a, b)]
    assert cycles == []
    into_families = sorted((m, t) for m, targets in graph.items() if m.startswith("packtool.runtime")
                           for t in targets if group(t, groups) == "packtool.families")
    assert into_families == [("packtool.runtime.registry", "packtool.families")]
    assert not [t for t in packages["packtool.families"] if t == "packtool.runtime"]
    assert graph["packtool.readkit"] <= {"packtool.format", "packtool.errors", "packtool.media",
                                         "packtool.media.image", "packtool.media.video", "packtool.mediapart"}
    assert graph["packtool.mediapart"] == set()  # a batch's media part: below the families' readers and the kit
    assert path(packages, "packtool.runtime", "packtool.readkit") is not None  # the runtime uses the kit too
    back = dict(sources)
    back["packtool.families.qwen3_vl.reader"] += "\ndef _x():\n    from packtool.runtime.read import pack_to_batch\n"
    again = group_graph(module_imports(back), groups)
    assert cycle_between(again, "packtool.families", "packtool.runtime") is not None


def test_the_format_stands_below_everything():
    """The format package (the contract) imports nothing of packtool but its own modules and the commit, storage and
    error modules, so every side may stand on it. The control: a format module importing a family is seen."""
    floor = {"packtool.commit", "packtool.storage", "packtool.errors"}
    sources = package_sources()
    graph = module_imports(sources)
    mine = {m for m in graph if m == "packtool.format" or m.startswith("packtool.format.")}
    assert {"packtool.format.record", "packtool.format.metadata"} <= mine
    above = sorted((m, t) for m in mine for t in graph[m] if t not in mine and t not in floor)
    assert above == []
    back = dict(sources)
    back["packtool.format.record"] += "\ndef _x():\n    from packtool.families import registered\n"
    graph = module_imports(back)
    assert any(t.startswith("packtool.families") for t in graph["packtool.format.record"])


def test_the_runtime_imports_nothing_from_the_build_side():
    """No runtime module imports a module of :mod:`packtool.packer`, directly or through the modules it imports
    (the families' imports of it are for type checking, so it is the runtime's own edges that count here)."""
    graph = module_imports(package_sources())
    direct = sorted((m, t) for m, targets in graph.items() if m.startswith("packtool.runtime")
                    for t in targets if t.startswith("packtool.packer"))
    assert direct == []
    # The control: the build side's entry point does import it.
    assert any(t.startswith("packtool.packer") for t in graph["packtool.api"])
