"""transfer/'s seams, read with ``ast`` (tests/helpers/imports.py; nothing is run): a payload path knows its endpoint
only through transfer/path.py's SendHost / ReceiveHost, never an endpoint's module or private attributes, and no
import circle runs through transfer/ but the backend registry's (transfer/base.py imports a backend once chosen)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.imports import imports_of, module_name, package_files

FILES = {module_name(p): p for p in package_files("transfer")}
PATHS = sorted(p for p in FILES.values() if p.name.endswith("_path.py"))
# the modules a path works with, which must not reach into the endpoints either
SEAM = [*PATHS, FILES["transfer.path"], FILES["transfer.handshake"]]
ENDPOINTS = {"transfer.base", "transfer.sender", "transfer.receiver", "transfer.local_backend"}
REGISTRY = {"make_sender", "make_receiver"}  # transfer/base.py: imports the chosen backend's module


def test_every_payload_path_is_checked() -> None:
    assert {p.name for p in PATHS} == {"inline_path.py", "ring_path.py", "pair_path.py", "direct_path.py"}


def test_no_payload_path_imports_an_endpoint() -> None:
    bad = [str(imp) for path in SEAM for imp in imports_of(path) if imp.module in ENDPOINTS]
    assert not bad, "a path (or the handshake) imports an endpoint's module:\n" + "\n".join(bad)


def other_objects_privates(path: Path) -> list[str]:
    """Every ``x._name`` where x is not ``self`` or ``cls``: a private attribute of another object."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_payload_path_reads_another_objects_privates() -> None:
    bad = [line for path in SEAM for line in other_objects_privates(path)]
    assert not bad, "reads of another object's private attributes:\n" + "\n".join(bad)


def test_the_private_read_check_sees_one(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f(receiver, self):\n    receiver._table.complete()\n    self._ok()\n")
    assert other_objects_privates(probe) == ["probe.py:2: receiver._table"]


def registry_imports(path: Path) -> set[int]:
    """Lines of the imports inside make_sender / make_receiver."""
    tree = ast.parse(path.read_text())
    return {
        node.lineno
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef) and function.name in REGISTRY
        for node in ast.walk(function)
        if isinstance(node, ast.Import | ast.ImportFrom)
    }


def import_graph(skip_registry: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in FILES}
    for name, path in FILES.items():
        lazy = registry_imports(path) if skip_registry and name == "transfer.base" else set()
        graph[name] = {imp.module for imp in imports_of(path) if imp.module in FILES and imp.line not in lazy}
        graph[name].discard(name)
    return graph


def circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of the graph ([] when there is none)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_import_circle_but_the_backend_registry() -> None:
    assert circle(import_graph(skip_registry=True)) == [], "an import circle inside transfer/"
    assert circle(import_graph(skip_registry=False)), "the check must see the registry's own circle"
