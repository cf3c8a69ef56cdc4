"""The simulated workers run the real roles (prefill/worker.py, decode/worker.py, worker/colocated.py) over a real
engine whose forward computes nothing, and move KV in simulated time: the decode role's own refusals and local
prefill, the transfer of whole blocks at the real model's size, the roles' clocks on simulated time, nothing left
held at the end, and one seed's records twice the same."""

from __future__ import annotations

import math
import time

import pytest
import simpy

from decode.worker import DecodeRole
from engine.request import SamplingParams
from planner.profile_model import Fit, Profile
from planner.sim_engine import SimRunner
from planner.simulator import Layout, SimCluster, SimRecord, SimSettings, as_profile_set, simulate
from planner.trace import TraceRequest
from prefill.worker import PrefillRole
from worker.colocated import ColocatedRole
from worker.messages import Event, Reserve, Reserved, Stats

EPS = 1e-9


def profile(
    prefill: Fit | None = None, decode_s: float = 0.1, transfer: Fit | None = None, kv_bytes: int = 1000
) -> Profile:
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
        prefill_fit=prefill or Fit(["1"], [0.5]),
        decode_fit=Fit(["1"], [decode_s]),
        transfer_fit=transfer or Fit(["1"], [0.0]),
    )


def settings(**overrides) -> SimSettings:
    base = {"prefill_max_batch_tokens": 100, "decode_max_batch_tokens": 100, "hop_s": 0.0}
    return SimSettings(**{**base, **overrides})


def run(prof: Profile, trace: list[TraceRequest], layout: Layout, s: SimSettings, after_s: float = 1.0) -> SimCluster:
    """``simulate``'s run, keeping the cluster, and ``after_s`` more once every request ended (acks, releases)."""
    env = simpy.Environment()
    cluster = SimCluster(env, as_profile_set(prof), layout, s)
    env.process(cluster.arrivals(sorted(trace, key=lambda t: t.arrival_s)))
    env.run(until=cluster.all_done)
    env.run(until=env.now + after_s)
    return cluster


def reserve(rid: str, tokens: int, max_tokens: int = 4, base: int = 0) -> Reserve:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Reserve(rid=rid, prompt=[base + i for i in range(tokens)], params=params)


def test_every_simulated_worker_is_its_real_role() -> None:
    cluster = run(profile(), [TraceRequest(0.0, 20, 2)], Layout("disaggregated", 1, 2), settings())
    kinds = {name: type(worker.role) for name, worker in cluster.workers.items()}
    assert kinds == {"prefill-0": PrefillRole, "decode-0": DecodeRole, "decode-1": DecodeRole}
    assert all(isinstance(worker.engine.runner, SimRunner) for worker in cluster.workers.values())
    colocated = run(profile(), [TraceRequest(0.0, 20, 2)], Layout("colocated", 0, 1), settings())
    assert isinstance(colocated.workers["colocated-0"].role, ColocatedRole)


def test_the_decode_role_refuses_with_its_reasons() -> None:
    # a decode worker of 4 blocks: room for one request refuses the second for max_num_seqs; room for two, a second
    # whose blocks are not free (40 + 1 tokens take 3 blocks, 20 + 1 take 2) for kv_full
    for max_num_seqs, second, reason in ((1, 20, "max_num_seqs"), (2, 20, "kv_full")):
        env = simpy.Environment()
        s = settings(decode_max_num_seqs=max_num_seqs, decode_kv_blocks=4)
        cluster = SimCluster(env, as_profile_set(profile()), Layout("disaggregated", 1, 1), s)
        events: list[Event] = []
        cluster.to_router = events.append  # type: ignore[method-assign]
        decode = cluster.workers["decode-0"]
        decode.handle(reserve("a", 40))
        decode.handle(reserve("b", second, base=100))
        replies = [(e.rid, e.ok, e.reason) for e in events if isinstance(e, Reserved)]
        assert replies == [("a", True, None), ("b", False, reason)]
        assert isinstance(events[-1], Reserved)  # no heartbeat after a refusal: nothing changed
        assert decode.role.counters.reservations_refused == 1
        assert sorted(decode.engine.requests) == ["a"]


def test_a_prompt_larger_than_the_decode_cache_is_an_invalid_request() -> None:
    # 2 blocks hold 32 tokens: a 40-token prompt cannot fit whatever frees up (the engine's check, a 400)
    (record,) = simulate(
        profile(), [TraceRequest(0.0, 40, 2)], Layout("disaggregated", 1, 1), settings(decode_kv_blocks=2)
    )
    assert record.rejected and math.isinf(record.ttft_s)


def test_max_num_seqs_queues_at_the_router_until_the_first_request_ends() -> None:
    first, second = simulate(
        profile(), [TraceRequest(0.0, 16, 5), TraceRequest(0.0, 16, 5)], Layout("disaggregated", 1, 1),
        settings(decode_max_num_seqs=1),
    )  # fmt: skip
    assert first.ttft_s == pytest.approx(0.5, abs=EPS) and first.e2e_s == pytest.approx(0.9, abs=EPS)
    assert second.ttft_s == pytest.approx(first.e2e_s + 0.5, abs=EPS)


