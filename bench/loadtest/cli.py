"""``pdserve bench serve`` / ``python -m bench.loadtest``: options, one run or a rate sweep, the results folder.

``run(args)``: ``prepare`` builds the workload once (not while timing), ``execute`` runs each rate (``--rates``, else
``--request-rate``) against the server, then the results folder is written, the table printed to stderr and the
summary returned; ``bench/compare_modes.py`` reuses ``prepare`` and ``execute``. Options (``options.py``) are named
as in ``vllm bench serve`` where they mean the same.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.loadtest import metrics, multiturn, output, plots, replay
from bench.loadtest.client import RequestResult, RequestSettings, RequestSpec
from bench.loadtest.conversations import ConversationSettings, ConversationSpec, build_conversations
from bench.loadtest.options import DEFAULT_SLOS_NOTE, PDSERVE_DEFAULT_SLOS_MS
from bench.loadtest.options import add_arguments as add_arguments
from bench.loadtest.options import add_workload_arguments as add_workload_arguments
from bench.loadtest.shapes import LoadShape, run_phase
from bench.loadtest.trace_prompts import trace_requests
from bench.loadtest.traces import fit_trace, read_trace
from bench.loadtest.workloads import PromptBuilder, WorkloadSettings, build_requests, load_tokenizer


@dataclass
class Plan:
    """What every run of a command shares: the request list, per-request settings (less the target) and SLOs."""

    specs: list[RequestSpec]
    workload: WorkloadSettings
    shapes: list[LoadShape]
    slos: dict
    slo_source: str
    percentiles: list[float]
    percentile_metrics: list[str]
    endpoint_type: str
    ignore_eos: bool
    temperature: float
    api_key: str | None
    request_timeout_s: float
    seed: int
    progress: bool
    slo_target_pct: float
    tokenizer: object = None  # counts output tokens when a server sends no usage
    conversations: list[ConversationSpec] | None = None  # multi-turn: played instead of ``specs``
    conversation_settings: ConversationSettings | None = None
    # rates after the first draw their own prompts (seed + index): no prefix-cache hits on an earlier rate's prompts
    later_specs: list[list[RequestSpec]] | None = None
    trace_replay: replay.TraceReplay | None = None  # a trace: one shape per speed-up, its rows on a fixed schedule

    def specs_for(self, rate_index: int) -> list[RequestSpec]:
        if rate_index == 0 or not self.later_specs:
            return self.specs
        return self.later_specs[rate_index - 1]


def prepare(
    args: argparse.Namespace,
    tokenizer_model: str | None,
    default_slos: dict | None = None,
    context_tokens: int | None = None,
    context_source: str = "the server (/v1/models max_model_len)",
) -> Plan:
    """Validate options and build the workload; an unset ``args.endpoint_type`` is resolved and written back.
    ``context_tokens``: the model's context, from ``context_source`` (a trace's rows over it are not sent);
    ``--max-context-tokens`` overrides it."""
    multi_turn = args.dataset_name == "multi-turn"
    replay.check_options(args)
    if args.endpoint_type is None:
        args.endpoint_type = "chat" if multi_turn else "completions"
    conversation_settings = None
    if multi_turn:
        conversation_settings = ConversationSettings(
            num_conversations=args.num_conversations,
            num_turns=args.num_turns,
            num_turns_range_ratio=args.num_turns_range_ratio,
            think_time_s=args.think_time_s,
            think_time_dist=args.think_time_dist,
        )
        conversation_settings.validate()
        if not args.num_conversations and args.duration is None:
            raise ValueError("a multi-turn run needs a bound: --num-conversations or --duration")
        if not args.num_conversations and math.isinf(args.request_rate) and args.max_concurrency is None:
            raise ValueError("--request-rate inf with no --num-conversations needs --max-concurrency")
    trace_replay = _fit_trace(args, context_tokens, context_source) if replay.is_trace(args) else None
    rates = [] if trace_replay is not None else metrics.parse_list(args.rates, "--rates") or [args.request_rate]
    count = args.num_conversations if multi_turn else args.num_prompts
    shapes = [  # a trace's: one per speed-up, once its prompts are built
        LoadShape(
            request_rate=rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            num_prompts=count or None,
            duration_s=args.duration,
            ramp_up_s=args.ramp_up_s,
            num_warmups=args.num_warmups,
        )
        for rate in rates
    ]
    for shape in shapes:
        shape.validate()
    percentile_metrics = metrics.parse_list(args.percentile_metrics, "--percentile-metrics", str)
    unknown = set(percentile_metrics) - set(metrics.METRICS)
    if unknown:
        raise ValueError(f"--percentile-metrics: {sorted(unknown)} not among {', '.join(metrics.METRICS)}")
    percentiles = metrics.parse_list(args.metric_percentiles, "--metric-percentiles")
    if any(not 0 <= p <= 100 for p in percentiles):
        raise ValueError("--metric-percentiles: each must be within 0..100")
    slos, slo_source = metrics.parse_goodput(args.goodput), "--goodput"
    if not slos and (len(shapes) > 1 or trace_replay is not None):  # a sweep or a trace: always SLOs
        slos, slo_source = dict(default_slos or _default_slos()), DEFAULT_SLOS_NOTE
    if not slos:
        slo_source = "none"
    workload = WorkloadSettings(
        dataset_name=args.dataset_name,
        dataset_path=args.dataset_path,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        length_dist=args.length_dist,
        length_cv=args.length_cv,
        shared_prefix_groups=args.shared_prefix_groups,
        shared_prefix_len=args.shared_prefix_len,
        seed=args.seed,
    )
    tokenizer = load_tokenizer(args.tokenizer, tokenizer_model)
    builder = PromptBuilder(tokenizer, args.endpoint_type, seed=args.seed)
    n = args.num_warmups + _pool_size(shapes) if shapes else 0
    conversations = None
    later_specs = None
    if trace_replay is not None:
        per_speedup = [
            _trace_specs(trace_replay, i, PromptBuilder(tokenizer, args.endpoint_type, seed=args.seed + i), args)
            for i in range(len(trace_replay.speedups))
        ]
        specs, later_specs = per_speedup[0], per_speedup[1:] or None
        shapes = [_trace_shape(trace, args) for trace in trace_replay.traces]
    elif conversation_settings is not None:
        conversations = build_conversations(conversation_settings, workload, builder, n)
        specs = []
    else:
        specs = build_requests(workload, builder, n)
    if trace_replay is None and conversation_settings is None and len(shapes) > 1:
        later_specs = [
            build_requests(
                replace(workload, seed=args.seed + i),
                PromptBuilder(tokenizer, args.endpoint_type, seed=args.seed + i),
                n,
            )
            for i in range(1, len(shapes))
        ]
    plan = Plan(
        specs,
        workload,
        shapes,
        slos,
        slo_source,
        percentiles,
        percentile_metrics,
        args.endpoint_type,
        args.ignore_eos,
        args.temperature,
        args.api_key,
        args.request_timeout_s,
        args.seed,
        not args.disable_tqdm,
        args.slo_target_pct,
        tokenizer,
        conversations,
        conversation_settings,
        later_specs,
        trace_replay,
    )
    return plan


def _fit_trace(args: argparse.Namespace, context_tokens: int | None, source: str) -> replay.TraceReplay:
    """The trace read once and fitted at each speed-up (prompts come later: ``_trace_specs``)."""
    context = context_tokens
    if args.max_context_tokens is not None:
        if args.max_context_tokens < 2:
            raise ValueError("--max-context-tokens must be at least 2")
        context, source = args.max_context_tokens, "--max-context-tokens"
    elif context is None:
        source = "unknown (the server reports none; give --max-context-tokens): no row held back"
    raw = read_trace(args.dataset_name, args.dataset_path)
    speeds = replay.speedups(args)
    traces = [fit_trace(raw, replay.fit_for(args, speed, context)) for speed in speeds]
    first = traces[0]
    if not first.rows:
        counts = first.counts
        where = f"--trace-window {args.trace_window}" if args.trace_window else "the trace"
        raise ValueError(
            f"{raw.path}: no row to send: {where} holds {counts['in_window']} rows (the file's span "
            f"{raw.rows[-1].arrival_s:.0f} s), {counts['over_context']} of them over the context of {context} tokens"
        )
    return replay.TraceReplay(raw, speeds, traces, context, source)


def _trace_specs(
    trace_replay: replay.TraceReplay, index: int, builder: PromptBuilder, args: argparse.Namespace
) -> list[RequestSpec]:
    """Warm-ups (unshared prompts of the first rows' lengths, sharing nothing with the trace), then one request per
    row of speed-up ``index``'s trace; the trace is replaced by the one as sent."""
    specs, sent, lengthened = trace_requests(trace_replay.traces[index], builder, args.seed + index)
    trace_replay.traces[index] = sent
    trace_replay.lengthened = lengthened
    if not sent.rows:
        raise ValueError(f"{sent.path}: every row is over the context of {trace_replay.context_tokens} tokens")
    lengths = [max(spec.input_tokens, builder.overhead() + 1) for spec in specs]
    warm = [
        RequestSpec(-1 - i, builder.build(length), spec.output_tokens, length)
        for i, spec, length in zip(range(args.num_warmups), itertools.cycle(specs), itertools.cycle(lengths))
    ]
    return warm + specs


def _trace_shape(trace, args: argparse.Namespace) -> LoadShape:
    shape = LoadShape(
        max_concurrency=args.max_concurrency,
        num_prompts=len(trace.rows),
        duration_s=args.duration,
        num_warmups=args.num_warmups,
        schedule=[row.arrival_s for row in trace.rows],
    )
    shape.validate()
    return shape


def _default_slos() -> dict:
    return dict(PDSERVE_DEFAULT_SLOS_MS)


def _pool_size(shapes: list[LoadShape]) -> int:
    """Distinct requests to build: the count bound, or enough for the duration (cycled beyond)."""
    if shapes[0].num_prompts:
        return shapes[0].num_prompts
    sizes = []
    for s in shapes:
        if math.isinf(s.request_rate):
            sizes.append(4 * (s.max_concurrency or 1) + 64)
        else:
            assert s.duration_s is not None  # validated: no num_prompts needs a duration
            sizes.append(int(s.request_rate * s.duration_s * 1.2) + 16)
    return max(1, min(2000, max(sizes)))


def execute(
    plan: Plan, base_url: str, model: str, folder: Path, mode: str | None = None, num_workers: int | None = None
) -> tuple[list[dict], list[list[RequestResult]], dict | None]:
    """Every rate against one server, appending to ``requests.jsonl``. Returns per-run summaries, per-run results
    and the sweep pick (None for a single rate)."""
    settings = RequestSettings(
        base_url=base_url,
        model=model,
        endpoint_type=plan.endpoint_type,
        ignore_eos=plan.ignore_eos,
        temperature=plan.temperature,
        api_key=plan.api_key,
        request_timeout_s=plan.request_timeout_s,
    )
    runs, all_results = [], []
    for rate_index, shape in enumerate(plan.shapes):
        rate_label = shape.rate_label
        label = f"{mode + ' ' if mode else ''}rate {rate_label}"
        conversations = None
        sampler = replay.KvSampler(base_url, plan.api_key) if plan.trace_replay is not None else None
        if plan.conversations is not None:
            conversations, duration_s, client_stats = asyncio.run(
                multiturn.run_conversations(
                    plan.conversations, shape, settings, seed=plan.seed, progress=plan.progress, label=label
                )
            )
            multiturn.fill_expected_input_tokens(conversations, plan.tokenizer)
            results = multiturn.turn_results(conversations)
        else:
            results, duration_s, client_stats = asyncio.run(
                run_phase(
                    plan.specs_for(rate_index),
                    shape,
                    settings,
                    seed=plan.seed,
                    progress=plan.progress,
                    label=label,
                    monitors=[sampler] if sampler is not None else (),
                )
            )
        _fill_counts(results, plan.tokenizer)
        measured = [r for r in results if not r.warmup]
        warm = [r for r in results if r.warmup]
        run: dict[str, Any] = {"mode": mode} if mode else {}
        run |= {
            "rate": rate_label,
            "burstiness": shape.burstiness,
            "max_concurrency": shape.max_concurrency,
            "closed_loop": shape.closed_loop,
        }
        run |= metrics.summarize(measured, duration_s, plan.slos, plan.percentiles, plan.percentile_metrics)
        if conversations is not None:
            run["multi_turn"] = multiturn.summarize_conversations(conversations, plan.percentiles)
        if plan.trace_replay is not None and sampler is not None:
            run |= replay.summarize(measured, plan.trace_replay.traces[rate_index], run, sampler.samples)
        run["warmups"] = {"requests": len(warm), "failed": sum(not r.success for r in warm)}
        run["client"] = client_stats
        output.write_requests(folder / "requests.jsonl", results, {"mode": mode} if mode else None)
        runs.append(run)
        all_results.append(results)
    sweep = None
    if len(runs) > 1:
        sweep = metrics.pick_max_rate(runs, plan.slo_target_pct, num_workers)
    return runs, all_results, sweep


def _fill_counts(results: list[RequestResult], tokenizer) -> None:
    for r in results:
        if r.success and r.output_tokens is None:
            r.output_tokens = len(tokenizer(r.generated_text, add_special_tokens=False)["input_ids"])
            r.output_tokens_source = "tokenizer"
        if r.success and r.input_tokens is None:
            r.input_tokens = r.expected_input_tokens
        r.generated_text = ""


def benchmark_settings(args: argparse.Namespace, plan: Plan) -> dict:
    keep = {k: v for k, v in vars(args).items() if k not in ("func", "api_key") and not callable(v)}
    settings: dict[str, Any] = {"slo_ms": plan.slos, "slo_source": plan.slo_source, "workload": asdict(plan.workload)}
    if plan.conversations is not None and plan.conversation_settings is not None:
        convs = plan.conversations
        turns = sum(c.turns for c in convs)
        settings |= {
            "multi_turn": asdict(plan.conversation_settings),
            "turns_per_conversation_mean": turns / len(convs),
            "user_tokens_mean": sum(sum(c.user_tokens) for c in convs) / turns,
            "output_tokens_mean": sum(sum(c.output_tokens) for c in convs) / turns,
        }
    else:
        measured = [s for s in plan.specs if s.index >= 0]  # a trace's warm-ups are not among its rows
        settings |= {
            "input_tokens_mean": sum(s.input_tokens for s in measured) / len(measured),
            "output_tokens_mean": sum(s.output_tokens for s in measured) / len(measured),
        }
    if plan.trace_replay is not None:
        settings["trace"] = plan.trace_replay.describe()
    return output.clean_json(keep | settings)


def result_folder(args: argparse.Namespace) -> Path:
    folder = Path(args.result_dir) if args.result_dir else output.default_result_dir()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "requests.jsonl").unlink(missing_ok=True)
    return folder


