"""The autoscaling policy (cluster/run/autoscale.py): its decisions over the router's real metrics, on a fake clock.

The inputs are what the router's own ``RouterMetrics`` renders at /metrics after real observations (TTFT and TPOT
histograms, the queue-depth gauge); the clock is a number the test moves. The last test runs the autoscaler's tick
against a live in-process cluster, so its decision resizes real pools through the same ``Scaler`` as ``pdserve scale``.
"""

from __future__ import annotations

import httpx
import pytest

from cluster.config import AutoscaleSection, SLOSection
from cluster.routing.metrics import RouterMetrics
from cluster.run.autoscale import Autoscaler, MetricsWindow, Policy, Window, _PoolState, window_quantile
from tests.helpers.cluster import tiny_cluster_config
from tests.helpers.scaling import Clock, RecordingScaler

SLO = SLOSection(ttft_s=2.0, tpot_s=0.2)


def _config(tiny_llama_path, **autoscale):
    section = {"enabled": False, "breaches": 2, "cooldown_s": 30, "min_requests": 3, **autoscale}
    return tiny_cluster_config(tiny_llama_path, autoscale=section, slo={"ttft_s": 2.0, "tpot_s": 0.2})


def _observe(metrics: RouterMetrics, requests: int, ttft_s: float, tpot_s: float) -> None:
    for _ in range(requests):
        metrics.ttft.observe(ttft_s)
        metrics.tpot.observe(tpot_s)


def test_window_quantile_interpolates_within_the_bucket_of_the_interval_only():
    before = {0.1: 10.0, 0.5: 10.0, 1.0: 10.0, float("inf"): 10.0}  # 10 fast ones in an earlier interval
    after = {0.1: 10.0, 0.5: 20.0, 1.0: 30.0, float("inf"): 30.0}  # this interval: 10 in (0.1, 0.5], 10 in (0.5, 1]
    p90, count = window_quantile(before, after, 0.9)
    assert count == 20
    assert p90 == pytest.approx(0.5 + 0.5 * (18 - 10) / 10)  # rank 18 of 20: 8 tenths into (0.5, 1]
    assert window_quantile(after, after, 0.9) == (None, 0)


def test_slow_decode_scales_decode_up_after_consecutive_breaches_then_cools_down(tiny_llama_path):
    metrics, clock = RouterMetrics(), Clock()
    scaler = RecordingScaler(prefill=1, decode=1)
    autoscaler = Autoscaler(_config(tiny_llama_path), scaler, MetricsWindow(metrics.render), clock)
    autoscaler.metrics.read()  # the baseline
    _observe(metrics, 10, ttft_s=0.3, tpot_s=0.4)  # TPOT p90 over the 0.2 s SLO, TTFT fine
    assert autoscaler.tick() == {}  # one breach is not enough (hysteresis)
    clock.now += 10
    _observe(metrics, 10, ttft_s=0.3, tpot_s=0.4)
    assert autoscaler.tick() == {"decode": 2}
    assert scaler.calls == [("decode", 2)]
    for _ in range(2):  # still slow, but within the cooldown: no second step yet
        clock.now += 10
        _observe(metrics, 10, ttft_s=0.3, tpot_s=0.4)
        assert autoscaler.tick() == {}
    clock.now += 15  # 35 s after the change: past the 30 s cooldown, and the breaches kept counting
    _observe(metrics, 10, ttft_s=0.3, tpot_s=0.4)
    assert autoscaler.tick() == {"decode": 3}


def test_a_long_queue_is_decode_shortage_even_when_ttft_breaches(tiny_llama_path):
    metrics, clock = RouterMetrics(), Clock()
    scaler = RecordingScaler(prefill=1, decode=1)
    autoscaler = Autoscaler(_config(tiny_llama_path, queue_per_replica=2), scaler, MetricsWindow(metrics.render), clock)
    autoscaler.metrics.read()
    metrics.queue_depth.set(5)  # more than 2 per decode replica wait for KV
    for _ in range(2):
        clock.now += 10
        _observe(metrics, 4, ttft_s=5.0, tpot_s=0.05)  # TTFT is long because of the queue: prefill is not it
        changes = autoscaler.tick()
    assert changes == {"decode": 2} and scaler.calls == [("decode", 2)]


def test_slow_first_tokens_with_no_queue_scale_prefill_within_its_bounds(tiny_llama_path):
    metrics, clock = RouterMetrics(), Clock()
    scaler = RecordingScaler(prefill=2, decode=1)
    config = _config(tiny_llama_path, cooldown_s=0, prefill={"min_replicas": 1, "max_replicas": 3})
    autoscaler = Autoscaler(config, scaler, MetricsWindow(metrics.render), clock)
    autoscaler.metrics.read()
    for _ in range(6):  # breaching all along: one step to the max of 3, then no further
        clock.now += 10
        _observe(metrics, 5, ttft_s=4.0, tpot_s=0.1)
        autoscaler.tick()
    assert scaler.calls == [("prefill", 3)]


