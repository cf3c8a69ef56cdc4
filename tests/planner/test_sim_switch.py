"""A switching cluster in simulated time (planner/sim_switch.py): a trace whose mix shifts from prompts to answers,
on a 2 prefill : 1 decode split. The autoscaler's own policy, reading the simulated router's metrics, moves a prefill
worker into the decode pool by a switch (drained, its cost waited, rejoined as a decode worker), and the switching
cluster meets the SLO for more requests than the fixed split; a switch that cannot drain is called off."""

from __future__ import annotations

from cluster.config import SLOSection
from planner.goodput import SLO, attainment
from planner.profile_model import Fit, Profile
from planner.sim_switch import SwitchSettings, simulate_switching
from planner.simulator import Layout, SimSettings, simulate
from planner.trace import TraceRequest

SLO_SECTION = SLOSection(ttft_s=2.0, tpot_s=0.2)


def batch_profile() -> Profile:
    """Prefill 1 ms a token; a decode step of 60 ms plus 8 ms per request in it. At 1 request/s of 100-token
    answers one decode worker settles at steps of 0.06 / (1 - 99 x 0.008) = 290 ms (over the TPOT SLO), two at
    0.06 / (1 - 49.5 x 0.008) = 99 ms."""
    return Profile(
        model="test",
        dtype="float32",
        device="cpu",
        backend="zmq",
        date="2025-01-01",
        block_size=16,
        kv_bytes_per_token=1000,
        max_batch_tokens=2048,
        max_num_seqs=64,
        prefill_fit=Fit(["1", "tokens"], [0.01, 0.001]),
        decode_fit=Fit(["1", "batch"], [0.06, 0.008]),
        transfer_fit=Fit(["1"], [0.0]),
    )


def shifting_trace() -> list[TraceRequest]:
    """60 s of 400-token prompts with 4-token answers at 1/s, then 120 s of 20-token prompts with 100-token answers
    at 1/s."""
    code = [TraceRequest(float(t), 400, 4) for t in range(60)]
    chat = [TraceRequest(60.0 + t, 20, 100) for t in range(120)]
    return code + chat


def test_a_prefill_worker_switches_to_decode_when_the_mix_turns_and_more_requests_meet_the_slo() -> None:
    profile, trace, layout = batch_profile(), shifting_trace(), Layout("disaggregated", 2, 1)
    settings = SimSettings(hop_s=0.0, prefill_kv_blocks=512, decode_kv_blocks=2048)
    fixed = simulate(profile, trace, layout, settings)
    run = simulate_switching(profile, trace, layout, settings, SLO_SECTION, SwitchSettings(switch_s=2.0))
    [switch] = run.switches
    assert (switch.worker, switch.to, switch.phase) == ("prefill-1", "decode", "done")
    assert switch.at_s > 60.0 and switch.drained_s is not None and switch.drained_s < 5.0
    slo = SLO(SLO_SECTION.ttft_s, SLO_SECTION.tpot_s)
    assert len(run.records) == len(fixed) == len(trace)
    assert all(r.e2e_s < float("inf") for r in run.records)  # every request was served
    assert attainment(run.records, slo) > attainment(fixed, slo) + 0.1


def test_a_switch_that_cannot_drain_in_its_deadline_is_called_off() -> None:
    """A prefill-heavy start on 1 prefill : 2 decode asks for a decode worker to switch; its long answers cannot end
    within a 0.5 s drain deadline (the simulated decode workers finish their requests: moving them is not modelled),
    so every such switch is called off, the worker decodes on, and every request is served."""
    profile = batch_profile()
    code = [TraceRequest(float(t) * 0.2, 400, 4) for t in range(100)]
    trace = code + [TraceRequest(20.0 + t, 20, 300) for t in range(60)]
    settings = SimSettings(hop_s=0.0, prefill_kv_blocks=512, decode_kv_blocks=2048)
    switching = SwitchSettings(switch_s=2.0, drain_deadline_s=0.5)
    run = simulate_switching(profile, trace, Layout("disaggregated", 1, 2), settings, SLO_SECTION, switching)
    assert run.switches and all(s.to == "prefill" and s.phase == "called_off" for s in run.switches)
    assert all(s.drained_s is None for s in run.switches)
    assert all(r.e2e_s < float("inf") for r in run.records)
