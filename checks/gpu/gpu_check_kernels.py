"""Which SDPA kernel each attention path of the gather + SDPA backend ran, read from the profiler.

A real engine (``attention_backend: sdpa``) runs each path once under ``torch.profiler`` (CPU activity: the ATen op
each SDPA call dispatches to is recorded on the host, on CPU and CUDA alike): a prefill with no cached context, a
chunk with cached context (folded heads and a mask under GQA; the lower-right causal bias without), a decode batch
of unequal contexts (masked), a single decode (unmasked), and the static decode step the CUDA graphs capture (masked,
padded). Kernels: ``flash``,
``efficient``, ``cudnn``, ``math`` (unfused: upcasts to float32, repeats K/V per head) or ``cpu_flash``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from checks.gpu.gpu_check_engine import RequestFailed, _abort_all, greedy
from checks.gpu.gpu_check_time import NEVER, Deadline
from engine.decode_graphs import DecodeGraphs, StaticStep
from engine.llm_engine import LLMEngine

# ATen ops an SDPA call dispatches to, by kernel
KERNEL_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_flash_attention_forward": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_efficient_attention_forward": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "cpu_flash",
}


def kernels_of(events: Any) -> list[str]:
    """The SDPA kernels among profiler events, most frequent first."""
    counts: dict[str, int] = {}
    for event in events:
        kernel = KERNEL_OPS.get(event.name)
        if kernel is not None:
            counts[kernel] = counts.get(kernel, 0) + 1
    return sorted(counts, key=lambda k: -counts[k])


def _profiled_step(engine: LLMEngine, deadline: Deadline, doing: str) -> list[str]:
    deadline.check(doing)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outputs = engine.step()
        if engine.config.device.startswith("cuda"):
            torch.cuda.synchronize()
    for output in outputs:
        if output.error is not None:
            raise RequestFailed(f"{doing}: {output.error}")
    return kernels_of(prof.events())


def sdpa_kernels(engine: LLMEngine, prompt_len: int, deadline: Deadline = NEVER) -> dict[str, Any]:
    """Each path's kernels (see the module docstring). ``engine``: the sdpa backend, decode graphs off, a
    ``max_batch_tokens`` below ``prompt_len`` (so a long prompt is chunked), two decode rows or more."""
    if engine.runner.backend.name != "sdpa" or engine.runner.decode_graphs is not None:
        raise ValueError("sdpa_kernels needs an engine on the sdpa backend without decode graphs")
    chunk, vocab = engine.config.max_batch_tokens, int(engine.model.config.vocab_size)
    paths: dict[str, list[str]] = {}
    short = [[(7 * i + 3 * j) % (vocab - 1) + 1 for j in range(min(prompt_len, chunk) // (i + 2))] for i in range(2)]
    ids = [engine.add_request(p, greedy(2)) for p in short]
    try:
        paths["prefill"] = _profiled_step(engine, deadline, "profiling a prefill")
        paths["decode_masked"] = _profiled_step(engine, deadline, "profiling a padded decode")
        _abort_all(engine, ids)
        long_prompt = [(11 * j) % (vocab - 1) + 1 for j in range(chunk + chunk // 2)]
        ids = [engine.add_request(long_prompt, greedy(2))]
        _profiled_step(engine, deadline, "profiling a first chunk")
        paths["prefill_with_context"] = _profiled_step(engine, deadline, "profiling a chunk with cached context")
        paths["decode_unmasked"] = _profiled_step(engine, deadline, "profiling a single decode")
        _abort_all(engine, ids)
        engine.runner.decode_graphs = DecodeGraphs(
            engine.runner, engine.config.max_num_seqs, engine.max_model_len, StaticStep.EAGER
        )
        ids = [engine.add_request(p, greedy(2)) for p in short]
        _profiled_step(engine, deadline, "prefilling for the static decode")
        paths["decode_graph_step"] = _profiled_step(engine, deadline, "profiling the static (graph) decode step")
    finally:
        _abort_all(engine, ids)
        engine.runner.decode_graphs = None
    engine.check_no_leaks()
    return {
        "paths": paths,
        "math_anywhere": any("math" in kernels for kernels in paths.values()),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
    }
