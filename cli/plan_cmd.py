"""``pdserve plan``: simulate colocated and every P:D split of N devices on a workload, at every tensor-parallel
degree profiled (one profile per degree); recommend one for an SLO (docs/planner.md, "pdserve plan").

Every figure is simulated (planner/simulator.py) from a measured profile, labelled with its model, device and date.
The workload is a trace (``trace:[FORMAT:]FILE``, read and fitted by the load tester's reader: cli/plan_trace.py) or
a synthetic spec (``--workload``'s help lists them) with Poisson arrivals and ``bench.loadtest.workloads.draw_lengths``'s
lengths; ``shared-prefix:GROUPS:PREFIX:IN:OUT`` is GROUPS system prompts of PREFIX tokens, then a question of IN
tokens. Standard library only at module level. ``plan kv`` and ``plan validate`` share this parser, so ``run`` checks
its options, not argparse.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from pathlib import Path

from cli import plan_trace
from cli.plan_trace import add_trace_arguments

DEFAULT_RANGE_RATIO = 0.5  # uniform: lengths within ±50% of the mean
DEFAULT_CV = 0.25  # normal, lognormal: the load tester's --length-cv default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        nargs="+",
        default=None,
        help="profile JSONs written by `pdserve profile`, one per tensor-parallel degree to search",
    )
    parser.add_argument(
        "--workload",
        default=None,
        metavar="W",
        help="trace:[FORMAT:]FILE (a production trace: its arrival pattern, lengths and shared prefixes), a "
        "pdserve JSONL trace, or fixed:IN:OUT, uniform:IN:OUT[:RATIO], normal|lognormal:IN:OUT[:CV], "
        "shared-prefix:GROUPS:PREFIX:IN:OUT",
    )
    parser.add_argument(
        "--slo", nargs="+", default=None, metavar="KIND:MS", help="ttft:MS tpot:MS (default: the config's slo)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="devices to split (prefill + decode); a worker of tensor-parallel degree d takes d of them",
    )
    parser.add_argument("--gpus", type=int, default=None, metavar="N", help="the same budget on a GPU cluster")
    parser.add_argument(
        "--config", default="local", help="base cluster config: a YAML path or a shipped config's name (default: local)"
    )
    parser.add_argument("--out", default=None, help="write the recommended layout's config YAML here")
    parser.add_argument(
        "--num-requests",
        type=int,
        default=300,
        metavar="K",
        help="requests per simulation (default 300; a trace: its first K rows unless --max-rows says)",
    )
    parser.add_argument(
        "--min-duration",
        type=float,
        default=60.0,
        metavar="S",
        help="each simulated run spans at least S seconds (the workload repeated), so a large cluster is measured in "
        "steady state, not on one burst (default 60)",
    )
    parser.add_argument(
        "--split-step",
        type=int,
        default=1,
        metavar="K",
        help="try 1, 1+K, 1+2K... prefill workers (and N-1); default 1: every split",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths and arrivals")
    parser.add_argument(
        "--tolerance", type=float, default=0.02, help="goodput bisection stops within this share (default 0.02)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--plot", default=None, metavar="FILE", help="plot goodput against the split (PNG)")
    add_trace_arguments(parser, TRACE_RATES, max_rows_default="--num-requests")


TRACE_RATES = (
    "Goodput on a trace: each rate the search tries replays the same rows with the trace's own clock compressed or "
    "stretched uniformly so that its mean rate is that rate; bursts, lulls and order are kept, and 'x trace' is the "
    "goodput over the trace's own rate at --trace-speedup (how much faster than recorded the layout still meets the "
    "SLO); rows that arrive together stay together at every rate. A probe shorter than --min-duration repeats the "
    "trace, the repeat sharing no prefix with the rows before."
)


def parse_slo(items: list[str] | None, default_ttft_s: float, default_tpot_s: float) -> tuple[float, float]:
    """``["ttft:500", "tpot:100"]`` (milliseconds) -> seconds; a kind not given keeps the config's."""
    values = {"ttft": default_ttft_s, "tpot": default_tpot_s}
    for item in items or []:
        kind, _, ms = item.partition(":")
        if kind not in values or not ms:
            raise ValueError(f"--slo: {item!r} is not ttft:MS or tpot:MS")
        try:
            seconds = float(ms) / 1000
        except ValueError:
            raise ValueError(f"--slo: {item!r}: {ms!r} is not a number of milliseconds") from None
        if seconds <= 0:
            raise ValueError(f"--slo: {item!r} must be positive")
        values[kind] = seconds
    return values["ttft"], values["tpot"]


