"""gpu-check's engine measurements: the engine run directly (no worker, no Ray), one engine per variant.

A variant is an (attention_backend, cuda_graphs) pair of ``EngineConfig``; one that cannot be built or run (a backend
not installed, a failed graph capture) is reported with its error string and the run goes on. Decode tokens/s counts
only the steps after every request has its first token, as the transformers figure it is compared with. Every wait
ends: a failed request raises ``RequestFailed`` with the engine's error, and every loop checks the ``Deadline``.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from checks.gpu.gpu_check_models import random_prompts, sync
from checks.gpu.gpu_check_time import NEVER, Deadline
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams


class RequestFailed(RuntimeError):
    """The engine's own error for a request of the measurement."""


def _step(engine: LLMEngine, deadline: Deadline, doing: str) -> list[Any]:
    """One engine step; raises the first failed request's error (it would never get the token a loop waits for)."""
    deadline.check(doing)
    outputs = engine.step()
    for output in outputs:
        if output.error is not None:
            raise RequestFailed(f"request {output.request_id} failed while {doing}: {output.error}")
    return outputs


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


def engine_greedy(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, deadline: Deadline = NEVER
) -> list[list[int]]:
    """Greedy token ids of ``prompts``, batched as the scheduler sees fit."""
    ids = [engine.add_request(p, greedy(max_tokens)) for p in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    try:
        while any(rid in engine.requests for rid in ids):
            for output in _step(engine, deadline, f"greedy decoding of {len(prompts)} prompts"):
                tokens[output.request_id].extend(output.new_token_ids)
    finally:
        _abort_all(engine, ids)
    return [tokens[rid] for rid in ids]


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


def decode_tps(
    engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, vocab: int, deadline: Deadline = NEVER
) -> float:
    """Decode tokens/s of ``batch`` requests: steps after every request's first token, to the last token."""
    device = engine.config.device
    prompts = random_prompts(batch, prompt_len, vocab, seed=1000 + batch)
    ids = [engine.add_request(p, greedy(new_tokens)) for p in prompts]
    try:
        started: set[str] = set()
        while len(started) < batch:  # the prompts' forward (chunked as the scheduler sees fit) and first tokens
            for output in _step(engine, deadline, f"prefilling a decode batch of {batch}"):
                if output.num_output_tokens >= 1:
                    started.add(output.request_id)
        sync(device)
        t0 = time.perf_counter()
        tokens = 0
        while any(rid in engine.requests for rid in ids):
            for output in _step(engine, deadline, f"decoding a batch of {batch}"):
                tokens += len(output.new_token_ids)
        sync(device)
        elapsed = time.perf_counter() - t0
    finally:
        _abort_all(engine, ids)
    engine.check_no_leaks()
    return tokens / max(elapsed, 1e-9)


def _abort_all(engine: LLMEngine, ids: list[str]) -> None:
    """Leave the engine empty whatever ended the measurement (the next one starts clean)."""
    for rid in ids:
        if rid in engine.requests:
            engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def prefill_tps(
    engine: LLMEngine, count: int, length: int, vocab: int, reps: int = 3, deadline: Deadline = NEVER
) -> float:
    """Prompt tokens/s at max_tokens 1 (the step computing a prompt samples its first token); fresh prompts each rep
    (no prefix-cache hits); the median after a warm-up."""
    device = engine.config.device
    times = []
    for rep in range(reps + 1):
        prompts = random_prompts(count, length, vocab, seed=5000 + rep)
        sync(device)
        t0 = time.perf_counter()
        ids = [engine.add_request(p, greedy(1)) for p in prompts]
        try:
            while any(rid in engine.requests for rid in ids):
                _step(engine, deadline, f"prefilling {count} x {length}")
        finally:
            _abort_all(engine, ids)
        sync(device)
        times.append(time.perf_counter() - t0)
    engine.check_no_leaks()
    times = sorted(times[1:])
    return count * length / times[len(times) // 2]


def smoke(engine: LLMEngine, deadline: Deadline = NEVER) -> None:
    """One short prompt, so a backend whose first forward fails (or compiles too long) is reported unmeasured."""
    ids = [engine.add_request([1] * 16, greedy(2))]
    try:
        while any(rid in engine.requests for rid in ids):
            _step(engine, deadline, "the smoke forward")
    finally:
        _abort_all(engine, ids)


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
    deadline: Deadline,
    rows: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Decode tokens/s per variant and batch, appended to ``rows`` as they come (a partial result can be written), an
    error string where one fails: ``smoke`` first, then each batch once untimed (lazy captures, first launches) and
    once timed."""
    rows = [] if rows is None else rows
    for backend, graphs in variants:
        row: dict[str, Any] = {"attention_backend": backend, "cuda_graphs": graphs}
        rows.append(row)
        if deadline.passed():
            row["error"] = "skipped: the section's time is spent"
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
            t0 = time.perf_counter()
            smoke(engine, deadline)
            row["smoke_s"] = round(time.perf_counter() - t0, 2)
            figures: dict[str, float] = {}
            row["tokens_per_s"] = figures
            for b in batches:
                decode_tps(engine, b, prompt_len, new_tokens, vocab, deadline)
                figures[str(b)] = round(decode_tps(engine, b, prompt_len, new_tokens, vocab, deadline), 1)
            row["graphs"] = graph_info(engine)
        except Exception as exc:  # noqa: BLE001 (a variant's failure is a result, reported by name)
            row["error"] = error_string(exc)
        finally:
            close_engine(engine)
    return rows


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_report(engine: LLMEngine, reserved_before: int) -> dict[str, Any]:
    """Peak GPU memory of what this engine ran against its plan term by term (measured where it can be), and torch's
    peak reserved above what was held before plus the plan's non-torch figure against the requested share."""
    weights = _bytes(engine.model.parameters())
    kv = _bytes(engine.kv_cache.kv)
    graphs = getattr(engine.runner, "decode_graphs", None)
    scratch = engine.runner.scratch_bytes + (graphs.scratch_bytes if graphs is not None else 0)
    measured: dict[str, int | None] = {"weights_bytes": weights, "kv_bytes": kv, "scratch_bytes": scratch}
    out: dict[str, Any] = {"measured": measured}
    if not torch.cuda.is_available() or not engine.config.device.startswith("cuda"):
        out["error"] = "not on a GPU"
        return out
    measured["graph_pool_bytes"] = graphs.pool_bytes() if graphs is not None else 0
    peak = int(torch.cuda.max_memory_reserved()) - reserved_before
    measured["peak_reserved_bytes"] = peak
    plan = engine.memory_plan
    if plan is None:
        out["error"] = "the engine has no memory plan (an explicit KV budget)"
        return out
    planned = plan.as_dict()
    out["plan"] = planned
    out["terms"] = [
        {"term": name, "planned_bytes": planned[name], "measured_bytes": measured.get(name)}
        for name in (
            "weights_bytes",
            "peak_activation_bytes",
            "non_torch_bytes",
            "scratch_bytes",
            "graph_pool_bytes",
            "nccl_bytes",
            "reserve_bytes",
            "kv_bytes",
        )
    ]
    budget = plan.requested_bytes
    out["budget_bytes"] = budget
    out["peak_plus_non_torch_bytes"] = peak + plan.non_torch_bytes
    out["within_budget"] = peak + plan.non_torch_bytes <= budget
    out["peak_over_budget"] = round((peak + plan.non_torch_bytes) / budget, 4)
    out["activation_and_other_bytes"] = peak - weights - kv - scratch - (measured["graph_pool_bytes"] or 0)
    return out
