"""The autoscaler's planner model (planner/autoscale_model.py): its arithmetic on a hand-made profile whose fits give
answers computable by hand, the policy's decisions with it over the router's real metrics on a fake clock, the
profile loading behind ``autoscale.profile``, and a live in-process cluster resized by it."""

from __future__ import annotations

import pytest

from cluster.config import ConfigError, parse_config
from cluster.routing.metrics import RouterMetrics
from cluster.run.autoscale import Autoscaler, LiveLoad, MetricsWindow
from planner.autoscale_model import ProfileCapacityModel, capacity_model_for
from planner.profile_model import Fit, Profile
from tests.helpers.scaling import Clock, RecordingScaler

# prefill: 10 ms + 1 ms per new token + 0.1 ms per cached token before them; decode: 20 ms + 5 ms per request in the
# batch (so at a TPOT SLO of 0.1 s the largest batch is exactly 16, 160 tokens/s); transfer: 1 ms + 1 us per byte
PREFILL = Fit(["1", "tokens", "context"], [0.01, 0.001, 0.0001])
DECODE = Fit(["1", "batch"], [0.02, 0.005])
TRANSFER = Fit(["1", "num_bytes"], [0.001, 1e-6])
SLO = {"ttft_s": 2.0, "tpot_s": 0.1}


def hand_profile(decode: Fit = DECODE, kv_bytes_per_token: int = 1000) -> Profile:
    return Profile(
        model="test",
        dtype="float32",
        device="cpu",
        backend="zmq",
        date="2026-01-01",
        block_size=16,
        kv_bytes_per_token=kv_bytes_per_token,
        max_batch_tokens=2048,
        max_num_seqs=64,
        prefill_fit=PREFILL,
        decode_fit=decode,
        transfer_fit=TRANSFER,
    )


def config(mode: str = "disaggregated", prefill: dict | None = None, decode: dict | None = None, **autoscale):
    section = {"breaches": 2, "cooldown_s": 0, "min_requests": 3, "target_utilization": 0.8, **autoscale}
    bounds = {"min_replicas": 1, "max_replicas": 6}
    section.setdefault("prefill", bounds)
    section.setdefault("decode", bounds)
    pools = {
        "prefill": {"replicas": 1, "kv_blocks": 1000, **(prefill or {})},
        "decode": {"replicas": 2, "kv_blocks": 1000, **(decode or {})},
    }
    return parse_config({"mode": mode, "pools": pools, "slo": SLO, "autoscale": section})


def load(rate: float, prompt: float | None = 100, output: float | None = 21, queue: float = 0) -> LiveLoad:
    return LiveLoad(10.0, rate, prompt, output, queue, 0.0, {"prefill": 1, "decode": 2}, None, None)


def test_each_pool_needs_its_busy_share_over_the_target_utilization_rounded_up():
    model = ProfileCapacityModel.from_config(config(), hand_profile())
    estimate = model.estimate(load(rate=20))
    assert estimate.prefill_busy == pytest.approx(20 * (0.01 + 0.001 * 100))  # 2.2 prefill-seconds per second
    assert estimate.transfer_busy == pytest.approx(20 * (0.001 + 1e-6 * 100 * 1000))  # 2.02: under prefill's
    assert estimate.decode_batch == 16  # 0.02 + 0.005 * 16 = 0.1 s, the TPOT SLO
    assert estimate.decode_busy == pytest.approx(20 * 20 / (16 / 0.1))  # 400 tokens/s over 160 per replica: 2.5
    assert estimate.needed == {"prefill": 3, "decode": 4}  # ceil(2.2 / 0.8 = 2.75), ceil(2.5 / 0.8 = 3.125)
    colocated = ProfileCapacityModel.from_config(config("colocated"), hand_profile())
    assert colocated.replicas_needed(load(rate=20)) == {"decode": 6}  # one pool does both: ceil(4.7 / 0.8 = 5.875)


def test_a_slow_transfer_sizes_the_prefill_pool():
    model = ProfileCapacityModel.from_config(config(), hand_profile(kv_bytes_per_token=2000))
    estimate = model.estimate(load(rate=20))
    assert estimate.transfer_busy == pytest.approx(20 * (0.001 + 1e-6 * 100 * 2000))  # 4.02 > 2.2
    assert estimate.needed["prefill"] == 6  # ceil(4.02 / 0.8 = 5.025)


def test_prompts_are_prefilled_in_the_served_pools_chunks():
    model = ProfileCapacityModel.from_config(config(prefill={"max_batch_tokens": 128}), hand_profile())
    # 300 tokens in chunks of 128, 128, 44 after 0, 128, 256 cached ones
    assert model.prefill_s(300) == pytest.approx(3 * 0.01 + 0.001 * 300 + 0.0001 * (0 + 128 + 256))


