"""The PNG plots of a results folder (matplotlib, Agg), and ``pdserve bench plot DIR`` to redraw them from it.

Every figure carries one caption (config, workload, rates, workers, date) and draws a run the same way in every
plot: its color says the mode, its line style the rate (where the rate is the x axis, the percentile), its name is
"<mode> rate <r>". Latency axes are logarithmic
and the tail is drawn as 1 − CDF on a log scale, so that a few long stalls (a colocated decode waiting for a whole
prefill) stand out instead of hugging the top of a linear CDF.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from bench.loadtest.client import RequestResult

STAGES_TTFT = ("router_queue", "prefill_queue", "prefill_compute", "first_token_delivery")
STAGES_SECOND = ("kv_after_prefill", "decode_queue")  # kv_transfer_s spans the prefill too
MODE_COLORS = {"colocated": "C0", "disaggregated": "C1", "": "C0"}
RATE_STYLES = ("-", "--", ":", "-.")
TAIL_MARKERS = (("p50", 50.0, "o"), ("p90", 90.0, "s"), ("p99", 99.0, "^"), ("max", 100.0, "X"))


@dataclass(frozen=True)
class Series:
    """How one run is drawn in every plot."""

    label: str
    color: str
    style: str


def run_label(run: dict) -> str:
    mode = f"{run['mode']} " if run.get("mode") else ""
    return f"{mode}rate {run['rate']}"


def _series(runs: Sequence[dict]) -> list[Series]:
    modes = sorted({r.get("mode", "") for r in runs} - set(MODE_COLORS))
    colors = MODE_COLORS | {m: f"C{i + 2}" for i, m in enumerate(modes)}
    rates = sorted({_rate_key(r["rate"]) for r in runs})
    return [
        Series(run_label(r), colors[r.get("mode", "")], RATE_STYLES[rates.index(_rate_key(r["rate"])) % 4])
        for r in runs
    ]


def _rate_key(rate) -> float:
    return float(rate)  # a number, or "inf"


def caption(summary: dict) -> str:
    """One or two lines naming what was measured: config, workload, rates, workers and date."""
    bench = summary.get("benchmark") or {}
    workload = bench.get("workload") or {}
    source = bench.get("config") or bench.get("base_url") or "an OpenAI-compatible server"
    trace = bench.get("trace")
    if trace:
        shape = (
            f"{trace['format']} trace {Path(trace['path']).name}, tokens x{trace['token_scale']:g}, "
            f"{_tokens(bench.get('input_tokens_mean'))} in / {_tokens(bench.get('output_tokens_mean'))} out"
        )
    elif bench.get("multi_turn"):
        shape = f"multi-turn, {bench.get('turns_per_conversation_mean', 0):.1f} turns per conversation"
    else:
        shape = (
            f"{workload.get('dataset_name', '?')} {_tokens(bench.get('input_tokens_mean'))} in / "
            f"{_tokens(bench.get('output_tokens_mean'))} out"
        )
    runs = summary.get("runs") or []
    per_rate = bench.get("num_prompts")
    rates = ", ".join(dict.fromkeys(str(r["rate"]) for r in runs))
    arrivals = "poisson" if bench.get("burstiness", 1.0) == 1.0 else f"gamma burstiness {bench['burstiness']}"
    if trace:
        arrivals = "the trace's schedule at speed-up " + ", ".join(f"{v:g}" for v in trace["speedups"])
        per_rate = None
    workers = "; ".join(
        f"{mode} {_workers(info)}" for mode, info in (summary.get("modes") or {}).items() if info.get("num_workers")
    ) or (f"{bench['num_workers']} workers" if bench.get("num_workers") else "")
    first = f"{source} · {shape}" + (f", {per_rate} prompts per rate" if per_rate else "")
    second = " · ".join(
        part for part in (f"rates {rates} req/s ({arrivals})", workers, summary.get("date") or "") if part
    )
    return f"{first}\n{second}"


def _tokens(value) -> str:
    return "?" if value is None else f"{value:.0f}"


def _workers(info: dict) -> str:
    roles = info.get("roles") or {}
    if set(roles) == {"prefill", "decode"}:
        return f"{roles['prefill']} prefill + {roles['decode']} decode"
    return f"{info['num_workers']} workers"


def write_plots(
    folder: Path, runs: Sequence[dict], results_by_run: Sequence[Sequence[RequestResult]], summary: dict
) -> list[str]:
    """The file names written into ``folder``; ``summary`` supplies the caption."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    text = caption(summary)
    series = _series(runs)
    ok_by_run = [[r for r in results if r.success and not r.warmup] for results in results_by_run]
    written = [
        _ttft(plt, folder, series, ok_by_run, text),
        _tpot_itl(plt, folder, series, ok_by_run, text),
    ]
    numeric = [r for r in runs if isinstance(r["rate"], (int, float))]
    if len(numeric) > 1:
        written.append(_latency_vs_rate(plt, folder, numeric, text))
    if any(r.get("server_timing_ms") for r in runs):
        written.append(_breakdown(plt, folder, runs, series, text))
    if any(r.get("series") for r in runs):
        written.append(_trace_series(plt, folder, runs, series, text))
    traced = [r for r in numeric if r.get("trace_speedup") is not None]
    if len(traced) > 1:
        written.append(_attainment_curves(plt, folder, traced, summary, text))
    return written