def run(args: argparse.Namespace) -> dict:
    context = None
    if replay.is_trace(args) and args.max_context_tokens is None:
        context = replay.server_context(args.base_url, args.model, args.api_key)
    plan = prepare(args, args.tokenizer or args.model, context_tokens=context)
    folder = result_folder(args)
    runs, results, sweep = execute(plan, args.base_url, args.model, folder, num_workers=args.num_workers)
    summary: dict[str, Any] = {
        "benchmark": benchmark_settings(args, plan),
        "runs": runs,
        "sweep": sweep,
        "result_dir": str(folder),
        "date": plots.today(),
    }
    summary["plots"] = plots.write_plots(folder, runs, results, summary)
    summary = output.clean_json(summary)
    output.write_summary(folder, summary)
    print(output.format_table(runs), file=sys.stderr)
    if sweep:
        print(
            f"highest rate with >= {sweep['target_attainment_pct']}% of requests within the SLOs "
            f"{plan.slos}: {sweep['max_rate_meeting_slo']}",
            file=sys.stderr,
        )
    print(f"results in {folder}", file=sys.stderr)
    return summary


def run_main(prog: str, description: str, add_args, run_fn, argv: list[str] | None = None) -> int:
    """The ``python -m`` entry of a benchmark: parse, run, print the summary as JSON with ``--json``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_args(parser)
    args = parser.parse_args(argv)
    try:
        summary = run_fn(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(
        "python -m bench.loadtest",
        "Load-test an OpenAI-compatible server (pdserve bench serve)",
        add_arguments,
        run,
        argv,
    )
