"""The compiled CPU decode step's artefacts on disk: compiled once per machine, loaded in seconds after that.

One entry per key under ``$PDSERVE_CACHE/compiled/<key>/``:

- ``batch-<n>.bin``: the step compiled ahead of time for batch bucket n (``torch.compile(...).aot_compile``, saved
  with ``save_compiled_function``): loading it skips dynamo's trace, which is most of a warm start otherwise;
- ``inductor/``: inductor's cache while those graphs compiled (their kernels' shared objects), so that a load
  compiles no C++ either;
- ``manifest.json``, written last: the key's fields, the batch sizes held, every file's sha256, and the vector ISAs
  inductor found usable while compiling (``vec_isas``).

The key hashes what a graph depends on (``DecodeGraphs.cache_fields``: the model's structure, dtype, the KV cache's
shape, the CPU linears' forms, torch threads, tensor-parallel rank, pdserve's engine source, torch, transformers,
Python, the CPU). The weights' values are inputs of the graph, not part of it, so two models of one shape share an
entry. An entry is trusted only whole: a missing or unreadable manifest, other fields, a listed file missing or with
another hash, or a file the manifest does not list, and the entry is removed and compiled again. One process at a
time holds a key (``locked``): a second worker of the same model waits, then loads what the first compiled.

A load asks inductor which vector ISA its kernels were built for. Inductor answers by compiling and ``dlopen``-ing a
test library per candidate ISA, each in a Python subprocess: about 1 s of a 2.3-2.7 s load on 2 cores. When the
entry records that every ISA the CPU's flags allow was usable at compile time (same CPU: it is in the key), a load
skips those base probes (``vec_isas_kept``); otherwise it probes, as before. The probes of extensions within an ISA
(AVX-512 BF16, VNNI) run either way: they change the kernels' compile flags, and so their keys.
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
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.cpu_info import cpu_fingerprint
from engine.model_loader import cache_dir

logger = logging.getLogger(__name__)

LOADER_POLL_S = 0.01  # KeptStepLoader.wait_loaded's look interval
LOADER_IDLE_WAIT_S = 1.0  # the loader's wait for the next want() between looks at whether it was closed
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


def vec_isas(probed: bool) -> list[str]:
    """Inductor's vector ISAs for this CPU, best first: ``probed``, those it found usable (each compiled and loaded
    once per process); else those the CPU's flags allow, without a probe. On other than x86 inductor does not probe:
    both are the same list."""
    from torch._inductor import cpu_vec_isa

    if probed or platform.machine() not in ("x86_64", "AMD64"):
        return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    flags = cpu_vec_isa.x86_isa_checker()
    return [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]


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
        manifest = {"fields": self.fields, "batches": sorted(batches), "files": files, "vec_isas": vec_isas(True)}
        tmp = self.dir / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp, self.dir / MANIFEST)

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    @contextlib.contextmanager
    def vec_isas_kept(self) -> Iterator[bool]:
        """Load under this: inductor skips its base probe of each ISA when the entry's compile found every ISA the
        CPU's flags allow usable (yields True), since those probes would find the same here; otherwise it probes
        (False). Its answer is kept for the process either way."""
        try:
            kept = json.loads((self.dir / MANIFEST).read_text()).get("vec_isas")
        except (OSError, ValueError, AttributeError):
            kept = None
        if kept is None or kept != vec_isas(False):
            yield False
            return
        from torch._inductor import config

        with config.patch({"cpp.vec_isa_ok": True}):
            yield True


class KeptStepLoader:
    """Loads an entry's kept steps on a thread of its own, each when its owner first asks for it (``want``): a
    worker serves (eagerly) meanwhile instead of waiting, and loads no size it never meets. The first load imports
    the compiler (1.5-2 s on 2 cores); each graph then links its kernels and builds its guards (about 0.1 s). A load
    holds the GIL for long stretches, so a step running beside one is slower (eager steps of 55 ms took about 130
    while the first load ran): sizes are loaded only when asked for, not all at once. The thread only reads the
    store; the owner installs what ``loaded`` holds between its own steps (a graph's first run writes the owner's
    static inputs). ``verified``: the batch sizes the caller has just verified (``verified_batches``, 0.16 s of
    hashing for seven sizes), not hashed again; None: the first load verifies the entry."""

    def __init__(self, store: CompiledStore, batches: list[int], verified: set[int] | None = None) -> None:
        self.store = store
        self._held = verified
        self.batches = list(batches)
        self.loaded: dict[int, Any] = {}  # batch -> its AOT-compiled function, in the order loaded
        self.seconds: dict[int, float] = {}  # batch -> seconds its load took
        self.error: str | None = None  # why the rest did not load (the entry is gone or damaged)
        self._wanted: list[int] = []  # batch sizes asked for, in order: appended by the owner's thread
        self._asked = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-kept-steps", daemon=True)
        self._thread.start()

    def want(self, batch: int) -> None:
        """A step needs ``batch``'s graph (one of ``batches``): it loads next."""
        if batch not in self._wanted:
            self._wanted.append(batch)
            self._asked.set()

    def wait_loaded(self, batch: int, timeout_s: float) -> bool:
        """Wait until ``batch`` is loaded (True), the loader failed or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while batch not in self.loaded and self.error is None and time.monotonic() < deadline:
            time.sleep(LOADER_POLL_S)
        return batch in self.loaded

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def close(self, timeout_s: float) -> None:
        """Stop after the load under way (waited for up to ``timeout_s``: it holds the entry's lock)."""
        self._closed.set()
        self._asked.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        import torch
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        try:
            while not self._closed.is_set() and len(self.loaded) < len(self.batches):
                batch = next((b for b in list(self._wanted) if b not in self.loaded), None)
                if batch is None:
                    self._asked.wait(LOADER_IDLE_WAIT_S)
                    self._asked.clear()  # a want() since the look above is found by the next look
                    continue
                # under inference mode, as the steps run: a guard built on load compares a tensor's dispatch keys
                # under this thread's modes, and inference mode is per thread. The lock is held per load only: a
                # worker waiting for its next size must not keep another from starting on the entry
                with (
                    torch.inference_mode(),
                    self.store.locked(),
                    temporary_cache_dir(str(self.store.inductor_dir)),
                    self.store.vec_isas_kept(),
                ):
                    if self._held is None:
                        self._held = self.store.verified_batches()
                    if batch not in self._held:
                        raise RuntimeError(f"the entry {self.store.dir} holds no step for batch {batch}")
                    started = time.perf_counter()
                    with self.store.graph_path(batch).open("rb") as f:
                        step = torch.compiler.load_compiled_function(f)
                    self.seconds[batch] = round(time.perf_counter() - started, 3)
                    self.loaded[batch] = step  # one dict store: atomic for the reading thread
        except Exception as exc:  # noqa: BLE001 - the owner stays eager and says why
            self.error = f"{type(exc).__name__}: {exc}"