def _save(plt, fig, folder: Path, name: str, text: str) -> str:
    fig.suptitle(text, fontsize=8)
    fig.savefig(folder / name, dpi=100)
    plt.close(fig)
    return name


def _cdf(ax, values_ms: Sequence[float], s: Series) -> None:
    import numpy as np

    if values_ms:
        xs = np.sort(np.asarray(values_ms))
        ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, s.style, color=s.color, label=s.label)


def _tail(ax, values_ms: Sequence[float], s: Series) -> None:
    """1 − CDF (the share of values at or above x) on log-log axes, with p50/p90/p99/max marked; the legend says
    the max."""
    import numpy as np

    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms))
    share_at_or_above = (xs.size - np.arange(xs.size)) / xs.size
    ax.plot(xs, share_at_or_above, s.style, color=s.color, label=f"{s.label} (max {xs[-1]:.0f} ms)")
    for _, pct, marker in TAIL_MARKERS:
        x = float(np.percentile(xs, pct))
        ax.plot([x], [max(1.0 - pct / 100.0, 1.0 / xs.size)], marker, color=s.color, markersize=6)


def _log_axis(axis) -> None:
    """Plain numbers on a log axis (not 1.05×10²), minor ticks labelled only when less than a decade shows."""
    from matplotlib import ticker

    plain = ticker.FuncFormatter(lambda v, _: f"{v:g}")
    axis.set_major_formatter(plain)
    low, high = axis.get_view_interval()
    narrow = low > 0 and high / low < 10
    axis.set_minor_formatter(plain if narrow else ticker.NullFormatter())


def _tpot_itl(plt, folder: Path, series: Sequence[Series], ok_by_run, text: str) -> str:
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), layout="constrained")
    for s, ok in zip(series, ok_by_run):
        tpot = [r.tpot_s * 1000 for r in ok if r.tpot_s]
        itl = [g * 1000 for r in ok for g in r.itl_s if g > 0]
        _cdf(axes[0][0], tpot, s)
        _cdf(axes[0][1], itl, s)
        _tail(axes[1][0], tpot, s)
        _tail(axes[1][1], itl, s)
    axes[0][0].set(ylabel="fraction of requests", title="TPOT CDF (per request)")
    axes[0][1].set(ylabel="fraction of gaps", title="ITL CDF (per text chunk)")
    axes[1][0].set(xlabel="TPOT (ms, log)", ylabel="share of requests ≥ x (log)", title="TPOT tail: 1 − CDF")
    axes[1][1].set(xlabel="ITL (ms, log)", ylabel="share of gaps ≥ x (log)", title="ITL tail: 1 − CDF")
    markers = [
        Line2D([], [], linestyle="", marker=m, color="gray", label=name) for name, _, m in TAIL_MARKERS
    ]  # fmt: skip
    for row in axes:
        for ax in row:
            ax.set_xscale("log")
            _log_axis(ax.xaxis)
            _finish_axes(ax)
    for ax in axes[1]:
        ax.set_yscale("log")
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(handles=handles + markers, fontsize="x-small", loc="upper right")
    return _save(plt, fig, folder, "tpot_itl_cdf.png", text)


def _ttft(plt, folder: Path, series: Sequence[Series], ok_by_run, text: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    for s, ok in zip(series, ok_by_run):
        _cdf(ax, [r.ttft_s * 1000 for r in ok if r.ttft_s], s)
    ax.set(xlabel="TTFT (ms, log)", ylabel="fraction of requests", title="TTFT CDF", xscale="log")
    _log_axis(ax.xaxis)
    _finish_axes(ax)
    return _save(plt, fig, folder, "ttft_cdf.png", text)


def _latency_vs_rate(plt, folder: Path, runs: Sequence[dict], text: str) -> str:
    modes = sorted({r.get("mode", "") for r in runs})
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5), layout="constrained")
    panels = [
        ("ttft_ms", "TTFT (ms, log)"),
        ("tpot_ms", "TPOT (ms, log)"),
        ("slo_attainment_pct", "SLO attainment (%)"),
    ]
    for ax, (key, title) in zip(axes, panels):
        for mode in modes:
            mine = sorted((r for r in runs if r.get("mode", "") == mode), key=lambda r: r["rate"])
            rates, name, color = [r["rate"] for r in mine], mode or "run", MODE_COLORS.get(mode, "C2")
            if key == "slo_attainment_pct":
                values = [r.get(key) for r in mine]
                if any(v is not None for v in values):
                    ax.plot(rates, [math.nan if v is None else v for v in values], marker="o", label=name, color=color)
                continue
            for stat, style in (("median", "-"), ("p90", "--"), ("p99", ":")):
                values = [(r.get(key) or {}).get(stat) for r in mine]
                if any(v is not None for v in values):
                    ax.plot(
                        rates, [math.nan if v is None else v for v in values], style, marker="o",
                        label=f"{name} {stat}", color=color,
                    )  # fmt: skip
        ax.set(xlabel="request rate (req/s)", title=title)
        if key != "slo_attainment_pct":
            ax.set_yscale("log")
            _log_axis(ax.yaxis)
        else:
            ax.set_ylim(-2, 102)
        _finish_axes(ax)
    return _save(plt, fig, folder, "latency_vs_rate.png", text)


