"""``pdserve plan kv``: KV bytes per token, tokens per GiB, and how many requests of a context fit a GPU.

Standard library only at module level; the sizing is ``planner/kv_sizing.py``. A bad value is a ValueError naming
its flag."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="a model folder (its config.json only), the default model's name, or a preset: llama-3.2-1b, "
        "llama-3.1-8b, llama-3.1-70b, qwen2.5-7b, mistral-7b, smollm2-135m",
    )
    parser.add_argument("--dtype", default=None, help="KV and weight dtype: float32, bfloat16, float16 (bf16, fp16)")
    parser.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=None,
        metavar="G",
        help="GPU memory in GiB (an 80 GB H100: 80); with it, the KV budget left after the weights",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="U",
        help="share of the GPU memory the server may use, in (0, 1] (default 0.9)",
    )
    parser.add_argument("--context", type=int, default=None, metavar="L", help="tokens per request (prompt + output)")
    parser.add_argument("--block-size", type=int, default=None, help="KV block size in tokens (default: the engine's)")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="ranks per worker (pools.<pool>.tensor_parallel_size): the figures are then one rank's GPU (default 1)",
    )
    parser.add_argument(
        "--expert-parallel-size",
        type=int,
        default=1,
        metavar="E",
        help="a mixture of experts' routed experts split over those ranks (pools.<pool>.expert_parallel_size: 1 or "
        "N); at 1 every rank holds every routed expert, whole",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _check(args: argparse.Namespace) -> None:
    if not args.model:
        raise ValueError("--model is required (a model folder, the default model, or a preset)")
    if not args.dtype:
        raise ValueError("--dtype is required (float32, bfloat16 or float16)")
    if args.gpu_memory_gb is not None and not args.gpu_memory_gb > 0:
        raise ValueError(f"--gpu-memory-gb must be positive, got {args.gpu_memory_gb}")
    utilization = args.gpu_memory_utilization
    if utilization is not None:
        if not 0 < utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
        if args.gpu_memory_gb is None:
            raise ValueError("--gpu-memory-utilization needs --gpu-memory-gb")
    if args.context is not None and args.context <= 0:
        raise ValueError(f"--context must be a positive number of tokens, got {args.context}")
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")
    if args.block_size is not None and args.block_size <= 0:
        raise ValueError(f"--block-size must be a positive number of tokens, got {args.block_size}")


def run(args: argparse.Namespace) -> int:
    _check(args)
    from engine.config import EngineConfig
    from engine.expert_parallel import degree_field
    from planner.kv_sizing import DEFAULT_GPU_MEMORY_UTILIZATION, format_table, load_shape, normalize_dtype, size_kv

    try:
        dtype = normalize_dtype(args.dtype)
    except ValueError as exc:
        raise ValueError(f"--dtype: {exc}") from None
    try:
        shape = load_shape(args.model)
    except ValueError as exc:
        raise ValueError(f"--model: {exc}") from None
    try:
        shape.rank_shape(args.tensor_parallel_size, args.expert_parallel_size)  # the model splits that many ways
    except ValueError as exc:
        flag = "--" + degree_field(exc).replace("_", "-")
        raise ValueError(f"{flag}: {exc}") from None
    sizing = size_kv(
        shape,
        dtype,
        block_size=args.block_size or EngineConfig().block_size,
        gpu_memory_gib=args.gpu_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        context_tokens=args.context,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel_size=args.expert_parallel_size,
    )
    print(json.dumps(sizing.to_dict()) if args.json else format_table(sizing))
    return 0