def test_the_decode_batch_is_bounded_by_context_kv_and_max_num_seqs():
    with_context = Fit(["1", "context_tokens"], [0.02, 0.0001])  # a request of 100 + 20/2 tokens adds 11 ms
    model = ProfileCapacityModel.from_config(config(), hand_profile(decode=with_context))
    assert model.decode_batch(100, 20) == (7, pytest.approx(0.02 + 0.0001 * 770))  # 8 would take 0.108 s
    small_kv = ProfileCapacityModel.from_config(config(decode={"kv_blocks": 10}), hand_profile())
    assert small_kv.decode_batch(100, 21) == (1, pytest.approx(0.025))  # 160 KV tokens hold one 121-token request
    few_seqs = ProfileCapacityModel.from_config(config(decode={"max_num_seqs": 4}), hand_profile())
    assert few_seqs.decode_batch(100, 21) == (4, pytest.approx(0.04))
    slow = ProfileCapacityModel.from_config(config(), hand_profile(decode=Fit(["1"], [0.3])))
    assert slow.decode_batch(100, 21) == (1, pytest.approx(0.3))  # over the SLO even alone: one at a time


def test_queued_requests_count_as_arrivals_idle_needs_one_each_unknown_mix_no_answer():
    model = ProfileCapacityModel.from_config(config(), hand_profile())
    assert model.estimate(load(rate=10, queue=100)).needed == model.estimate(load(rate=20)).needed  # 100 over 10 s
    assert model.replicas_needed(load(rate=0, prompt=None, output=None)) == {"prefill": 1, "decode": 1}
    assert model.replicas_needed(load(rate=5, prompt=None, output=None)) == {}


# ---- the policy with the model, over the router's real metrics --------------------------------------------------


def serve_requests(metrics: RouterMetrics, n: int, ttft_s: float, tpot_s: float, prompt: int = 100, out: int = 21):
    """What the router records for ``n`` requests that came in and finished (cluster/routing/router.py's order)."""
    for _ in range(n):
        metrics.inflight.inc()
        metrics.requests.labels("finished").inc()
        metrics.prompt_tokens.inc(prompt)
        metrics.generated_tokens.inc(out)
        metrics.ttft.observe(ttft_s)
        metrics.tpot.observe(tpot_s)
        metrics.inflight.dec()


def autoscaler(cfg, scaler, with_model: bool = True):
    metrics, clock = RouterMetrics(), Clock()
    model = ProfileCapacityModel.from_config(cfg, hand_profile()) if with_model else None
    scaler_ = Autoscaler(cfg, scaler, MetricsWindow(metrics.render, clock), clock, model)
    scaler_.metrics.read()  # the baseline
    return scaler_, metrics, clock


def test_the_window_counts_arrivals_finished_requests_and_their_tokens():
    metrics, clock = RouterMetrics(), Clock()
    window = MetricsWindow(metrics.render, clock)
    window.read()
    serve_requests(metrics, 3, 0.1, 0.01, prompt=50, out=10)
    metrics.requests.labels("error").inc()  # one came in and failed
    metrics.inflight.inc(2)  # two came in and are still running
    clock.now += 4
    seen = window.read()
    assert (seen.elapsed_s, seen.arrivals, seen.finished) == (4, 6, 3)
    assert (seen.prompt_tokens, seen.output_tokens, seen.inflight) == (150, 30, 2)


def test_rising_load_scales_up_before_the_slo_breaks_one_step_at_a_time():
    cfg = config()
    scaler = RecordingScaler(prefill=1, decode=2)
    auto, metrics, clock = autoscaler(cfg, scaler)
    for _ in range(6):  # 20 requests/s; latency within the SLO all along (the threshold rule sees nothing wrong)
        clock.now += 10
        serve_requests(metrics, 200, ttft_s=0.3, tpot_s=0.06)
        auto.tick()
    assert auto.policy.last_needed == {"prefill": 3, "decode": 4}
    assert scaler.calls == [("decode", 3), ("prefill", 2), ("decode", 4), ("prefill", 3)]

    without = RecordingScaler(prefill=1, decode=2)
    auto, metrics, clock = autoscaler(cfg, without, with_model=False)
    for _ in range(6):
        clock.now += 10
        serve_requests(metrics, 200, ttft_s=0.3, tpot_s=0.06)
        auto.tick()
    assert without.calls == []


