"""The simulator against queues whose answers are computed by hand: constant step times, spaced arrivals."""

from __future__ import annotations

import math

import pytest

from planner.profile_model import Fit, Profile
from planner.simulator import Layout, SimSettings, simulate
from planner.trace import TraceRequest

EPS = 1e-9


def constant_profile(prefill_s: float, decode_s: float, transfer_s: float = 0.0, kv_bytes: int = 1000) -> Profile:
    """A profile whose every fit is a constant: each step costs the same whatever is in it."""
    return Profile(
        model="test",
        dtype="float32",
        device="cpu",
        backend="zmq",
        date="2025-01-01",
        block_size=16,
        kv_bytes_per_token=kv_bytes,
        max_batch_tokens=100,
        max_num_seqs=64,
        prefill_fit=Fit(["1"], [prefill_s]),
        decode_fit=Fit(["1"], [decode_s]),
        transfer_fit=Fit(["1"], [transfer_s]),
    )


def settings(**overrides) -> SimSettings:
    # one 100-token prompt per step, no router hop: the queue is exactly an M/D/1 one with the arrivals given
    base = {"prefill_max_batch_tokens": 100, "decode_max_batch_tokens": 100, "hop_s": 0.0}
    return SimSettings(**{**base, **overrides})


@pytest.mark.parametrize("layout", [Layout("colocated", 0, 1), Layout("disaggregated", 1, 1)])
def test_one_server_deterministic_service_waits_grow_by_half_a_second(layout: Layout) -> None:
    # a request every 1 s, 1.5 s of prefill each: the k-th waits 0.5*k s, so its TTFT is 1.5 + 0.5*k
    profile = constant_profile(prefill_s=1.5, decode_s=0.1)
    trace = [TraceRequest(float(k), 100, 1) for k in range(8)]
    records = simulate(profile, trace, layout, settings())
    assert [r.ttft_s for r in records] == pytest.approx([1.5 + 0.5 * k for k in range(8)], abs=EPS)
    assert all(r.tpot_s is None and r.e2e_s == r.ttft_s for r in records)


def test_hops_add_to_ttft_exactly() -> None:
    # colocated: Generate takes one hop to the worker, the first token one hop back
    profile = constant_profile(prefill_s=1.0, decode_s=0.1)
    trace = [TraceRequest(0.0, 100, 1), TraceRequest(5.0, 100, 1)]
    records = simulate(profile, trace, Layout("colocated", 0, 1), settings(hop_s=0.01))
    assert [r.ttft_s for r in records] == pytest.approx([1.02, 1.02], abs=EPS)


def test_equal_decode_batch_tpot_is_the_step_time() -> None:
    # four equal requests arrive together, are prefilled in one step and decoded together: every token one step
    profile = constant_profile(prefill_s=0.5, decode_s=0.04)
    trace = [TraceRequest(0.0, 10, 21) for _ in range(4)]
    records = simulate(profile, trace, Layout("colocated", 0, 1), settings())
    for r in records:
        assert r.ttft_s == pytest.approx(0.5, abs=EPS)
        assert r.tpot_s == pytest.approx(0.04, abs=EPS)
        assert r.e2e_s == pytest.approx(0.5 + 20 * 0.04, abs=EPS)


def test_disaggregated_transfer_delays_the_second_token_not_the_first() -> None:
    # prefill 0.5 s, then 0.3 s of KV transfer before the decode worker can start; decode steps of 0.1 s
    profile = constant_profile(prefill_s=0.5, decode_s=0.1, transfer_s=0.3)
    records = simulate(profile, [TraceRequest(0.0, 10, 11)], Layout("disaggregated", 1, 1), settings())
    (r,) = records
    assert r.ttft_s == pytest.approx(0.5, abs=EPS)
    assert r.e2e_s == pytest.approx(0.5 + 0.3 + 10 * 0.1, abs=EPS)
    assert r.tpot_s == pytest.approx((0.3 + 1.0) / 10, abs=EPS)


def test_transfers_overlap_the_next_prefill() -> None:
    # two requests queued on one prefill worker: the first's transfer (0.4 s) runs during the second's prefill
    profile = constant_profile(prefill_s=0.5, decode_s=0.1, transfer_s=0.4)
    trace = [TraceRequest(0.0, 100, 2), TraceRequest(0.0, 100, 2)]
    records = simulate(profile, trace, Layout("disaggregated", 1, 2), settings())
    assert [r.ttft_s for r in records] == pytest.approx([0.5, 1.0], abs=EPS)
    assert [r.e2e_s for r in records] == pytest.approx([0.5 + 0.4 + 0.1, 1.0 + 0.4 + 0.1], abs=EPS)