def _ints(spec: str, parts: list[str], count: int) -> list[int]:
    try:
        values = [int(p) for p in parts[:count]]
    except ValueError:
        raise ValueError(f"--workload: {spec!r}: lengths must be whole numbers") from None
    if any(v < 1 for v in values):
        raise ValueError(f"--workload: {spec!r}: lengths must be at least 1")
    return values


def build_workload(spec: str, num_requests: int, seed: int):
    """A ``planner.trace.Workload`` from a synthetic spec (the forms: ``--workload``'s help)."""
    import numpy as np

    from bench.loadtest.workloads import draw_lengths
    from planner.trace import TraceRequest, poisson_workload

    if num_requests < 2:
        raise ValueError("--num-requests must be at least 2")
    kind, *parts = spec.split(":")
    rng = np.random.default_rng(seed)
    if kind == "shared-prefix":
        if len(parts) != 4:
            raise ValueError(f"--workload: {spec!r} is not shared-prefix:GROUPS:PREFIX:IN:OUT")
        groups, prefix, question, output = _ints(spec, parts, 4)
        shapes = [
            TraceRequest(0.0, prefix + question, output, prefix_id=i % groups, prefix_tokens=prefix)
            for i in range(num_requests)
        ]
        return poisson_workload(spec, shapes, seed)
    if kind not in ("fixed", "uniform", "normal", "lognormal") or len(parts) not in (2, 3):
        raise ValueError(
            f"--workload: {spec!r} is neither trace:[FORMAT:]FILE nor one of fixed:IN:OUT, uniform:IN:OUT[:RATIO], "
            "normal:IN:OUT[:CV], lognormal:IN:OUT[:CV], shared-prefix:GROUPS:PREFIX:IN:OUT"
        )
    mean_in, mean_out = _ints(spec, parts, 2)
    spread = float(parts[2]) if len(parts) == 3 else (DEFAULT_RANGE_RATIO if kind == "uniform" else DEFAULT_CV)
    inputs = draw_lengths(mean_in, num_requests, kind, rng, range_ratio=spread, cv=spread)
    outputs = draw_lengths(mean_out, num_requests, kind, rng, range_ratio=spread, cv=spread)
    return poisson_workload(spec, [TraceRequest(0.0, i, o) for i, o in zip(inputs, outputs)], seed)


def _workload(args: argparse.Namespace, base):
    """The planner's workload, and what it reports about a trace (None for a synthetic spec)."""
    source = plan_trace.trace_source(args)
    if source is None:
        return build_workload(args.workload, args.num_requests, args.seed), None
    if args.num_requests < 2:
        raise ValueError("--num-requests must be at least 2")
    max_rows = args.max_rows if args.max_rows is not None else args.num_requests
    trace = plan_trace.fit(source, args, max_rows, base.model.max_model_len)
    workload = plan_trace.planner_workload(source, trace)
    assert workload.native_rate is not None
    return workload, plan_trace.describe(source, trace, workload.native_rate)


def _shares_prefixes(workload) -> bool:
    return any(s.hash_ids is not None or s.prefix_id is not None for s in workload.shapes)


def describe_profile(profiles) -> str:
    """One profile, or a set of them (one per tensor-parallel degree, of one model)."""
    one = getattr(profiles, "first", profiles)
    degrees = getattr(profiles, "degrees", [one.degree])
    at = f", degrees {'/'.join(d.label for d in degrees)}" if [tuple(d) for d in degrees] != [(1, 1)] else ""
    when = "estimated" if one.backend == "estimate" else "measured"  # planner/roofline.py: no GPU was run
    backend = "" if one.backend == "estimate" else f" ({one.backend})"
    return f"profile {one.model} {one.dtype} on {one.device}{backend}{at}, {when} {one.date}"


