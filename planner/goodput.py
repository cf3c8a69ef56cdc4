"""Goodput: the highest request rate at which a layout still meets the SLO for enough requests (DistServe's measure).

Attainment is the share of requests meeting both SLOs (a rejected or unfinished one meets neither); it falls with
the rate, since every probe runs the same workload compressed in time (planner/trace.py). The search brackets by
doubling, then bisects to ``rel_tol``: the answer is a rate that was simulated and passed, never an interpolation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from planner.profile_model import Profile, ProfileSet
from planner.simulator import Layout, SimRecord, SimSettings, as_profile_set, simulate
from planner.trace import Workload
from planner.validate import prefix_hit_rate

ATTAINMENT = 0.9  # the share of requests that must meet both SLOs


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float
    tpot_s: float


def attainment(records: list[SimRecord], slo: SLO) -> float:
    if not records:
        return 0.0
    return sum(r.meets(slo.ttft_s, slo.tpot_s) for r in records) / len(records)


@dataclass(slots=True)
class GoodputResult:
    rate: float  # requests/s; 0 when even ``min_rate`` fails
    attainment: float  # at ``rate``
    probes: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment), in the order tried
    prefix_hit_rate: float | None = None  # at ``rate``: prompt tokens served from a prefix cache, of all


def find_goodput(
    passes: Callable[[float], float],
    start: float = 1.0,
    rel_tol: float = 0.02,
    min_rate: float = 1e-3,
    max_rate: float = 1e6,
    target: float = ATTAINMENT,
) -> GoodputResult:
    """The highest rate whose attainment (``passes(rate)``) is at least ``target``."""
    probes: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        value = passes(rate)
        probes.append((rate, value))
        return value >= target

    if ok(start):  # bracket upwards: double until a rate fails
        lo, hi = start, start * 2
        while ok(hi):
            lo, hi = hi, hi * 2
            if hi > max_rate:
                return GoodputResult(lo, probes[-1][1], probes)
    else:  # bracket downwards: halve until a rate passes
        lo, hi = 0.0, start
        while lo == 0.0:
            if hi / 2 < min_rate:
                return GoodputResult(0.0, 0.0, probes)
            if ok(hi / 2):
                lo = hi / 2
            else:
                hi = hi / 2
    while hi - lo > rel_tol * lo:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    best = max((a for r, a in probes if r == lo), default=0.0)
    return GoodputResult(lo, best, probes)


def layout_goodput(
    profile: Profile | ProfileSet,
    workload: Workload,
    layout: Layout,
    settings: SimSettings,
    slo: SLO,
    rel_tol: float = 0.02,
    start: float | None = None,
    min_duration_s: float = 0.0,
) -> GoodputResult:
    """The first probe, unless given, is a rough capacity guess (workers over one request's service time), so the
    bracket takes few doublings. ``min_duration_s``: each probe's trace spans at least this long."""
    if start is None:
        profiles = as_profile_set(profile)
        prefill = profiles.at(layout.prefill_degree if layout.mode == "disaggregated" else layout.decode_degree)
        decode = profiles.at(layout.decode_degree)
        per_request = prefill.prefill_s(int(workload.mean_input)) + workload.mean_output * decode.decode_step_s(
            1, int(workload.mean_input + workload.mean_output / 2)
        )
        start = max(layout.workers / max(per_request, 1e-6), 1e-3)

    hits: dict[float, float | None] = {}

    def measure(rate: float) -> float:
        records = simulate(profile, workload.at_rate(rate, min_duration_s), layout, settings)
        hits[rate] = prefix_hit_rate(records)
        return attainment(records, slo)

    result = find_goodput(measure, start=start, rel_tol=rel_tol)
    result.prefix_hit_rate = hits.get(result.rate)
    return result