POOL_MARKERS = {"prefill": "o", "decode": "s", "colocated": "^"}


def _trace_series(plt, folder: Path, runs: Sequence[dict], series: Sequence[Series], text: str) -> str:
    """A replay minute by minute: arrivals, TTFT p90, and the share of each pool's KV blocks requests held."""
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 9), sharex=True, layout="constrained")
    for s, run in zip(series, runs):
        data = run.get("series")
        if not data:
            continue
        minutes = [t / 60.0 for t in data["start_s"]]
        ax1.plot(minutes, data["arrivals"], s.style, drawstyle="steps-post", marker=".", color=s.color, label=s.label)
        ttft = [math.nan if v is None else v for v in data["ttft_p90_ms"]]
        ax2.plot(minutes, ttft, s.style, marker=".", color=s.color, label=s.label)
        for pool, used in data["kv_used"].items():
            means = [math.nan if v is None else 100.0 * v for v in used["mean"]]
            marker = POOL_MARKERS.get(pool, "x")
            ax3.plot(minutes, means, s.style, marker=marker, color=s.color, label=f"{s.label} {pool} (mean)")
    ax1.set(ylabel=f"arrivals per {_bin_label(runs)}", title="arrivals (by send time)")
    ax2.set(ylabel="TTFT p90 (ms, log)", yscale="log", title="TTFT p90 of the requests sent in each bin")
    _log_axis(ax2.yaxis)
    ax3.set(
        xlabel="minutes from the start of the replay",
        ylabel="KV blocks held (%)",
        title="KV blocks held by requests, per pool (pdserve /status; blocks only cached count as free)",
        ylim=(-2, 102),
    )
    for ax in (ax1, ax2):
        _finish_axes(ax)
    ax3.grid(alpha=0.3)
    if ax3.get_legend_handles_labels()[0]:
        ax3.legend(fontsize="x-small")
    else:
        ax3.text(0.5, 0.5, "no KV samples (not a pdserve server)", ha="center", va="center", transform=ax3.transAxes)
    return _save(plt, fig, folder, "trace_series.png", text)


def _bin_label(runs: Sequence[dict]) -> str:
    bin_s = next((r["series"]["bin_s"] for r in runs if r.get("series")), 60.0)
    return "minute" if bin_s == 60.0 else f"{bin_s:g} s"


def _attainment_curves(plt, folder: Path, runs: Sequence[dict], summary: dict, text: str) -> str:
    """DistServe's figure: goodput and SLO attainment against the rate, one point per trace speed-up, per mode."""
    target = (summary.get("benchmark") or {}).get("slo_target_pct")
    slos: dict = next((r["slo_ms"] for r in runs if r.get("slo_ms")), {})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    rates = [float(r["rate"]) for r in runs]
    ax1.plot([0, max(rates)], [0, max(rates)], ":", color="gray", label="every request within the SLOs")
    for mode in sorted({r.get("mode", "") for r in runs}):
        mine = sorted((r for r in runs if r.get("mode", "") == mode), key=lambda r: float(r["rate"]))
        xs, color, name = [float(r["rate"]) for r in mine], MODE_COLORS.get(mode, "C2"), mode or "run"
        for ax, key in ((ax1, "goodput"), (ax2, "slo_attainment_pct")):
            ys = [math.nan if r.get(key) is None else r[key] for r in mine]
            ax.plot(xs, ys, marker="o", color=color, label=name)
            for x, y, r in zip(xs, ys, mine):
                ax.annotate(
                    f"x{r['trace_speedup']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7,
                    color=color,
                )  # fmt: skip
    if target is not None:
        ax2.axhline(float(target), linestyle="--", color="gray", label=f"target {float(target):g}%")
    within = ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items())
    ax1.set(xlabel="request rate (req/s: the trace at each speed-up)", ylabel="goodput (req/s)", title="goodput")
    ax2.set(
        xlabel="request rate (req/s: the trace at each speed-up)",
        ylabel="requests within the SLOs (%)",
        title=f"SLO attainment ({within})",
        ylim=(-2, 102),
    )
    for ax in (ax1, ax2):
        _finish_axes(ax)
    return _save(plt, fig, folder, "slo_attainment_curves.png", text)


