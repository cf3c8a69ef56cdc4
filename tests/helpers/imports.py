"""Reading a file's imports without running it: every ``import``, wherever it is, as absolute module names.

``ast`` sees what executing a module would hide: imports inside functions and ``if TYPE_CHECKING:`` blocks, relative
imports (resolved against the file's place in the tree) and ``importlib.import_module("...")`` /
``__import__("...")`` with a literal name. Used by ``tests/test_layers.py`` and the load tester's import check.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository: module names are relative to it


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    module: str  # the absolute dotted name imported
    source: str  # the statement as written

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.source}"


def package_files(package: str) -> list[Path]:
    folder = ROOT / package
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts) if folder.is_dir() else []


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve_relative(path: Path, level: int, module: str | None) -> str:
    """``from ..x import y`` in ``path``: the absolute name of ``..x``."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()  # a module's relative imports start from its package
    base = package[: len(package) - (level - 1)] if level > 1 else package
    return ".".join([*base, module] if module else base)


def _literal_import(call: ast.Call) -> str | None:
    """The module named by ``importlib.import_module("m")``, ``import_module("m")`` or ``__import__("m")``."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not call.args:
        return None
    first = call.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def imports_of(path: Path, source: str | None = None) -> list[Import]:
    """Every import in one file (``source``: its text, read from ``path`` when not given), wherever it is: module
    level, functions, classes, conditionals."""
    source = path.read_text() if source is None else source
    tree = ast.parse(source, filename=str(path))
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(path, node.lineno, alias.name, _first_line(source, node)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = resolve_relative(path, node.level, node.module) if node.level else node.module or ""
            text = _first_line(source, node)
            found.append(Import(path, node.lineno, base, text))
            # `from bench import engine_bench` imports the module bench.engine_bench: check the full name too
            found += [
                Import(path, node.lineno, f"{base}.{alias.name}", text) for alias in node.names if alias.name != "*"
            ]
        elif isinstance(node, ast.Call) and (name := _literal_import(node)) is not None:
            found.append(Import(path, node.lineno, name, _first_line(source, node)))
    return found


def _first_line(source: str, node: ast.AST) -> str:
    return (ast.get_source_segment(source, node) or "").split("\n")[0]
