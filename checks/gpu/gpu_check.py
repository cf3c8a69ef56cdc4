"""gpu-check: one command that proves the GPU path on a GPU machine, and runs the same code on the CPU in CI.

    python checks/gpu/gpu_check.py --quick --out gpu-check-quick.json  # make gpu-check-quick: the first run, <= 4 min
    python checks/gpu/gpu_check.py --out gpu-check.json                # make gpu-check: everything, <= 8 minutes
    python checks/gpu/gpu_check.py --device cpu --tiny --quick --out x.json  # the same script on a tiny model (CI)

On a machine with two GPUs the run starts with ``tensor_parallel_2`` (checks/gpu/gpu_check_tp.py: one engine at
degree 2 on NCCL, KV hand-offs between degrees 1 and 2), and its budget and hard limit grow by that section's cap;
elsewhere the section only says why it was skipped ("one device", "no CUDA device").

No network, no Ray: random-weight Llama-shaped models built in-process (checks/gpu/gpu_check_models.py), the engine
run directly (checks/gpu/gpu_check_engine.py), a prefill/decode pair over the shm backend (checks/gpu/gpu_check_pd.py).
Each figure is compared with a baseline from the same run; the goals are ratios with pass/fail. Sections run in order
of value under their caps and ``--budget-s``, and the JSON is rewritten atomically to ``--out`` after each, so a cut
run keeps every finished section. A watchdog ends the run at ``--hard-limit-s`` (a compile, a hung kernel): it writes
the last state with the cut section and exits with status 3. A failed section records its error; what the machine
lacks is listed in ``dependencies``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python checks/gpu/gpu_check.py`: make the repository importable, as `-m` would
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from checks.gpu import gpu_check_engine as eng
from checks.gpu import gpu_check_models as models
from checks.gpu import gpu_check_tp as tp
from checks.gpu.gpu_check_kernels import sdpa_kernels
from checks.gpu.gpu_check_pd import run_pair
from checks.gpu.gpu_check_time import Deadline, OutOfTime

MIB = 1024**2
ABORT_STATUS = 3  # the watchdog ended the run

# Section sizes: a GPU run on the real shapes, and the tiny CPU run (CI).
GPU_SIZES: dict[str, Any] = dict(
    exact_prompts=4, exact_prompt_len=64, exact_tokens=32,
    decode_prompt_len=128, decode_tokens=64, batches=[1, 32, 128],
    reps=3, prefill_count=8, prefill_len=2048, kernel_prompt_len=512,
    pd=dict(exact_prompts=4, exact_prompt_len=256, exact_tokens=32, running=32, idle_steps=200, during_steps_max=400,
            long_prompts=3, long_prompt_len=8192, max_model_len=16384, timeout_s=150),
    tp=dict(exact_prompts=4, exact_prompt_len=64, exact_tokens=32, batches=[1, 8], decode_prompt_len=128,
            decode_tokens=64, handoff_prompts=8, handoff_prompt_len=1024, handoff_reps=3),
)  # fmt: skip
TINY_SIZES: dict[str, Any] = dict(
    exact_prompts=2, exact_prompt_len=16, exact_tokens=8,
    decode_prompt_len=16, decode_tokens=6, batches=[1, 4], reps=1,
    prefill_count=2, prefill_len=32, kernel_prompt_len=48,
    pd=dict(exact_prompts=2, exact_prompt_len=40, exact_tokens=6, running=2, idle_steps=8, during_steps_max=64,
            long_prompts=1, long_prompt_len=128, max_model_len=512, timeout_s=150),
    tp=dict(exact_prompts=2, exact_prompt_len=16, exact_tokens=6, batches=[1, 8], decode_prompt_len=16,
            decode_tokens=6, handoff_prompts=2, handoff_prompt_len=64, handoff_reps=2),
)  # fmt: skip
# wall-clock caps per section, seconds (the run's budget bounds them all); the quick run's where they differ
CAPS = dict(
    model=60, exact_float32=45, decode=90, generate_compiled=150, sdpa_kernels=25, prefill_decode_pair=150,
    memory=45, prefill=45, decode_other_backends=150, llama_3_8b=200, tensor_parallel_2=240,
)  # fmt: skip
QUICK_CAPS = dict(generate_compiled=75, prefill_decode_pair=90, decode_other_backends=60, tensor_parallel_2=180)
# tensor_parallel_2's (prefill degree, decode degree) hand-offs, by mode
TP_PAIRS = {"full": [(1, 2), (2, 1), (2, 2)], "quick": [(1, 2), (2, 2)]}
# one H200 in at most 4 minutes, compiles included (the imports before the clock starts take about 10 s)
QUICK_BUDGET_S, QUICK_HARD_S = 200.0, 220.0
FULL_BUDGET_S, FULL_HARD_S = 450.0, 475.0  # at most 8 minutes
GOALS = [  # name, what it divides, target, "ge"/"le"
    ("decode_b1_vs_eager", "1B-shaped bf16 decode tok/s at batch 1: default config / sdpa without CUDA graphs", 3.0,
     "ge"),
    ("decode_b1_vs_generate", "1B-shaped bf16 decode tok/s at batch 1: default config / the faster transformers "
     "generate (eager or compiled static cache)", 2.0, "ge"),
    ("decode_b128_vs_generate", "1B-shaped bf16 decode tok/s at the largest batch (128): default config / the faster "
     "generate", 1.5, "ge"),
    ("prefill_vs_forward", "1B-shaped bf16 prefill tok/s, 8 x 2048: engine / plain transformers forward", 0.8, "ge"),
    ("itl_p99_during_vs_idle", "decode p99 inter-token latency while KV arrives / idle", 1.2, "le"),
]  # fmt: skip
# what the check imports, by import name: the distribution a missing one comes from
DEPENDENCIES = {
    "torch": "torch", "transformers": "transformers", "accelerate": "accelerate", "safetensors": "safetensors",
    "tokenizers": "tokenizers", "numpy": "numpy", "msgpack": "msgpack", "msgspec": "msgspec", "xxhash": "xxhash",
    "zmq": "pyzmq",
    "flashinfer": "flashinfer-python", "flashinfer_cubin": "flashinfer-cubin",
    "flashinfer_jit_cache": "flashinfer-jit-cache",
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-check.json", help="where the JSON object is written (also printed)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and small sizes (the CPU run in CI)")
    ap.add_argument("--quick", action="store_true", help="the first run: the 1B shape, sections in order of value")
    ap.add_argument("--budget-s", type=float, default=None, help="no section runs past this (default: by mode)")
    ap.add_argument("--hard-limit-s", type=float, default=None, help="the watchdog ends the run here")
    ap.add_argument("--skip-8b", action="store_true", help="only the 1B-shaped model (the quick run never has 8B)")
    ap.add_argument(
        "--tensor-parallel-only", action="store_true", help="only tensor_parallel_2 (two GPUs), within its own cap"
    )
    return ap.parse_args(argv)


# ---- the run: sections, the JSON on disk, the watchdog ---------------------------------------------------------


@dataclass
class Run:
    """The result being built, written to ``out`` after every section; the run's deadline; the section running."""

    out: Path
    result: dict[str, Any]
    deadline: Deadline
    sizes: dict[str, Any]
    caps: dict[str, float] = field(default_factory=lambda: dict(CAPS))
    running: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _written: str = ""  # the JSON text last written: what the watchdog writes again
    _start: float = field(default_factory=time.monotonic)

    def section(self, name: str, fn: Callable[[Deadline], Any], into: dict[str, Any] | None = None) -> Any:
        """``fn(deadline)`` as section ``name`` under its cap: an error recorded, not raised; "skipped" past the run's
        deadline. Writes the JSON afterwards."""
        target = self.result if into is None else into
        if self.deadline.passed():
            target[name] = {"error": "skipped: the run's time budget is spent"}
            self.write()
            return None
        deadline = self.deadline.within(self.caps.get(name, 60), name)
        self.running = name
        t0 = time.monotonic()
        try:
            target[name] = fn(deadline)
        except Exception as exc:  # noqa: BLE001 (the JSON says what failed; later sections still run)
            error = f"out of time: {exc}" if isinstance(exc, OutOfTime) else eng.error_string(exc)
            partial = target.get(name)  # what the section recorded before it stopped stays
            if isinstance(partial, list):
                target[f"{name}_error"] = error
            else:
                target[name] = {**(partial or {}), "error": error}
        seconds = round(time.monotonic() - t0, 1)
        if isinstance(target[name], dict):
            target[name]["section_s"] = seconds
        else:
            target[f"{name}_section_s"] = seconds
        self.running = ""
        self.write()
        return target[name]

    def write(self, aborted: str | None = None) -> str:
        """With the goals computed from what is there; atomic (a temporary file renamed)."""
        with self._lock:
            if aborted is None:
                self.result["goals"] = goals(self.result.get("primary") or {}, self.sizes)
                self.result["exact"] = exact_summary(self.result)
                self.result["verdict"] = verdict(self.result)
                self.result["wall_s"] = round(time.monotonic() - self._start, 1)
                text = json.dumps(self.result)
                self._written = text
            else:  # the watchdog: the last complete state, marked; never the dict the main thread may be changing
                data = json.loads(self._written) if self._written else {"check": "gpu-check"}
                data["aborted"] = aborted
                data["verdict"] = verdict(data)
                data["wall_s"] = round(time.monotonic() - self._start, 1)
                text = json.dumps(data)
            tmp = self.out.with_name(f".{self.out.name}.{os.getpid()}.tmp")
            tmp.write_text(text + "\n")
            os.replace(tmp, self.out)
            return text

    def start_watchdog(self, hard_limit_s: float) -> threading.Timer:
        def fire() -> None:
            text = self.write(aborted=f"the hard limit of {hard_limit_s:g} s passed while running {self.running!r}")
            print(text, flush=True)
            for child in multiprocessing.active_children():  # the pair's processes: nothing outlives the run
                child.kill()
            os._exit(ABORT_STATUS)

        timer = threading.Timer(hard_limit_s, fire)
        timer.daemon = True
        timer.start()
        return timer


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _reserved() -> int:
    _free()
    return int(torch.cuda.memory_reserved()) if torch.cuda.is_available() else 0


