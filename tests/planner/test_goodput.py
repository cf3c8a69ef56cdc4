"""The goodput search: bisection on a known threshold, and a simulated queue whose goodput is computed by hand."""

from __future__ import annotations

import pytest

from planner.goodput import SLO, find_goodput, layout_goodput
from planner.simulator import Layout
from planner.trace import TraceRequest, Workload, poisson_workload
from tests.planner.test_simulator import constant_profile, settings


@pytest.mark.parametrize("start", [0.01, 1.0, 3.3, 500.0])
def test_bisection_finds_a_threshold_from_any_start(start: float) -> None:
    result = find_goodput(lambda rate: 1.0 if rate <= 3.3 else 0.5, start=start, rel_tol=0.001)
    assert 3.3 * (1 - 0.001) <= result.rate <= 3.3
    assert result.attainment == 1.0
    assert all(a >= 0.9 for r, a in result.probes if r <= result.rate)


def test_nothing_passes_is_zero() -> None:
    result = find_goodput(lambda rate: 0.0, start=1.0)
    assert result.rate == 0.0


def test_goodput_of_a_deterministic_queue() -> None:
    # evenly spaced arrivals (gap 1/rate), 1 s of prefill each, one output token, one server, TTFT SLO 2 s:
    # above rate 1 the k-th request's TTFT is 1 + k(1 - 1/rate); 9 of 10 (k = 0..8) meet 2 s while rate <= 8/7
    profile = constant_profile(prefill_s=1.0, decode_s=0.1)
    workload = Workload("even", [TraceRequest(float(k), 100, 1) for k in range(10)])
    slo = SLO(ttft_s=2.0 + 1e-9, tpot_s=1.0)
    result = layout_goodput(profile, workload, Layout("colocated", 0, 1), settings(), slo, rel_tol=0.001)
    assert 8 / 7 * (1 - 0.001) <= result.rate <= 8 / 7 + 1e-9
    assert result.attainment >= 0.9


def test_more_workers_more_goodput() -> None:
    profile = constant_profile(prefill_s=0.2, decode_s=0.02)
    workload = poisson_workload("fixed", [TraceRequest(0.0, 100, 10) for _ in range(200)], seed=1)
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    one = layout_goodput(profile, workload, Layout("colocated", 0, 1), settings(), slo)
    four = layout_goodput(profile, workload, Layout("colocated", 0, 4), settings(), slo)
    assert one.rate > 0
    assert four.rate > 2.5 * one.rate