def test_decode_kv_full_queues_at_the_router_then_serves_everyone() -> None:
    # a decode worker of 2 blocks holds one request (prompt 10 + first token = 1 block... 2 with its output);
    # the second waits for the first to end, so its TTFT includes the first's whole decode
    profile = constant_profile(prefill_s=0.5, decode_s=0.1)
    trace = [TraceRequest(0.0, 16, 5), TraceRequest(0.0, 16, 5)]
    s = settings(decode_kv_blocks=2, reserve_headroom_tokens=4)  # each reservation: 16 + 1 + 4 tokens = 2 blocks
    first, second = simulate(profile, trace, Layout("disaggregated", 1, 1), s)
    assert first.ttft_s == pytest.approx(0.5, abs=EPS)
    assert first.e2e_s == pytest.approx(0.5 + 4 * 0.1, abs=EPS)
    assert second.ttft_s == pytest.approx(first.e2e_s + 0.5, abs=EPS)  # reserved when the first ended
    assert not first.rejected and not second.rejected


def test_full_router_queue_rejects() -> None:
    profile = constant_profile(prefill_s=0.5, decode_s=0.1)
    trace = [TraceRequest(0.0, 16, 5) for _ in range(3)]
    s = settings(decode_kv_blocks=2, reserve_headroom_tokens=4, queue_size=1)
    records = simulate(profile, trace, Layout("disaggregated", 1, 1), s)
    assert [r.rejected for r in records] == [False, False, True]
    assert math.isinf(records[2].ttft_s) and not records[2].meets(100.0, 100.0)


def test_chunked_prefill_takes_one_step_per_chunk() -> None:
    # a 250-token prompt with 100-token chunks: three prefill steps
    profile = constant_profile(prefill_s=0.2, decode_s=0.1)
    (r,) = simulate(profile, [TraceRequest(0.0, 250, 1)], Layout("colocated", 0, 1), settings())
    assert r.ttft_s == pytest.approx(3 * 0.2, abs=EPS)


def test_shared_prefix_goes_to_the_worker_holding_it_and_skips_it() -> None:
    # kv_aware: the second request with the prefix lands where the first computed it and prefills 16 tokens less
    profile = Profile(
        model="test", dtype="float32", device="cpu", backend="zmq", date="2025-01-01", block_size=16,
        kv_bytes_per_token=1000, max_batch_tokens=100, max_num_seqs=64,
        prefill_fit=Fit(["tokens"], [0.01]), decode_fit=Fit(["1"], [0.1]), transfer_fit=Fit(["1"], [0.0]),
    )  # fmt: skip
    trace = [TraceRequest(0.0, 40, 1, prefix_id=7, prefix_tokens=32), TraceRequest(10.0, 40, 1, 7, 32)]
    s = settings(decode_policy="kv_aware")
    first, second = simulate(profile, trace, Layout("colocated", 0, 4), s)
    assert first.ttft_s == pytest.approx(0.40, abs=EPS)
    assert second.ttft_s == pytest.approx(0.08, abs=EPS)  # 32 cached, 8 computed
    off = simulate(profile, trace, Layout("colocated", 0, 4), settings(decode_policy="kv_aware", prefix_caching=False))
    assert [r.ttft_s for r in off] == pytest.approx([0.40, 0.40], abs=EPS)


def test_same_seed_same_records() -> None:
    profile = constant_profile(prefill_s=0.05, decode_s=0.01)
    trace = [TraceRequest(0.01 * k, 30 + k % 7, 5 + k % 3) for k in range(50)]
    layout = Layout("disaggregated", 2, 3)
    assert simulate(profile, trace, layout, settings(seed=3)) == simulate(profile, trace, layout, settings(seed=3))


def test_prompts_batched_in_one_step_cost_attention_per_sequence() -> None:
    # two 100-token prompts in one 200-token step: the fit's tokens^2 term counts each prompt apart (0.1 s each),
    # the fixed 0.1 s once: 0.3 s, not 0.1 + 1e-5 * 200^2 = 0.5 s
    profile = constant_profile(prefill_s=0.0, decode_s=0.1)
    profile.prefill_fit = Fit(["1", "tokens*tokens"], [0.1, 1e-5])
    trace = [TraceRequest(0.0, 100, 1), TraceRequest(0.0, 100, 1)]
    records = simulate(profile, trace, Layout("colocated", 0, 1), settings(decode_max_batch_tokens=200))
    assert [r.ttft_s for r in records] == pytest.approx([0.3, 0.3], abs=EPS)
