"""``pdserve bench routing``: KV-aware routing and prefix reuse against a least-loaded baseline, in one invocation.

On the served cluster (Ray, or threads with ``--in-process``; 2 prefill workers, 1 decode), per workload two runs,
each on a fresh cluster with the same requests in the same order:
- ``baseline``: both policies least_loaded, decode prefix caching off, ``local_prefill_max_tokens`` 0: a prompt goes
  to the least loaded worker whatever it holds, and the decode worker receives every block of every prompt;
- ``kv_aware``: both policies kv_aware, decode prefix caching on, ``local_prefill_max_tokens`` from the flag (default
  128 for multi-turn, where a later turn's uncached part is its new user message; 0 for shared-prefix, so that the
  prefill routing is what is measured).
Closed loop at ``--max-concurrency`` (default 2, one per prefill worker; with more, a prefix hit mostly waits behind
a miss, docs/benchmarks.md section 8). Shared-prefix groups are shuffled and multi-turn think times exponential, so
least_loaded cannot partition them by accident; each prefill worker's KV holds half the groups' prefixes plus the
requests in flight (``prefill_sizing``). Figures: ``benchmarks/routing_figures.py``; the goal is TTFT p50 ratio <= 0.5.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from typing import TYPE_CHECKING, Any

from bench.loadtest.cli import Plan, result_folder
from bench.loadtest.workloads import PromptBuilder
from benchmarks.options import add_routing_bench_arguments as add_arguments
from benchmarks.routing_figures import compare, run_figures
from benchmarks.served_cluster import (
    closed_loop_plan,
    local_ray,
    measure,
    served_settings,
    serving,
    shared_prefix_argv,
    shared_prefix_blocks,
)
from engine.blocks import model_kv_bytes_per_token

if TYPE_CHECKING:
    from cluster.config import ClusterConfig

RUNS = ("baseline", "kv_aware")
WORKLOADS = ("shared-prefix", "multi-turn")
# the kv_aware run's local_prefill_max_tokens without --local-prefill-max-tokens (module docstring)
LOCAL_PREFILL_DEFAULT = {"shared-prefix": 0, "multi-turn": 128}
MIB = 1024 * 1024


# ---- the cluster configs ---------------------------------------------------------------------------------------


def base_config(args: argparse.Namespace) -> ClusterConfig:
    """The config every run starts from: disaggregated, 2 prefill workers (prefix caching on), 1 decode worker."""
    from cluster.config import load_config

    given = getattr(args, "cluster_config", None)  # a ClusterConfig object (tests) instead of a file
    config = (given if given is not None else load_config(args.config)).model_copy(deep=True)
    if args.model:
        config.model.name = args.model
    config.mode = "disaggregated"
    config.router.port = 0
    config.pools.prefill.replicas = 2
    config.pools.decode.replicas = 1
    config.pools.prefill.enable_prefix_caching = True
    return config


def local_prefill_max_tokens(args: argparse.Namespace, workload: str) -> int:
    if args.local_prefill_max_tokens is not None:
        return args.local_prefill_max_tokens
    return LOCAL_PREFILL_DEFAULT[workload]


def run_config(
    base: ClusterConfig, run: str, args: argparse.Namespace, prefill_kv_blocks: int | None, workload: str
) -> ClusterConfig:
    """One run's config: ``baseline`` or ``kv_aware``, otherwise the same."""
    config = base.model_copy(deep=True)
    new = run == "kv_aware"
    config.router.prefill_policy = "kv_aware" if new else "least_loaded"
    config.router.decode_policy = "kv_aware" if new else "least_loaded"
    config.pools.decode.enable_prefix_caching = new
    config.router.local_prefill_max_tokens = local_prefill_max_tokens(args, workload) if new else 0
    if new and args.prefix_weight is not None:
        config.router.kv_aware.prefix_weight = args.prefix_weight
    if new and args.load_weight is not None:
        config.router.kv_aware.load_weight = args.load_weight
    if prefill_kv_blocks is not None:
        config.pools.prefill.kv_blocks = prefill_kv_blocks
    return config


def run_settings(config: ClusterConfig) -> dict[str, Any]:
    """What differs between the runs, read back from each run's config."""
    router = config.router
    return {
        "prefill_policy": router.prefill_policy,
        "decode_policy": router.decode_policy,
        "decode_prefix_caching": config.pools.decode.enable_prefix_caching,
        "local_prefill_max_tokens": router.local_prefill_max_tokens,
        "kv_aware_weights": router.kv_aware.model_dump(),
    }


def prefill_sizing(plan: Plan, args: argparse.Namespace, block_size: int, bytes_per_token: int) -> dict[str, Any]:
    """The prefill workers' KV for shared-prefix: half the groups' prefixes plus every request in flight's own blocks
    (its question and the partial block after the prefix), so all the prefixes do not fit one worker and half do."""
    prefix_tokens, prefix_blocks, request_blocks = shared_prefix_blocks(plan, block_size)
    headroom = args.max_concurrency * (request_blocks - prefix_blocks)
    kv_blocks = args.prefill_kv_blocks or max(
        request_blocks, math.ceil(args.prefix_groups / 2) * prefix_blocks + headroom
    )
    return {
        "prefix_tokens": prefix_tokens,
        "prefix_blocks": prefix_blocks,
        "request_blocks": request_blocks,
        "in_flight_headroom_blocks": headroom,
        "kv_blocks": kv_blocks,
        "kv_memory_mb": round(kv_blocks * block_size * bytes_per_token / MIB, 1),
        "all_prefixes_blocks": args.prefix_groups * prefix_blocks,
        "prefixes_one_worker_holds": kv_blocks // prefix_blocks if prefix_blocks else None,
        "all_prefixes_fit_one_worker": args.prefix_groups * prefix_blocks + headroom <= kv_blocks,
        "half_the_prefixes_fit_one_worker": math.ceil(args.prefix_groups / 2) * prefix_blocks <= kv_blocks,
    }


