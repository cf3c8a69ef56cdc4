"""``pdserve bench tp``: prefill and decode step time of one engine at each tensor-parallel degree, same total threads.

Each degree N runs as N local processes (``engine.tp_launch``) with ``--threads / N`` torch threads each, so every
degree has the same CPU; rank 0 prefills ``--batch`` prompts of ``--input-len`` random tokens in one step, then
decodes ``--output-len`` tokens, and reports the mean prefill and decode step times from the engine's own step
stats. On a CPU this is a correctness feature, not a speed claim: the all-reduces and the step broadcast cost what
the split saves. The greedy tokens of every degree are compared with degree 1's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from typing import Any

from benchmarks.options import main


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--degrees", default="1,3", help="tensor-parallel degrees (each must divide the heads)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all, split over a degree's ranks")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="runs per degree after a warm-up; the median is kept")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")


def _rank(rank: int, size: int, store_path: str, payload: dict) -> dict:
    import torch
    import torch.distributed as dist

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams
    from engine.tensor_parallel import RowParallel, TPGroup
    from engine.tp_launch import serve_follower

    torch.set_num_threads(max(1, payload["threads"] // size))
    group = TPGroup(dist.FileStore(store_path, size), rank, size, timeout_s=120.0) if size > 1 else None
    config = EngineConfig(
        model=payload["model"],
        dtype="float32",
        max_batch_tokens=payload["batch"] * payload["input_len"],
        enable_prefix_caching=False,  # every repeat computes its prompts
        tensor_parallel_size=payload.get("tensor_parallel_size", size),
        expert_parallel_size=payload.get("expert_parallel_size", 1),
    )
    if rank > 0:
        assert group is not None  # size > 1
        return {"ended": serve_follower(config, group)}
    engine = LLMEngine(config, group)
    params = SamplingParams(max_tokens=payload["output_len"], temperature=0.0, ignore_eos=True)
    greedy = _greedy_logprobs(engine, payload["prompts"], params) if payload.get("logprobs") else None
    runs = []
    for _ in range(1 + payload["repeats"]):
        engine.step_stats.clear()
        results = engine.generate(payload["prompts"], params)
        stats = list(engine.step_stats)
        prefill = [s.duration_s for s in stats if s.num_decode_tokens == 0]
        decode = [s.duration_s for s in stats if s.num_prefill_tokens == 0]
        runs.append({"prefill_s": statistics.mean(prefill), "decode_s": statistics.mean(decode)})
    engine.check_no_leaks()
    if engine.runner.step_channel is not None:
        engine.runner.step_channel.stop()
    measured = runs[1:]  # the first is the warm-up
    traffic = engine.expert_traffic
    return {
        "row_parallel_linears": sum(isinstance(m, RowParallel) for m in engine.model.modules()),
        "expert_traffic": traffic.summary() if traffic is not None else None,
        "prefill_step_ms": 1000 * statistics.median(r["prefill_s"] for r in measured),
        "decode_step_ms": 1000 * statistics.median(r["decode_s"] for r in measured),
        "tokens": [r.token_ids for r in results],
        **({"logprobs": greedy} if greedy is not None else {}),
    }


def _greedy_logprobs(engine: Any, prompts: list[list[int]], params: Any) -> list[list[float]]:
    """Each prompt's chosen tokens' logprobs, greedy (the gap between degrees is measured on them)."""
    params = params.copy()
    params.logprobs = 0
    ids = [engine.add_request(prompt, params.copy(), request_id=f"logprobs-{i}") for i, prompt in enumerate(prompts)]
    out: dict[str, list[float]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for step in engine.step():
            out[step.request_id].extend(lp.logprob for lp in step.logprobs or [])
    return [out[rid] for rid in ids]


def run(args: argparse.Namespace) -> dict:
    from engine.model_loader import load_tokenizer
    from engine.tp_launch import run_ranks

    degrees = [int(d) for d in args.degrees.split(",") if d.strip()]
    if not degrees or any(d < 1 for d in degrees):
        raise ValueError(f"--degrees: positive integers, got {args.degrees!r}")
    tokenizer = load_tokenizer(args.model)
    rng = random.Random(0)
    ordinary = [t for t in range(len(tokenizer)) if t not in set(tokenizer.all_special_ids)]
    prompts = [[rng.choice(ordinary) for _ in range(args.input_len)] for _ in range(args.batch)]
    payload = {
        "model": args.model,
        "threads": args.threads,
        "batch": args.batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "prompts": prompts,
    }
    by_degree = {}
    for degree in degrees:
        print(f"degree {degree}: {degree} rank(s), {max(1, args.threads // degree)} threads each", file=sys.stderr)
        by_degree[degree] = run_ranks(_rank, degree, payload, timeout_s=1800)[0]
    base = by_degree[degrees[0]]
    return {
        "benchmark": "tensor-parallel step time, same total threads",
        "model": args.model,
        "threads_total": args.threads,
        "batch": args.batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "degrees": {
            str(d): {
                "threads_per_rank": max(1, args.threads // d),
                "prefill_step_ms": round(r["prefill_step_ms"], 2),
                "decode_step_ms": round(r["decode_step_ms"], 2),
                f"prefill_vs_degree_{degrees[0]}": round(r["prefill_step_ms"] / base["prefill_step_ms"], 3),
                f"decode_vs_degree_{degrees[0]}": round(r["decode_step_ms"] / base["decode_step_ms"], 3),
                f"same_tokens_as_degree_{degrees[0]}": r["tokens"] == base["tokens"],
            }
            for d, r in by_degree.items()
        },
    }


if __name__ == "__main__":
    sys.exit(main("python -m benchmarks.tp_bench", add_arguments, run))
