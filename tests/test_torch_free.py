"""The modules that hold no tensors import no torch: the router, its config and the worker spec start in a process
that never loads torch (a router host needs no CUDA), and the engine's request and scheduler types hold no tensors
either. Each module is imported in a fresh interpreter. (The planner's simulator is not one of them: it runs the real
roles over a real engine whose forward computes nothing, planner/sim_engine.py.)"""

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
)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_no_torch(module: str) -> None:
    probe = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"{module} imports {proc.stdout.strip()}"
