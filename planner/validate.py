"""Measured against simulated: the comparison behind ``pdserve plan validate`` (cli/plan_validate_cmd.py).

Plain arithmetic on per-request records; the planner may not import bench, so the load tester's records come as
the dicts of its ``requests.jsonl``, read by key. The simulator replays the requests as sent (actual send offsets,
so client lateness is not blamed on the model, and the token counts the server reported; a trace's rows keep their
hash ids, so the prompts share what they shared); percentiles interpolate as ``numpy.percentile`` does, as the load
tester's; the ratio is simulated / measured; the prefix hit rate is cached over prompt tokens on both sides. How to
read the result: docs/planner.md "pdserve plan validate".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from planner.trace import TraceRequest

GOAL_TOLERANCE = 0.20  # simulated within 20% of measured
METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")
LABELS = {"ttft_p50": "TTFT p50", "ttft_p90": "TTFT p90", "tpot_p50": "TPOT p50", "tpot_p90": "TPOT p90"}


class Latencies(Protocol):
    """A measured request (``MeasuredRequest``) or a simulated one (``planner.simulator.SimRecord``)."""

    input_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float | None
    cached_tokens: int | None


@dataclass(slots=True)
class MeasuredRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float | None
    cached_tokens: int | None = None  # the server's usage.prompt_tokens_details.cached_tokens


@dataclass(slots=True)
class Replay:
    """One measured run as the simulator's ``trace`` and the comparison's ``measured``, in the same order."""

    trace: list[TraceRequest]
    measured: list[MeasuredRequest]
    failed: int  # requests that did not complete: in neither list


def replay_from_records(
    records: Iterable[dict],
    prefix_tokens: dict[int, int] | None = None,
    hash_blocks: Mapping[int, tuple[tuple[int, ...], int]] | None = None,
) -> Replay:
    """The trace the load tester actually sent (warm-ups skipped). ``prefix_tokens``: shared-prefix group -> the
    tokens its requests share; they get ``prefix_id`` = group, so the simulator models prefix-cache hits.
    ``hash_blocks``: a replayed trace's request index -> its row's hash ids and hash-block size."""
    rows = sorted((r for r in records if not r.get("warmup")), key=lambda r: (r["sent_s"] is None, r["sent_s"] or 0))
    trace: list[TraceRequest] = []
    measured: list[MeasuredRequest] = []
    failed = 0
    for r in rows:
        if not r.get("success") or r.get("ttft_s") is None or r.get("sent_s") is None:
            failed += 1
            continue
        inputs = int(r["input_tokens"] if r.get("input_tokens") is not None else r["expected_input_tokens"])
        outputs = int(r["output_tokens"])
        group = r.get("group")
        shared = min((prefix_tokens or {}).get(group, 0), inputs) if group is not None else 0
        ids, block = (hash_blocks or {}).get(r["index"], (None, 0))
        sent = TraceRequest(float(r["sent_s"]), inputs, outputs, group if shared else None, shared, ids, block)
        trace.append(sent)
        measured.append(
            MeasuredRequest(
                float(r["sent_s"]), inputs, outputs, float(r["ttft_s"]), r.get("tpot_s"), r.get("cached_tokens")
            )
        )
    return Replay(trace, measured, failed)


def prefix_hit_rate(requests: Iterable[Latencies]) -> float | None:
    """Prompt tokens served from a prefix cache over all prompt tokens, of the requests that report it (a usage's
    ``cached_tokens``; a simulated request that got its first token); None when none does."""
    reporting = [r for r in requests if r.cached_tokens is not None]
    total = sum(r.input_tokens for r in reporting)
    return sum(r.cached_tokens or 0 for r in reporting) / total if total else None


def percentile(values: Sequence[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (``numpy.percentile``'s default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    if rank == low or ordered[high] == ordered[low]:  # also keeps inf (an unfinished request) from giving nan
        return ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True)
class LatencySummary:
    """Percentiles in ms. A simulated request with no first token counts as an infinite TTFT (as a timeout would)
    and in ``unfinished``; JSON shows an infinite percentile as null."""

    requests: int
    ttft_p50: float | None  # ms
    ttft_p90: float | None
    tpot_p50: float | None  # ms, over requests with more than one output token
    tpot_p90: float | None
    unfinished: int = 0
    prefix_hit_rate: float | None = None  # None: no request reported its cached tokens

    def figures(self) -> dict[str, float | None]:
        """The figures by their JSON names (``ttft_p50_ms``, ..., ``prefix_hit_rate``)."""
        return {f"{m}_ms": getattr(self, m) for m in METRICS} | {"prefix_hit_rate": self.prefix_hit_rate}


def summarize(requests: Sequence[Latencies]) -> LatencySummary:
    ttft = [r.ttft_s * 1000.0 for r in requests]
    tpot = [r.tpot_s * 1000.0 for r in requests if r.output_tokens > 1 and r.tpot_s is not None]
    unfinished = sum(not math.isfinite(r.ttft_s) or getattr(r, "rejected", False) for r in requests)
    return LatencySummary(
        len(requests),
        percentile(ttft, 50),
        percentile(ttft, 90),
        percentile(tpot, 50),
        percentile(tpot, 90),
        unfinished,
        prefix_hit_rate(requests),
    )


def ratio(simulated: float | None, measured: float | None) -> float | None:
    if simulated is None or measured is None or measured <= 0 or not math.isfinite(measured):
        return None
    return simulated / measured  # inf when the simulator never finished what the cluster did


@dataclass(slots=True)
class Comparison:
    """One mode at one rate: the measured run and its simulated replay."""

    mode: str
    rate: float
    measured: LatencySummary
    simulated: LatencySummary
    failed: int = 0
    notes: list[str] = field(default_factory=list)

    def ratios(self) -> dict[str, float | None]:
        return {m: ratio(getattr(self.simulated, m), getattr(self.measured, m)) for m in METRICS}

    def within_goal(self, tolerance: float = GOAL_TOLERANCE) -> dict[str, bool | None]:
        return {m: None if r is None else abs(r - 1.0) <= tolerance for m, r in self.ratios().items()}

    def to_json(self) -> dict:
        """Plain JSON: an infinite figure or ratio is null (the ``unfinished`` counts say why)."""
        return _finite(asdict(self) | {"ratios": self.ratios(), "within_goal": self.within_goal()})


def compare(
    mode: str, rate: float, replay: Replay, simulated: Sequence[Latencies], notes: Iterable[str] = ()
) -> Comparison:
    if len(simulated) != len(replay.trace):
        raise ValueError(f"the simulator returned {len(simulated)} records for a trace of {len(replay.trace)}")
    return Comparison(mode, rate, summarize(replay.measured), summarize(simulated), replay.failed, list(notes))


def goal_summary(comparisons: Sequence[Comparison], tolerance: float = GOAL_TOLERANCE) -> dict:
    """How many of the figures are within the goal, and the worst one."""
    checked = [(c, m, r) for c in comparisons for m, r in c.ratios().items() if r is not None]
    worst = max(checked, key=lambda t: abs(t[2] - 1.0), default=None)
    return _finite(
        {
            "tolerance": tolerance,
            "within": sum(abs(r - 1.0) <= tolerance for _, _, r in checked),
            "figures": len(checked),
            "worst": None
            if worst is None
            else {"mode": worst[0].mode, "rate": worst[0].rate, "metric": worst[1], "ratio": worst[2]},
        }
    )


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(comparisons: Sequence[Comparison], tolerance: float = GOAL_TOLERANCE) -> str:
    """One row per mode, rate and figure: measured ms, simulated ms, simulated / measured, within the goal."""
    header = ("mode", "rate/s", "n", "figure", "measured ms", "simulated ms", "sim/meas", f"within {tolerance:.0%}")
    rows = [header]
    for c in comparisons:
        ratios, within = c.ratios(), c.within_goal(tolerance)
        for m in METRICS:
            rows.append(
                (
                    c.mode,
                    f"{c.rate:g}",
                    str(c.measured.requests),
                    LABELS[m],
                    _ms(getattr(c.measured, m)),
                    _ms(getattr(c.simulated, m)),
                    "-" if ratios[m] is None else f"{ratios[m]:.2f}",
                    {True: "yes", False: "NO", None: "-"}[within[m]],
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) if i < 4 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    for c in comparisons:
        if c.measured.prefix_hit_rate is not None or c.simulated.prefix_hit_rate is not None:
            hits = ratio(c.simulated.prefix_hit_rate, c.measured.prefix_hit_rate)
            lines.append(
                f"{c.mode} at {c.rate:g}/s: prefix hit rate measured {_share(c.measured.prefix_hit_rate)}, "
                f"simulated {_share(c.simulated.prefix_hit_rate)}" + ("" if hits is None else f" (sim/meas {hits:.2f})")
            )
    for c in comparisons:
        if c.simulated.unfinished:
            lines.append(f"{c.mode} at {c.rate:g}/s: {c.simulated.unfinished} simulated requests got no first token")
    if any(c.failed for c in comparisons):
        lines.append(
            "failed requests (left out of both sides): "
            + ", ".join(f"{c.mode} at {c.rate:g}/s: {c.failed}" for c in comparisons if c.failed)
        )
    return "\n".join(lines)