def core_variants() -> list[tuple[str, bool]]:
    """The default config (auto, graphs on) and our eager path (sdpa, no graphs): the goals' two figures."""
    return [("auto", True), ("sdpa", False)]


def other_variants(device: str, quick: bool) -> tuple[list[tuple[str, bool]], dict[str, str]]:
    """The other (backend, graphs) pairs worth a row, and why each missing one is left out: sdpa with graphs is the
    default config without FlashInfer; FlashInfer needs to be importable, and prebuilt kernels in the quick run."""
    skipped: dict[str, str] = {}
    variants: list[tuple[str, bool]] = []
    flashinfer = importlib.util.find_spec("flashinfer") is not None
    prebuilt = any(importlib.util.find_spec(m) is not None for m in ("flashinfer_cubin", "flashinfer_jit_cache"))
    if flashinfer and device.startswith("cuda"):
        variants.append(("sdpa", True))
    else:
        skipped["sdpa+graphs"] = "the default config (auto resolves to sdpa without FlashInfer)"
    variants += [("flex", False), ("flex", True)]
    if not flashinfer:
        skipped["flashinfer"] = "not importable (flashinfer-python is not installed: make gpu-wheels FLASHINFER=1)"
    elif quick and not prebuilt:
        skipped["flashinfer"] = "no prebuilt kernels (flashinfer-cubin / flashinfer-jit-cache): it would JIT-compile"
    else:
        variants += [("flashinfer", False), ("flashinfer", True)]
    return variants, skipped


