"""cluster/config.py's ``if TYPE_CHECKING`` view of the sections create_model builds names the fields each borrows:
neither a field mypy cannot see nor one mypy sees that the section lacks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cluster import config

SOURCE = Path(config.__file__).read_text()


def _typed_views() -> dict[str, set[str]]:
    """Class name -> the names assigned in its body, for the classes declared under ``if TYPE_CHECKING``."""
    views = {}
    for node in ast.parse(SOURCE).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for item in node.body:
                if isinstance(item, ast.ClassDef):
                    views[item.name] = {
                        target.id
                        for statement in item.body
                        if isinstance(statement, ast.Assign)
                        for target in statement.targets
                        if isinstance(target, ast.Name)
                    }
    return views


@pytest.mark.parametrize("name", ["ModelSection", "PoolSection", "TransferSection", "RouterSection"])
def test_typed_view_names_the_borrowed_fields(name):
    section = getattr(config, name)
    (base,) = section.__bases__
    borrowed = set(section.model_fields) - set(base.model_fields)
    assert _typed_views()[name] == borrowed
