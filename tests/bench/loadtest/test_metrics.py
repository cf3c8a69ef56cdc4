import math

import numpy as np
import pytest

from bench.loadtest.client import RequestResult
from bench.loadtest.metrics import describe, meets_slos, parse_goodput, pick_max_rate, summarize
from bench.loadtest.shapes import arrival_offsets


def ok(ttft, e2el, out, itl=(), timing=None, expected_in=10, usage_in=10):
    return RequestResult(
        index=0,
        success=True,
        ttft_s=ttft,
        e2el_s=e2el,
        output_tokens=out,
        itl_s=list(itl),
        content_chunks=out,
        input_tokens=usage_in,
        expected_input_tokens=expected_in,
        requested_output_tokens=out,
        server_timing=timing,
        output_tokens_source="usage",
    )


def failed(reason):
    return RequestResult(index=0, success=False, error=reason)


def test_describe_by_hand():
    d = describe([1, 2, 3, 4], (50, 90, 99))
    assert d["mean"] == 2.5 and d["median"] == 2.5
    # linear interpolation between closest ranks: rank 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3)
    assert d["p90"] == pytest.approx(3.7)
    assert d["p99"] == pytest.approx(3.97)
    assert d["count"] == 4
    assert describe([], (50,))["mean"] is None


def test_tpot_by_hand():
    assert ok(0.2, 1.2, 11).tpot_s == pytest.approx(0.1)  # (1.2 - 0.2) / (11 - 1)
    assert ok(0.2, 0.2, 1).tpot_s == 0.0
    assert failed("timeout").tpot_s is None


def test_summary_goodput_and_attainment_by_hand():
    results = [
        ok(0.1, 1.1, 11, itl=[0.1] * 10),  # ttft 100 ms, tpot 100 ms: meets both
        ok(0.3, 1.3, 11, itl=[0.1] * 10),  # ttft 300 ms: misses ttft
        ok(0.1, 2.1, 11, itl=[0.2] * 10, usage_in=12),  # tpot 200 ms: misses tpot; input count differs
        failed("http_500"),
        failed("timeout"),
    ]
    s = summarize(results, duration_s=2.0, slos=parse_goodput(["ttft:200", "tpot:150"]))
    assert (s["requests"], s["completed"], s["failed"]) == (5, 3, 2)
    assert s["failures"] == {"http_500": 1, "timeout": 1}
    assert s["good_requests"] == 1
    assert s["goodput"] == pytest.approx(0.5)  # 1 good request in 2 s
    assert s["slo_attainment_pct"] == pytest.approx(20.0)  # failures count in the denominator
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_token_throughput"] == pytest.approx(33 / 2)
    assert s["input_token_throughput"] == pytest.approx(32 / 2)
    assert s["ttft_ms"]["median"] == pytest.approx(100.0)
    assert s["tpot_ms"]["mean"] == pytest.approx((100 + 100 + 200) / 3)
    assert s["itl_ms"]["count"] == 30
    assert s["itl_ms"]["p90"] == pytest.approx(200.0)
    assert s["input_tokens_mismatch"] == 1


def test_slo_on_e2el_and_missing_values():
    assert meets_slos(ok(0.1, 0.5, 5), {"e2el": 500})
    assert not meets_slos(ok(0.1, 0.6, 5), {"e2el": 500})
    assert not meets_slos(failed("stream_cut"), {})


def test_parse_goodput_rejects_nonsense():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["ttft:500,e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_server_timing_stages():
    timing = {"router_queue_s": 0.01, "prefill_compute_s": 0.05, "ttft_s": 0.08}
    s = summarize([ok(0.1, 1.0, 5, timing=timing), ok(0.1, 1.0, 5)], duration_s=1.0)
    st = s["server_timing_ms"]
    assert st["router_queue"]["mean"] == pytest.approx(10.0) and st["router_queue"]["count"] == 1
    assert st["client_minus_server_ttft"]["mean"] == pytest.approx(20.0)
    assert "kv_transfer" not in st
    assert summarize([ok(0.1, 1.0, 5)], 1.0)["server_timing_ms"] == {}


def test_sweep_picks_highest_rate_meeting_target():
    runs = [
        {"rate": 0.5, "slo_attainment_pct": 100.0},
        {"rate": 1.0, "slo_attainment_pct": 95.0},
        {"rate": 2.0, "slo_attainment_pct": 89.9},
        {"rate": 4.0, "slo_attainment_pct": 10.0},
    ]
    pick = pick_max_rate(runs, 90.0, num_workers=2)
    assert pick["max_rate_meeting_slo"] == 1.0 and pick["max_rate_per_worker"] == 0.5 and pick["monotonic"]
    noisy = pick_max_rate([{"rate": 1, "slo_attainment_pct": 80.0}, {"rate": 2, "slo_attainment_pct": 91.0}])
    assert noisy["max_rate_meeting_slo"] == 2 and not noisy["monotonic"]
    assert pick_max_rate([{"rate": 1, "slo_attainment_pct": 50.0}])["max_rate_meeting_slo"] is None


def test_arrivals_have_the_asked_rate_and_ramp():
    rng = np.random.default_rng(0)
    gen = arrival_offsets(10.0, 1.0, 0.0, rng)
    times = [next(gen) for _ in range(5001)]
    assert times[0] == 0.0
    assert 5000 / times[-1] == pytest.approx(10.0, rel=0.05)
    gaps = np.diff(times)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.1)  # Poisson: CV 1
    bursty = np.diff([t for t, _ in zip(arrival_offsets(10.0, 0.25, 0.0, rng), range(5001))])
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(2.0, rel=0.1)  # gamma shape k: CV 1/sqrt(k)
    ramp = [t for t, _ in zip(arrival_offsets(10.0, 4.0, 10.0, rng), range(2000))]
    # linear ramp to 10/s over 10 s: about 50 arrivals in the first 10 s, 12.5 in the first 5 s
    assert sum(t < 10 for t in ramp) == pytest.approx(50, abs=8)
    assert sum(t < 5 for t in ramp) == pytest.approx(12.5, abs=5)
    assert all(b >= a for a, b in zip(ramp, ramp[1:]))
    assert next(arrival_offsets(math.inf, 1.0, 0.0, rng)) == 0.0
