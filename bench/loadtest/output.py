"""The results folder and the printed table.

Files: ``requests.jsonl`` (one record per request, warm-ups flagged, failures with their reason), ``summary.json``
(what ``run()`` returns), ``summary.csv`` (one row per run), and the PNG plots of ``plots.py``.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.loadtest.client import RequestResult
from bench.loadtest.plots import run_label


def _nested(*keys: str) -> Callable[[dict], Any]:
    """A run summary's value under ``keys``, one level each (None where a level is missing)."""

    def get(summary: dict) -> Any:
        value: Any = summary
        for key in keys:
            value = (value or {}).get(key)
        return value

    return get


CSV_FIELDS: list[tuple[str, Callable[[dict], Any]]] = [
    ("mode", lambda s: s.get("mode", "")),
    ("rate", lambda s: s["rate"]),
    ("requests", lambda s: s["requests"]),
    ("completed", lambda s: s["completed"]),
    ("failed", lambda s: s["failed"]),
    ("duration_s", lambda s: s["duration_s"]),
    ("request_throughput", lambda s: s["request_throughput"]),
    ("output_token_throughput", lambda s: s["output_token_throughput"]),
    ("goodput", lambda s: s["goodput"]),
    ("slo_attainment_pct", lambda s: s["slo_attainment_pct"]),
]
for _metric in ("ttft", "tpot", "itl", "e2el"):
    for _stat in ("mean", "median", "p90", "p99"):
        CSV_FIELDS.append((f"{_metric}_{_stat}_ms", _nested(f"{_metric}_ms", _stat)))

for _part, _key in (("turn1", "ttft_ms_first_turn"), ("later_turns", "ttft_ms_later_turns")):
    for _stat in ("median", "p90"):  # multi-turn runs only; empty for the others
        CSV_FIELDS.append((f"ttft_{_part}_{_stat}_ms", _nested("multi_turn", _key, _stat)))

for _stat in ("total", "mean", "fraction"):  # empty when the server reports no cached tokens
    CSV_FIELDS.append((f"cached_tokens_{_stat}", _nested("cached_tokens", _stat)))

CSV_FIELDS += [  # trace replays only; empty for the others
    ("trace_speedup", lambda s: s.get("trace_speedup")),
    ("rows_sent", _nested("rows", "sent")),
    ("rows_over_context", _nested("rows", "over_context")),
    ("schedule_lag_p50_ms", _nested("schedule_lag_ms", "p50")),
    ("schedule_lag_p99_ms", _nested("schedule_lag_ms", "p99")),
    ("prefix_hit_rate_ideal", _nested("prefix_hit_rate", "ideal")),
    ("prefix_hit_rate_measured", _nested("prefix_hit_rate", "measured")),
]


def default_result_dir() -> Path:
    import time

    return Path("results") / time.strftime("%Y%m%d-%H%M%S")


def write_requests(path: Path, results: Sequence[RequestResult], extra: dict | None = None) -> None:
    with path.open("a") as f:
        for r in results:
            f.write(json.dumps((extra or {}) | r.to_record(), allow_nan=False) + "\n")


def clean_json(value):
    """NaN and inf are not JSON: inf becomes "inf", NaN None."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {k: clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    return value


def write_summary(folder: Path, summary: dict) -> None:
    (folder / "summary.json").write_text(json.dumps(clean_json(summary), indent=2, allow_nan=False) + "\n")
    with (folder / "summary.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([name for name, _ in CSV_FIELDS])
        for run in summary["runs"]:
            writer.writerow(["" if (v := get(run)) is None else v for _, get in CSV_FIELDS])


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.{digits}f}"


def format_table(runs: Sequence[dict]) -> str:
    head = [
        "mode",
        "rate",
        "ok/fail",
        "req/s",
        "out tok/s",
        "TTFT p50/p90 ms",
        "TPOT p50/p90 ms",
        "ITL p50 ms",
        "E2EL p50 ms",
        "goodput",
        "SLO %",
    ]
    rows = [head]
    for s in runs:
        ttft, tpot = s.get("ttft_ms") or {}, s.get("tpot_ms") or {}
        rows.append(
            [
                s.get("mode", "-"),
                _fmt(s["rate"], 2),
                f"{s['completed']}/{s['failed']}",
                _fmt(s["request_throughput"], 2),
                _fmt(s["output_token_throughput"], 1),
                f"{_fmt(ttft.get('median'))}/{_fmt(ttft.get('p90'))}",
                f"{_fmt(tpot.get('median'))}/{_fmt(tpot.get('p90'))}",
                _fmt((s.get("itl_ms") or {}).get("median")),
                _fmt((s.get("e2el_ms") or {}).get("median")),
                _fmt(s.get("goodput"), 2),
                _fmt(s.get("slo_attainment_pct"), 1),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    failures = [f"{s.get('mode', '')} rate {s['rate']}: {s['failures']}" for s in runs if s["failures"]]
    if failures:
        lines.append("failures by reason: " + "; ".join(failures))
    lines += [_cached_line(s) for s in runs if s.get("cached_tokens") and not s.get("multi_turn")]
    lines += [_multi_turn_line(s) for s in runs if s.get("multi_turn")]
    lines += [_trace_line(s) for s in runs if s.get("rows")]
    return "\n".join(lines)


def _share(value) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def _trace_line(run: dict) -> str:
    rows, lag, hit = run["rows"], run["schedule_lag_ms"], run["prefix_hit_rate"]
    return (
        f"{run_label(run)} (trace x{run['trace_speedup']:g}): rows {rows['in_window']} in the window, "
        f"{rows['over_context']} over the context, {rows['sent']} sent, {rows['completed']} completed, "
        f"{rows['failed']} failed; schedule lag p50/p99 {_fmt(lag['p50'])}/{_fmt(lag['p99'])} ms; prefix hit rate "
        f"ideal {_share(hit['ideal'])}, measured {_share(hit['measured'])}"
    )


def _cached_line(run: dict) -> str:
    c = run["cached_tokens"]
    share = "-" if c["fraction"] is None else _fmt(100.0 * c["fraction"])
    return (
        f"{run_label(run)}: cached prompt tokens {c['total']} ({share}% of the prompt tokens, mean "
        f"{_fmt(c['mean'])} per request, {c['requests_reporting']} requests reporting)"
    )


def _multi_turn_line(run: dict) -> str:
    m = run["multi_turn"]
    first, later = m["ttft_ms_first_turn"], m["ttft_ms_later_turns"]
    cached = m.get("cached_tokens")
    hit = (
        f", cached prompt tokens {_fmt(100.0 * cached['hit_rate'])}%"
        if cached and cached["hit_rate"] is not None
        else ""
    )
    return (
        f"{run_label(run)}: conversations {m['completed']} completed / {m['failed']} failed / {m['unfinished']} "
        f"unfinished; TTFT p50/p90 turn 1 {_fmt(first.get('median'))}/{_fmt(first.get('p90'))} ms, later turns "
        f"{_fmt(later.get('median'))}/{_fmt(later.get('p90'))} ms{hit}"
    )
