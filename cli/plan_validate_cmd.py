"""``pdserve plan validate``: one workload on the local cluster and through the simulator, side by side
(docs/planner.md, "pdserve plan validate"; the comparison: planner/validate.py, the goal every ratio within 20% of 1).

Per mode it starts the cluster here and runs the load tester at each rate (open loop, Poisson, a fixed seed), then
the simulator replays what was sent (actual send offsets, server-reported token counts). ``--workload`` takes
``pdserve plan``'s synthetic specs, or ``trace:[FORMAT:]FILE``: the load tester replays the trace on its own schedule
(``--dataset-name FORMAT`` and the same ``--trace-*`` options, one run per mode instead of one per rate) and the
simulator replays the rows as sent with their hash ids, so both sides' prefix caches see the same sharing. Answers
run to their length (``ignore_eos``), so both sides decode the same lengths. Standard library only at module level.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from cli import plan_trace
from cli.plan_cmd import DEFAULT_CV, DEFAULT_RANGE_RATIO

MODES = ("disaggregated", "colocated")
DEFAULT_WORKLOAD = "fixed:128:32"
DEFAULT_RATES = "0.25,0.5,1"  # below and near one prefill worker's capacity for fixed:128:32 on this 2-core box
DEFAULT_NUM_REQUESTS = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default="local",
        help="the cluster config to start: a YAML path or a shipped config's name "
        "(default: local); disaggregated runs its pools, colocated as many workers as both together",
    )
    parser.add_argument("--profile", required=True, help="a profile JSON from `pdserve profile` for that config")
    parser.add_argument(
        "--workload",
        default=DEFAULT_WORKLOAD,
        help=f"fixed:IN:OUT, uniform:IN:OUT[:RATIO], normal|lognormal:IN:OUT[:CV], shared-prefix:GROUPS:PREFIX:IN:OUT "
        f"or trace:[FORMAT:]FILE (default {DEFAULT_WORKLOAD})",
    )
    parser.add_argument(
        "--rates",
        default=None,
        help=f"requests/s, comma-separated (default {DEFAULT_RATES}; a trace runs at its own times, see below)",
    )
    parser.add_argument(
        "--num-requests", type=int, default=DEFAULT_NUM_REQUESTS, help="measured requests per mode and rate"
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: disaggregated, colocated")
    parser.add_argument("--seed", type=int, default=0, help="arrivals and lengths (the same in every mode)")
    parser.add_argument(
        "--num-warmups", type=int, default=2, help="requests sent before each rate's measured ones (not compared)"
    )
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--in-process", action="store_true", help="workers as threads in this process, not Ray actors (tests)"
    )
    parser.add_argument("--result-dir", default=None, help="the load tester's records and validation.json")
    parser.add_argument("--json", action="store_true", help="print the results as JSON (the table goes to stderr)")
    plan_trace.add_trace_arguments(parser, TRACE_RUN)


TRACE_RUN = (
    "A trace runs once per mode, each row sent at its own time (trace time / --trace-speedup), and is replayed "
    "through the simulator as sent; the table adds the prefix hit rate measured (the server's cached_tokens) and "
    "simulated, and --json has per mode a 'simulated' and a 'measured' object."
)


def workload_argv(spec: str) -> list[str]:
    """The load tester's options for a ``--workload`` word (ValueError naming the problem)."""
    name, _, rest = spec.partition(":")
    try:
        values = [float(v) for v in rest.split(":")] if rest else []
    except ValueError:
        raise ValueError(f"--workload {spec!r}: the fields after the name must be numbers") from None
    shapes = {"fixed": (2, 2), "uniform": (2, 3), "normal": (2, 3), "lognormal": (2, 3), "shared-prefix": (4, 4)}
    if name not in shapes:
        raise ValueError(f"--workload {spec!r}: choose fixed, uniform, normal, lognormal or shared-prefix")
    low, high = shapes[name]
    if not low <= len(values) <= high:
        raise ValueError(f"--workload {spec!r}: {name} takes {low} to {high} numbers, see --help")
    counts = values[:2] if name != "shared-prefix" else values
    if any(v < 1 or v != int(v) for v in counts):
        raise ValueError(f"--workload {spec!r}: token counts and groups must be whole numbers >= 1")
    if name == "shared-prefix":
        groups, prefix, inp, out = (int(v) for v in values)
        return [
            "--dataset-name", "shared-prefix", "--shared-prefix-groups", str(groups), "--shared-prefix-len",
            str(prefix), "--random-input-len", str(inp), "--random-output-len", str(out),
        ]  # fmt: skip
    argv = ["--dataset-name", "random", "--random-input-len", str(int(values[0]))]
    argv += ["--random-output-len", str(int(values[1])), "--length-dist", name]
    if name == "uniform":
        ratio = values[2] if len(values) > 2 else DEFAULT_RANGE_RATIO
        if not 0 < ratio < 1:
            raise ValueError(f"--workload {spec!r}: the uniform ratio must be within (0, 1)")
        argv += ["--random-range-ratio", str(ratio)]
    if name in ("normal", "lognormal"):
        cv = values[2] if len(values) > 2 else DEFAULT_CV
        if not cv > 0:
            raise ValueError(f"--workload {spec!r}: the CV must be positive")
        argv += ["--length-cv", str(cv)]
    return argv