def primary(run: Run, shape: models.Shape, device: str, quick: bool, workdir: Path) -> dict[str, Any]:
    """The 1B-shaped model (or the tiny one), its sections in order of value, each in ``out`` as it ends."""
    sizes = run.sizes
    out: dict[str, Any] = {"model": shape.name, "params": shape.num_params()}
    run.result["primary"] = out
    vocab = shape.vocab_size
    folder = workdir / shape.name
    state: dict[str, Any] = {}

    def build(deadline: Deadline) -> dict[str, Any]:
        hf, tokenizer = models.build_model(shape, device, torch.bfloat16)  # the engine's weights: bf16, saved once
        save_s = models.save_folder(hf, tokenizer, folder)
        state["hf"] = hf
        return {"save_s": round(save_s, 2), "weights_dtype": "bfloat16"}

    run.section("model", build, out)
    if "hf" not in state:
        return out
    prompts = models.random_prompts(sizes["exact_prompts"], sizes["exact_prompt_len"], vocab, seed=3)
    n = sizes["exact_tokens"]

    def exact_fp32(deadline: Deadline) -> dict[str, Any]:
        hf = state["hf"].float()  # in place: the bf16 weights widened, exactly the engine's float32 weights
        try:
            reference = models.hf_greedy(hf, prompts, n)
        finally:
            hf.to(torch.bfloat16)
        engine = eng.make_engine(
            str(folder),
            device,
            "float32",
            kv_cache_memory_bytes=256 * MIB,
            max_model_len=sizes["exact_prompt_len"] + n + 16,
        )
        try:
            result = eng.exactness(reference, eng.engine_greedy(engine, prompts, n, deadline))
            result["backend_used"] = eng.backend_name(engine)
        finally:
            eng.close_engine(engine)
        return result

    run.section("exact_float32", exact_fp32, out)

    decode_kv = decode_kv_bytes(sizes, shape)
    transformers_out: dict[str, Any] = {}
    out["transformers"] = transformers_out

    def decode(deadline: Deadline) -> list[dict[str, Any]]:
        transformers_out["generate_eager_tokens_per_s"] = eager = {}
        for b in sizes["batches"]:  # eager generate: no compile, so it is quick and always there
            eager[str(b)] = round(
                models.hf_decode_tps(
                    state["hf"], b, sizes["decode_prompt_len"], sizes["decode_tokens"], device, vocab, False, deadline
                ),
                1,
            )
        rows: list[dict[str, Any]] = []
        out["decode"] = rows  # rows land as they are measured: a cut section keeps the finished ones
        state.pop("hf")  # the engines below get the device to themselves
        _free()
        return eng.decode_variants(
            str(folder), device, "bfloat16", core_variants(), sizes["batches"], sizes["decode_prompt_len"],
            sizes["decode_tokens"], vocab, decode_kv, deadline, rows,
        )  # fmt: skip

    run.section("decode", decode, out)
    state.pop("hf", None)
    _free()

    def compiled(deadline: Deadline) -> dict[str, Any]:
        figures: dict[str, float] = {}
        result: dict[str, Any] = {"compiled": models.generate_compiles(device), "tokens_per_s": figures}
        transformers_out["generate_compiled"] = result
        hf = models.load_hf(folder, device, torch.bfloat16)
        try:  # the goals' batches first: each shape's compile is in its warm-up, never in the timed runs
            for b in sorted(sizes["batches"], key=lambda b: (b != 1, -b)):
                figures[str(b)] = round(
                    models.hf_decode_tps(
                        hf, b, sizes["decode_prompt_len"], sizes["decode_tokens"], device, vocab, True, deadline
                    ),
                    1,
                )
        finally:
            del hf
            _free()
        return result

    run.section("generate_compiled", compiled, transformers_out)

    def kernels(deadline: Deadline) -> dict[str, Any]:
        engine = eng.make_engine(
            str(folder), device, "bfloat16", attention_backend="sdpa", cuda_graphs=False,
            kv_cache_memory_bytes=64 * MIB, max_batch_tokens=sizes["kernel_prompt_len"], max_num_seqs=8,
            max_model_len=4 * sizes["kernel_prompt_len"],
        )  # fmt: skip
        try:
            return sdpa_kernels(engine, sizes["kernel_prompt_len"], deadline)
        finally:
            eng.close_engine(engine)

    run.section("sdpa_kernels", kernels, out)

    pd = dict(sizes["pd"], folder=str(folder), device=device, kv_bytes=pair_kv_bytes(sizes["pd"], shape))

    def pair(deadline: Deadline) -> dict[str, Any]:
        return run_pair(dict(pd, timeout_s=max(10.0, min(pd["timeout_s"], deadline.left()))))

    run.section("prefill_decode_pair", pair, out)
    run.section("memory", lambda d: memory(shape, str(folder), device, sizes, d), out)

    def prefill(deadline: Deadline) -> dict[str, Any]:
        count, length = sizes["prefill_count"], sizes["prefill_len"]
        engine = eng.make_engine(
            str(folder), device, "bfloat16",
            kv_cache_memory_bytes=(count * (length + 16) + 4096) * shape.kv_bytes_per_token(2),
            max_batch_tokens=count * length, max_model_len=length + 64,
        )  # fmt: skip
        try:
            ours = eng.prefill_tps(engine, count, length, vocab, sizes["reps"], deadline)
            tokens = eng.engine_greedy(engine, prompts, n, deadline)
        finally:
            eng.close_engine(engine)
        hf = models.load_hf(folder, device, torch.bfloat16)
        try:
            forward = models.hf_prefill_tps(hf, count, length, device, vocab, sizes["reps"], deadline)
            agree = sum(sum(a == b for a, b in zip(models.hf_top1(hf, p, t), t)) for p, t in zip(prompts, tokens))
        finally:
            del hf
            _free()
        total = sum(len(t) for t in tokens)
        return {
            "prompts": f"{count} x {length}",
            "engine_tokens_per_s": round(ours, 1),
            "forward_tokens_per_s": round(forward, 1),
            "top1_bfloat16": {"positions": total, "agree": agree, "top1_agreement": round(agree / max(total, 1), 4)},
        }

    run.section("prefill", prefill, out)

    def others(deadline: Deadline) -> dict[str, Any]:
        variants, skipped = other_variants(device, quick)
        rows: list[dict[str, Any]] = []
        result = {"skipped": skipped, "rows": rows}
        out["decode_other_backends"] = result
        eng.decode_variants(
            str(folder), device, "bfloat16", variants, sizes["batches"], sizes["decode_prompt_len"],
            sizes["decode_tokens"], vocab, decode_kv, deadline, rows,
        )  # fmt: skip
        return result

    run.section("decode_other_backends", others, out)
    return out