def test_quiet_intervals_scale_down_to_the_minimum_and_sparse_ones_say_nothing(tiny_llama_path):
    metrics, clock = RouterMetrics(), Clock()
    scaler = RecordingScaler(prefill=1, decode=3)
    autoscaler = Autoscaler(_config(tiny_llama_path, cooldown_s=0), scaler, MetricsWindow(metrics.render), clock)
    autoscaler.metrics.read()
    for _ in range(3):  # two requests an interval, both slow: under min_requests, so no vote at all
        clock.now += 10
        _observe(metrics, 2, ttft_s=9.0, tpot_s=1.0)
        assert autoscaler.tick() == {}
    for _ in range(8):  # fast (under half the SLO), nothing queued: too many decode workers, down to min 1
        clock.now += 10
        _observe(metrics, 5, ttft_s=0.2, tpot_s=0.02)
        autoscaler.tick()
    assert scaler.calls == [("decode", 2), ("decode", 1)]  # prefill stays at its min of 1


def test_colocated_mode_scales_the_one_pool_on_either_slo(tiny_llama_path):
    policy = Policy(AutoscaleSection(breaches=1, cooldown_s=0, min_requests=1), SLO, "colocated")
    slow_ttft = Window(queue_depth=0, requests=5, ttft_p90_s=3.0, tpot_p90_s=0.05)
    assert policy.decide(0.0, slow_ttft, {"prefill": 0, "decode": 2}) == {"decode": 3}
    fast = Window(queue_depth=0, requests=5, ttft_p90_s=0.1, tpot_p90_s=0.05)
    assert policy.decide(1.0, fast, {"prefill": 0, "decode": 3}) == {"decode": 2}


