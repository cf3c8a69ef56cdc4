"""gpu-check: one command that proves the GPU path on a GPU machine, and runs the same code on the CPU in CI.

    python bench/gpu_check.py --out gpu-check.json              # make gpu-check: one GPU, at most 8 minutes
    python bench/gpu_check.py --device cpu --tiny --out x.json  # the same script on a tiny model (CI, < 1 minute)

No network, no Ray: random-weight models shaped like Llama-3.2-1B and Llama-3-8B are built in-process
(bench/gpu_check_models.py), the engine is run directly (bench/gpu_check_engine.py), and the prefill/decode pair runs
as two processes over the shm transfer backend (bench/gpu_check_pd.py). Prints one JSON object and writes it to
``--out``. Every figure is compared with a baseline measured in the same run (transformers ``generate`` with a
static cache, a plain transformers forward, our own eager path, the idle decode loop), and the issue's goals are
reported as ratios with pass/fail. A section or variant that fails records its error string; the run goes on.
``--budget-s`` bounds the run: sections not started by then are reported as skipped.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/gpu_check.py`: make the repository importable, as `-m` would
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import gpu_check_engine as eng
from bench import gpu_check_models as models
from bench.gpu_check_pd import run_pair

GIB = 1024**3
MIB = 1024**2

# Section sizes: a GPU run on the real shapes, and the tiny CPU run (CI).
GPU_SIZES: dict[str, Any] = dict(
    exact_prompts=4, exact_prompt_len=64, exact_tokens=32,
    decode_prompt_len=128, decode_tokens=64, batches=[1, 32, 128],
    reps=3, prefill_count=8, prefill_len=2048,
    pd=dict(exact_prompts=4, exact_prompt_len=256, exact_tokens=32, running=32, idle_steps=200,
            long_prompts=3, long_prompt_len=8192, max_model_len=16384, timeout_s=180),
)  # fmt: skip
TINY_SIZES: dict[str, Any] = dict(
    exact_prompts=2, exact_prompt_len=16, exact_tokens=8,
    decode_prompt_len=16, decode_tokens=6, batches=[1, 4], reps=1,
    prefill_count=2, prefill_len=32,
    pd=dict(exact_prompts=2, exact_prompt_len=40, exact_tokens=6, running=2, idle_steps=8,
            long_prompts=1, long_prompt_len=128, max_model_len=512, timeout_s=120),
)  # fmt: skip
GOALS = [  # name, what it divides, target, "ge"/"le"
    (
        "decode_b1_vs_eager",
        "1B-shaped bf16 decode tok/s at batch 1: default config / sdpa without CUDA graphs",
        3.0,
        "ge",
    ),
    (
        "decode_b1_vs_generate",
        "1B-shaped bf16 decode tok/s at batch 1: default config / transformers generate",
        2.0,
        "ge",
    ),
    (
        "decode_b128_vs_generate",
        "1B-shaped bf16 decode tok/s at the largest batch (128): default config / generate",
        1.5,
        "ge",
    ),
    ("prefill_vs_forward", "1B-shaped bf16 prefill tok/s, 8 x 2048: engine / plain transformers forward", 0.8, "ge"),
    ("itl_p99_during_vs_idle", "decode p99 inter-token latency while KV arrives / idle", 1.2, "le"),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-check.json", help="where the JSON object is written (also printed)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and small sizes (the CPU run in CI)")
    ap.add_argument(
        "--budget-s", type=float, default=330.0, help="sections not started by then are skipped (8 minutes in all)"
    )
    ap.add_argument("--skip-8b", action="store_true", help="only the 1B-shaped model")
    return ap.parse_args(argv)


def _variants(device: str) -> list[tuple[str, bool]]:
    """Every backend with and without CUDA graphs, and the default config (auto, graphs on) first."""
    return [("auto", True)] + [(b, g) for b in ("sdpa", "flex", "flashinfer") for g in (False, True)]


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _section(out: dict[str, Any], name: str, deadline: float, fn: Any) -> None:
    """Run one section into out[name]; its error string, or "skipped" past the deadline, instead of a crash."""
    if time.monotonic() > deadline:
        out[name] = {"error": "skipped: the run's time budget is spent"}
        return
    t0 = time.monotonic()
    try:
        out[name] = fn()
    except Exception as exc:  # noqa: BLE001 (the JSON says what failed; later sections still run)
        out[name] = {"error": eng.error_string(exc)}
    if isinstance(out[name], dict):
        out[name]["section_s"] = round(time.monotonic() - t0, 1)


def primary(shape: models.Shape, device: str, sizes: dict[str, Any], workdir: Path, deadline: float) -> dict:
    """The 1B-shaped model (or the tiny one): exactness, decode and prefill against transformers, variants, memory,
    and the prefill/decode pair."""
    out: dict[str, Any] = {"model": shape.name, "params": shape.num_params()}
    vocab = shape.vocab_size
    folder = workdir / shape.name
    hf, tokenizer = models.build_model(shape, device, torch.float32)
    out["save_s"] = round(models.save_folder(hf, tokenizer, folder), 2)
    prompts = models.random_prompts(sizes["exact_prompts"], sizes["exact_prompt_len"], vocab, seed=3)
    n = sizes["exact_tokens"]
    state: dict[str, Any] = {}

    def exact_fp32() -> dict[str, Any]:
        reference = models.hf_greedy(hf, prompts, n)
        engine = eng.make_engine(
            str(folder),
            device,
            "float32",
            kv_cache_memory_bytes=256 * MIB,
            max_model_len=sizes["exact_prompt_len"] + n + 16,
        )
        try:
            result = eng.exactness(reference, eng.engine_greedy(engine, prompts, n))
            result["backend_used"] = eng.backend_name(engine)
        finally:
            eng.close_engine(engine)
        return result

    _section(out, "exact_float32", deadline, exact_fp32)
    hf.to(torch.bfloat16)
    prefill_kv = (sizes["prefill_count"] * (sizes["prefill_len"] + 16) + 4096) * shape.kv_bytes_per_token(2)

    def bf16_engine() -> dict[str, Any]:
        engine = eng.make_engine(
            str(folder),
            device,
            "bfloat16",
            kv_cache_memory_bytes=prefill_kv,
            max_batch_tokens=sizes["prefill_count"] * sizes["prefill_len"],
            max_model_len=sizes["prefill_len"] + 64,
        )
        try:
            tokens = eng.engine_greedy(engine, prompts, n)
            agree = [sum(a == b for a, b in zip(models.hf_top1(hf, p, t), t)) for p, t in zip(prompts, tokens)]
            total = sum(len(t) for t in tokens)
            state["prefill"] = eng.prefill_tps(
                engine, sizes["prefill_count"], sizes["prefill_len"], vocab, sizes["reps"]
            )
        finally:
            eng.close_engine(engine)
        return {"positions": total, "agree": sum(agree), "top1_agreement": round(sum(agree) / max(total, 1), 4)}

    _section(out, "top1_bfloat16", deadline, bf16_engine)

    def baselines() -> dict[str, Any]:
        gen = {
            str(b): round(
                models.hf_decode_tps(hf, b, sizes["decode_prompt_len"], sizes["decode_tokens"], device, vocab), 1
            )
            for b in sizes["batches"]
        }
        fwd = models.hf_prefill_tps(hf, sizes["prefill_count"], sizes["prefill_len"], device, vocab, sizes["reps"])
        return {"generate_static_tokens_per_s": gen, "forward_prefill_tokens_per_s": round(fwd, 1)}

    _section(out, "transformers", deadline, baselines)
    out["prefill"] = {
        "prompts": f"{sizes['prefill_count']} x {sizes['prefill_len']}",
        "engine_tokens_per_s": round(state["prefill"], 1) if "prefill" in state else None,
        "forward_tokens_per_s": out["transformers"].get("forward_prefill_tokens_per_s"),
    }
    hf = None  # the engines below get the device to themselves
    _free()
    decode_kv = (
        max(sizes["batches"]) * (sizes["decode_prompt_len"] + sizes["decode_tokens"] + 48) * shape.kv_bytes_per_token(2)
    )
    out["decode"] = eng.decode_variants(
        str(folder), device, "bfloat16", _variants(device), sizes["batches"], sizes["decode_prompt_len"],
        sizes["decode_tokens"], vocab, int(decode_kv * 1.25), lambda: time.monotonic() > deadline,
    )  # fmt: skip
    _section(out, "memory", deadline, lambda: memory(shape, str(folder), device, sizes))
    pd = dict(sizes["pd"], folder=str(folder), device=device, dtype="bfloat16")
    pd["kv_bytes"] = (pd["running"] + 4) * pd["max_model_len"] // 4 * shape.kv_bytes_per_token(2) + 2 * pd[
        "long_prompt_len"
    ] * shape.kv_bytes_per_token(2)
    _section(out, "prefill_decode_pair", deadline, lambda: run_pair(pd))
    return out


def memory(shape: models.Shape, folder: str, device: str, sizes: dict[str, Any]) -> dict[str, Any]:
    """Peak memory of an engine that sized its own KV (gpu_memory_utilization; on the CPU: the default budget)
    through the largest prefill and decode batches of this run, against its budget."""
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
        eng.prefill_tps(engine, sizes["prefill_count"], sizes["prefill_len"], shape.vocab_size, reps=1)
        eng.decode_tps(engine, max(sizes["batches"]), sizes["decode_prompt_len"], 8, shape.vocab_size)
        weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        kv = sum(t.numel() * t.element_size() for t in _kv_tensors(engine))
        return eng.memory_report(engine, weights, kv)
    finally:
        eng.close_engine(engine)


def _kv_tensors(engine: Any) -> list[torch.Tensor]:
    cache = engine.kv_cache
    found = [v for v in vars(cache).values() if isinstance(v, torch.Tensor)] if hasattr(cache, "__dict__") else []
    for name in ("k", "v", "k_cache", "v_cache", "key_cache", "value_cache"):
        value = getattr(cache, name, None)
        if isinstance(value, list):
            found += [t for t in value if isinstance(t, torch.Tensor)]
    return found


def secondary(shape: models.Shape, device: str, sizes: dict[str, Any], workdir: Path, deadline: float) -> dict:
    """The 8B-shaped model in bfloat16: decode and prefill against transformers, default config and eager sdpa."""
    out: dict[str, Any] = {"model": shape.name, "params": shape.num_params()}
    vocab = shape.vocab_size
    folder = workdir / shape.name
    hf, tokenizer = models.build_model(shape, device, torch.bfloat16)
    out["save_s"] = round(models.save_folder(hf, tokenizer, folder), 2)
    _section(out, "transformers", deadline, lambda: {
        "generate_static_tokens_per_s": {
            str(b): round(models.hf_decode_tps(hf, b, sizes["decode_prompt_len"], sizes["decode_tokens"], device, vocab), 1)
            for b in sizes["batches"]
        },
        "forward_prefill_tokens_per_s": round(
            models.hf_prefill_tps(hf, sizes["prefill_count"], sizes["prefill_len"], device, vocab), 1
        ),
    })  # fmt: skip
    hf = None  # the engines below get the device to themselves
    _free()
    decode_kv = (
        max(sizes["batches"]) * (sizes["decode_prompt_len"] + sizes["decode_tokens"] + 48) * shape.kv_bytes_per_token(2)
    )
    out["decode"] = eng.decode_variants(
        str(folder), device, "bfloat16", [("auto", True), ("sdpa", False)], sizes["batches"],
        sizes["decode_prompt_len"], sizes["decode_tokens"], vocab, int(decode_kv * 1.25),
        lambda: time.monotonic() > deadline,
    )  # fmt: skip
    return out


def _tps(rows: list[dict[str, Any]], backend: str, graphs: bool, batch: int) -> float | None:
    for row in rows:
        if row["attention_backend"] == backend and row["cuda_graphs"] == graphs:
            return (row.get("tokens_per_s") or {}).get(str(batch))
    return None


def goals(primary_out: dict[str, Any], sizes: dict[str, Any]) -> list[dict[str, Any]]:
    rows = primary_out.get("decode") or []
    gen = (primary_out.get("transformers") or {}).get("generate_static_tokens_per_s") or {}
    big = str(max(sizes["batches"]))
    pair = primary_out.get("prefill_decode_pair") or {}
    prefill = primary_out.get("prefill") or {}

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    values = {
        "decode_b1_vs_eager": ratio(_tps(rows, "auto", True, 1), _tps(rows, "sdpa", False, 1)),
        "decode_b1_vs_generate": ratio(_tps(rows, "auto", True, 1), gen.get("1")),
        "decode_b128_vs_generate": ratio(_tps(rows, "auto", True, int(big)), gen.get(big)),
        "prefill_vs_forward": ratio(prefill.get("engine_tokens_per_s"), prefill.get("forward_tokens_per_s")),
        "itl_p99_during_vs_idle": ratio(pair.get("itl_during_p99_ms"), pair.get("itl_idle_p99_ms")),
    }
    out = []
    for name, what, target, op in GOALS:
        value = values[name]
        passed = None if value is None else (value >= target if op == "ge" else value <= target)
        out.append({"goal": name, "what": what, "value": value, "target": target, "op": op, "passed": passed})
    return out


def environment(device: str) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "flashinfer_importable": importlib.util.find_spec("flashinfer") is not None,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    return env


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    start = time.monotonic()
    deadline = start + args.budget_s
    sizes = TINY_SIZES if args.tiny else GPU_SIZES
    result: dict[str, Any] = {"check": "gpu-check", "tiny": bool(args.tiny), "environment": environment(device)}
    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        shape = models.SHAPES["tiny" if args.tiny else "llama-3.2-1b"]
        _section(result, "primary", deadline, lambda: primary(shape, device, sizes, workdir, deadline))
        shutil.rmtree(workdir / shape.name, ignore_errors=True)
        if not args.tiny and not args.skip_8b:
            big = models.SHAPES["llama-3-8b"]
            _section(result, "llama_3_8b", deadline, lambda: secondary(big, device, sizes, workdir, deadline))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["goals"] = goals(result.get("primary") or {}, sizes)
    exact = ((result.get("primary") or {}).get("exact_float32") or {}).get("exact")
    pair_exact = (((result.get("primary") or {}).get("prefill_decode_pair") or {}).get("exact") or {}).get("exact")
    result["exact"] = {"float32_vs_generate": exact, "prefill_decode_pair_vs_single_engine": pair_exact}
    result["wall_s"] = round(time.monotonic() - start, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    text = json.dumps(result)
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
