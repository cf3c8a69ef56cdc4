"""Imports point down only: cli → bench, planner → cluster → prefill, decode → worker → engine, transfer.

Why a test and not a convention: an upward import (a worker importing the cluster, a benchmark imported to build the
CLI's parser) makes a cycle, and a cycle is what made ``pdserve status`` import torch and the workers untestable
without the cluster. The check reads every ``.py`` file of the layered packages with ``ast``
(``tests/helpers/imports.py``; nothing is executed), so it sees imports inside functions, ``if TYPE_CHECKING:``
blocks and ``importlib.import_module("...")`` with a literal name too: "not even inside a function"
(``../shared/ARCHITECTURE.md``, Layout).

Rules (a package may import itself and anything in a lower layer):

- layers, top to bottom: cli; bench, planner; cluster; prefill, decode; worker; engine, transfer;
- two packages of one layer never import each other (prefill/decode, engine/transfer, bench/planner);
- nothing imports cli (it is the top layer);
- engine, transfer, worker, prefill and decode never import Ray (they run and are tested without it);
- inside cluster/, wings top to bottom: run (pools, launch, scaling); openai (the HTTP surface); routing (the router
  core); the config modules at cluster/'s top level.
"""

from __future__ import annotations

import pytest

from tests.helpers.imports import ROOT, Import, imports_of, module_name, package_files, resolve_relative

LAYERS: list[tuple[str, ...]] = [  # top first
    ("cli",),
    ("bench", "planner"),
    ("cluster",),
    ("prefill", "decode"),
    ("worker",),
    ("engine", "transfer"),
]
LEVEL = {package: len(LAYERS) - i for i, layer in enumerate(LAYERS) for package in layer}
NO_RAY = ("engine", "transfer", "worker", "prefill", "decode")
FORBIDDEN_EXTERNAL = {package: ("ray",) for package in NO_RAY}


def violation(importer: str, imp: Import) -> str | None:
    """Why ``importer`` (a top-level package) may not make this import; None when it may."""
    target = imp.module.split(".")[0]
    if target in FORBIDDEN_EXTERNAL.get(importer, ()):
        return f"{importer} must not import {target}"
    if target not in LEVEL or target == importer:
        return None
    if target == "cli":
        return "nothing imports cli"
    if LEVEL[target] == LEVEL[importer]:
        return f"{importer} and {target} are one layer: neither imports the other"
    if LEVEL[target] > LEVEL[importer]:
        return f"{importer} imports {target}, a layer above it"
    return None


CLUSTER_WINGS = ["run", "openai", "routing", ""]  # top first; "": cluster/config*.py and network_exposure.py
WING_LEVEL = {wing: len(CLUSTER_WINGS) - i for i, wing in enumerate(CLUSTER_WINGS)}


def wing_of(module: str) -> str | None:
    """The cluster wing a module name is in ("" for the top level), None outside cluster/."""
    parts = module.split(".")
    if parts[0] != "cluster":
        return None
    return parts[1] if len(parts) > 2 and parts[1] in WING_LEVEL else ""


def wing_violation(importer_module: str, imp: Import) -> str | None:
    """Why a cluster module may not import another cluster module (a wing above its own); None when it may."""
    mine, theirs = wing_of(importer_module), wing_of(imp.module)
    if mine is None or theirs is None or mine == theirs or imp.module == "cluster":
        return None
    if WING_LEVEL[theirs] > WING_LEVEL[mine]:
        return f"cluster/{mine or '(top)'} imports cluster/{theirs or '(top)'}, a wing above it"
    return None


def all_violations() -> list[str]:
    problems = []
    for package in LEVEL:
        for path in package_files(package):
            for imp in imports_of(path):
                why = violation(package, imp) or (
                    wing_violation(module_name(path), imp) if package == "cluster" else None
                )
                if why:
                    problems.append(f"{imp}  ({why})")
    return sorted(set(problems))


# ---- the rule itself ----------------------------------------------------------------------------------------------


def test_imports_point_down_only():
    problems = all_violations()
    assert not problems, "imports that break the layering:\n" + "\n".join(problems)


