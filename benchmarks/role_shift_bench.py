"""``pdserve bench role-shift``: a trace whose mix shifts, on a fixed split against autoscaling by restarts and by
role switches.

The trace is two windows back to back, from the public traces in ``--traces`` (``../shared/traces``), scaled to this
box: a code-like window (the Azure code trace's first rows: long prompts, short answers; prompts times
``--code-input-scale``) and a conversation-like one (the Mooncake conversation trace's first rows, prompts times
``--chat-input-scale`` and answers times ``--chat-output-scale``: short prompts, long answers). Each window holds its
rows in order, evenly spaced at its rate (``--code-rate``, ``--chat-rate``) for ``--window-s``. It is replayed three times on a cluster of
``--workers`` workers of the config (the load tester, on the trace's schedule, greedy, ``ignore_eos``):
- ``fixed``: the split best for the first window (``--fixed-prefill`` prefill workers, the rest decode);
- ``restarts``: the same start, with the autoscaler on within a budget of ``--workers`` (``autoscale.max_workers``),
  moving workers between pools by stopping one and starting another (``switch_roles: false``);
- ``switches``: the same, moving them by role switches (cluster/run/role_switch.py).
Figures per run: goodput (requests meeting both SLOs of the config, per second), SLO attainment, failures, the
moves made and their times; the ratios against ``fixed``. Goal: switches >= 1.2x fixed in goodput, 0 requests lost.
Wall-clock figures from a shared, noisy box: every run prints the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.options import add_role_shift_bench_arguments as add_arguments
from benchmarks.served_cluster import bench_config, closed_loop_plan, local_ray, measure, serving

if TYPE_CHECKING:
    from cluster.config import ClusterConfig

__all__ = ["add_arguments", "run"]

GOAL_GOODPUT_RATIO = 1.2
WAYS = ("fixed", "restarts", "switches")


def shifting_trace(args: argparse.Namespace, max_context_tokens: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The two windows' rows as trace-jsonl rows (``arrival_s``, ``input_tokens``, ``output_tokens``), and how each
    window was made."""
    from bench.loadtest.traces import read_trace

    traces = Path(args.traces)
    code = read_trace("azure", traces / "AzureLLMInferenceTrace_code.csv").rows
    chat = read_trace("mooncake", traces / "mooncake_conversation_trace.jsonl").rows
    windows = [
        ("code", code, args.code_rate, args.code_input_scale, 1.0, 0.0),
        ("conversation", chat, args.chat_rate, args.chat_input_scale, args.chat_output_scale, args.window_s),
    ]
    rows: list[dict[str, Any]] = []
    made: dict[str, Any] = {}
    for name, trace_rows, rate, input_scale, output_scale, start_s in windows:
        source = trace_rows[: max(1, round(rate * args.window_s))]
        inputs, outputs = [], []
        for i, row in enumerate(source):
            at_s = i / rate  # evenly spaced: the traces' first rows come in bursts that are not their mean rate
            output_tokens = max(1, round(row.output_tokens * output_scale))
            input_tokens = max(1, min(round(row.input_tokens * input_scale), max_context_tokens - output_tokens - 1))
            rows.append(
                {"arrival_s": round(start_s + at_s, 3), "input_tokens": input_tokens, "output_tokens": output_tokens}
            )
            inputs.append(input_tokens)
            outputs.append(output_tokens)
        made[name] = {
            "rows": len(source),
            "rate_rps": rate,
            "starts_s": start_s,
            "input_scale": input_scale,
            "output_scale": output_scale,
            "mean_input_tokens": round(statistics.mean(inputs), 1),
            "mean_output_tokens": round(statistics.mean(outputs), 1),
        }
    return rows, made


