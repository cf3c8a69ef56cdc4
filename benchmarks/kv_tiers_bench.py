"""``pdserve bench kv-tiers``: KV tiers (host memory, disk) under a multi-tenant shared-prefix load, against no tiers.

T tenants, each with an L-token system prompt, ask in turn (request i: tenant i mod T) on a served cluster
(disaggregated 1 prefill + 1 decode worker, or ``--mode colocated``: 1 worker) whose workers hold few device KV
blocks (``--kv-blocks``), so the tenants' prefixes take at least 4x a worker's KV (``sizing``) and an LRU device
cache alone misses every time. Two runs, same requests, each on a fresh cluster:
- ``without``: no ``kv_offload``: an evicted prefix is recomputed;
- ``with``: a host tier that holds every tenant's prefix and every request's own blocks, and a disk tier below it,
  in a folder this bench creates and removes; each run has a ``host_pool`` of its own, so the runs share nothing.
Each run first sends one request per tenant (not measured), then measures ``--num-prompts``. Figures: TTFT p50/p90,
prefix hit rate (usage's cached tokens over prompt tokens, and the workers' device + tier hit tokens), what each
tier saved and loaded (``/status``), and the goals: TTFT p50 with/without <= 0.33, hit rate with tiers >= 0.8.

Then the restart (``--restart-requests``, disk tier only, an empty folder): one request per tenant on a fresh
worker (cold: nothing cached anywhere), then the worker that computes prompts is SIGKILLed and Ray restarts it (with
``--in-process`` nothing restarts a thread: the cluster is stopped and started again on the same folder instead), and
requests on the tenants whose prefixes left the device first measure the restarted worker. Both phases start with a
prompt shorter than a block (nothing to cache or load), so neither pays a fresh process's first forward. Goal: the
restarted worker's TTFT p50 <= 0.5x the cold one.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from bench.loadtest.cli import Plan, execute, result_folder
from bench.loadtest.client import RequestSpec
from bench.loadtest.workloads import PromptBuilder
from benchmarks.options import add_kv_tiers_bench_arguments as add_arguments
from benchmarks.routing_figures import ratio, run_figures, worker_sum
from benchmarks.served_cluster import (
    Snapshot,
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
    from cluster.run.launch import ServeHandle

RUNS = ("without", "with")
GOAL_TTFT_P50_RATIO = 0.33
GOAL_HIT_RATE = 0.8
GOAL_RESTART_TTFT_RATIO = 0.5
MIN_PREFIXES_OVER_KV = 4.0
TIER_KEYS = (
    "host_hit_tokens",
    "disk_hit_tokens",
    "host_saved_bytes",
    "disk_saved_bytes",
    "host_loaded_bytes",
    "disk_loaded_bytes",
    "tier_loads",
    "tier_load_seconds",
)
# where a request's TTFT goes, by the router's timing (``server_timing``): waiting for a decode reservation, in the
# prefill worker's queue, and its compute (a tier load, then the rest of the prompt)
TTFT_PARTS = ("router_queue", "prefill_queue", "prefill_compute")
TIER_MARGIN = 1.25  # the default tier size over what the run can put there
RESTART_TIMEOUT_S = 180.0
MIB = 1024 * 1024
LOG = "kv-tiers bench"


# ---- sizing and configs ----------------------------------------------------------------------------------------


def check_options(args: argparse.Namespace) -> None:
    for name in ("max_concurrency", "tenants", "prefix_len", "question_len", "output_len", "num_prompts", "kv_blocks"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("host_memory_mb", "disk_mb"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.restart_requests < 0:
        raise ValueError("--restart-requests cannot be negative")
    if args.restart_requests > args.num_prompts:
        raise ValueError("--restart-requests cannot exceed --num-prompts (it takes their questions)")


def sizing(
    args: argparse.Namespace, block_size: int, bytes_per_token: int, prefix_tokens: int, request_blocks: int
) -> dict[str, Any]:
    """The device KV against the tenants' prefixes, and the tiers' default sizes; ``ValueError`` when a worker cannot
    hold the requests in flight or the restart has no tenant whose prefix surely left the device."""
    prefix_blocks = prefix_tokens // block_size  # the full blocks a tenant's requests share
    own_blocks = request_blocks - prefix_blocks  # a request's question and the partial block after the prefix
    if args.max_concurrency * request_blocks > args.kv_blocks:
        raise ValueError(
            f"--kv-blocks {args.kv_blocks} cannot hold {args.max_concurrency} requests of {request_blocks} blocks"
        )
    all_prefixes = args.tenants * prefix_blocks
    over_kv = all_prefixes / args.kv_blocks
    # the restart asks tenants 0..K-1 again: their prefixes must have left the device (the last tenants' may be on
    # it still, and one more may be on its way to the disk)
    on_device = min(args.tenants, args.kv_blocks // max(1, prefix_blocks) + 1)
    left_device = args.tenants - on_device
    if args.restart_requests > left_device:
        raise ValueError(
            f"--restart-requests {args.restart_requests}: only {left_device} tenants' prefixes surely leave the "
            f"device KV before the restart (the rest may be on it): more tenants or fewer --kv-blocks"
        )
    block_mb = block_size * bytes_per_token / MIB
    requests = args.tenants + args.num_prompts  # warm-up and measured
    held_mb = (all_prefixes + requests * own_blocks) * block_mb
    default_mb = max(1, math.ceil(TIER_MARGIN * held_mb))
    return {
        "prefix_tokens": prefix_tokens,
        "prefix_blocks": prefix_blocks,
        "request_blocks": request_blocks,
        "device_kv_blocks": args.kv_blocks,
        "device_kv_tokens": args.kv_blocks * block_size,
        "device_kv_mb": round(args.kv_blocks * block_mb, 1),
        "all_prefixes_blocks": all_prefixes,
        "prefixes_over_device_kv": round(over_kv, 2),
        "at_least_4x": over_kv >= MIN_PREFIXES_OVER_KV,
        # between two visits of a tenant the other tenants' prompts pass through the device cache (LRU)
        "device_lru_always_misses": (args.tenants - 1) * request_blocks >= args.kv_blocks,
        "restart_tenants_off_device": left_device,
        "host_memory_mb": args.host_memory_mb or default_mb,
        "disk_mb": args.disk_mb or default_mb,
        "tier_default_mb": default_mb,
    }


def base_config(args: argparse.Namespace) -> ClusterConfig:
    """Every run's config before its tiers: 1 prefill + 1 decode worker (or 1 colocated), ``--kv-blocks`` each,
    prefix caching on, every prompt computed on the prefill worker."""
    from cluster.config import load_config

    given = getattr(args, "cluster_config", None)  # a ClusterConfig object (tests) instead of a file
    config = (given if given is not None else load_config(args.config)).model_copy(deep=True)
    if args.model:
        config.model.name = args.model
    config.mode = args.mode
    config.router.port = 0
    config.router.local_prefill_max_tokens = 0
    config.router.request_timeout_s = args.request_timeout_s
    config.pools.prefill.replicas = 1
    config.pools.decode.replicas = 1 if args.mode == "disaggregated" else 0
    for pool in (config.pools.prefill, config.pools.decode):
        pool.kv_blocks = args.kv_blocks
        pool.enable_prefix_caching = True
        pool.kv_offload = None
    return config


def tiered_config(
    base: ClusterConfig, name: str, folder: Path | None, host_memory_mb: int, disk_mb: int
) -> ClusterConfig:
    """``base`` with tiers on every pool: a host tier of ``host_memory_mb`` (0: none) under a ``host_pool`` named
    for this run alone, and a disk tier per pool in ``folder``/<pool> (None: none)."""
    from engine.config import KVOffloadConfig

    config = base.model_copy(deep=True)
    host_pool = f"kvbench-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    for pool_name in ("prefill", "decode"):
        disk_dir = None if folder is None else str(folder / pool_name)
        offload = KVOffloadConfig(
            host_memory_mb=host_memory_mb,
            disk_dir=disk_dir,
            disk_mb=disk_mb if disk_dir else 0,
            host_pool=host_pool,
        )
        getattr(config.pools, pool_name).kv_offload = offload
    return config


def offload_settings(config: ClusterConfig) -> dict[str, Any] | None:
    offload = config.pools.prefill.kv_offload
    return None if offload is None else dataclasses.asdict(offload)


# ---- the workload ----------------------------------------------------------------------------------------------


def workload_plan(args: argparse.Namespace, tokenizer_model: str) -> Plan:
    """One request per tenant for the warm-up, then ``--num-prompts`` measured, tenants in turn throughout."""
    argv = shared_prefix_argv(args.tenants, args.prefix_len, args.question_len, args.output_len)
    return closed_loop_plan(argv + ["--num-prompts", str(args.tenants + args.num_prompts)], args, tokenizer_model)


def subplan(plan: Plan, specs: list[RequestSpec]) -> Plan:
    """``plan`` sending exactly ``specs``, in order."""
    shape = dataclasses.replace(plan.shapes[0], num_prompts=len(specs), num_warmups=0)
    return dataclasses.replace(plan, specs=specs, shapes=[shape], later_specs=None)


def short_plan(plan: Plan, block_size: int, seed: int) -> Plan:
    """One prompt shorter than a block: a fresh worker's first forward, with nothing to cache or load."""
    tokens = max(2, block_size // 2)
    prompt = PromptBuilder(plan.tokenizer, plan.endpoint_type, seed=seed + 1).build(tokens)
    return subplan(plan, [RequestSpec(0, prompt, 1, tokens)])


# ---- figures ---------------------------------------------------------------------------------------------------


def compute_role(config: ClusterConfig) -> str:
    """The role of the worker that computes the prompts."""
    return "prefill" if config.mode == "disaggregated" else "colocated"


def tier_figures(before: dict, after: dict, roles: list[str]) -> dict[str, dict[str, float | None]]:
    """Per role, the tier counters' change between two ``/status`` (bytes, tokens, loads, seconds)."""
    out: dict[str, dict[str, float | None]] = {}
    for role in roles:
        deltas: dict[str, float | None] = {
            key: worker_sum(after, role, key) - worker_sum(before, role, key) for key in TIER_KEYS
        }
        seconds, loads = round(deltas["tier_load_seconds"] or 0.0, 3), deltas["tier_loads"]
        deltas["tier_load_seconds"] = seconds
        deltas["load_ms_mean"] = round(1000 * seconds / loads, 2) if loads else None
        out[role] = deltas
    return out


def phase_figures(summary: dict, before: Snapshot, after: Snapshot, config: ClusterConfig) -> dict[str, Any]:
    """One measured load's figures: the routing bench's (TTFT, TPOT, KV moved, what is held after), the prefix
    hit rate from usage and from the workers' counters, and what each tier did."""
    figures = run_figures(summary, before, after)
    (_, s0), (_, s1) = before, after
    role = compute_role(config)
    cached = summary.get("cached_tokens") or {}
    prompt_tokens = summary["total_input_tokens"]
    hits = {
        "device": worker_sum(s1, role, "prefix_hit_tokens") - worker_sum(s0, role, "prefix_hit_tokens"),
        "host": worker_sum(s1, role, "host_hit_tokens") - worker_sum(s0, role, "host_hit_tokens"),
        "disk": worker_sum(s1, role, "disk_hit_tokens") - worker_sum(s0, role, "disk_hit_tokens"),
    }
    figures["prompt_tokens"] = prompt_tokens
    figures["cached_prompt_tokens"] = cached.get("total")
    figures["hit_rate"] = {
        "usage": None if cached.get("fraction") is None else round(cached["fraction"], 4),
        "workers": ratio(sum(hits.values()), prompt_tokens),
    }
    figures["hit_tokens"] = {"role": role} | hits
    stages = summary.get("server_timing_ms") or {}
    figures["ttft_parts_ms_p50"] = {part: round(stages[part]["median"], 1) for part in TTFT_PARTS if part in stages}
    roles = [role] if config.mode == "colocated" else ["prefill", "decode"]
    figures["tiers"] = tier_figures(s0, s1, roles)
    return figures


def hit_rate(figures: dict) -> float | None:
    """The run's hit rate: usage's where the server reports it, else the workers'."""
    rate = figures["hit_rate"]
    return rate["usage"] if rate["usage"] is not None else rate["workers"]


def compare_runs(runs: dict[str, dict]) -> dict[str, Any]:
    without, with_ = runs["without"], runs["with"]
    p50 = ratio(with_["ttft_ms"]["p50"], without["ttft_ms"]["p50"])
    rate = hit_rate(with_)
    out: dict[str, Any] = {
        "ttft_p50_ratio": p50,
        "ttft_p90_ratio": ratio(with_["ttft_ms"]["p90"], without["ttft_ms"]["p90"]),
        "hit_rate": {name: hit_rate(figures) for name, figures in runs.items()},
        "goals": {
            "ttft_p50_ratio_at_most": GOAL_TTFT_P50_RATIO,
            "ttft_p50_ratio_met": p50 is not None and p50 <= GOAL_TTFT_P50_RATIO,
            "hit_rate_at_least": GOAL_HIT_RATE,
            "hit_rate_met": rate is not None and rate >= GOAL_HIT_RATE,
        },
    }
    goals = out["goals"]
    goals["all_met"] = goals["ttft_p50_ratio_met"] and goals["hit_rate_met"]
    return out


def compare_restart(cold: dict, restarted: dict) -> dict[str, Any]:
    p50 = ratio(restarted["ttft_ms"]["p50"], cold["ttft_ms"]["p50"])
    return {
        "ttft_p50_ratio": p50,
        "ttft_p90_ratio": ratio(restarted["ttft_ms"]["p90"], cold["ttft_ms"]["p90"]),
        "goal": {
            "ttft_p50_ratio_at_most": GOAL_RESTART_TTFT_RATIO,
            "met": p50 is not None and p50 <= GOAL_RESTART_TTFT_RATIO,
        },
    }


# ---- the runs --------------------------------------------------------------------------------------------------


def _one_run(
    config: ClusterConfig, plan: Plan, tenants: int, name: str, folder: Path, args: argparse.Namespace
) -> dict[str, Any]:
    warm, measured = subplan(plan, plan.specs[:tenants]), subplan(plan, plan.specs[tenants:])
    with serving(config, f"{LOG}: {name}", args.in_process) as handle:
        execute(warm, handle.base_url, config.served_model_name, folder, mode=f"{name} warm-up")
        summary, before, after = measure(handle, config, measured, name, folder)
    figures = phase_figures(summary, before, after, config)
    print(
        f"{LOG}: {name}: {figures['completed']}/{figures['requests']} completed, TTFT p50 {figures['ttft_ms']['p50']}"
        f" ms, hit rate {figures['hit_rate']}",
        file=sys.stderr,
    )
    return figures


def _kill_and_wait(handle: ServeHandle, role: str) -> dict[str, Any]:
    """SIGKILL the worker of ``role``; back once Ray has restarted it and the router has it live again."""
    record = next(w for w in handle.workers if w.role == role)
    pid = record.info["pid"]
    os.kill(pid, signal.SIGKILL)  # a worker process this bench started
    killed = time.monotonic()
    new_pid = None
    while time.monotonic() - killed < RESTART_TIMEOUT_S:
        new_pid = next((w.get("pid") for w in handle.worker_infos() if w["name"] == record.name), None)
        if new_pid not in (None, pid):
            status = httpx.get(f"{handle.base_url}/status", timeout=10).json()
            if any(w["name"] == record.name and w["alive"] for w in status["workers"]):
                break
        time.sleep(0.2)
    else:
        raise RuntimeError(f"{record.name} (pid {pid}) was not restarted within {RESTART_TIMEOUT_S:.0f} s")
    back_s = time.monotonic() - killed
    return {"worker": record.name, "pid": pid, "new_pid": new_pid, "back_after_s": round(back_s, 1)}


def _restart_run(
    base: ClusterConfig, plan: Plan, args: argparse.Namespace, folder: Path, tmp: Path, disk_mb: int
) -> dict[str, Any]:
    """Cold worker on an empty disk tier, then the same worker restarted on its pages (module docstring)."""
    config = tiered_config(base, "restart", tmp / "restart", 0, disk_mb)
    role = compute_role(config)
    block_size = config.transfer.block_size
    short = short_plan(plan, block_size, args.seed)
    cold_plan = subplan(plan, plan.specs[: args.tenants])
    # later questions, to the tenants that were computed first (their prefixes left the device first)
    restarted_plan = subplan(plan, plan.specs[args.tenants : args.tenants + args.restart_requests])
    model = config.served_model_name
    label = f"{LOG}: restart"
    out: dict[str, Any] = {"kv_offload": offload_settings(config), "role": role}

    def after_first_forward(handle: ServeHandle, phase: str, phase_plan: Plan) -> tuple[dict, Snapshot, Snapshot]:
        execute(short, handle.base_url, model, folder, mode=f"restart {phase} first forward")
        return measure(handle, config, phase_plan, f"restart {phase}", folder)

    with serving(config, label, args.in_process) as handle:
        cold = after_first_forward(handle, "cold", cold_plan)
        if not args.in_process:
            out["method"] = "the worker's process SIGKILLed mid-run and restarted by Ray on the same disk_dir"
            out["kill"] = _kill_and_wait(handle, role)
            restarted = after_first_forward(handle, "restarted", restarted_plan)
    if args.in_process:
        out["method"] = "in-process workers (nothing restarts a killed thread): the cluster stopped and started again"
        with serving(config, f"{label} (again)", args.in_process) as handle:
            restarted = after_first_forward(handle, "restarted", restarted_plan)
    out["cold"] = phase_figures(*cold, config)
    out["restarted"] = phase_figures(*restarted, config)
    out["tenants"] = {"cold": args.tenants, "restarted": sorted({s.group for s in restarted_plan.specs})}
    out |= compare_restart(out["cold"], out["restarted"])
    print(
        f"{LOG}: restart: TTFT p50 cold {out['cold']['ttft_ms']['p50']} ms, restarted "
        f"{out['restarted']['ttft_ms']['p50']} ms",
        file=sys.stderr,
    )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.model_loader import resolve_model_path

    check_options(args)
    base = base_config(args)
    model_path = str(resolve_model_path(base.model.name))
    per_token = model_kv_bytes_per_token(model_path, base.served_dtype)
    block_size = base.transfer.block_size
    plan = workload_plan(args, model_path)
    prefix_tokens, _, request_blocks = shared_prefix_blocks(plan, block_size)
    size = sizing(args, block_size, per_token, prefix_tokens, request_blocks)
    if not size["at_least_4x"]:
        print(
            f"{LOG}: warning: the tenants' prefixes take {size['prefixes_over_device_kv']}x a worker's device KV, "
            f"under the {MIN_PREFIXES_OVER_KV:g}x the measurement is meant for",
            file=sys.stderr,
        )
    folder = result_folder(args)
    out: dict[str, Any] = {
        "configuration": served_settings(base, args, per_token),
        "workload": {
            "tenants": args.tenants,
            "prefix_len": args.prefix_len,
            "question_len": args.question_len,
            "output_len": args.output_len,
            "num_prompts": args.num_prompts,
            "order": "tenants in turn: request i asks tenant i mod T",
            "warm_up": "one request per tenant before measuring, in every run (not measured)",
            "input_tokens_mean": round(sum(s.input_tokens for s in plan.specs) / len(plan.specs), 1),
        },
        "sizing": size,
        "runs": {},
        "result_dir": str(folder),
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-tiers-") as tmp, local_ray(base, args.in_process):
        configs = {
            "without": base,
            "with": tiered_config(base, "with", Path(tmp) / "with", size["host_memory_mb"], size["disk_mb"]),
        }
        for name in RUNS:
            figures = _one_run(configs[name], plan, args.tenants, name, folder, args)
            out["runs"][name] = {"kv_offload": offload_settings(configs[name])} | figures
        out["comparison"] = compare_runs(out["runs"])
        if args.restart_requests:
            out["restart"] = _restart_run(base, plan, args, folder, Path(tmp), size["disk_mb"])
    out["tier_folders_removed"] = not Path(tmp).exists()
    out["wall_s"] = round(time.monotonic() - started, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.loadtest.cli import run_main

    return run_main("python -m benchmarks.kv_tiers_bench", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
