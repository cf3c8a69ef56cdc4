"""The modules that hold no tensors import no torch: the router, its config, the worker spec and the planner's
simulator start in a process that never loads torch (a router host needs no CUDA), and the engine's request and
scheduler types are what the planner simulates with. Each module is imported in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.imports import ROOT

TORCH_FREE = (
    "engine.request",
    "engine.scheduler",
    "transfer.config",
    "worker.messages",
    "worker.spec",
    "cluster.config",
    "cluster.routing.core",
    "planner.simulator",
)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_no_torch(module: str) -> None:
    probe = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"{module} imports {proc.stdout.strip()}"
