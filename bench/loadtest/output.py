"""The results folder and the printed table.

Files: ``requests.jsonl`` (one record per request, warm-ups flagged, failures with their reason), ``summary.json``
(what ``run()`` returns), ``summary.csv`` (one row per run), and Agg PNG plots: ``ttft_cdf.png``,
``tpot_itl_cdf.png``, ``latency_vs_rate.png`` (sweeps, comparisons), ``ttft_breakdown.png`` (with server timings).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path

from bench.loadtest.client import RequestResult

CSV_FIELDS = [
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
        CSV_FIELDS.append((f"{_metric}_{_stat}_ms", lambda s, m=_metric, k=_stat: (s.get(f"{m}_ms") or {}).get(k)))

for _part, _key in (("turn1", "ttft_ms_first_turn"), ("later_turns", "ttft_ms_later_turns")):
    for _stat in ("median", "p90"):  # multi-turn runs only; empty for the others
        CSV_FIELDS.append(
            (f"ttft_{_part}_{_stat}_ms", lambda s, k=_key, st=_stat: ((s.get("multi_turn") or {}).get(k) or {}).get(st))
        )

for _stat in ("total", "mean", "fraction"):  # empty when the server reports no cached tokens
    CSV_FIELDS.append((f"cached_tokens_{_stat}", lambda s, st=_stat: (s.get("cached_tokens") or {}).get(st)))

STAGES_TTFT = ("router_queue", "prefill_queue", "prefill_compute", "first_token_delivery")
STAGES_SECOND = ("kv_after_prefill", "decode_queue")  # kv_transfer_s spans the prefill too


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
    return "\n".join(lines)


def _cached_line(run: dict) -> str:
    c = run["cached_tokens"]
    share = "-" if c["fraction"] is None else _fmt(100.0 * c["fraction"])
    return (
        f"{_run_label(run)}: cached prompt tokens {c['total']} ({share}% of the prompt tokens, mean "
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
        f"{_run_label(run)}: conversations {m['completed']} completed / {m['failed']} failed / {m['unfinished']} "
        f"unfinished; TTFT p50/p90 turn 1 {_fmt(first.get('median'))}/{_fmt(first.get('p90'))} ms, later turns "
        f"{_fmt(later.get('median'))}/{_fmt(later.get('p90'))} ms{hit}"
    )


def _run_label(run: dict) -> str:
    mode = f"{run['mode']} " if run.get("mode") else ""
    return f"{mode}rate {run['rate']}"


def _finish_axes(ax) -> None:
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no successful requests", ha="center", va="center", transform=ax.transAxes)


def _cdf(ax, values_ms: Sequence[float], label: str) -> None:
    import numpy as np

    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms))
    ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=label)


def write_plots(folder: Path, runs: Sequence[dict], results_by_run: Sequence[Sequence[RequestResult]]) -> list[str]:
    """The file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    ok_by_run = [[r for r in results if r.success and not r.warmup] for results in results_by_run]

    fig, ax = plt.subplots(figsize=(6, 4))
    for run, ok in zip(runs, ok_by_run):
        _cdf(ax, [r.ttft_s * 1000 for r in ok if r.ttft_s is not None], _run_label(run))
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    _finish_axes(ax)
    fig.tight_layout()
    fig.savefig(folder / "ttft_cdf.png", dpi=100)
    plt.close(fig)
    written.append("ttft_cdf.png")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for run, ok in zip(runs, ok_by_run):
        _cdf(ax1, [r.tpot_s * 1000 for r in ok if r.tpot_s is not None], _run_label(run))
        _cdf(ax2, [g * 1000 for r in ok for g in r.itl_s], _run_label(run))
    ax1.set(xlabel="TPOT (ms)", ylabel="fraction of requests", title="TPOT CDF (per request)")
    ax2.set(xlabel="ITL (ms)", ylabel="fraction of gaps", title="ITL CDF (per text chunk)")
    for ax in (ax1, ax2):
        _finish_axes(ax)
    fig.tight_layout()
    fig.savefig(folder / "tpot_itl_cdf.png", dpi=100)
    plt.close(fig)
    written.append("tpot_itl_cdf.png")

    numeric = [r for r in runs if isinstance(r["rate"], (int, float))]
    if len(numeric) > 1:
        written.append(_latency_vs_rate(plt, folder, numeric))
    if any(r.get("server_timing_ms") for r in runs):
        written.append(_breakdown(plt, folder, runs))
    return written


def _latency_vs_rate(plt, folder: Path, runs: Sequence[dict]) -> str:
    modes = sorted({r.get("mode", "") for r in runs})
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("slo_attainment_pct", "SLO attainment (%)")]
    colors = {mode: f"C{i}" for i, mode in enumerate(modes)}
    for ax, (key, title) in zip(axes, panels):
        for mode in modes:
            mine = sorted((r for r in runs if r.get("mode", "") == mode), key=lambda r: r["rate"])
            rates = [r["rate"] for r in mine]
            name = mode or "run"
            if key == "slo_attainment_pct":
                values = [r.get(key) for r in mine]
                if any(v is not None for v in values):
                    ax.plot(
                        rates,
                        [math.nan if v is None else v for v in values],
                        marker="o",
                        label=name,
                        color=colors[mode],
                    )
                continue
            for stat, style in (("median", "-"), ("p90", "--")):
                values = [(r.get(key) or {}).get(stat) for r in mine]
                ax.plot(
                    rates,
                    [math.nan if v is None else v for v in values],
                    style,
                    marker="o",
                    label=f"{name} {stat}",
                    color=colors[mode],
                )
        ax.set(xlabel="request rate (req/s)", title=title)
        _finish_axes(ax)
    fig.tight_layout()
    fig.savefig(folder / "latency_vs_rate.png", dpi=100)
    plt.close(fig)
    return "latency_vs_rate.png"


def _breakdown(plt, folder: Path, runs: Sequence[dict]) -> str:
    import numpy as np

    labels = [_run_label(r) for r in runs]
    y = np.arange(len(runs))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 2.0 + 0.5 * len(runs)))
    left = np.zeros(len(runs))
    for stage in STAGES_TTFT:
        widths = np.array([((r.get("server_timing_ms") or {}).get(stage) or {}).get("mean") or 0.0 for r in runs])
        ax1.barh(y, widths, left=left, label=stage)
        left += widths
    client = np.array([((r.get("ttft_ms") or {}).get("mean") or 0.0) for r in runs])
    ax1.scatter(client, y, color="black", marker="|", s=200, label="client TTFT", zorder=3)
    ax1.set(yticks=y, yticklabels=labels, xlabel="mean ms", title="TTFT by stage (server timing)")
    ax1.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    left = np.zeros(len(runs))
    for stage in STAGES_SECOND:
        widths = np.array([((r.get("server_timing_ms") or {}).get(stage) or {}).get("mean") or 0.0 for r in runs])
        ax2.barh(y, widths, left=left, label=stage)
        left += widths
    ax2.set(yticks=y, yticklabels=labels, xlabel="mean ms", title="second token: KV transfer and decode queue")
    ax2.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(folder / "ttft_breakdown.png", dpi=100)
    plt.close(fig)
    return "ttft_breakdown.png"