def _stage_mean(run: dict, stage: str) -> float | None:
    return ((run.get("server_timing_ms") or {}).get(stage) or {}).get("mean")


def _breakdown(plt, folder: Path, runs: Sequence[dict], series: Sequence[Series], text: str) -> str:
    import numpy as np

    labels = [s.label for s in series]
    y = np.arange(len(runs))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 3.2 + 0.6 * len(runs)), layout="constrained")
    left = np.zeros(len(runs))
    for i, stage in enumerate(STAGES_TTFT):
        widths = np.array([_stage_mean(r, stage) or 0.0 for r in runs])
        ax1.barh(y, widths, left=left, label=stage, color=f"C{i + 2}")
        left += widths
    client = np.array([((r.get("ttft_ms") or {}).get("mean") or 0.0) for r in runs])
    ax1.scatter(client, y, color="black", marker="|", s=200, label="client TTFT", zorder=3)
    for yi, (server, seen) in enumerate(zip(left, client)):
        ax1.annotate(
            f"{server:.0f} ms (client {seen:.0f})", (max(server, seen), yi), textcoords="offset points",
            xytext=(6, 0), va="center", fontsize=7,
        )  # fmt: skip
    ax1.set(yticks=y, yticklabels=labels, xlabel="mean ms", title="TTFT by stage (server timing)")
    ax1.set_xlim(0, max(float(left.max()), float(client.max()), 1.0) * 1.3)
    ax1.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=5)

    height = 0.8 / len(STAGES_SECOND)
    for i, stage in enumerate(STAGES_SECOND):
        means = [_stage_mean(r, stage) for r in runs]
        shown = [yi for yi, m in enumerate(means) if m is not None]
        bars = ax2.barh(
            y[shown] + (i - 0.5) * height, [means[yi] for yi in shown], height=height, label=stage, color=f"C{i + 6}"
        )
        ax2.bar_label(bars, fmt="%.1f ms", fontsize=7, padding=3)
    for yi, run in enumerate(runs):
        if all(_stage_mean(run, stage) is None for stage in STAGES_SECOND):
            ax2.text(0.0, yi, "  no KV hand-off in this mode", va="center", fontsize=7, color="gray")
    ax2.axvline(0.0, color="black", linewidth=1.0)
    low, high = ax2.get_xlim()
    span = max(high - low, 1.0)
    ax2.set_xlim(min(low, -0.1 * span) - 0.2 * span, max(high, 0.1 * span) + 0.45 * span)
    ax2.set(
        yticks=y,
        yticklabels=labels,
        title="second token: when the KV was complete, and the decode queue",
        ylim=(-0.6, len(runs) - 0.4),
        xlabel="mean ms\n< 0: KV complete before the first token (streaming hid the transfer)\n"
        "> 0: KV complete after it (the second token waited for it)",
    )
    ax2.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)
    return _save(plt, fig, folder, "ttft_breakdown.png", text)


def _finish_axes(ax) -> None:
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="x-small")
    else:
        ax.text(0.5, 0.5, "no successful requests", ha="center", va="center", transform=ax.transAxes)


def load_folder(folder: Path) -> tuple[dict, list[list[RequestResult]]]:
    """A results folder's summary and each run's requests, as ``write_plots`` takes them."""
    summary = json.loads((folder / "summary.json").read_text())
    names = {f.name for f in fields(RequestResult)}
    by_run: dict[tuple[str, float], list[RequestResult]] = {}
    with (folder / "requests.jsonl").open() as f:
        for line in f:
            record = json.loads(line)
            result = RequestResult(**{k: v for k, v in record.items() if k in names})
            by_run.setdefault((record.get("mode") or "", _rate_key(record["rate"])), []).append(result)
    results = [by_run.get((r.get("mode") or "", _rate_key(r["rate"])), []) for r in summary["runs"]]
    return summary, results


def today() -> str:
    return time.strftime("%Y-%m-%d")


def run(args: argparse.Namespace) -> dict:
    """``pdserve bench plot DIR``: redraw a results folder's plots from its summary.json and requests.jsonl."""
    folder = Path(args.result_dir)
    if not (folder / "summary.json").is_file() or not (folder / "requests.jsonl").is_file():
        raise ValueError(f"{folder}: not a results folder (summary.json and requests.jsonl are needed)")
    summary, results = load_folder(folder)
    return {"result_dir": str(folder), "plots": write_plots(folder, summary["runs"], results, summary)}
