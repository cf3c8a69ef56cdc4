"""Shared fixtures: tiny deterministic models (built once per session), the default model, and leak checks."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

_SESSION_CACHE: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Each run keeps its compiled decode steps in a cache of its own, as on a clean machine: entries an earlier run
    (of other code, or interrupted) left in the machine's cache must not decide what a test sees. The converted
    models are shared with the machine's cache (converted once per machine). Set here, before any worker process
    starts, so that every process of the run reads the same folder."""
    global _SESSION_CACHE
    machine = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
    (machine / "models").mkdir(parents=True, exist_ok=True)
    _SESSION_CACHE = Path(tempfile.mkdtemp(prefix="pdserve-test-cache-"))
    (_SESSION_CACHE / "models").symlink_to(machine / "models", target_is_directory=True)
    os.environ["PDSERVE_CACHE"] = str(_SESSION_CACHE)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION_CACHE is not None:
        _stop_background_compiles(_SESSION_CACHE)
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def _stop_background_compiles(cache: Path) -> None:
    """End the background compiles this run's workers left (engine/detached.py: they outlive their workers, to keep
    a step for the next start, which for a test run's own cache never comes): found by the cache they write to."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"engine.background_compile" not in (proc / "cmdline").read_bytes():
                continue
            if f"PDSERVE_CACHE={cache}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGTERM)
        except OSError:
            continue  # gone meanwhile, or not ours to read


def _tiny_model(tmp_path_factory, arch: str) -> Path:
    from engine.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> Path:
    return _tiny_model(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory) -> Path:
    return _tiny_model(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_mistral_path(tmp_path_factory) -> Path:
    return _tiny_model(tmp_path_factory, "mistral")


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory) -> Path:
    return _tiny_model(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The default model's converted folder (converted on first use into $PDSERVE_CACHE)."""
    from engine.model_loader import DEFAULT_MODEL, resolve_model_path

    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def ray_local():
    """A fresh local Ray for one test module, on loopback (never attaching to another cluster on the machine)."""
    import ray

    from cluster.run.ray_cluster import init_local_ray

    if ray.is_initialized():
        ray.shutdown()
    init_local_ray(4, f"pdserve-test-{uuid.uuid4().hex[:8]}")
    yield
    ray.shutdown()
