"""``pdserve bench compare --config FILE``: the same workload and rates against the cluster in colocated mode and
in disaggregated mode, on the same workers, into one results folder with one table and the plots.

It starts pdserve's cluster, so it is not in bench/loadtest/, which imports nothing of the server. Per mode: start
the cluster from a copy of the config (``mode`` set, ``router.port`` 0) with ``cluster.run.launch.start_serving``,
run every rate against ``handle.base_url``, stop it. SLOs: ``--goodput``, else the config's ``slo``; the per-worker
rate divides by ``handle.num_workers`` unless ``--num-workers`` is given. A trace (``--dataset-name mooncake ...``)
is replayed at each ``--trace-speedups`` instead of each rate; its context is the config's ``model.max_model_len``,
else what the first cluster reports.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from bench.loadtest import output, plots, replay
from bench.loadtest.cli import benchmark_settings, execute, prepare, result_folder
from bench.options import COMPARE_MODES as MODES
from bench.options import add_compare_arguments as add_arguments


def run(args: argparse.Namespace) -> dict:
    from cluster.config import load_config

    config = load_config(args.config)
    modes = [m for m in args.modes.replace(" ", "").split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"--modes: {args.modes!r}: choose from {', '.join(MODES)}")
    slos = {"ttft": config.slo.ttft_s * 1000.0, "tpot": config.slo.tpot_s * 1000.0}
    from_config = not args.goodput
    if from_config:
        args.goodput = [f"ttft:{slos['ttft']:g}", f"tpot:{slos['tpot']:g}"]
    replay.check_options(args)  # before any cluster starts
    context = config.model.max_model_len
    plan = None
    if not replay.is_trace(args) or context is not None or args.max_context_tokens is not None:
        plan = _prepare(args, config, context, f"{args.config}: model.max_model_len", from_config)
    folder = result_folder(args)
    runs, results, per_mode = [], [], {}
    for mode in modes:
        handle = _start(config, mode)
        try:
            if plan is None:  # a trace, and the config does not say the context: the cluster does
                context = replay.server_context(handle.base_url, config.served_model_name, args.api_key)
                plan = _prepare(args, config, context, "the cluster (/v1/models max_model_len)", from_config)
            workers = args.num_workers or handle.num_workers
            roles = Counter(info["role"] for info in handle.worker_infos())
            mode_runs, mode_results, sweep = execute(
                plan, handle.base_url, config.served_model_name, folder, mode=mode, num_workers=workers
            )
        finally:
            handle.stop()
        per_mode[mode] = {"base_url": handle.base_url, "num_workers": workers, "roles": roles, "sweep": sweep}
        runs += mode_runs
        results += mode_results
    assert plan is not None  # made before or in the first mode
    summary = {
        "benchmark": benchmark_settings(args, plan) | {"config": str(args.config)},
        "modes": per_mode,
        "runs": runs,
        "result_dir": str(folder),
        "date": plots.today(),
    }
    summary["plots"] = plots.write_plots(folder, runs, results, summary)
    summary = output.clean_json(summary)
    output.write_summary(folder, summary)
    (folder / "table.txt").write_text(output.format_table(runs) + "\n")
    print(output.format_table(runs), file=sys.stderr)
    for mode, info in per_mode.items():
        if info["sweep"]:
            s = info["sweep"]
            print(
                f"{mode}: highest rate within the SLOs {plan.slos}: {s['max_rate_meeting_slo']} "
                f"({s['max_rate_per_worker']} per worker, {info['num_workers']} workers)",
                file=sys.stderr,
            )
    print(f"results in {folder}", file=sys.stderr)
    return summary


def _prepare(args: argparse.Namespace, config, context: int | None, source: str, from_config: bool):
    plan = prepare(args, args.tokenizer or config.model.name, context_tokens=context, context_source=source)
    if from_config:
        plan.slo_source = f"{args.config}: slo"
    return plan


def _start(config, mode: str):
    from cluster.run.launch import start_serving  # lazily: the launcher needs Ray and the workers

    copy = config.model_copy(deep=True)
    copy.mode = mode
    copy.router.port = 0
    return start_serving(copy)


def main(argv: list[str] | None = None) -> int:
    from bench.loadtest.cli import run_main

    return run_main(
        "python -m bench.compare_modes", "colocated vs disaggregated on the same workers", add_arguments, run, argv
    )


if __name__ == "__main__":
    sys.exit(main())
