"""The compiled CPU decode step's artefacts on disk: compiled once per machine, loaded in seconds after that.

One entry per key under ``$PDSERVE_CACHE/compiled/<key>/``:

- ``batch-<n>.bin``: the step compiled ahead of time for batch bucket n (``torch.compile(...).aot_compile``, saved
  with ``save_compiled_function``): loading it skips dynamo's trace, which is most of a warm start otherwise;
- ``inductor/``: inductor's cache while those graphs compiled (their kernels' shared objects), so that a load
  compiles no C++ either;
- ``manifest.json``, written last: the key's fields, the batch sizes held, and every file's sha256.

The key hashes what a graph depends on (``DecodeGraphs.cache_fields``: the model's structure, dtype, the KV cache's
shape, the CPU linears' forms, torch threads, tensor-parallel rank, pdserve's engine source, torch, transformers,
Python, the CPU). The weights' values are inputs of the graph, not part of it, so two models of one shape share an
entry. An entry is trusted only whole: a missing or unreadable manifest, other fields, a listed file missing or with
another hash, or a file the manifest does not list, and the entry is removed and compiled again. One process at a
time holds a key (``locked``): a second worker of the same model waits, then loads what the first compiled.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.cpu_info import cpu_fingerprint
from engine.model_loader import cache_dir

logger = logging.getLogger(__name__)

FORMAT = 1  # the layout above; another format is another key
MANIFEST = "manifest.json"
INDUCTOR = "inductor"
IGNORED = ("locks",)  # inductor's lock files inside its cache: neither read as code nor listed


def store_root() -> Path:
    return cache_dir() / "compiled"


# pdserve's modules a compiled step traces (besides transformers'), and this one: an edit to them is another key
TRACED_SOURCES = (
    "compile_cache.py",
    "decode_graphs.py",
    "model_runner.py",
    "cpu_linear.py",
    "kv_cache.py",
    "tensor_parallel.py",
    "attention",
)


@functools.cache
def source_fingerprint() -> str:
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in TRACED_SOURCES:
        for path in sorted((root / name).rglob("*.py")) if (root / name).is_dir() else [root / name]:
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def runtime_fields() -> dict[str, object]:
    """The software and hardware part of every key."""
    import torch
    import transformers

    return {
        "format": FORMAT,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": cpu_fingerprint(),
        "engine_source": source_fingerprint(),
    }


def model_fingerprint(model: Any) -> str:
    """The model's structure: its config and every parameter's and buffer's name, shape, dtype and strides (not
    their values, which a compiled step reads as inputs)."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "name_or_path")}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.stride()}\n".encode())
    return digest.hexdigest()[:24]


def kept_linear_forms(fields: dict[str, object], root: Path | None = None) -> list[str] | None:
    """The CPU linears' forms an earlier start timed for these fields (engine.cpu_linear), or None. Kept so that a
    compiled step's key stays the same from start to start: timing on a busy machine picks differently each time."""
    path = (root or store_root()) / f"linear-forms-{CompiledStore(fields, root).key}.json"
    try:
        kept = json.loads(path.read_text())
        if kept["fields"] == json.loads(json.dumps(fields, sort_keys=True)):
            return [str(form) for form in kept["forms"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def keep_linear_forms(fields: dict[str, object], forms: list[str], root: Path | None = None) -> None:
    root = root or store_root()
    path = root / f"linear-forms-{CompiledStore(fields, root).key}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"fields": fields, "forms": forms}, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("the CPU linears' forms are not kept in %s: %s", root, exc)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class CompiledStore:
    """One key's entry; every method but ``locked`` expects the caller to hold the lock."""

    def __init__(self, fields: dict[str, object], root: Path | None = None) -> None:
        self.fields = json.loads(json.dumps(fields, sort_keys=True))  # as the manifest will read back
        self.key = hashlib.sha256(json.dumps(self.fields, sort_keys=True).encode()).hexdigest()[:24]
        self.root = root or store_root()
        self.dir = self.root / self.key
        self.inductor_dir = self.dir / INDUCTOR

    def graph_path(self, batch: int) -> Path:
        return self.dir / f"batch-{batch}.bin"

    @contextlib.contextmanager
    def locked(self, wait: bool = True) -> Iterator[None]:
        """Hold the key; ``wait=False``: raise ``BlockingIOError`` at once if another process holds it."""
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / f"{self.key}.lock").open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _files(self) -> dict[str, Path]:
        if not self.dir.is_dir():
            return {}
        return {
            str(path.relative_to(self.dir)): path
            for path in self.dir.rglob("*")
            if path.is_file()
            and path.name != MANIFEST
            and not any(part in IGNORED for part in path.relative_to(self.dir).parts)
        }

    def verified_batches(self) -> set[int]:
        """The batch sizes a whole, untouched entry holds; anything else removes the entry (and returns none)."""
        if not self.dir.exists():
            return set()
        problem = self._problem()
        if problem is None:
            manifest = json.loads((self.dir / MANIFEST).read_text())
            return {int(b) for b in manifest["batches"]}
        logger.warning("compiled decode cache %s is not used (%s): removed, compiling again", self.dir, problem)
        self.clear()
        return set()

    def _problem(self) -> str | None:
        try:
            manifest = json.loads((self.dir / MANIFEST).read_text())
            fields, files, batches = manifest["fields"], manifest["files"], manifest["batches"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"no readable manifest: {exc!r}"
        if fields != self.fields:
            changed = sorted(k for k in set(fields) | set(self.fields) if fields.get(k) != self.fields.get(k))
            return f"made for other {', '.join(changed)}"
        present = self._files()
        if set(present) != set(files):
            return f"files differ from the manifest: {sorted(set(present) ^ set(files))[:3]}"
        for name, digest in files.items():
            if _sha256(present[name]) != digest:
                return f"{name} changed since it was written"
        if not all(isinstance(b, int) and self.graph_path(b).name in files for b in batches):
            return "a batch without its graph"
        return None

    def record(self, batches: set[int]) -> None:
        """Write the manifest of what the entry holds now (the last write of a save)."""
        files = {name: _sha256(path) for name, path in sorted(self._files().items())}
        manifest = {"fields": self.fields, "batches": sorted(batches), "files": files}
        tmp = self.dir / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp, self.dir / MANIFEST)

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
