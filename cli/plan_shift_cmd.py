"""``pdserve plan shift``: what a cluster that moves workers by role switches attains on a trace, beside the fixed
split (planner/sim_switch.py; both simulated from a profile, neither measured).

The trace is served twice on ``--layout`` (default: the config's pools): as it is, and with the autoscaler's policy
moving workers between the pools by role switches, each costing ``--switch-s`` of rebuild (``pdserve bench
role-switch`` measures it) after its drain. Printed: per run, the requests that met both SLOs and the switches made.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from cli import plan_trace
from cli.plan_cmd import TRACE_RATES, describe_profile, parse_slo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="local", help="base cluster config: a YAML path or a shipped config's name")
    parser.add_argument("--profile", nargs="+", required=True, help="profile JSONs written by `pdserve profile`")
    parser.add_argument(
        "--workload",
        required=True,
        help="trace:[FORMAT:]FILE, a trace whose mix shifts (pdserve bench role-shift writes one)",
    )
    parser.add_argument("--layout", default=None, metavar="P:D", help="prefill:decode workers (default: the config's)")
    parser.add_argument("--switch-s", type=float, default=2.0, help="a switch's rebuild, seconds (bench role-switch)")
    parser.add_argument("--interval-s", type=float, default=5.0, help="the autoscaler's interval")
    parser.add_argument("--breaches", type=int, default=2, help="like intervals before the autoscaler acts")
    parser.add_argument("--cooldown-s", type=float, default=15.0, help="the autoscaler's cool-down per pool")
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="a switch's drain deadline, seconds")
    parser.add_argument(
        "--slo", nargs="+", default=None, metavar="KIND:MS", help="ttft:MS tpot:MS (default: the config's slo)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    plan_trace.add_trace_arguments(parser, TRACE_RATES)


def _layout(text: str | None, config) -> tuple[int, int]:
    if text is None:
        return config.pools.prefill.replicas, config.pools.decode.replicas
    prefill, _, decode = text.partition(":")
    try:
        counts = int(prefill), int(decode)
    except ValueError:
        raise ValueError(f"--layout: {text!r} is not P:D") from None
    if min(counts) < 1:
        raise ValueError(f"--layout: {text!r}: each pool needs at least one worker")
    return counts


def run(args: argparse.Namespace) -> int:
    from cluster.config import SLOSection, load_config
    from planner.goodput import SLO, attainment
    from planner.profile_model import Profile, ProfileSet
    from planner.sim_switch import SwitchSettings, simulate_switching
    from planner.simulator import Layout, SimSettings, simulate

    base = load_config(args.config)
    source = plan_trace.trace_source(args)
    if source is None:
        raise ValueError("--workload: pdserve plan shift replays a trace (trace:[FORMAT:]FILE)")
    trace = plan_trace.fit(source, args, args.max_rows, base.model.max_model_len)
    workload = plan_trace.planner_workload(source, trace)
    assert workload.native_rate is not None
    requests = workload.at_rate(workload.native_rate)
    profiles = ProfileSet.of([Profile.load(path) for path in args.profile])
    ttft_s, tpot_s = parse_slo(args.slo, base.slo.ttft_s, base.slo.tpot_s)
    prefill, decode = _layout(args.layout, base)
    layout = Layout("disaggregated", prefill, decode)
    settings = SimSettings.from_config(base, profiles)
    settings.seed = args.seed
    switching = SwitchSettings(args.switch_s, args.interval_s, args.breaches, args.cooldown_s, args.drain_timeout)
    slo = SLO(ttft_s, tpot_s)
    fixed = simulate(profiles, requests, layout, settings)
    moved = simulate_switching(
        profiles, requests, layout, settings, SLOSection(ttft_s=ttft_s, tpot_s=tpot_s), switching
    )
    runs = {"fixed": fixed, "switching": moved.records}
    out: dict[str, Any] = {
        "label": f"SIMULATED, not measured: {describe_profile(profiles)}",
        "trace": plan_trace.describe(source, trace, workload.native_rate),
        "layout": {"prefill": prefill, "decode": decode},
        "slo": {"ttft_s": ttft_s, "tpot_s": tpot_s},
        "switch_s": args.switch_s,
        "runs": {
            name: {
                "requests": len(records),
                "met_slo": round(attainment(records, slo) * len(records)),
                "attainment": round(attainment(records, slo), 4),
                "unserved": sum(1 for r in records if r.e2e_s == float("inf")),
            }
            for name, records in runs.items()
        },
        "switches": [
            {"worker": s.worker, "to": s.to, "at_s": round(s.at_s, 1), "phase": s.phase, "drained_s": s.drained_s}
            for s in moved.switches
        ],
    }
    met = out["runs"]["fixed"]["met_slo"]
    out["switching_over_fixed"] = round(out["runs"]["switching"]["met_slo"] / met, 3) if met else None
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(out["label"])
    print(f"layout {prefill}P:{decode}D, SLO TTFT {ttft_s:g} s, TPOT {tpot_s:g} s, a switch costs {args.switch_s:g} s")
    for name, figures in out["runs"].items():
        print(
            f"{name:>9}: {figures['met_slo']} of {figures['requests']} requests met the SLO "
            f"({figures['attainment']:.1%}), {figures['unserved']} unserved"
        )
    for switch in out["switches"]:
        print(f"  at {switch['at_s']} s: {switch['worker']} -> {switch['to']}: {switch['phase']}")
    print(f"switching / fixed: {out['switching_over_fixed']}")
    return 0