def trace_argv(source, args: argparse.Namespace) -> list[str]:
    """The load tester's options for a trace (only those given: its defaults stay its own)."""
    argv = ["--dataset-name", source.fmt, "--dataset-path", source.path]
    for flag in ("trace_speedup", "trace_token_scale", "trace_window", "max_rows"):
        value = getattr(args, flag)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", f"{value:g}" if isinstance(value, float) else str(value)]
    return argv


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.replace(" ", "").split(",") if r]
    except ValueError:
        raise ValueError(f"--rates {text!r}: comma-separated numbers, e.g. 0.5,1,2") from None
    if not rates or any(not 0 < r < float("inf") for r in rates):
        raise ValueError(f"--rates {text!r}: each rate must be a positive finite number of requests/s")
    return rates


def _modes(text: str) -> list[str]:
    modes = [m for m in text.replace(" ", "").split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"--modes {text!r}: choose from {', '.join(MODES)}")
    return modes


def run(args: argparse.Namespace) -> int:
    modes = _modes(args.modes)
    if args.num_requests < 1 or args.num_warmups < 0:
        raise ValueError("--num-requests must be at least 1 and --num-warmups not negative")
    source = plan_trace.trace_source(args)
    if source is not None:
        if args.rates is not None:
            raise ValueError("--rates: a trace runs on its own schedule; scale it with --trace-speedup")
        rates: list[float | None] = [None]
        workload = trace_argv(source, args)
    else:
        rates = list(_rates(args.rates or DEFAULT_RATES))
        workload = workload_argv(args.workload)
    if not Path(args.profile).is_file():
        raise ValueError(f"--profile {args.profile!r}: no such file (make one with `pdserve profile`)")
    result = validate(args, rates, modes, workload, source)
    if args.json:
        print(result["table"], file=sys.stderr)
        print(json.dumps(result))
    else:
        print(result["table"])
        print(result["summary_line"])
        print(f"results in {result['result_dir']}", file=sys.stderr)
    return 0


# ---- the run (heavy modules imported here, not at module level) ------------------------------------------------