# ---- the workloads ---------------------------------------------------------------------------------------------


def workload_plan(args: argparse.Namespace, workload: str, tokenizer_model: str) -> Plan:
    """The load tester's plan for one workload; shared-prefix's groups in an order shuffled with the seed."""
    if workload == "shared-prefix":
        argv = shared_prefix_argv(args.prefix_groups, args.prefix_len, args.question_len, args.output_len)
        argv += ["--num-prompts", str(args.num_prompts)]
    else:
        argv = ["--dataset-name", "multi-turn", "--num-conversations", str(args.num_conversations)]
        argv += ["--num-turns", str(args.num_turns), "--random-input-len", str(args.user_len)]
        argv += ["--random-output-len", str(args.turn_output_len), "--think-time-s", str(args.think_time_s)]
        argv += ["--think-time-dist", "exponential"]
    plan = closed_loop_plan(argv, args, tokenizer_model)
    if workload == "shared-prefix":
        random.Random(args.seed).shuffle(plan.specs)  # groups in a random order, the same in both runs
    elif args.system_len:
        # one system prompt for every chat, as a deployment has: computed once per worker, then a cached prefix
        system = PromptBuilder(plan.tokenizer, "chat", seed=args.seed).build_system(args.system_len)
        for conversation in plan.conversations or []:
            conversation.system = system
    return plan


# ---- the runs --------------------------------------------------------------------------------------------------


def _one_run(config: ClusterConfig, plan: Plan, label: str, folder, in_process: bool) -> dict[str, Any]:
    with serving(config, f"routing bench: {label}", in_process) as handle:
        summary, before, after = measure(handle, config, plan, label, folder)
    figures = run_figures(summary, before, after)
    print(
        f"routing bench: {label}: {figures['completed']}/{figures['requests']} completed, "
        f"TTFT p50 {figures['ttft_ms']['p50']} ms, {figures['kv_bytes']['per_request']} KV bytes/request",
        file=sys.stderr,
    )
    return figures


def _workload_settings(args: argparse.Namespace, workload: str, plan: Plan) -> dict[str, Any]:
    if workload == "shared-prefix":
        return {
            "prefix_groups": args.prefix_groups,
            "prefix_len": args.prefix_len,
            "question_len": args.question_len,
            "output_len": args.output_len,
            "num_prompts": args.num_prompts,
            "order": "groups shuffled with the seed",
            "input_tokens_mean": round(sum(s.input_tokens for s in plan.specs) / len(plan.specs), 1),
        }
    return {
        "num_conversations": args.num_conversations,
        "num_turns": args.num_turns,
        "system_len": args.system_len,
        "user_len": args.user_len,
        "turn_output_len": args.turn_output_len,
        "think_time_s": args.think_time_s,
        "think_time_dist": "exponential",
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.model_loader import resolve_model_path

    for name in ("max_concurrency", "prefix_groups", "prefix_len", "question_len", "num_prompts", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.system_len < 0 or (args.local_prefill_max_tokens or 0) < 0:
        raise ValueError("--system-len and --local-prefill-max-tokens cannot be negative")
    base = base_config(args)
    model_path = str(resolve_model_path(base.model.name))
    per_token = model_kv_bytes_per_token(model_path, base.served_dtype)
    block_size = base.transfer.block_size
    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    folder = result_folder(args)
    out: dict[str, Any] = {
        "configuration": served_settings(base, args, per_token)
        | {
            "prefill_kv_blocks_config": base.pools.prefill.kv_blocks,
            "prefill_kv_memory_mb_config": base.pools.prefill.kv_memory_mb,
            "decode_kv_blocks": base.pools.decode.kv_blocks,
            "decode_kv_memory_mb": base.pools.decode.kv_memory_mb,
        },
        "workloads": {},
        "result_dir": str(folder),
    }
    t_start = time.monotonic()
    with local_ray(base, args.in_process):
        for workload in workloads:
            plan = workload_plan(args, workload, model_path)
            entry: dict[str, Any] = {
                "workload": _workload_settings(args, workload, plan),
                "runs_compared": {name: run_settings(run_config(base, name, args, None, workload)) for name in RUNS},
            }
            kv_blocks = None
            if workload == "shared-prefix":
                entry["prefill_kv"] = prefill_sizing(plan, args, block_size, per_token)
                kv_blocks = entry["prefill_kv"]["kv_blocks"]
            runs = {}
            for name in RUNS:
                config = run_config(base, name, args, kv_blocks, workload)
                runs[name] = _one_run(config, plan, f"{workload} {name}", folder, args.in_process)
            entry |= runs
            entry |= compare(runs)
            out["workloads"][workload] = entry
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.loadtest.cli import run_main

    return run_main("python -m benchmarks.routing_bench", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