@pytest.mark.timeout(120)
def test_the_autoscaler_resizes_a_live_cluster_through_the_scaler(serve, tiny_llama_path):
    """Real requests, the router's real /metrics over HTTP, the real Scaler: quiet fast traffic takes decode 2 -> 1."""
    from cluster.run.autoscale import http_metrics

    handle = serve(
        pools={"decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160}},
        autoscale={"breaches": 1, "cooldown_s": 0, "min_requests": 1, "scale_down_fraction": 0.99},
        slo={"ttft_s": 60.0, "tpot_s": 10.0},  # whatever this box does is far under it: "too many"
    )
    clock = Clock()
    autoscaler = Autoscaler(handle.config, handle.scaler, MetricsWindow(http_metrics(handle.base_url, None)), clock)
    autoscaler.metrics.read()
    body = {"model": handle.config.served_model_name, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    for _ in range(2):
        assert httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60).status_code == 200
    assert autoscaler.tick() == {"decode": 1}
    assert handle.scaler.wait_idle(timeout_s=20)
    assert [r.name for r in handle.workers if r.pool == "decode"] == ["decode-0"]


@pytest.mark.timeout(120)
def test_enabled_in_the_config_it_runs_by_itself_and_idle_pools_shrink_to_their_minimum(serve):
    """``autoscale.enabled``: ``pdserve serve``'s own thread, reading /metrics over HTTP; no traffic at all votes
    "too big" each interval, so decode goes 2 -> 1 (its minimum) by itself and stays there."""
    from tests.helpers.cluster import wait_until

    handle = serve(
        pools={"decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160}},
        autoscale={"enabled": True, "interval_s": 0.2, "breaches": 2, "cooldown_s": 0},
    )
    assert handle.autoscaler is not None
    wait_until(lambda: [r.name for r in handle.workers if r.pool == "decode"] == ["decode-0"], timeout_s=20)
    assert handle.scaler.wait_idle(timeout_s=20)
    wait_until(lambda: handle.autoscaler.decisions, timeout_s=20)  # recorded once ``scale`` returns
    assert [(pool, size) for _, pool, size in handle.autoscaler.decisions] == [("decode", 1)]


def test_the_config_takes_a_profile_path_and_refuses_a_missing_one_naming_the_field(tmp_path):
    """``autoscale.profile`` is checked at load (a typo must not silently mean "the threshold rule")."""
    from cluster.config import ConfigError, load_config

    assert (AutoscaleSection().profile, AutoscaleSection().target_utilization) == (None, 0.7)
    profile = tmp_path / "profile.json"
    profile.write_text("{}")  # the file is read by the planner's model when `pdserve serve` starts
    path = tmp_path / "cluster.yaml"
    path.write_text(f"autoscale:\n  enabled: true\n  profile: {profile}\n  target_utilization: 0.6\n")
    section = load_config(path).autoscale
    assert (section.profile, section.target_utilization) == (str(profile), 0.6)
    path.write_text(f"autoscale:\n  profile: {tmp_path / 'absent.json'}\n")
    with pytest.raises(ConfigError, match=r"cluster\.yaml: autoscale\.profile: .*no such profile file"):
        load_config(path)
    path.write_text("autoscale:\n  target_utilization: 1.5\n")
    with pytest.raises(ConfigError, match=r"autoscale\.target_utilization"):
        load_config(path)


def test_one_pool_up_and_the_other_down_is_a_role_switch_and_else_two_resizes(tiny_llama_path):
    """Slow first tokens with fast decode: prefill too small, decode too big in the same interval. A decode worker
    switches role (one move, weights kept); where the switch is refused, both pools are resized instead."""
    for refuse in ("", "one role switch at a time per pool: one is under way"):
        metrics, clock = RouterMetrics(), Clock()
        scaler = RecordingScaler(prefill=1, decode=2)
        scaler.refuse_switch = refuse
        config = _config(tiny_llama_path, cooldown_s=0, prefill={"min_replicas": 1, "max_replicas": 3})
        autoscaler = Autoscaler(config, scaler, MetricsWindow(metrics.render), clock)
        autoscaler.metrics.read()
        for _ in range(2):  # breaches: 2
            clock.now += 10
            _observe(metrics, 5, ttft_s=4.0, tpot_s=0.02)
            changes = autoscaler.tick()
        assert changes == {"prefill": 2, "decode": 1}
        if refuse:
            assert sorted(scaler.calls) == [("decode", 1), ("prefill", 2)] and not autoscaler.switches
        else:
            assert scaler.calls == [("switch", "decode-1->prefill")]
            assert autoscaler.switches == [(clock.now, "decode", "prefill")]
        assert scaler.pools.replicas == {"prefill": 2, "decode": 1}


@pytest.mark.timeout(120)
def test_the_autoscaler_switches_a_live_workers_role(serve):
    """The real Scaler and role switcher: slow first tokens against the SLO and fast decode move decode-1 into the
    prefill pool in place."""
    from cluster.run.autoscale import http_metrics
    from tests.helpers.cluster import wait_until, worker_named

    handle = serve(
        pools={"decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160}},
        autoscale={"breaches": 1, "cooldown_s": 0, "min_requests": 1, "scale_down_fraction": 0.99},
        slo={"ttft_s": 0.000001, "tpot_s": 10.0},  # every first token is late, every decode step far under its SLO
    )
    clock = Clock()
    autoscaler = Autoscaler(handle.config, handle.scaler, MetricsWindow(http_metrics(handle.base_url, None)), clock)
    autoscaler.metrics.read()
    body = {"model": handle.config.served_model_name, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    for _ in range(2):
        assert httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60).status_code == 200
    assert autoscaler.tick() == {"prefill": 2, "decode": 1}
    assert [s[1:] for s in autoscaler.switches] == [("decode", "prefill")]
    wait_until(lambda: handle.router.members.workers["decode-1"].role == "prefill", timeout_s=60)
    assert handle.scaler.wait_idle(timeout_s=30)
    assert worker_named(handle, "decode-1").info()["epoch"] == 1
    assert [r.name for r in handle.workers if r.pool == "prefill"] == ["prefill-0", "decode-1"]


def test_a_pool_that_must_grow_on_a_spent_budget_takes_a_worker_from_the_other():
    """``max_workers``: decode too slow on 2P:1D with a budget of 3 moves a prefill worker to decode (prefill voted
    nothing); at prefill's minimum, or with prefill cooling down after a change of its own, decode waits."""
    section = AutoscaleSection(breaches=1, cooldown_s=30, min_requests=1, max_workers=3)
    slow_decode = Window(queue_depth=0, requests=5, ttft_p90_s=1.5, tpot_p90_s=0.5)  # TTFT near its SLO: no vote
    policy = Policy(section, SLO, "disaggregated")
    assert policy.decide(0.0, slow_decode, {"prefill": 2, "decode": 1}) == {"prefill": 1, "decode": 2}
    assert policy.decide(100.0, slow_decode, {"prefill": 1, "decode": 2}) == {}  # prefill is at its minimum of 1
    cooling = Policy(section, SLO, "disaggregated")
    cooling.state["prefill"] = _PoolState(last_change=90.0)  # prefill changed 10 s ago
    assert cooling.decide(100.0, slow_decode, {"prefill": 2, "decode": 1}) == {}
    unbounded = Policy(AutoscaleSection(breaches=1, cooldown_s=30, min_requests=1), SLO, "disaggregated")
    assert unbounded.decide(0.0, slow_decode, {"prefill": 2, "decode": 1}) == {"decode": 2}
    quiet = Window(queue_depth=0, requests=0, ttft_p90_s=None, tpot_p90_s=None)  # idle: every pool votes down
    assert unbounded.decide(100.0, quiet, {"prefill": 2, "decode": 2}) == {"prefill": 1, "decode": 1}
    held = Policy(section, SLO, "disaggregated")
    assert held.decide(0.0, quiet, {"prefill": 2, "decode": 1}) == {}  # under a budget, workers wait for the other pool


def test_long_answers_in_flight_are_not_idleness():
    """An interval in which no request finished but many are in flight (long answers) votes nothing down."""
    policy = Policy(AutoscaleSection(breaches=1, cooldown_s=0, min_requests=1), SLO, "disaggregated")
    streaming = Window(queue_depth=0, requests=0, ttft_p90_s=None, tpot_p90_s=None, inflight=26)
    assert policy.decide(0.0, streaming, {"prefill": 2, "decode": 2}) == {}