def tensor_parallel(run: Run, shape: models.Shape, device: str, quick: bool, workdir: Path) -> dict[str, Any]:
    """Section ``tensor_parallel_2`` where the machine has two devices (on a model folder of its own, removed after);
    elsewhere ``{"skipped": why}``, written at once whatever the budget."""
    reason = tp.skip_reason(device)
    if reason is not None:
        run.result[tp.NAME] = {"skipped": reason}
        run.write()
        return run.result[tp.NAME]
    folder = workdir / f"tp-{shape.name}"

    def section(deadline: Deadline) -> dict[str, Any]:
        hf, tokenizer = models.build_model(shape, device, torch.bfloat16)
        models.save_folder(hf, tokenizer, folder)
        del hf
        _free()
        sizes, pairs = run.sizes["tp"], TP_PAIRS["quick" if quick else "full"]
        params = tp.section_params(folder, shape.vocab_size, shape.kv_bytes_per_token(4), device, sizes, pairs)
        try:
            return tp.tensor_parallel_2(params, deadline)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    return run.section(tp.NAME, section)


def decode_kv_bytes(sizes: dict[str, Any], shape: models.Shape) -> int:
    """bf16 KV for the largest decode batch at its full length, with a quarter to spare."""
    tokens = max(sizes["batches"]) * (sizes["decode_prompt_len"] + sizes["decode_tokens"] + 48)
    return int(tokens * shape.kv_bytes_per_token(2) * 1.25)