def cluster_for(args: argparse.Namespace, way: str) -> ClusterConfig:
    config = bench_config(args)
    prefill = args.fixed_prefill
    config.pools.prefill.replicas, config.pools.decode.replicas = prefill, args.workers - prefill
    # eager decode in every run: a compiled step not yet on disk compiles in a background process, which would take
    # a core from whichever run came first
    config.pools.decode.compile_decode_batches = None
    section = config.autoscale
    section.enabled = way != "fixed"
    section.switch_roles = way == "switches"
    section.max_workers = args.workers
    section.interval_s, section.breaches, section.cooldown_s = args.interval_s, 2, args.cooldown_s
    section.min_requests = 3
    section.prefill.min_replicas = section.decode.min_replicas = 1
    section.prefill.max_replicas = section.decode.max_replicas = args.workers - 1
    return config


def _moves(handle) -> list[dict[str, Any]]:
    autoscaler = handle.autoscaler
    if autoscaler is None:
        return []
    start = autoscaler.decisions[0][0] if autoscaler.decisions else 0.0
    return [{"at_s": round(at - start, 1), "pool": pool, "replicas": size} for at, pool, size in autoscaler.decisions]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.cpu_info import cpu_model

    base = bench_config(args)
    max_context = base.model.max_model_len or 2048
    rows, windows = shifting_trace(args, max_context)
    folder = Path(tempfile.mkdtemp(prefix="pdserve-role-shift-"))
    trace_path = folder / "shifting.jsonl"
    trace_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    slo = base.slo
    out: dict[str, Any] = {
        "cpu": cpu_model(),
        "model": base.model.name,
        "workers": args.workers,
        "fixed_split": {"prefill": args.fixed_prefill, "decode": args.workers - args.fixed_prefill},
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "windows": windows,
        "trace_file": str(trace_path),  # pdserve plan shift simulates the same trace
        "runs": {},
    }
    workload = [
        "--dataset-name",
        "trace-jsonl",
        "--dataset-path",
        str(trace_path),
        "--ignore-eos",
        "--temperature",
        "0",
    ]
    workload += ["--goodput", f"ttft:{slo.ttft_s * 1000:g}", f"tpot:{slo.tpot_s * 1000:g}"]
    for way in WAYS:
        if args.ways and way not in args.ways.split(","):
            continue
        config = cluster_for(args, way)
        print(f"role-shift: {way}", file=sys.stderr)
        # restarts start a worker in a placement group of its own while the stopped one's bundle stays: one CPU more
        spare = config.pools.decode.cpus_per_replica
        with local_ray(config, args.in_process, spare), serving(config, f"role-shift {way}", args.in_process) as handle:
            plan = closed_loop_plan(workload, args, config.model.name if args.tokenizer is None else args.tokenizer)
            (folder / way).mkdir()
            summary, _, after = measure(handle, config, plan, way, folder / way)
            switches = handle.scaler.roles.records() if handle.scaler is not None else []
            out["runs"][way] = {
                "goodput_rps": summary.get("goodput"),
                "slo_attainment_pct": summary.get("slo_attainment_pct"),
                "requests": summary["requests"],
                "failed": summary["failed"],
                "failures": summary["failures"],
                "ttft_p90_ms": summary["ttft_ms"].get("p90"),
                "tpot_p90_ms": summary["tpot_ms"].get("p90"),
                "duration_s": round(summary["duration_s"], 1),
                "moves": _moves(handle),
                "switches": [{k: s[k] for k in ("worker", "from_role", "to", "phase", "total_s")} for s in switches],
                "kv_free_after": bool(after[1].get("settled")),
            }
    fixed = out["runs"].get("fixed", {}).get("goodput_rps")
    ratios = {
        way: round(run_["goodput_rps"] / fixed, 3) if fixed and run_.get("goodput_rps") is not None else None
        for way, run_ in out["runs"].items()
    }
    out["goodput_over_fixed"] = ratios
    lost = sum(r["failed"] for r in out["runs"].values())
    out["goals"] = {
        "switches_goodput_over_fixed_at_least": GOAL_GOODPUT_RATIO,
        "lost_requests": lost,
        "all_met": (ratios.get("switches") or 0) >= GOAL_GOODPUT_RATIO and lost == 0,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.loadtest.cli import run_main

    return run_main("python -m benchmarks.role_shift_bench", (__doc__ or "").splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