def test_the_check_reads_every_layered_package():
    """A layer check that silently scans nothing passes forever: the packages that exist today must be scanned."""
    for package in ("cli", "bench", "cluster", "prefill", "decode", "worker", "engine", "transfer"):
        files = package_files(package)
        assert files, f"{package}/ has no .py file: the layer check would scan nothing there"
        assert any(imports_of(p) for p in files), f"no import found in {package}/: the parser is broken"


# ---- the checker catches what it must (on source written here, not on the tree) --------------------------------


def _violations_in(package: str, source: str) -> list[str]:
    """The checker's findings for ``source`` as if it were the file <package>/probe.py (nothing is written)."""
    found = []
    for imp in imports_of(ROOT / package / "probe.py", source):
        why = violation(package, imp)
        if why:
            found.append(f"{imp}  ({why})")
    return found


@pytest.mark.parametrize(
    ("package", "source", "expected"),
    [
        ("prefill", "from cluster.config import ClusterConfig\n", "prefill imports cluster, a layer above it"),
        ("prefill", "def f():\n    import decode.worker\n", "prefill and decode are one layer"),
        ("engine", "from transfer import wire\n", "engine and transfer are one layer"),
        ("worker", "import ray\n", "worker must not import ray"),
        ("transfer", "def f():\n    from ray import util\n", "transfer must not import ray"),
        ("cluster", "import importlib\nm = importlib.import_module('bench.chaos')\n", "cluster imports bench"),
        ("cluster", "m = __import__('cli.main')\n", "nothing imports cli"),
        ("bench", "from planner import simulate\n", "bench and planner are one layer"),
        (
            "engine",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from worker.runtime import X\n",
            "engine imports worker",
        ),
        ("cluster", "from bench import chaos\n", "cluster imports bench"),
    ],
)
def test_an_upward_import_is_reported_with_file_line_and_statement(package, source, expected):
    found = _violations_in(package, source)
    assert len(found) >= 1 and all(expected in f for f in found), found
    last_line = len(source.rstrip("\n").splitlines())
    assert any(f.startswith(f"{package}/probe.py:") for f in found)
    assert any(f":{line}: " in f for f in found for line in range(1, last_line + 1))


@pytest.mark.parametrize(
    ("package", "source"),
    [
        ("cli", "def run():\n    from bench import engine_bench\n    import cluster.run.serve\n"),
        ("bench", "from cluster.config import load_config\nfrom engine.request import SamplingParams\n"),
        ("cluster", "from prefill.worker import PrefillRole\nimport ray\n"),
        ("decode", "from worker.runtime import WorkerRuntime\nfrom transfer.base import make_receiver\n"),
        ("worker", "from engine.llm_engine import LLMEngine\nfrom transfer.wire import ModelFingerprint\n"),
        ("engine", "from engine.request import Request\nfrom .scheduler import Scheduler\nimport torch\n"),
    ],
)
def test_a_downward_or_own_import_passes(package, source):
    assert _violations_in(package, source) == []


def test_relative_imports_are_resolved_against_the_file():
    assert resolve_relative(ROOT / "prefill" / "worker.py", 1, "x") == "prefill.x"
    assert resolve_relative(ROOT / "bench" / "loadtest" / "cli.py", 2, "chaos") == "bench.chaos"
    assert resolve_relative(ROOT / "bench" / "loadtest" / "__init__.py", 1, "cli") == "bench.loadtest.cli"
    assert resolve_relative(ROOT / "prefill" / "worker.py", 2, "cluster") == "cluster"


@pytest.mark.parametrize(
    ("importer", "module", "allowed"),
    [
        ("cluster.run.launch", "cluster.openai.api", True),
        ("cluster.openai.api", "cluster.routing.router", True),
        ("cluster.routing.core", "cluster.config", True),
        ("cluster.routing.router", "cluster.openai.choices", False),
        ("cluster.openai.api", "cluster.run.scaling", False),
        ("cluster.config", "cluster.routing.errors", False),
    ],
)
def test_cluster_wings_import_downward_only(importer, module, allowed):
    imp = Import(ROOT / "cluster" / "probe.py", 1, module, f"import {module}")
    assert (wing_violation(importer, imp) is None) is allowed
