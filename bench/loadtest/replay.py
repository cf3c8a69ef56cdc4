"""Trace replay (``--dataset-name mooncake | azure | burstgpt | trace-jsonl``): the options, the server's context,
the plan per speed-up, the KV sampler and what a replay's summary adds.

``cli.prepare`` reads and fits the trace (``traces``) once per ``--trace-speedup(s)``, builds its prompts
(``trace_prompts``) and gives each speed-up a ``LoadShape`` whose ``schedule`` is the rows' send times, so
``shapes.run_phase`` sends every row at its own time. ``cli.execute`` runs ``KvSampler`` beside it (pdserve's
``/status``) and adds ``summarize``'s fields to the run: ``rows``, ``schedule_lag_ms``, ``prefix_hit_rate`` and
per-minute ``series``.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import httpx
import numpy as np

from bench.loadtest import metrics
from bench.loadtest.client import RequestResult
from bench.loadtest.shapes import WALL_CLOCK, Clock
from bench.loadtest.traces import TRACE_FORMATS, RawTrace, Trace, TraceFit, parse_window

SERIES_BIN_S = 60.0  # the per-minute series
KV_SAMPLE_PERIOD_S = 2.0
TRACE_ONLY = ("trace_speedup", "trace_speedups", "trace_token_scale", "trace_window", "max_rows", "max_context_tokens")


def is_trace(args: argparse.Namespace) -> bool:
    return args.dataset_name in TRACE_FORMATS


def check_options(args: argparse.Namespace) -> None:
    """A trace's own options only with a trace; a trace's schedule instead of a rate."""
    given = [f"--{name.replace('_', '-')}" for name in TRACE_ONLY if getattr(args, name, None) is not None]
    if not is_trace(args):
        if given:
            raise ValueError(f"{given[0]} applies to a trace replay (--dataset-name {' | '.join(TRACE_FORMATS)})")
        return
    if not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path (the trace file)")
    refused = [
        name
        for name, value in (
            ("--rates", args.rates),
            ("--request-rate", not math.isinf(args.request_rate)),
            ("--ramp-up-s", args.ramp_up_s),
            ("--burstiness", args.burstiness != 1.0),
        )
        if value
    ]
    if refused:
        raise ValueError(
            f"{', '.join(refused)}: a trace is replayed on its own schedule, each row at its own time, not at a "
            "rate; fit it with --trace-speedup F (or sweep --trace-speedups 0.5,1,2), --trace-window START:END and "
            "--max-rows N"
        )
    if args.trace_speedup is not None and args.trace_speedups:
        raise ValueError("give --trace-speedup or --trace-speedups, not both")


def speedups(args: argparse.Namespace) -> list[float]:
    values = metrics.parse_list(args.trace_speedups, "--trace-speedups")
    return values or [1.0 if args.trace_speedup is None else args.trace_speedup]


def server_context(base_url: str, model: str, api_key: str | None = None) -> int | None:
    """The context length the server reports for ``model`` in ``/v1/models`` (``max_model_len``: pdserve, vLLM);
    None when it reports none or cannot be asked."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=headers, timeout=10, trust_env=False)
        entries = (response.json().get("data") or []) if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    lengths = {e.get("id"): e.get("max_model_len") for e in entries if isinstance(e, dict)}
    value = lengths.get(model, next(iter(lengths.values()), None) if len(lengths) == 1 else None)
    return value if isinstance(value, int) and value > 0 else None


@dataclass(slots=True)
class TraceReplay:
    """A trace fitted once per speed-up: the same rows, at their sent lengths, at that speed-up's times."""

    raw: RawTrace
    speedups: list[float]
    traces: list[Trace]  # one per speed-up, as sent
    context_tokens: int | None
    context_source: str
    lengthened: int = 0  # rows sent longer than their scaled length (the template's tail, see trace_prompts)

    def describe(self) -> dict:
        first = self.traces[0]
        fit = first.fit
        return {
            "format": self.raw.name,
            "path": self.raw.path,
            "speedups": self.speedups,
            "token_scale": fit.token_scale,
            "window_s": list(fit.window) if fit.window else None,
            "max_rows": fit.max_rows,
            "context_tokens": self.context_tokens,
            "context_source": self.context_source,
            "block_tokens": first.block_tokens,
            "rows_in_file": len(self.raw.rows) + self.raw.skipped,
            "rows": first.counts | {"scheduled": len(first.rows), "lengthened": self.lengthened},
            "trace_span_s": first.duration_s * fit.speedup,
            "ideal_prefix_hit_rate": first.ideal_prefix_hit_rate(),
        }


def fit_for(args: argparse.Namespace, speedup: float, context_tokens: int | None) -> TraceFit:
    window = parse_window(args.trace_window) if args.trace_window is not None else None
    scale = 1.0 if args.trace_token_scale is None else args.trace_token_scale
    return TraceFit(speedup, scale, window, args.max_rows, context_tokens)


