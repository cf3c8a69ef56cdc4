"""gpu-check's engine measurements: the engine run directly (no worker, no Ray), one engine per variant.

A variant is an (attention_backend, cuda_graphs) pair of ``EngineConfig``; one that cannot be built or run (a backend
not installed, a graph capture that fails) is reported with its error string and the run goes on. Decode tokens/s
counts only the steps after every request has its first token, so the prompts' forward is not in it (the
transformers figure it is compared with leaves it out the same way).
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, is_dataclass
from typing import Any

import torch

from bench.gpu_check_models import random_prompts, sync
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def error_string(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def make_engine(folder: str, device: str, dtype: str, **settings: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=folder, device=device, dtype=dtype, **settings))


def close_engine(engine: LLMEngine | None) -> None:
    """Free an engine's GPU memory before the next one is built (the engines of one run never overlap)."""
    if engine is None:
        return
    graphs = getattr(engine.runner, "decode_graphs", None)
    if graphs is not None and hasattr(graphs, "close"):
        graphs.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    results = engine.generate(prompts, greedy(max_tokens))
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(errors[0])
    return [r.token_ids for r in results]


def exactness(reference: list[list[int]], ours: list[list[int]]) -> dict[str, Any]:
    """Token-exact rows, and where each other row first differs."""
    first_diffs = []
    for ref, got in zip(reference, ours):
        diff = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        if diff is None and len(ref) != len(got):
            diff = min(len(ref), len(got))
        first_diffs.append(diff)
    exact = sum(d is None for d in first_diffs)
    return {"rows": len(reference), "exact_rows": exact, "exact": exact == len(reference), "first_diff": first_diffs}


def decode_tps(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> float:
    """Decode tokens/s of ``batch`` requests: steps after every request's first token, to the last token."""
    device = engine.config.device
    prompts = random_prompts(batch, prompt_len, vocab, seed=1000 + batch)
    ids = [engine.add_request(p, greedy(new_tokens)) for p in prompts]
    started: set[str] = set()
    while len(started) < batch:  # the prompts' forward (chunked as the scheduler sees fit) and first tokens
        for output in engine.step():
            if output.num_output_tokens >= 1:
                started.add(output.request_id)
    sync(device)
    t0 = time.perf_counter()
    tokens = 0
    while any(rid in engine.requests for rid in ids):
        for output in engine.step():
            tokens += len(output.new_token_ids)
    sync(device)
    elapsed = time.perf_counter() - t0
    engine.check_no_leaks()
    return tokens / max(elapsed, 1e-9)


def prefill_tps(engine: LLMEngine, count: int, length: int, vocab: int, reps: int = 3) -> float:
    """Prompt tokens/s of ``count`` prompts of ``length`` (max_tokens 1: the step that computes them samples their
    first token). Fresh prompts each rep, so the prefix cache serves nothing; median after a warm-up."""
    device = engine.config.device
    times = []
    for rep in range(reps + 1):
        prompts = random_prompts(count, length, vocab, seed=5000 + rep)
        sync(device)
        t0 = time.perf_counter()
        engine_greedy(engine, prompts, 1)
        sync(device)
        times.append(time.perf_counter() - t0)
    engine.check_no_leaks()
    times = sorted(times[1:])
    return count * length / times[len(times) // 2]


def graph_info(engine: LLMEngine) -> dict[str, Any] | None:
    graphs = getattr(engine.runner, "decode_graphs", None)
    if graphs is None:
        return None
    info: dict[str, Any] = {}
    for name in ("num_graphs", "scratch_bytes"):
        value = getattr(graphs, name, None)
        info[name] = value() if callable(value) else value
    return info


def backend_name(engine: LLMEngine) -> str | None:
    backend = getattr(engine.runner, "backend", None)
    return getattr(backend, "name", None) or (type(backend).__name__ if backend is not None else None)


def decode_variants(
    folder: str,
    device: str,
    dtype: str,
    variants: list[tuple[str, bool]],
    batches: list[int],
    prompt_len: int,
    new_tokens: int,
    vocab: int,
    kv_bytes: int,
    out_of_time: Any,
) -> list[dict[str, Any]]:
    """Decode tokens/s per (attention_backend, cuda_graphs) and batch; an error string where a variant fails."""
    rows = []
    for backend, graphs in variants:
        row: dict[str, Any] = {"attention_backend": backend, "cuda_graphs": graphs}
        rows.append(row)
        if out_of_time():
            row["error"] = "skipped: the run's time budget is spent"
            continue
        engine = None
        try:
            t0 = time.perf_counter()
            engine = make_engine(
                folder,
                device,
                dtype,
                attention_backend=backend,
                cuda_graphs=graphs,
                kv_cache_memory_bytes=kv_bytes,
                max_num_seqs=max(batches),
                max_batch_tokens=max(2048, prompt_len),
                max_model_len=prompt_len + new_tokens + 16,
            )
            row["start_s"] = round(time.perf_counter() - t0, 2)
            row["backend_used"] = backend_name(engine)
            figures = {}
            for b in batches:  # the same run once untimed first: lazy graph captures and first launches of its
                decode_tps(engine, b, prompt_len, new_tokens, vocab)  # batch and context buckets stay out of it
                figures[str(b)] = round(decode_tps(engine, b, prompt_len, new_tokens, vocab), 1)
            row["tokens_per_s"] = figures
            row["graphs"] = graph_info(engine)
        except Exception as exc:  # noqa: BLE001 (a variant's failure is a result, reported by name)
            row["error"] = error_string(exc)
        finally:
            close_engine(engine)
    return rows


def memory_report(engine: LLMEngine, weights_bytes: int, kv_bytes: int) -> dict[str, Any]:
    """Peak GPU memory of everything this engine ran, against its budget: the measured plan's share of the GPU
    (``engine.memory_plan``) when the engine sized its KV itself, else weights + KV (a lower bound: no activations)."""
    out: dict[str, Any] = {"weights_bytes": weights_bytes, "kv_bytes": kv_bytes}
    if not torch.cuda.is_available() or not engine.config.device.startswith("cuda"):
        out["error"] = "not on a GPU"
        return out
    plan = getattr(engine, "memory_plan", None)
    peak = int(torch.cuda.max_memory_reserved())
    out["peak_reserved_bytes"] = peak
    out["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    if plan is not None:
        out["plan"] = plan.as_dict() if hasattr(plan, "as_dict") else (asdict(plan) if is_dataclass(plan) else None)
        budget = int(getattr(plan, "requested_bytes", 0) or 0)
        out["budget_source"] = "engine.memory_plan (gpu_memory_utilization x total)"
        # torch's peak plus what the plan measured outside torch (CUDA context, cuBLAS) must fit the requested share
        out["within_budget"] = peak + int(getattr(plan, "non_torch_bytes", 0) or 0) <= budget
    else:
        budget = weights_bytes + kv_bytes
        out["budget_source"] = "weights + kv (no memory plan on this engine)"
    out["budget_bytes"] = budget
    out["peak_over_budget"] = round(peak / budget, 4) if budget else None
    return out
