"""``pdserve profile --config F``: measure prefill, decode and KV transfer times here; write the profile JSON.

Standard library only at module level; the measuring is ``planner/profiler.py``."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default="local", help="cluster config: a YAML path or a shipped config's name (default: local)"
    )
    parser.add_argument("--out", default="profile.json", help="where to write the profile (default: profile.json)")
    parser.add_argument("--quick", action="store_true", help="fewer points and repeats (tests, a first look)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="profile both pools' workers at this degree (default: the pools' own); `pdserve plan` reads one "
        "profile per degree",
    )


def run(args: argparse.Namespace) -> int:
    from cluster.config import load_config
    from planner.profiler import profile_cluster

    config = load_config(args.config)  # ConfigError is a ValueError: main prints it, exit 2
    profile = profile_cluster(
        config,
        quick=args.quick,
        progress=not args.no_progress,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    profile.save(args.out)
    summary = (
        f"wrote {args.out}: {profile.model} ({profile.dtype}) on {profile.device}, tensor_parallel_size "
        f"{profile.tensor_parallel_size}, backend {profile.backend}, "
        f"{len(profile.prefill_points)} prefill / {len(profile.decode_points)} decode / "
        f"{len(profile.transfer_points)} transfer points\n{profile.notes}"
    )
    print(summary, file=sys.stderr)
    return 0
