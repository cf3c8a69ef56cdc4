"""``--workload trace:[FORMAT:]FILE`` for ``pdserve plan`` and ``plan validate``: the ``--trace-*`` options, the file
read and fitted by the load tester's own reader (bench/loadtest/traces.py, so both replay the same rows), and the
planner's requests made from the fitted rows (lengths, arrival times, hash ids and their block size).

FORMAT is one of the load tester's ``--dataset-name`` traces (mooncake, azure, burstgpt, trace-jsonl); without it,
``--trace-format`` or the file's first line says which. A bare path is pdserve's JSONL (``trace-jsonl``), as
``pdserve plan`` has always read it. Standard library only at module level (the CLI's parser imports this).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

PREFIX = "trace:"
TRACE_FLAGS = ("trace_speedup", "trace_token_scale", "trace_window", "max_rows", "trace_format")


def add_trace_arguments(parser: argparse.ArgumentParser, rate_note: str, max_rows_default: str = "all") -> None:
    """The load tester's names for fitting a trace to a cluster (the spellings scripts rely on)."""
    group = parser.add_argument_group(
        "trace workloads (--workload trace:[FORMAT:]FILE)",
        "FORMAT: mooncake, azure, burstgpt or trace-jsonl (the load tester's --dataset-name); without it, "
        "--trace-format or the file's first line decides. " + rate_note,
    )
    group.add_argument("--trace-format", default=None, metavar="FORMAT", help="the trace file's format")
    group.add_argument(
        "--trace-speedup", type=float, default=None, metavar="F", help="trace time divided by F (default 1)"
    )
    group.add_argument(
        "--trace-token-scale",
        type=float,
        default=None,
        metavar="F",
        help="prompt and output lengths, and the hash-block size with them, times F (default 1)",
    )
    group.add_argument(
        "--trace-window", default=None, metavar="START:END", help="only the rows in [START, END) seconds of trace time"
    )
    group.add_argument(
        "--max-rows",
        type=int,
        default=None,
        metavar="N",
        help=f"at most the window's first N rows (default: {max_rows_default})",
    )


@dataclass(frozen=True, slots=True)
class TraceSource:
    fmt: str
    path: str

    @property
    def label(self) -> str:
        return f"trace:{self.fmt}:{self.path}"


def trace_source(args: argparse.Namespace) -> TraceSource | None:
    """The trace ``--workload`` names, or None for a synthetic spec (then no ``--trace-*`` option may be given)."""
    from bench.loadtest.traces import TRACE_FORMATS

    spec: str = args.workload
    fmt: str | None = None
    if spec.startswith(PREFIX):
        path = spec[len(PREFIX) :]
        head, sep, tail = path.partition(":")
        if sep and head in TRACE_FORMATS:
            fmt, path = head, tail
    elif Path(spec).is_file():
        path, fmt = spec, "trace-jsonl"
    else:
        given = [f"--{flag.replace('_', '-')}" for flag in TRACE_FLAGS if getattr(args, flag, None) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: only for a trace workload (--workload trace:[FORMAT:]FILE)")
        return None
    if not path or not Path(path).expanduser().is_file():
        raise ValueError(f"--workload {spec!r}: {path!r} is not a file")
    option = args.trace_format
    if option is not None and option not in TRACE_FORMATS:
        raise ValueError(f"--trace-format: one of {', '.join(TRACE_FORMATS)}, got {option!r}")
    if option is not None and fmt is not None and option != fmt:
        raise ValueError(f"--trace-format {option} contradicts --workload {spec!r}")
    fmt = option or fmt or guess_format(path)
    return TraceSource(fmt, path)


def guess_format(path: str) -> str:
    """The format a trace file's first line shows (its header or first row's keys); ValueError when it shows none."""
    with Path(path).expanduser().open() as file:
        first = next((line for line in file if line.strip()), "")
    if first.lstrip().startswith("{"):
        try:
            keys = set(json.loads(first))
        except ValueError:
            keys = set()
        if {"timestamp", "input_length"} <= keys:
            return "mooncake"
        if "arrival_s" in keys:
            return "trace-jsonl"
    else:
        header = {name.strip() for name in first.split(",")}
        if "ContextTokens" in header:
            return "azure"
        if "Request tokens" in header:
            return "burstgpt"
    raise ValueError(f"--workload: cannot tell the format of {path}; write trace:FORMAT:FILE or give --trace-format")


def fit(source: TraceSource, args: argparse.Namespace, max_rows: int | None, max_context_tokens: int | None):
    """The file read and fitted as the load tester fits it (``bench.loadtest.traces.Trace``)."""
    from bench.loadtest.traces import TraceFit, fit_trace, parse_window, read_trace

    window = parse_window(args.trace_window) if args.trace_window is not None else None
    settings = TraceFit(
        speedup=1.0 if args.trace_speedup is None else args.trace_speedup,
        token_scale=1.0 if args.trace_token_scale is None else args.trace_token_scale,
        window=window,
        max_rows=max_rows,
        max_context_tokens=max_context_tokens,
    )
    trace = fit_trace(read_trace(source.fmt, source.path), settings)
    if len(trace.rows) < 2:
        raise ValueError(
            f"{source.path}: {len(trace.rows)} rows left after --trace-window, --max-rows and the context "
            f"({trace.counts}); a trace needs at least two (their spacing sets the rate)"
        )
    return trace


def planner_workload(source: TraceSource, trace):
    """The fitted rows as the planner's ``Workload`` (at unit rate; ``native_rate`` the fitted trace's own)."""
    from planner.trace import TraceRequest, trace_workload

    block = trace.block_tokens or 0
    requests = [
        TraceRequest(row.arrival_s, row.input_tokens, row.output_tokens, hash_ids=row.hash_ids, hash_block_tokens=block)
        for row in trace.rows
    ]
    return trace_workload(source.label, requests)


def describe(source: TraceSource, trace, native_rate: float | None) -> dict:
    """What a plan or a validation reports about the trace it ran (JSON)."""
    fit_ = trace.fit
    return {
        "format": source.fmt,
        "path": source.path,
        "rows": {"used": len(trace.rows)} | dict(trace.counts),
        "speedup": fit_.speedup,
        "token_scale": fit_.token_scale,
        "window_s": list(fit_.window) if fit_.window else None,
        "max_rows": fit_.max_rows,
        "hash_block_tokens": trace.block_tokens,
        "duration_s": trace.duration_s,
        "native_rate_rps": native_rate,
        "ideal_prefix_hit_rate": trace.ideal_prefix_hit_rate(),
    }


def summary_line(info: dict) -> str:
    rows = info["rows"]
    cut = f", {rows['over_context']} over the context left out" if rows.get("over_context") else ""
    ideal = info["ideal_prefix_hit_rate"]
    sharing = "no hash ids" if ideal is None else f"ideal prefix hit rate {ideal:.3f}"
    return (
        f"trace {info['format']}:{info['path']}: {rows['used']} rows of {rows['in_window']} in the window{cut}, "
        f"{info['duration_s']:.1f} s at --trace-speedup {info['speedup']:g} ({info['native_rate_rps']:.3g} req/s), "
        f"token scale {info['token_scale']:g}; {sharing}"
    )