def device_budget(args: argparse.Namespace) -> int:
    if args.workers is not None and args.gpus is not None and args.workers != args.gpus:
        raise ValueError(f"--workers {args.workers} and --gpus {args.gpus}: give one budget")
    devices = args.gpus if args.gpus is not None else args.workers
    if devices is None:
        raise ValueError("pdserve plan needs --workers (or --gpus) (see pdserve plan --help)")
    if devices < 1:
        raise ValueError(f"--{'gpus' if args.gpus is not None else 'workers'} must be at least 1, got {devices}")
    return devices


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--profile", args.profile), ("--workload", args.workload)):
        if value is None:
            raise ValueError(f"pdserve plan needs {flag} (see pdserve plan --help)")
    devices = device_budget(args)
    for path in args.profile:
        if not Path(path).is_file():
            raise ValueError(f"--profile: {path!r} is not a file (write one with `pdserve profile`)")
    from cluster.config import load_config
    from planner.goodput import SLO
    from planner.profile_model import Profile, ProfileSet
    from planner.recommend import best, best_disaggregated, evaluate, plan_config, write_config

    profiles = ProfileSet.of([Profile.load(path) for path in args.profile])
    base = load_config(args.config)
    ttft_s, tpot_s = parse_slo(args.slo, base.slo.ttft_s, base.slo.tpot_s)
    slo = SLO(ttft_s, tpot_s)
    workload, trace_info = _workload(args, base)
    quiet = args.json

    def progress(result) -> None:
        if not quiet:
            print(f"  simulated {result.layout.label}: {result.goodput.rate:.3f} req/s", file=sys.stderr, flush=True)

    results = evaluate(
        profiles, workload, devices, base, slo, args.tolerance, progress, args.min_duration, args.split_step, args.seed
    )
    chosen = best(results, args.tolerance)
    split = best_disaggregated(results)
    colocated = max((r for r in results if r.layout.mode == "colocated"), key=lambda r: r.goodput.rate)
    label = f"SIMULATED, not measured: {describe_profile(profiles)}"
    if args.out:
        header = (
            f"pdserve plan: {chosen.layout.label} for {args.workload}, SLO ttft {ttft_s * 1000:g} ms tpot "
            f"{tpot_s * 1000:g} ms\nsimulated goodput {chosen.goodput.rate:.3f} req/s; {label}"
        )
        write_config(plan_config(base, chosen.layout), args.out, header)
    if args.plot:
        _plot(results, args.plot, label, args.workload, ttft_s, tpot_s)
    if args.json:
        data = _as_json(results, chosen, profiles, args, devices, ttft_s, tpot_s)
        if trace_info is not None:
            data["trace"] = trace_info
            for row, r in zip(data["results"], results):
                row["trace_speed"] = r.goodput.rate / trace_info["native_rate_rps"]
        print(json.dumps(data, indent=1))
        return 0
    print(label)
    if trace_info is not None:
        print(plan_trace.summary_line(trace_info))
    print(
        f"workload {workload.name}: {len(workload.shapes)} requests, mean input {workload.mean_input:.0f}, "
        f"mean output {workload.mean_output:.0f} tokens; SLO ttft {ttft_s * 1000:g} ms, tpot {tpot_s * 1000:g} ms, "
        f">= 90% of requests"
    )
    shared = _shares_prefixes(workload)
    width = max(16, *(len(r.layout.label) + 2 for r in results))
    extra = (f"{'x trace':>9}" if trace_info else "") + (f"{'prefix hits':>13}" if shared else "")
    print(f"{'layout':<{width}}{'devices':>8}{'goodput req/s':>15}{'per device':>12}{'attainment':>12}{extra}")
    for r in results:
        mark = "  <- recommended" if r is chosen else ""
        extra = f"{r.goodput.rate / workload.native_rate:>9.2f}" if trace_info and workload.native_rate else ""
        if shared:
            hits = r.goodput.prefix_hit_rate
            extra += f"{'-' if hits is None else f'{hits:.3f}':>13}"
        print(
            f"{r.layout.label:<{width}}{r.layout.devices:>8}{r.goodput.rate:>15.3f}{r.per_device:>12.3f}"
            f"{r.goodput.attainment:>12.2f}{extra}{mark}"
        )
    if split is not None and colocated.goodput.rate > 0:
        print(
            f"best split {split.layout.label}: {split.goodput.rate / colocated.goodput.rate:.2f}x the best colocated, "
            f"{colocated.layout.label} (simulated)"
        )
    if args.out:
        print(f"wrote {args.out} ({chosen.layout.label}); run it with: pdserve serve --config {args.out}")
    return 0