def pair_kv_bytes(pd: dict[str, Any], shape: models.Shape) -> dict[str, dict[str, int]]:
    """KV budgets of the pair's engines by dtype and side: in float32 only the exactness prompts; in bfloat16 the
    decode side holds the running decodes and a long prompt, the prefill side two long prompts."""
    exact_tokens = pd["exact_prompts"] * (pd["exact_prompt_len"] + pd["exact_tokens"] + 64) + 4096
    running_tokens = (pd["running"] + 4) * pd["max_model_len"] // 4 + 2 * pd["long_prompt_len"]
    return {
        "float32": {
            "decode": exact_tokens * shape.kv_bytes_per_token(4),
            "prefill": exact_tokens * shape.kv_bytes_per_token(4),
        },
        "bfloat16": {
            "decode": running_tokens * shape.kv_bytes_per_token(2),
            "prefill": (2 * pd["long_prompt_len"] + 4096) * shape.kv_bytes_per_token(2),
        },
    }


def memory(shape: models.Shape, folder: str, device: str, sizes: dict[str, Any], deadline: Deadline) -> dict:
    """An engine that sized its own KV (gpu_memory_utilization 0.3; on the CPU the default budget) through this run's
    largest prefill and decode batches: its peak against its plan, term by term."""
    before = _reserved()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    engine = eng.make_engine(
        folder,
        device,
        "bfloat16",
        gpu_memory_utilization=0.3,
        max_num_seqs=max(sizes["batches"]),
        max_batch_tokens=sizes["prefill_count"] * sizes["prefill_len"],
        max_model_len=sizes["prefill_len"] + 64,
    )
    try:
        eng.prefill_tps(engine, sizes["prefill_count"], sizes["prefill_len"], shape.vocab_size, 1, deadline)
        eng.decode_tps(engine, max(sizes["batches"]), sizes["decode_prompt_len"], 8, shape.vocab_size, deadline)
        return eng.memory_report(engine, before)
    finally:
        eng.close_engine(engine)