def test_falling_load_shrinks_only_where_latency_has_room():
    scaler = RecordingScaler(prefill=3, decode=4)
    auto, metrics, clock = autoscaler(config(), scaler)
    for _ in range(4):  # 1 request/s: one of each is enough, but TPOT p90 is 0.08 s, over half the 0.1 s SLO
        clock.now += 10
        serve_requests(metrics, 10, ttft_s=0.2, tpot_s=0.08)
        auto.tick()
    assert auto.policy.last_needed == {"prefill": 1, "decode": 1}
    assert scaler.calls == [("prefill", 2), ("prefill", 1)]  # TTFT 0.2 s is under 1 s: prefill shrinks
    for _ in range(2):
        clock.now += 10
        serve_requests(metrics, 10, ttft_s=0.2, tpot_s=0.02)
        auto.tick()
    assert scaler.calls[-1] == ("decode", 3)


def test_with_no_finished_request_yet_the_threshold_rule_votes():
    scaler = RecordingScaler(prefill=1, decode=1)
    auto, metrics, clock = autoscaler(config(queue_per_replica=2), scaler)
    metrics.queue_depth.set(5)
    metrics.inflight.set(8)  # arriving, none finished: the token mix is unknown
    for _ in range(2):
        clock.now += 10
        auto.tick()
    assert auto.policy.last_needed == {}
    assert scaler.calls == [("decode", 2)]  # the queue's vote (a long queue: decode is short)


# ---- loading the profile ----------------------------------------------------------------------------------------


def test_capacity_model_for_loads_the_configured_profile_and_refuses_one_without_fits(tmp_path):
    assert capacity_model_for(config()) is None
    path = tmp_path / "profile.json"
    hand_profile().save(path)
    model = capacity_model_for(config(profile=str(path)))
    assert model.replicas_needed(load(rate=20)) == {"prefill": 3, "decode": 4}
    empty = hand_profile()
    empty.decode_fit = None
    empty.save(path)
    with pytest.raises(ValueError, match="autoscale.profile"):
        capacity_model_for(config(profile=str(path)))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="autoscale.profile: cannot read"):
        capacity_model_for(config(profile=str(path)))


def test_a_missing_profile_file_is_a_config_error_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"autoscale\.profile: .*no such profile file"):
        config(profile=str(tmp_path / "absent.json"))


@pytest.mark.timeout(120)
def test_a_live_cluster_is_resized_by_the_model(tiny_llama_path, tmp_path):
    """``start_serving`` with the model ``pdserve serve`` builds: its thread reads /metrics over HTTP; with no
    traffic the model needs one replica per pool, so decode goes 2 -> 1 by itself."""
    from cluster.run.launch import start_serving
    from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free, wait_until

    path = tmp_path / "profile.json"
    hand_profile().save(path)
    cfg = tiny_cluster_config(
        tiny_llama_path,
        pools={"decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160}},
        autoscale={"enabled": True, "interval_s": 0.2, "breaches": 2, "cooldown_s": 0, "profile": str(path)},
    )
    handle = start_serving(cfg, in_process=True, capacity_model=capacity_model_for(cfg))
    try:
        wait_until(lambda: [r.name for r in handle.workers if r.pool == "decode"] == ["decode-0"], timeout_s=20)
        assert handle.scaler.wait_idle(timeout_s=20)
        wait_until(lambda: handle.autoscaler.decisions, timeout_s=20)  # recorded once ``scale`` returns
        assert handle.autoscaler.policy.last_needed == {"prefill": 1, "decode": 1}
        assert [(pool, size) for _, pool, size in handle.autoscaler.decisions] == [("decode", 1)]
        wait_all_kv_free(handle.base_url)
        assert not handle.router.flows
    finally:
        handle.stop()


def test_pdserve_serve_hands_the_cluster_the_model_of_the_configured_profile(tmp_path, monkeypatch):
    """The wiring alone (cli/serve_cmd.py -> cluster/run/serve.py -> start_serving): the cluster start is replaced by one
    that records what it was given and stops there; what it is given is the real model of the real file."""
    import cluster.run.launch
    from cli.main import build_parser

    profile = tmp_path / "profile.json"
    hand_profile().save(profile)
    path = tmp_path / "cluster.yaml"
    path.write_text(f"autoscale:\n  enabled: true\n  profile: {profile}\n  target_utilization: 0.8\n")
    given: dict = {}

    class Started(Exception):
        pass

    def start_serving(config, **kwargs):
        given.update(kwargs, config=config)
        raise Started

    monkeypatch.setattr(cluster.run.launch, "start_serving", start_serving)
    args = build_parser().parse_args(["serve", "--config", str(path)])
    with pytest.raises(Started):
        args.func(args)
    model = given["capacity_model"]
    assert isinstance(model, ProfileCapacityModel) and model.profile.decode_fit == DECODE
    assert model.replicas_needed(load(rate=20))["prefill"] == 3  # target 0.8 from the file: ceil(2.2 / 0.8)
