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
- inside cluster/, wings top to bottom: sim (the protocol's seeded simulation); run (pools, launch, scaling); openai (the HTTP surface); routing (the router
  core); the config modules at cluster/'s top level;
- benchmarks/ (the experiments) and checks/ (the GPU acceptance run) are folders of the checkout, not packaged: they
  may import any package, not each other, and no package imports them, by statement or by a module name in a
  string, with one exception: cli/main.py's ``_experiment``, the ``pdserve bench <experiment>`` entry, which imports
  ``benchmarks.<module>`` by name when that subcommand runs.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

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
UNPACKAGED = ("benchmarks", "checks")  # top-level folders of the checkout that pyproject.toml does not package
# the product's one reference to them: the experiments' registry entry, which builds "benchmarks.<module>"
EXPERIMENT_ENTRY = ("cli/main.py", "_experiment")


def violation(importer: str, imp: Import) -> str | None:
    """Why ``importer`` (a top-level package or unpackaged folder) may not make this import; None when it may."""
    target = imp.module.split(".")[0]
    if target in FORBIDDEN_EXTERNAL.get(importer, ()):
        return f"{importer} must not import {target}"
    if target in UNPACKAGED and target != importer:
        if importer in UNPACKAGED:
            return f"{importer} and {target} are unpackaged folders: neither imports the other"
        return f"{importer} imports {target}, which is not packaged (only cli/main.py's _experiment may, by name)"
    if importer in UNPACKAGED:
        return None  # the experiments and checks may import anything in the product
    if target not in LEVEL or target == importer:
        return None
    if target == "cli":
        return "nothing imports cli"
    if LEVEL[target] == LEVEL[importer]:
        return f"{importer} and {target} are one layer: neither imports the other"
    if LEVEL[target] > LEVEL[importer]:
        return f"{importer} imports {target}, a layer above it"
    return None


# top first; "": cluster/config*.py and network_exposure.py. sim: the protocol's simulation (the router core and the
# roles in simulated time), which nothing of the cluster imports
CLUSTER_WINGS = ["sim", "run", "openai", "routing", ""]
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
    for package in [*LEVEL, *UNPACKAGED]:
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
    for package in ("cli", "bench", "cluster", "prefill", "decode", "worker", "engine", "transfer", *UNPACKAGED):
        files = package_files(package)
        assert files, f"{package}/ has no .py file: the layer check would scan nothing there"
        assert any(imports_of(p) for p in files), f"no import found in {package}/: the parser is broken"


NAMED_UNPACKAGED = re.compile(rf"^({'|'.join(UNPACKAGED)})(\.[\w.]*)?$")


def names_of_unpackaged_modules(path: Path, source: str | None = None) -> list[tuple[int, str, str]]:
    """(line, the string, the function it is in) for every string constant in a file that names a module of an
    unpackaged folder (``"benchmarks.chaos"``, or ``f"benchmarks.{name}"``'s head): an import no statement shows."""
    tree = ast.parse(path.read_text() if source is None else source)
    functions = {
        node: node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    found = []
    for function, name in [*functions.items(), (tree, "")]:
        for node in ast.walk(function):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAMED_UNPACKAGED.match(node.value):
                found.append((node.lineno, node.value, name))
    # a string inside a function is found there and again from the module: keep the innermost function's name
    innermost: dict[tuple[int, str], str] = {}
    for line, value, name in found:
        innermost[(line, value)] = innermost.get((line, value)) or name
    return sorted((line, value, name) for (line, value), name in innermost.items())


def test_no_package_names_the_unpackaged_folders_but_the_experiments_entry():
    """The imports by name the statement check cannot see: a module name built in a string. Only the CLI's entry for
    the experiments builds one, and only of benchmarks/ (so `pdserve --help` and the product's packages work from an
    installed wheel, which holds neither folder)."""
    named = {
        str(path.relative_to(ROOT)): names
        for package in LEVEL
        for path in package_files(package)
        if (names := names_of_unpackaged_modules(path))
    }
    where, function = EXPERIMENT_ENTRY
    assert set(named) == {where}, named
    assert named[where] and all(
        value.split(".")[0] == "benchmarks" and name == function for _, value, name in named[where]
    )


def test_the_unpackaged_folders_are_left_out_of_the_package():
    # [tool.setuptools.packages.find]'s include list: a TOML list of strings reads as a Python one (3.10 has no tomllib)
    found = re.search(
        r"^\[tool\.setuptools\.packages\.find\]\ninclude = (\[[^\]]*\])", (ROOT / "pyproject.toml").read_text(), re.M
    )
    assert found, "pyproject.toml: no [tool.setuptools.packages.find] include list"
    patterns = ast.literal_eval(found.group(1))
    for folder in UNPACKAGED:
        assert (ROOT / folder / "__init__.py").is_file()  # `python -m benchmarks.<module>` from the root
        for name in (folder, f"{folder}.gpu", f"{folder}.chaos"):
            assert not any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns), (name, patterns)
    assert any(fnmatch.fnmatchcase("bench.loadtest", pattern) for pattern in patterns)  # the load tester is


def test_a_module_name_in_a_string_is_found_with_its_function():
    source = (
        "import importlib\n"
        "A = 'benchmarks.chaos'\n"
        "def load(name):\n"
        "    return importlib.import_module(f'checks.{name}')\n"
        "HELP = 'see benchmarks/chaos.py or python -m benchmarks.chaos'\n"
    )
    found = names_of_unpackaged_modules(ROOT / "cli" / "probe.py", source)
    assert found == [(2, "benchmarks.chaos", ""), (4, "checks.", "load")]


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
        ("bench", "from benchmarks import chaos\n", "bench imports benchmarks, which is not packaged"),
        ("cli", "def run():\n    import benchmarks.chaos\n", "cli imports benchmarks, which is not packaged"),
        ("engine", "def f():\n    from checks.gpu import gpu_check\n", "engine imports checks, which is not packaged"),
        ("checks", "from benchmarks.options import main\n", "checks and benchmarks are unpackaged folders"),
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
        ("benchmarks", "from cluster.config import load_config\nfrom bench.engine_bench import interleaved_medians\n"),
        ("benchmarks", "from engine.tp_launch import run_ranks\nfrom cli.main import build_parser\nimport ray\n"),
        ("checks", "from engine.llm_engine import LLMEngine\nfrom checks.gpu.gpu_check_time import Deadline\n"),
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
