"""No import circle inside a top-level folder, except the few listed in ``ALLOWED`` with their reason.

The modules of one folder import each other one way. A circle (a strongly connected component of the folder's import
graph with more than one module) means one idea cut across files that reach into each other, whichever import closes
it: imports are read with ``ast`` (tests/helpers/imports.py), so one inside a function or under ``if TYPE_CHECKING:``
counts as much as one at the top. ``tests/test_layers.py`` checks the imports between folders; this file, those
inside one. Importing one's own package (``engine.attention.sdpa`` importing ``engine.attention``) is no edge: the
package runs before its modules anyway.

A registry that imports the implementation chosen by name (a backend's module, once picked) may stay, listed with its
reason; an entry whose circle is gone must leave the list.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.helpers.imports import ROOT, Import, imports_of, module_name, package_files


@dataclass(frozen=True)
class AllowedCircle:
    members: frozenset[str]
    reason: str

    def allows(self, circle: frozenset[str]) -> bool:
        return circle == self.members


ALLOWED = [
    AllowedCircle(
        frozenset(f"transfer.{name}" for name in ("base", "sender", "receiver", "local_backend")),
        "transfer/base.py's backend registry: make_sender / make_receiver import the backend chosen by name, which "
        "imports base.py's interface (tests/transfer/test_structure.py allows exactly that)",
    ),
]


def top_level_folders() -> list[str]:
    return sorted(
        path.name
        for path in ROOT.iterdir()
        if path.is_dir() and not path.name.startswith(".") and package_files(path.name)
    )


def import_graph(files: dict[str, Path], sources: dict[str, str] | None = None) -> dict[str, dict[str, list[Import]]]:
    """module -> {another module of ``files`` it imports -> the imports that do}; ``sources``: text to read instead
    of a module's file."""
    graph: dict[str, dict[str, list[Import]]] = {name: {} for name in files}
    for name, path in files.items():
        for imp in imports_of(path, (sources or {}).get(name)):
            target = imp.module
            while target and target not in files:  # `from engine.attention.batch import X`: the module, not X
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                edge = graph[name].setdefault(target, [])
                if imp.line not in {seen.line for seen in edge}:  # `from m import a, b` names m three times
                    edge.append(imp)
    return graph


def circles(graph: dict[str, dict[str, list[Import]]]) -> list[frozenset[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found, key=sorted)


def describe(circle: frozenset[str], graph: dict[str, dict[str, list[Import]]]) -> str:
    """The circle's members and every import between them, as file:line: statement."""
    lines = [f"{len(circle)} modules: {', '.join(sorted(circle))}"]
    for name in sorted(circle):
        for target in sorted(set(graph[name]) & circle):
            lines += [f"    {imp}" for imp in graph[name][target]]
    return "\n".join(lines)


def tree_circles() -> tuple[list[frozenset[str]], dict[str, dict[str, list[Import]]]]:
    found, whole = [], {}
    for folder in top_level_folders():
        graph = import_graph({module_name(path): path for path in package_files(folder)})
        found += circles(graph)
        whole.update(graph)
    return found, whole


def test_no_import_circle_inside_a_folder_but_the_allowed_ones():
    found, graph = tree_circles()
    unexplained = [circle for circle in found if not any(entry.allows(circle) for entry in ALLOWED)]
    assert not unexplained, "import circles inside a folder (break them, or list one in ALLOWED with why):\n" + (
        "\n".join(describe(circle, graph) for circle in unexplained)
    )
    kept = [entry for entry in ALLOWED if entry.members not in found]
    assert not kept, "circles in ALLOWED that are gone: take them off the list\n" + "\n".join(
        ", ".join(sorted(entry.members)) for entry in kept
    )


def test_each_allowed_circle_is_inside_one_folder_with_its_reason():
    for entry in ALLOWED:
        assert len(entry.members) > 1 and entry.reason, entry
        assert len({name.split(".")[0] for name in entry.members}) == 1, entry


def test_the_check_reads_every_top_level_folder():
    folders = top_level_folders()
    assert {"cli", "cluster", "engine", "transfer", "worker", "tests"} <= set(folders), folders
    assert "docs" not in folders  # no Python there


# ---- the checker finds what it must (on source written here, not on the tree) -----------------------------------


def _circles_of(sources: dict[str, str]) -> list[frozenset[str]]:
    files = {name: ROOT / Path(*name.split(".")).with_suffix(".py") for name in sources}
    return circles(import_graph(files, sources))


def test_a_circle_closed_by_a_type_only_or_a_lazy_import_counts():
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from probe.b import B\n"
    lazy = "def make():\n    from probe import a\n    return a\n"
    assert _circles_of({"probe.a": type_only, "probe.b": lazy, "probe.c": "import probe.a\n"}) == [
        frozenset({"probe.a", "probe.b"})
    ]


def test_a_module_importing_its_own_package_is_no_circle():
    sources = {"probe.pkg": "from probe.pkg.x import X\n", "probe.pkg.x": "from probe.pkg import helpers\n"}
    assert _circles_of({**sources, "probe.pkg.helpers": "X = 1\n"}) == []


def test_a_longer_circle_is_one_component_and_is_described_with_its_imports():
    sources = {"probe.a": "import probe.b\n", "probe.b": "from probe.c import f\n", "probe.c": "from probe import a\n"}
    files = {name: ROOT / Path(*name.split(".")).with_suffix(".py") for name in sources}
    graph = import_graph(files, sources)
    (circle,) = circles(graph)
    assert circle == frozenset(sources)
    text = describe(circle, graph)
    assert text.startswith("3 modules: probe.a, probe.b, probe.c")
    assert "probe/b.py:1: from probe.c import f" in text and "probe/c.py:1: from probe import a" in text