def test_local_prefill_is_the_decode_roles_rule_over_its_prefix_cache() -> None:
    # router.local_prefill_max_tokens 16: the first prompt (100 tokens, nothing cached) goes to the prefill worker;
    # the second shares 96 tokens the decode worker now holds (6 blocks), so it computes the 4 left itself
    prof = profile(prefill=Fit(["tokens"], [0.01]))
    trace = [TraceRequest(0.0, 100, 2, prefix_id=1, prefix_tokens=96), TraceRequest(5.0, 100, 2, 1, 96)]
    cluster = run(prof, trace, Layout("disaggregated", 1, 1), settings(local_prefill_max_tokens=16))
    first, second = cluster.records
    assert first.ttft_s == pytest.approx(1.0, abs=EPS)  # 100 tokens at the prefill worker
    assert second.ttft_s == pytest.approx(0.04, abs=EPS)  # 4 tokens after 96 cached, at the decode worker
    assert second.e2e_s == pytest.approx(0.04 + 0.1, abs=EPS)
    prefill, decode = cluster.workers["prefill-0"].role, cluster.workers["decode-0"].role
    assert prefill.counters.transfers_ok == 1 and decode.counters.transfers_ok == 1
    assert decode.counters.local_prefills == 1
    assert decode.engine.block_manager.prefix_hit_tokens == 96


def test_a_transfer_takes_the_profiles_time_for_the_real_bytes_of_the_blocks_sent() -> None:
    # 100 tokens fill 7 blocks of 16: 7 * 16 * 1000 bytes of the real model's KV at 1 us per 1000 bytes = 0.112 s
    prof = profile(transfer=Fit(["num_bytes"], [1e-6]), kv_bytes=1000)
    cluster = run(prof, [TraceRequest(0.0, 100, 3)], Layout("disaggregated", 1, 1), settings())
    (record,) = cluster.records
    assert record.ttft_s == pytest.approx(0.5, abs=EPS)
    assert record.e2e_s == pytest.approx(0.5 + 0.112 + 2 * 0.1, abs=EPS)
    for name in ("prefill-0", "decode-0"):  # both ends count the real bytes
        assert cluster.workers[name].role.counters.transfer_bytes == 7 * 16 * 1000
    # the sender's lease, in simulated seconds: from the prefill's start to the receiver's acknowledgement
    assert cluster.workers["prefill-0"].role.counters.transfer_seconds == pytest.approx(0.5 + 0.112, abs=EPS)


def test_the_roles_clocks_are_the_simulations(monkeypatch) -> None:
    # a box so slow that each reading of the wall clock is 1000 s later: the same records, no reservation expired
    prof = profile(prefill=Fit(["tokens"], [0.002]), decode_s=0.02)
    trace = [TraceRequest(0.05 * k, 50 + 10 * (k % 5), 4 + k % 3) for k in range(40)]
    layout, s = Layout("disaggregated", 1, 2), settings(decode_kv_blocks=40)
    expected = simulate(prof, trace, layout, s)
    real = time.monotonic
    readings = iter(range(1, 1 << 40))
    monkeypatch.setattr(time, "monotonic", lambda: real() + 1000.0 * next(readings))
    cluster = run(prof, trace, layout, s)
    assert cluster.records == expected
    for name in ("decode-0", "decode-1"):
        worker = cluster.workers[name]
        assert worker.role.clock() == worker.engine.kv_importer.clock() == cluster.env.now
    assert all(math.isfinite(r.e2e_s) for r in expected)
    assert sum(w.role.counters.reservations_expired for w in cluster.workers.values()) == 0


def test_a_reservation_expires_after_its_deadline_in_simulated_seconds() -> None:
    # the prefill takes 2 s; the decode role frees a reservation whose first token has not come in 1 s
    cluster = run(profile(prefill=Fit(["1"], [2.0])), [TraceRequest(0.0, 20, 3)], Layout("disaggregated", 1, 1),
                  settings(kv_deadline_s=1.0))  # fmt: skip
    (record,) = cluster.records
    assert math.isinf(record.ttft_s) and math.isinf(record.e2e_s) and not record.rejected
    decode = cluster.workers["decode-0"].role
    assert decode.counters.reservations_expired == 1


@pytest.mark.parametrize("layout", [Layout("disaggregated", 2, 2), Layout("colocated", 0, 3)])
def test_every_worker_ends_holding_nothing(layout: Layout) -> None:
    # prefix sharing, local prefill, a decode cache tight enough to preempt: every block, request and transfer goes
    trace = [TraceRequest(0.02 * k, 40 + 7 * (k % 9), 3 + k % 11, k % 3, 32) for k in range(60)]
    s = settings(decode_kv_blocks=48, local_prefill_max_tokens=24, decode_policy="kv_aware")
    cluster = run(profile(prefill=Fit(["tokens"], [0.001]), decode_s=0.01), trace, layout, s)
    assert all(math.isfinite(r.e2e_s) for r in cluster.records)
    for worker in cluster.workers.values():
        worker.engine.check_no_leaks()
        if worker.sender is not None:
            assert worker.sender.active_transfers() == []
        if worker.receiver is not None:
            assert worker.receiver.pending_transfers() == []
        assert worker.role.load().requests == 0


def test_one_seed_gives_the_same_records_and_heartbeats_twice() -> None:
    prof = profile(prefill=Fit(["1", "tokens"], [0.01, 0.001]), decode_s=0.01, transfer=Fit(["num_bytes"], [1e-8]))
    trace = [TraceRequest(0.013 * k, 30 + 11 * (k % 13), 2 + k % 17, k % 4 or None, 16) for k in range(120)]
    layout = Layout("disaggregated", 2, 3)
    s = settings(decode_kv_blocks=64, local_prefill_max_tokens=20, prefill_policy="kv_aware", seed=7)

    def heard() -> tuple[list[SimRecord], list[Stats]]:
        cluster = run(prof, trace, layout, s)
        stats = [w.stats() for w in cluster.workers.values()]
        return cluster.records, stats

    first, second = heard(), heard()
    assert first == second
    assert any(r.tpot_s is not None for r in first[0])