def validate(
    args: argparse.Namespace, rates: list[float | None], modes: list[str], workload: list[str], source=None
) -> dict:
    """Every mode: start the cluster, run every rate (a trace: its schedule once), stop it; then replay each run
    through the simulator."""
    from bench.loadtest.cli import execute
    from cluster.config import load_config
    from cluster.run.launch import start_serving
    from planner.profile_model import Profile
    from planner.simulator import SimSettings, simulate
    from planner.validate import compare, format_table, goal_summary, replay_from_records

    started = time.monotonic()
    config = load_config(args.config)
    profile = Profile.load(args.profile)
    # each rate its own prompts (seed + i): the same prompts again would hit the prefix cache, unlike the simulator
    plans = [_load_plan(args, rate, workload, config, args.seed + i) for i, rate in enumerate(rates)]
    sent = _trace_as_sent(plans[0]) if source is not None else None
    folder = Path(args.result_dir) if args.result_dir else Path(tempfile.mkdtemp(prefix="pdserve-validate-"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "requests.jsonl").unlink(missing_ok=True)
    notes = _profile_notes(profile, config)
    comparisons, measured_runs, per_mode = [], [], {}
    for mode in modes:
        mode_config = _mode_config(config, mode)
        layout = _layout(mode_config)
        print(f"plan validate: {mode} ({layout.label}): starting the cluster", file=sys.stderr)
        mode_started = time.monotonic()
        handle = start_serving(mode_config, in_process=args.in_process)
        runs, results = [], []
        try:
            for plan in plans:
                [run_summary], [rate_results], _ = execute(
                    plan, handle.base_url, mode_config.served_model_name, folder, mode=mode
                )
                runs.append(run_summary)
                results.append(rate_results)
            held = _held_after(handle.base_url, mode_config.router.api_key)
        finally:
            handle.stop()
        settings = SimSettings.from_config(mode_config, profile)
        per_mode[mode] = {"layout": layout.label, "elapsed_s": round(time.monotonic() - mode_started, 1)} | held
        for rate, plan, run_summary, rate_results in zip(rates, plans, runs, results):
            records = [r.to_record() for r in rate_results]
            hashes = _hash_blocks(sent, records) if sent is not None else None
            replay = replay_from_records(records, _prefix_tokens(plan), hashes)
            simulated = simulate(profile, replay.trace, layout, settings)
            comparison = compare(
                mode, rate if rate is not None else float(run_summary["rate"]), replay, simulated, notes
            )
            comparisons.append(comparison)
            measured_runs.append(
                {k: run_summary.get(k) for k in ("mode", "rate", "completed", "failed", "failures", "duration_s")}
            )
            if sent is not None:  # one run per mode: its figures side by side
                per_mode[mode] |= {
                    "simulated": comparison.simulated.figures(),
                    "measured": comparison.measured.figures(),
                }
    goal = goal_summary(comparisons)
    table = format_table(comparisons)
    line = (
        f"{goal['within']}/{goal['figures']} figures within {goal['tolerance']:.0%} "
        f"(simulated from the profile of {profile.model} on {profile.device}, {profile.date}; measured on this box)"
    )
    result = {
        "configuration": {
            "config": str(args.config),
            "profile": {k: getattr(profile, k) for k in ("model", "dtype", "device", "backend", "date")},
            "workload": args.workload,
            "rates": [c.rate for c in comparisons[: len(rates)]],
            "num_requests": args.num_requests,
            "num_warmups": args.num_warmups,
            "seed": args.seed,
            "in_process": args.in_process,
        },
        "modes": per_mode,
        "measured_runs": measured_runs,
        "comparisons": [c.to_json() for c in comparisons],
        "goal": goal,
        "notes": notes,
        "trace": _describe_sent(source, sent),
        "elapsed_s": round(time.monotonic() - started, 1),
        "result_dir": str(folder),
        "table": table,
        "summary_line": line,
    }
    (folder / "validation.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _load_plan(args: argparse.Namespace, rate: float | None, workload: list[str], config, seed: int):
    """The load tester's plan for one rate (None: a trace, on its own schedule, the rows the config's context holds),
    through its own options (its defaults and checks stay its own)."""
    from bench.loadtest.cli import prepare
    from bench.loadtest.options import add_workload_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_workload_arguments(parser)
    if rate is not None:
        argv = workload + ["--request-rate", f"{rate:g}", "--num-prompts", str(args.num_requests)]
    else:
        argv = list(workload)
        if config.model.max_model_len:
            argv += ["--max-context-tokens", str(config.model.max_model_len)]
    argv += ["--num-warmups", str(args.num_warmups), "--seed", str(seed), "--ignore-eos"]
    argv += ["--request-timeout-s", str(args.request_timeout_s), "--metric-percentiles", "50,90"]
    argv += ["--goodput", f"ttft:{config.slo.ttft_s * 1000:g}", f"tpot:{config.slo.tpot_s * 1000:g}"]
    if config.router.api_key:
        argv += ["--api-key", config.router.api_key]
    if args.json:
        argv += ["--disable-tqdm"]
    return prepare(parser.parse_args(argv), config.model.name)


def _trace_as_sent(plan):
    """The trace the load tester will send (``plan.trace_replay``: rows at their sent lengths, request ``i`` being
    row ``i``); ValueError when this load tester has no trace replay."""
    replay = getattr(plan, "trace_replay", None)
    if replay is None:
        raise ValueError("--workload trace:...: this load tester cannot replay a trace (bench/loadtest has no replay)")
    return replay.traces[0]


def _hash_blocks(sent, records: list[dict]) -> dict[int, tuple[tuple[int, ...], int]]:
    """Each measured request's row's hash ids and block size, by request index; ValueError when a request is not
    its row (another length asked), so a misaligned replay is never compared."""
    out: dict[int, tuple[tuple[int, ...], int]] = {}
    for r in records:
        if r.get("warmup"):
            continue
        index = r["index"]
        row = sent.rows[index] if 0 <= index < len(sent.rows) else None
        asked = r.get("requested_output_tokens")
        if row is None or (asked is not None and asked != row.output_tokens):
            raise ValueError(f"the load tester's request {index} is not row {index} of the trace as sent")
        if row.hash_ids is not None and sent.block_tokens:
            out[index] = (row.hash_ids, sent.block_tokens)
    return out


def _describe_sent(source, sent) -> dict | None:
    if source is None or sent is None:
        return None
    rows = sent.rows
    span = rows[-1].arrival_s - rows[0].arrival_s if len(rows) > 1 else 0.0
    return plan_trace.describe(source, sent, len(rows) / span if span > 0 else None)  # the load tester's rate label


def _prefix_tokens(plan) -> dict[int, int]:
    """Shared-prefix groups: the tokens of each group's common text, counted as the server will (a BOS included)."""
    out: dict[int, int] = {}
    for spec in plan.specs:
        if spec.group is not None and spec.system and spec.group not in out:
            out[spec.group] = len(plan.tokenizer(spec.system, add_special_tokens=True)["input_ids"])
    return out


def _mode_config(config, mode: str):
    copy = config.model_copy(deep=True)
    copy.mode = mode
    copy.router.port = 0
    return copy


def _layout(config):
    from planner.simulator import Layout

    pools = config.pools
    prefill, decode = pools.prefill.replicas, pools.decode.replicas
    if config.mode == "colocated":  # both pools' workers serve whole requests; the simulator gives them one degree
        degree = pools.decode
        return Layout(
            "colocated",
            0,
            prefill + decode,
            decode_tp=degree.tensor_parallel_size,
            decode_ep=degree.expert_parallel_size,
        )
    return Layout(
        "disaggregated",
        prefill,
        decode,
        pools.prefill.tensor_parallel_size,
        pools.decode.tensor_parallel_size,
        pools.prefill.expert_parallel_size,
        pools.decode.expert_parallel_size,
    )


def _profile_notes(profile, config) -> list[str]:
    notes = []
    if Path(str(profile.model)).name != Path(str(config.model.name)).name:
        notes.append(f"the profile is of {profile.model}, the config serves {config.model.name}")
    if profile.dtype != config.served_dtype:
        notes.append(f"the profile was measured in {profile.dtype}, the config serves {config.served_dtype}")
    return notes


def _held_after(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> dict:
    """KV blocks and requests the workers still hold after the runs (must be 0), from heartbeats sent after this
    call began."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    began = time.monotonic()
    status: dict = {"workers": [], "inflight": None}
    while True:
        status = httpx.get(f"{base_url}/status", headers=headers, timeout=10).json()
        workers = [w for w in status["workers"] if w["alive"]]
        fresh = all(w.get("stats_age_s") is not None and w["stats_age_s"] < time.monotonic() - began for w in workers)
        blocks = sum((w.get("total_blocks") or 0) - (w.get("free_blocks") or 0) for w in workers)
        requests = sum(w.get("requests", 0) or 0 for w in workers) + (status.get("inflight") or 0)
        settled = bool(workers) and fresh and blocks == 0 and requests == 0
        if settled or time.monotonic() - began > timeout_s:
            return {"settled": settled, "held_kv_blocks": blocks, "held_requests": requests}
        time.sleep(0.1)