def schedule_lag_ms(results: Sequence[RequestResult]) -> dict:
    """Actual minus planned send time of every sent request (ms): p50, p99, max."""
    lags = [r.sent_s - r.scheduled_s for r in results if r.sent_s is not None and r.scheduled_s is not None]
    d = metrics.describe(lags, (50.0, 99.0), scale=1000.0)
    return {k: d[k] for k in ("p50", "p99", "max", "mean", "count")}


def summarize(
    results: Sequence[RequestResult], trace: Trace, run: dict, samples: Sequence[tuple[float, dict[str, float]]]
) -> dict:
    """What a replay adds to a run's summary (``run``: ``metrics.summarize``'s, for completed and failed). The ideal
    hit rate is over the rows sent (a ``--duration`` bound may leave the last ones unsent); result ``index`` i is
    row i."""
    cached = run.get("cached_tokens")
    sent = [trace.rows[r.index] for r in results if r.sent_s is not None and 0 <= r.index < len(trace.rows)]
    ideal = replace(trace, rows=sent).ideal_prefix_hit_rate()
    measured = cached["fraction"] if cached else None
    return {
        "trace_speedup": trace.fit.speedup,
        "rows": {
            "in_window": trace.counts["in_window"],
            "over_context": trace.counts["over_context"],
            "scheduled": len(trace.rows),
            "sent": len(sent),
            "completed": run["completed"],
            "failed": run["failed"],
        },
        "schedule_lag_ms": schedule_lag_ms(results),
        "prefix_hit_rate": {
            "ideal": ideal,
            "measured": measured,
            "measured_over_ideal": measured / ideal if measured is not None and ideal else None,
        },
        "series": minute_series(results, samples, run["duration_s"]),
    }


def minute_series(
    results: Sequence[RequestResult],
    samples: Sequence[tuple[float, dict[str, float]]],
    duration_s: float,
    bin_s: float = SERIES_BIN_S,
) -> dict:
    """Per ``bin_s`` of the run (by send time): arrivals, TTFT p90 (ms) of the successful requests, and the mean
    and max share of KV blocks held per pool (``kv_used``; empty when the server is not pdserve)."""
    bins = max(1, math.ceil(duration_s / bin_s))

    def slot(t: float) -> int:
        return min(bins - 1, max(0, int(t // bin_s)))

    arrivals = [0] * bins
    ttfts: list[list[float]] = [[] for _ in range(bins)]
    for r in results:
        t = r.sent_s if r.sent_s is not None else r.scheduled_s
        if t is None:
            continue
        arrivals[slot(t)] += 1
        if r.success and r.ttft_s is not None:
            ttfts[slot(t)].append(r.ttft_s * 1000.0)
    by_role: dict[str, list[list[float]]] = defaultdict(lambda: [[] for _ in range(bins)])
    for t, used in samples:
        for role, share in used.items():
            by_role[role][slot(t)].append(share)
    return {
        "bin_s": bin_s,
        "start_s": [i * bin_s for i in range(bins)],
        "arrivals": arrivals,
        "ttft_p90_ms": [float(np.percentile(v, 90)) if v else None for v in ttfts],
        "kv_used": {
            role: {
                "mean": [float(np.mean(v)) if v else None for v in per_bin],
                "max": [float(np.max(v)) if v else None for v in per_bin],
            }
            for role, per_bin in sorted(by_role.items())
        },
    }


def kv_used(status: object) -> dict[str, float]:
    """Per pool, the share of its live workers' KV blocks that requests hold, from pdserve's ``/status`` (blocks
    the prefix cache keeps but no request uses are free); {} for anything else."""
    held: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    workers = status.get("workers") if isinstance(status, dict) else None
    for w in workers if isinstance(workers, list) else []:
        total, free = (w.get("total_blocks"), w.get("free_blocks")) if isinstance(w, dict) else (None, None)
        if w.get("alive", True) and isinstance(total, int) and total > 0 and isinstance(free, int):
            held[str(w.get("role"))][0] += total - free
            held[str(w.get("role"))][1] += total
    return {role: used / total for role, (used, total) in held.items()}


@dataclass
class KvSampler:
    """Samples ``/status`` every ``period_s`` beside a measured phase (``shapes.PhaseMonitor``); stops at the first
    answer that is not pdserve's, so another server costs one request. Its HTTP client is made with it, before the
    phase: making one takes tens of ms of the event loop, which would delay the first sends."""

    base_url: str
    api_key: str | None = None
    period_s: float = KV_SAMPLE_PERIOD_S
    clock: Clock = WALL_CLOCK
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    client: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=5, trust_env=False))

    async def run(self, start: float) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with self.client as client:
            while True:
                at = self.clock.now() - start
                try:
                    response = await client.get(f"{self.base_url.rstrip('/')}/status", headers=headers)
                    body = response.json() if response.status_code == 200 else None
                except (httpx.HTTPError, ValueError):
                    body = None
                used = kv_used(body)
                if used:
                    self.samples.append((at, used))
                elif not self.samples and not (isinstance(body, dict) and isinstance(body.get("workers"), list)):
                    return  # not pdserve's /status (pdserve's before its workers' first heartbeats: sampled on)
                await self.clock.sleep(self.period_s)
