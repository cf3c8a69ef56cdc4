"""Measured loads on a cluster this process serves, for the benchmarks that compare cluster configs run after run
(``benchmarks/routing_bench.py``, ``benchmarks/kv_tiers_bench.py``).

``local_ray`` starts a local Ray sized for a config's pools (unless one is up, or the workers are threads);
``serving`` starts a cluster (``cluster/run/launch.py``) and stops it after; ``closed_loop_plan`` builds the load
tester's plan through its own options, and ``measure`` runs it against the cluster between two snapshots of the
router's ``/metrics`` samples and its settled ``/status`` (``benchmarks/routing_figures.py``), from which the benchmarks
make their figures.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.loadtest.cli import Plan, execute, prepare
from bench.loadtest.options import add_workload_arguments
from benchmarks.routing_figures import Samples, router_samples, settle

if TYPE_CHECKING:
    from cluster.config import ClusterConfig
    from cluster.run.launch import ServeHandle

Snapshot = tuple[Samples, dict]  # the router's samples and its settled /status


def bench_config(args: argparse.Namespace) -> ClusterConfig:
    """The config a benchmark serves: ``--config`` (or ``args.cluster_config``, a ClusterConfig tests give), its model
    overridden by ``--model``, on a free port."""
    from cluster.config import load_config

    given = getattr(args, "cluster_config", None)
    config = (given if given is not None else load_config(args.config)).model_copy(deep=True)
    if args.model:
        config.model.name = args.model
    config.router.port = 0
    return config


@contextmanager
def local_ray(config: ClusterConfig, in_process: bool, spare_cpus: float = 0) -> Iterator[None]:
    """A local Ray for the whole benchmark, its logical CPUs enough for every worker's share and ``spare_cpus`` more
    (a worker started while another still holds its bundle); shut down after."""
    import ray

    from cluster.run.ray_cluster import init_local_ray

    if in_process or ray.is_initialized():
        yield
        return
    needed = sum(p.replicas * p.cpus_per_replica for p in (config.pools.prefill, config.pools.decode)) + spare_cpus
    init_local_ray(max(math.ceil(needed), os.cpu_count() or 1), config.ray.namespace)
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def serving(config: ClusterConfig, label: str, in_process: bool) -> Iterator[ServeHandle]:
    from cluster.run.launch import start_serving

    print(f"{label}: starting the cluster", file=sys.stderr)
    handle = start_serving(config, in_process=in_process)
    try:
        yield handle
    finally:
        handle.stop()


def snapshot(handle: ServeHandle) -> Snapshot:
    status = settle(handle.base_url)
    return router_samples(handle.base_url), status


def measure(
    handle: ServeHandle, config: ClusterConfig, plan: Plan, label: str, folder: Path
) -> tuple[dict, Snapshot, Snapshot]:
    """The load tester's summary of ``plan`` (its single rate) and the snapshots before and after it."""
    before = snapshot(handle)
    [summary], _, _ = execute(plan, handle.base_url, config.served_model_name, folder, mode=label)
    return summary, before, snapshot(handle)


def closed_loop_plan(workload_argv: list[str], args: argparse.Namespace, tokenizer_model: str) -> Plan:
    """The load tester's plan, parsed from its own options (defaults and checks stay its own): the workload's, in a
    closed loop at ``args.max_concurrency`` with ``args.seed`` and ``args.request_timeout_s``."""
    parser = argparse.ArgumentParser(add_help=False)
    add_workload_arguments(parser)
    argv = ["--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed), "--disable-tqdm"]
    argv += ["--request-timeout-s", str(args.request_timeout_s), "--metric-percentiles", "50,90,99"]
    return prepare(parser.parse_args(argv + workload_argv), tokenizer_model)


def shared_prefix_argv(groups: int, prefix_len: int, question_len: int, output_len: int) -> list[str]:
    """The load tester's shared-prefix workload: request i asks group i mod ``groups`` (``ignore_eos``)."""
    argv = ["--dataset-name", "shared-prefix", "--shared-prefix-groups", str(groups)]
    argv += ["--shared-prefix-len", str(prefix_len), "--random-input-len", str(question_len)]
    return argv + ["--random-output-len", str(output_len), "--ignore-eos"]


def shared_prefix_blocks(plan: Plan, block_size: int) -> tuple[int, int, int]:
    """A shared-prefix plan's longest prefix in tokens, the full blocks it fills (what a group's requests share),
    and the most blocks one request's prompt takes."""
    tokenizer = plan.tokenizer
    prefix_tokens = max(len(tokenizer(s.system or "", add_special_tokens=True)["input_ids"]) for s in plan.specs)
    return prefix_tokens, prefix_tokens // block_size, max(math.ceil(s.input_tokens / block_size) for s in plan.specs)


def served_settings(config: ClusterConfig, args: argparse.Namespace, kv_bytes_per_token: int) -> dict[str, Any]:
    """What a run's figures depend on besides the workload, as the benchmarks' JSON reports it."""
    pools = config.pools
    return {
        "model": config.model.name,
        "dtype": config.served_dtype,
        "mode": config.mode,
        "pools": {"prefill": pools.prefill.replicas, "decode": pools.decode.replicas},
        "block_size": config.transfer.block_size,
        "kv_bytes_per_token": kv_bytes_per_token,
        "torch_threads": {"prefill": pools.prefill.torch_threads, "decode": pools.decode.torch_threads},
        "transfer_backend": config.transfer.backend,
        "max_concurrency": args.max_concurrency,
        "load": "closed loop",
        "seed": args.seed,
        "in_process": args.in_process,
        "cpu_count": os.cpu_count(),
    }