def secondary(run: Run, shape: models.Shape, device: str, workdir: Path, deadline: Deadline) -> dict[str, Any]:
    """The 8B-shaped model in bfloat16 (full run only): the baselines and the core variants' decode tokens/s."""
    sizes = run.sizes
    out: dict[str, Any] = {"model": shape.name, "params": shape.num_params()}
    run.result["llama_3_8b"] = out
    vocab = shape.vocab_size
    folder = workdir / shape.name
    hf, tokenizer = models.build_model(shape, device, torch.bfloat16)
    out["save_s"] = round(models.save_folder(hf, tokenizer, folder), 2)
    out["generate_eager_tokens_per_s"] = {
        str(b): round(
            models.hf_decode_tps(
                hf, b, sizes["decode_prompt_len"], sizes["decode_tokens"], device, vocab, False, deadline
            ),
            1,
        )
        for b in sizes["batches"]
    }
    out["forward_prefill_tokens_per_s"] = round(
        models.hf_prefill_tps(hf, sizes["prefill_count"], sizes["prefill_len"], device, vocab, 1, deadline), 1
    )
    del hf
    _free()
    decode_kv = decode_kv_bytes(sizes, shape)
    out["decode"] = eng.decode_variants(
        str(folder), device, "bfloat16", core_variants(), sizes["batches"], sizes["decode_prompt_len"],
        sizes["decode_tokens"], vocab, decode_kv, deadline,
    )  # fmt: skip
    return out


# ---- goals ------------------------------------------------------------------------------------------------------


def _tps(rows: list[dict[str, Any]], backend: str, graphs: bool, batch: int) -> float | None:
    for row in rows:
        if row["attention_backend"] == backend and row["cuda_graphs"] == graphs:
            return (row.get("tokens_per_s") or {}).get(str(batch))
    return None


def faster_generate(primary_out: dict[str, Any], batch: int) -> tuple[float | None, str | None]:
    """(tokens/s, which) of the faster generate baseline at ``batch``."""
    transformers_out = primary_out.get("transformers") or {}
    candidates = [
        ((transformers_out.get("generate_eager_tokens_per_s") or {}).get(str(batch)), "eager"),
        (((transformers_out.get("generate_compiled") or {}).get("tokens_per_s") or {}).get(str(batch)), "compiled"),
    ]
    measured = [(value, name) for value, name in candidates if value]
    return max(measured) if measured else (None, None)


def goals(primary_out: dict[str, Any], sizes: dict[str, Any]) -> list[dict[str, Any]]:
    rows = primary_out.get("decode") if isinstance(primary_out.get("decode"), list) else []
    big = max(sizes["batches"])
    pair = primary_out.get("prefill_decode_pair") or {}
    prefill = primary_out.get("prefill") or {}

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    gen1, base1 = faster_generate(primary_out, 1)
    gen_big, base_big = faster_generate(primary_out, big)
    values = {
        "decode_b1_vs_eager": (ratio(_tps(rows, "auto", True, 1), _tps(rows, "sdpa", False, 1)), "sdpa eager"),
        "decode_b1_vs_generate": (ratio(_tps(rows, "auto", True, 1), gen1), base1 and f"generate {base1}"),
        "decode_b128_vs_generate": (ratio(_tps(rows, "auto", True, big), gen_big), base_big and f"generate {base_big}"),
        "prefill_vs_forward": (ratio(prefill.get("engine_tokens_per_s"), prefill.get("forward_tokens_per_s")), None),
        "itl_p99_during_vs_idle": (ratio(pair.get("itl_during_p99_ms"), pair.get("itl_idle_p99_ms")), None),
    }
    out = []
    for name, what, target, op in GOALS:
        value, baseline = values[name]
        passed = None if value is None else (value >= target if op == "ge" else value <= target)
        row = {"goal": name, "what": what, "value": value, "target": target, "op": op, "passed": passed}
        if baseline:
            row["baseline"] = baseline
        out.append(row)
    return out


