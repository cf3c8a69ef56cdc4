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
    parser.add_argument(
        "--expert-parallel-size",
        type=int,
        default=None,
        metavar="E",
        help="split a mixture of experts' routed experts E ways over those ranks (1 or N; default: the pools' own); "
        "`pdserve plan` reads one profile per (tensor, expert) degree",
    )
    parser.add_argument(
        "--roofline",
        default=None,
        metavar="GPU",
        help="measure nothing: estimate a GPU's profile from --model's shape and the GPU's datasheet "
        "(h100-sxm, h200, a100-80gb; planner/roofline.py), labelled as an estimate",
    )
    parser.add_argument("--model", default=None, help="with --roofline: a preset (llama-3.1-8b, ...) or a model folder")
    parser.add_argument("--dtype", default="bf16", help="with --roofline: bf16 or fp16 (default bf16)")


def run(args: argparse.Namespace) -> int:
    from cluster.config import load_config
    from planner.profiler import profile_cluster

    if args.roofline is not None:
        profile = _roofline(args)
        profile.save(args.out)
        print(
            f"wrote {args.out}: {profile.model} ({profile.dtype}) on {profile.device}\n{profile.notes}", file=sys.stderr
        )
        return 0
    if args.model is not None:
        raise ValueError("--model goes with --roofline; a measured profile takes the model of --config")
    config = load_config(args.config)  # ConfigError is a ValueError: main prints it, exit 2
    profile = profile_cluster(
        config,
        quick=args.quick,
        progress=not args.no_progress,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel_size=args.expert_parallel_size,
    )
    profile.save(args.out)
    summary = (
        f"wrote {args.out}: {profile.model} ({profile.dtype}) on {profile.device}, tensor_parallel_size "
        f"{profile.tensor_parallel_size}, expert_parallel_size {profile.expert_parallel_size}, backend {profile.backend}, "
        f"{len(profile.prefill_points)} prefill / {len(profile.decode_points)} decode / "
        f"{len(profile.transfer_points)} transfer points\n{profile.notes}"
    )
    print(summary, file=sys.stderr)
    return 0


def _roofline(args: argparse.Namespace):
    from engine.expert_parallel import degree_field
    from planner.kv_sizing import load_shape
    from planner.roofline import roofline_profile

    if args.model is None:
        raise ValueError("--roofline needs --model (a preset such as llama-3.1-8b, or a model folder)")
    tp = args.tensor_parallel_size or 1
    try:
        load_shape(args.model).rank_shape(tp, args.expert_parallel_size or 1)
    except ValueError as exc:
        flag = "--" + degree_field(exc).replace("_", "-")
        raise ValueError(f"{flag}: {exc}") from None
    return roofline_profile(
        load_shape(args.model), args.roofline, args.dtype, tp, expert_parallel_size=args.expert_parallel_size or 1
    )