def _as_json(results, chosen, profiles, args, devices: int, ttft_s: float, tpot_s: float) -> dict:
    profile = profiles.first
    return {
        "simulated": True,
        "profile": {k: getattr(profile, k) for k in ("model", "dtype", "device", "backend", "date")}
        | {
            "tensor_parallel_sizes": sorted({d.tensor for d in profiles.degrees}),
            "degrees": [{"tensor": d.tensor, "expert": d.expert} for d in profiles.degrees],
        },
        "workload": args.workload,
        "workers": devices,
        "min_duration_s": args.min_duration,
        "slo": {"ttft_s": ttft_s, "tpot_s": tpot_s, "attainment": 0.9},
        "results": [
            {
                "layout": r.layout.label,
                "mode": r.layout.mode,
                "prefill": r.layout.prefill,
                "decode": r.layout.decode,
                "prefill_tensor_parallel_size": r.layout.prefill_tp,
                "decode_tensor_parallel_size": r.layout.decode_tp,
                "prefill_expert_parallel_size": r.layout.prefill_ep,
                "decode_expert_parallel_size": r.layout.decode_ep,
                "devices": r.layout.devices,
                "goodput_rps": r.goodput.rate,
                "attainment": r.goodput.attainment,
                "prefix_hit_rate": r.goodput.prefix_hit_rate,
                "probes": len(r.goodput.probes),
            }
            for r in results
        ],
        "recommended": chosen.layout.label,
        "config": args.out,
    }


def _plot(results, path: str, label: str, workload: str, ttft_s: float, tpot_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from planner.profile_model import Degree

    devices = max(r.layout.devices for r in results)
    fig, ax = plt.subplots(figsize=(9, 4.5))

    def degrees(r) -> tuple:
        return (r.layout.prefill_degree, r.layout.decode_degree)

    pairs = sorted({degrees(r) for r in results if r.layout.mode == "disaggregated"})
    colocated = [r for r in results if r.layout.mode == "colocated"]
    one = (Degree(), Degree())
    only_degree_1 = pairs in ([], [one]) and all(r.layout.decode_degree == Degree() for r in colocated)
    for i, (prefill, decode) in enumerate(pairs):  # the load-test plots' colors: colocated C0, split C1...
        split = [r for r in results if r.layout.mode == "disaggregated" and degrees(r) == (prefill, decode)]
        name = "disaggregated P:D" if only_degree_1 else f"P {prefill.label} : D {decode.label}"
        ax.plot(
            [r.layout.prefill * prefill.ranks for r in split],
            [r.goodput.rate for r in split],
            "o-",
            color=f"C{1 + i}",
            label=name,
        )
    for j, r in enumerate(colocated):
        style = ["--", ":", "-.", (0, (5, 1))][j % 4]
        ax.axhline(r.goodput.rate, color="C0", linestyle=style, label=r.layout.label)
    unit = "workers" if only_degree_1 else "devices"
    ax.set_xlabel(f"prefill {unit} (of {devices}; the rest decode)")
    ax.set_ylabel("goodput, req/s (simulated)")
    head, _, profile = label.partition(": ")  # "SIMULATED, not measured:" above the profile's name
    title = (
        f"{workload}, {devices} {unit}, SLO ttft {ttft_s * 1000:g} ms tpot {tpot_s * 1000:g} ms, "
        f"plotted {time.strftime('%Y-%m-%d')}\n{head}:\n" + "\n".join(textwrap.wrap(profile, 100))
    )
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: never over a point
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