def exact_summary(result: dict[str, Any]) -> dict[str, Any]:
    primary_out = result.get("primary") or {}
    pair = primary_out.get("prefill_decode_pair") or {}
    tensor_parallel = result.get(tp.NAME) or {}
    return {
        "float32_vs_generate": (primary_out.get("exact_float32") or {}).get("exact"),
        "prefill_decode_pair_float32_vs_single_engine": (pair.get("exact") or {}).get("exact"),
        "prefill_decode_pair_bfloat16_top1": (pair.get("bfloat16") or {}).get("top1_agreement"),
        "tensor_parallel_2_float32_vs_degree_1": (tensor_parallel.get("greedy") or {}).get("exact"),
        "tensor_parallel_2_handoffs_float32_vs_degree_1": tensor_parallel.get("handoffs_exact"),
    }


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """The run's one answer: ``ok`` only when every goal passed and every exactness check held, and no part was
    left unmeasured (a part that did not run is not a pass); the parts that did not, by name."""
    failed = [f"goals.{row['goal']}" for row in result.get("goals", []) if row.get("passed") is False]
    unmeasured = [f"goals.{row['goal']}" for row in result.get("goals", []) if row.get("passed") is None]
    for name, value in (result.get("exact") or {}).items():
        if value is None:
            unmeasured.append(f"exact.{name}")
        elif value is False:  # a figure (bfloat16's top-1 agreement) is reported, not judged
            failed.append(f"exact.{name}")
    if result.get("aborted"):
        failed.append("aborted")
    return {"ok": not failed and not unmeasured, "failed": failed, "unmeasured": unmeasured}


# ---- environment ------------------------------------------------------------------------------------------------


def dependencies() -> dict[str, str]:
    """Each package's version, or "missing" (what needs it reports why it did not run)."""
    found: dict[str, str] = {}
    for module, dist in DEPENDENCIES.items():
        if importlib.util.find_spec(module) is None:
            found[module] = f"missing (pip: {dist})"
            continue
        try:
            found[module] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[module] = "importable"
    return found


def environment(device: str) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            gpu_memory_bytes=props.total_memory,
            gpu_count=torch.cuda.device_count(),
            cuda=torch.version.cuda,
        )
    return env


def run(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    quick = bool(args.quick)
    budget = args.budget_s or (QUICK_BUDGET_S if quick else FULL_BUDGET_S)
    hard = args.hard_limit_s or (QUICK_HARD_S if quick else FULL_HARD_S)
    caps = {**CAPS, **(QUICK_CAPS if quick else {})}
    if args.tensor_parallel_only:
        budget, hard = caps[tp.NAME], caps[tp.NAME] + 25
    elif tp.skip_reason(device) is None:  # two devices: the tensor-parallel section's time comes on top
        budget += caps[tp.NAME]
        hard += caps[tp.NAME]
    sizes = TINY_SIZES if args.tiny else GPU_SIZES
    result: dict[str, Any] = {
        "check": "gpu-check",
        "mode": "quick" if quick else "full",
        "tiny": bool(args.tiny),
        "budget_s": budget,
        "hard_limit_s": hard,
        "environment": environment(device),
        "dependencies": dependencies(),
    }
    state = Run(Path(args.out), result, Deadline.after(budget, "the run"), sizes, caps)
    state.write()
    watchdog = state.start_watchdog(hard)
    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        shape = models.SHAPES["tiny" if args.tiny else "llama-3.2-1b"]
        try:
            tensor_parallel(state, shape, device, quick, workdir)
        except Exception as exc:  # noqa: BLE001 (a bug of the check itself: the other sections still run)
            result[f"{tp.NAME}_error"] = eng.error_string(exc)
        try:
            if not args.tensor_parallel_only:
                primary(state, shape, device, quick, workdir)
        except Exception as exc:  # noqa: BLE001 (a bug of the check itself: still leave the JSON)
            result["primary_error"] = eng.error_string(exc)
        shutil.rmtree(workdir / shape.name, ignore_errors=True)
        if not quick and not args.tiny and not args.skip_8b and not args.tensor_parallel_only:
            big = models.SHAPES["llama-3-8b"]
            state.section("llama_3_8b", lambda d: secondary(state, big, device, workdir, d))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    watchdog.cancel()
    return json.loads(state.write()), 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result, status = run(args)
    print(json.dumps(result))
    return status


if __name__ == "__main__":
    sys.exit(main())
