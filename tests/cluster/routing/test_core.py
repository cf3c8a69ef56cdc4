"""The router core driven by hand-built events, as the worker roles are tested: no socket, no event loop, no worker.

Each test registers workers, feeds the core typed events (``Reserved``, ``Tokens``, ``ErrorEvent``, ``Stats``) and the
time, and reads what it would send (``outbox``) and what each flow shows: its status, workers, wire id and what the
client gets. Covered: the disaggregated and colocated paths, refusals and retries, a late answer after the router gave
up, a local prefill on the decode worker, a worker's death and an abort at every status, draining, the queue and its
bound, deadlines, affinity and load derived from the flows. Every test ends with no flow and no load left.
"""

from __future__ import annotations

import random

import pytest

from cluster.routing.admission import Admission
from cluster.routing.core import MAX_RETRIES, MAX_WORKERS_TRIED, QUEUE_RETRY_S, RouterCore
from cluster.routing.flow import Flow, FlowStatus
from cluster.routing.metrics import RouterMetrics
from cluster.routing.policies import make_policy
from engine.request import FinishReason, SamplingParams
from tests.helpers.cluster import tiny_cluster_config
from worker.messages import (
    Abort,
    Drain,
    ErrorCode,
    ErrorEvent,
    Generate,
    Prefill,
    Reserve,
    Reserved,
    Start,
    Stats,
    Timing,
    TokenItem,
    Tokens,
    WorkerCounters,
    WorkerLoad,
)

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = list(range(1, 21))


class Harness:
    """A core with named workers; ``sent(kind)`` pops what it would have sent of one kind, by worker."""

    def __init__(self, mode: str = "disaggregated", decode: int = 2, prefill: int = 1, queue: int = 8, **router):
        self.config = tiny_cluster_config(
            "unused-model",
            mode=mode,
            router={"decode_policy": "round_robin", "prefill_policy": "round_robin", **router},
        )
        self.core = RouterCore(self.config, RouterMetrics(), Admission(queue))
        self.now = 0.0
        role = "colocated" if mode == "colocated" else "decode"
        names = [f"{role}-{i}" for i in range(decode)] + [
            f"prefill-{i}" for i in range(prefill if role == "decode" else 0)
        ]
        for name in names:
            self.core.add_worker(name, name.rsplit("-", 1)[0], f"tcp://{name}", f"tcp://{name}/kv", self.now)
            self.heartbeat(name)

    def heartbeat(self, name: str, free_blocks: int = 90, total_blocks: int = 96) -> None:
        load = WorkerLoad(free_blocks=free_blocks, total_blocks=total_blocks)
        role = name.rsplit("-", 1)[0]
        self.event(Stats(worker=name, role=role, address=f"tcp://{name}", load=load, counters=WorkerCounters()))

    def event(self, event) -> None:
        self.core.on_event(event, self.now)

    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.core.on_tick(self.now)

    def submit(self, rid: str = "r", prompt: list[int] = PROMPT, params: SamplingParams = PARAMS, **kw) -> Flow:
        return self.core.submit(rid, list(prompt), params, self.now, **kw)

    def sent(self, kind: type | None = None) -> list[tuple[str, object]]:
        """What the core sent (of ``kind``) since the last call; the rest stays for the next."""
        outbox = self.core.outbox
        taken = [(name, cmd) for name, cmd in outbox if kind is None or isinstance(cmd, kind)]
        for entry in taken:
            outbox.remove(entry)
        return taken

    def grant(self, worker: str, rid: str, **fields) -> None:
        self.event(Reserved(rid=rid, worker=worker, ok=True, blocks=[3, 4], kv_address=f"tcp://{worker}/kv", **fields))

    def tokens(self, worker: str, rid: str, ids: list[int], text: str = "x", finish: FinishReason | None = None):
        self.event(Tokens(worker=worker, items=[TokenItem(rid, ids, text, finish)]))

    def load(self) -> dict[str, int]:
        return {name: w.inflight for name, w in self.core.members.workers.items()}

    def release(self, flow: Flow) -> None:
        self.core.release(flow, self.now)

    def check_no_leaks(self) -> None:
        assert self.core.flows == {} and self.core.queue_depth == 0 and self.core.admission.total == 0
        assert all(n == 0 for n in self.load().values()), self.load()


def _disaggregated_to_decoding(h: Harness, rid: str = "r") -> tuple[Flow, str, str]:
    flow = h.submit(rid)
    [(decode, reserve)] = h.sent(Reserve)
    h.grant(decode, reserve.rid)
    [(prefill, command)] = h.sent(Prefill)
    h.tokens(prefill, command.rid, [7], "a")
    return flow, decode, prefill


# ---- the paths -------------------------------------------------------------------------------------------------


def test_a_disaggregated_request_walks_every_status_and_each_message_goes_where_it_belongs():
    h = Harness()
    flow = h.submit()
    assert flow.status is FlowStatus.RESERVING and flow.wire_id == "r"
    [(decode, reserve)] = h.sent()
    assert isinstance(reserve, Reserve) and reserve.prompt == PROMPT and h.load()[decode] == 1  # the ask is load
    h.grant(decode, "r", cached_tokens=0)
    assert flow.status is FlowStatus.PREFILLING and flow.decode == decode and flow.prefill == "prefill-0"
    [(prefill, command)] = h.sent()
    assert isinstance(command, Prefill) and command.kv_address == f"tcp://{decode}/kv" and command.dst_blocks == [3, 4]
    assert h.load()[prefill] == 1 and h.load()[decode] == 1
    first = TokenItem("r", [7], "a", None, Timing(prefill_queue_s=0.01, prefill_compute_s=0.02))
    h.now = 0.5
    h.event(Tokens(worker=prefill, items=[first]))  # the prefill worker's first token
    assert flow.status is FlowStatus.DECODING and h.load()[prefill] == 0  # its part is done
    assert h.sent() == [(decode, Start("r", [7]))]
    assert flow.take().text == "a" and flow.first_token_s == 0.5
    h.now = 1.0
    h.event(
        Tokens(worker=decode, items=[TokenItem("r", [8, 9, 10], "bcd", FinishReason.LENGTH, Timing(kv_transfer_s=0.3))])
    )
    assert flow.status is FlowStatus.DONE and h.load()[decode] == 0
    event = flow.take()
    assert (event.text, event.num_tokens, event.finish_reason) == ("bcd", 3, "length") and flow.finished
    timing = h.core.last_timing["r"]
    assert timing["ttft_s"] == 0.5 and timing["e2e_s"] == 1.0 and timing["kv_transfer_s"] == 0.3
    assert timing["prefill_queue_s"] == 0.01 and timing["decode_cached_tokens"] == 0.0
    assert h.core.placements.get("r").prefill == prefill
    h.release(flow)
    assert h.sent() == []  # nothing to abort: it ended normally
    h.check_no_leaks()


def test_the_metrics_show_each_gap_between_token_messages_and_the_ttft_by_stage():
    h = Harness()
    flow, decode, prefill = _disaggregated_to_decoding(h)  # the first token at 0.0
    h.now = 0.25
    h.tokens(decode, flow.wire_id, [8, 9])
    h.now = 1.25
    h.tokens(decode, flow.wire_id, [])  # no token: no gap
    h.now = 1.5
    h.tokens(decode, flow.wire_id, [10], finish=FinishReason.LENGTH)
    registry = h.core.metrics.registry

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert sample("pdserve_itl_seconds_count") == 2 and sample("pdserve_itl_seconds_sum") == 1.5
    assert sample("pdserve_itl_seconds_bucket", le="0.25") == 1
    assert sample("pdserve_ttft_stage_seconds_count", stage="router_queue") == 1
    assert sample("pdserve_ttft_stage_seconds_count", stage="first_token_delivery") == 1
    assert sample("pdserve_ttft_stage_seconds_count", stage="prefill_compute") == 0  # no worker reported it
    h.release(flow)
    h.check_no_leaks()


def test_a_colocated_request_goes_to_one_worker():
    h = Harness(mode="colocated")
    flow = h.submit()
    [(worker, command)] = h.sent()
    assert isinstance(command, Generate) and flow.status is FlowStatus.PREFILLING and flow.decode == worker
    h.tokens(worker, "r", [5], "a")
    assert flow.status is FlowStatus.DECODING and h.load()[worker] == 1
    h.tokens(worker, "r", [6], "b", FinishReason.STOP)
    assert flow.status is FlowStatus.DONE and flow.take().text == "ab"
    h.release(flow)
    h.check_no_leaks()


def test_a_decode_worker_that_lacks_little_prefills_it_itself_with_no_prefill_worker():
    h = Harness(local_prefill_max_tokens=64)
    flow = h.submit()
    [(decode, reserve)] = h.sent()
    assert reserve.local_prefill_max_tokens == 64
    h.grant(decode, "r", prefill_local=True)
    assert flow.status is FlowStatus.PREFILLING and flow.prefill is None and h.sent() == []
    h.tokens(decode, "r", [5], "a")  # its first token comes from where it decodes: no Start to send
    assert flow.status is FlowStatus.DECODING and h.sent() == []
    h.tokens(decode, "r", [6], "", FinishReason.STOP)
    assert h.core.last_timing["r"]["prefill_local"] == 1.0
    h.release(flow)
    h.check_no_leaks()


# ---- reservations: refusals, retries, a late answer --------------------------------------------------------------


def test_a_refusal_asks_the_next_worker_under_a_new_wire_id_and_then_the_request_queues():
    h = Harness(decode=4)
    flow = h.submit()
    asked = []
    for _ in range(MAX_WORKERS_TRIED):
        [(name, reserve)] = h.sent(Reserve)
        asked.append((name, reserve.rid))
        h.event(Reserved(rid=reserve.rid, worker=name, ok=False, reason="kv_full"))
    assert [rid for _, rid in asked] == ["r", "r.1", "r.2"] and len({n for n, _ in asked}) == MAX_WORKERS_TRIED
    assert flow.status is FlowStatus.QUEUED and h.core.queue_depth == 1 and h.sent() == []
    h.heartbeat("decode-0")  # no more room than its last heartbeat showed: nobody is asked again
    assert h.sent() == []
    h.heartbeat("decode-0", free_blocks=95)  # blocks were freed there: a new round
    [(name, reserve)] = h.sent(Reserve)
    assert reserve.rid == "r.3" and flow.status is FlowStatus.RESERVING
    h.grant(name, "r.3")
    assert h.core.queue_depth == 0 and h.core.admission.total == 0
    h.event(Reserved(rid="r.1", worker=asked[1][0], ok=True, blocks=[1]))  # an old attempt's late ok: undone there
    assert h.sent(Abort) == [(asked[1][0], Abort("r.1"))]
    h.release(flow)
    assert {name for name, _ in h.sent(Abort)} == {name, "prefill-0"}  # the client went: both holders told
    h.check_no_leaks()


def test_a_queued_request_asks_again_after_a_while_without_news():
    h = Harness(decode=1)
    flow = h.submit()
    [(name, reserve)] = h.sent(Reserve)
    h.event(Reserved(rid=reserve.rid, worker=name, ok=False, reason="kv_full"))
    assert flow.status is FlowStatus.QUEUED
    h.tick(0.1)
    assert h.sent() == []
    h.tick(QUEUE_RETRY_S)
    [(_, again)] = h.sent(Reserve)
    assert again.rid == "r.1"
    h.release(flow)
    h.check_no_leaks()


def test_a_worker_at_its_request_limit_is_not_asked_though_it_has_blocks():
    h = Harness(decode=2)
    load = WorkerLoad(requests=4, max_requests=4, free_blocks=90, total_blocks=96)
    h.event(Stats(worker="decode-0", role="decode", address="tcp://decode-0", load=load, counters=WorkerCounters()))
    flows = [h.submit(f"r{i}") for i in range(3)]
    assert {name for name, _ in h.sent(Reserve)} == {"decode-1"}
    for flow in flows:
        h.release(flow)
    h.check_no_leaks()


def test_a_reservation_not_answered_in_time_moves_on_and_its_late_ok_is_aborted():
    h = Harness(worker_timeout_s=2.0)
    flow = h.submit()
    [(slow, _)] = h.sent(Reserve)
    h.tick(2.5)
    [(other, reserve)] = h.sent(Reserve)
    assert other != slow and reserve.rid == "r.1" and h.load()[slow] == 0
    h.grant(slow, "r")  # the slow worker's answer, after the router moved on
    assert h.sent(Abort) == [(slow, Abort("r"))] and flow.status is FlowStatus.RESERVING
    h.grant(other, "r.1")
    assert flow.decode == other
    h.release(flow)
    h.check_no_leaks()


def test_a_reservation_refused_for_what_the_request_is_ends_it_with_a_400():
    h = Harness()
    flow = h.submit()
    [(name, reserve)] = h.sent(Reserve)
    h.event(ErrorEvent(rid=reserve.rid, worker=name, message="top_p must be in (0, 1]", code=ErrorCode.INVALID_REQUEST))
    assert flow.status is FlowStatus.FAILED and flow.error.status == 400 and "top_p" in str(flow.error)
    h.release(flow)
    h.check_no_leaks()


def test_a_worker_error_while_decoding_fails_the_request_with_a_500_and_tells_the_others():
    h = Harness()
    flow, decode, prefill = _disaggregated_to_decoding(h)
    h.sent()
    h.event(ErrorEvent(rid="r", worker=decode, message="boom", code=ErrorCode.WORKER_ERROR))
    assert flow.status is FlowStatus.FAILED and flow.error.status == 500 and flow.error.code == "worker_error"
    assert {name for name, _ in h.sent(Abort)} == {decode, prefill}
    assert flow.take().text == "a"  # what came before the error is given first
    h.release(flow)
    h.check_no_leaks()


def test_when_every_worker_is_reserved_and_the_queue_is_full_the_request_is_a_429():
    h = Harness(decode=1, queue=1)
    for name in ("decode-0",):
        h.heartbeat(name, free_blocks=0)
    waiting = h.submit("a")
    assert waiting.status is FlowStatus.QUEUED and h.sent() == []  # no worker has room: none is asked
    refused = h.submit("b")
    assert refused.status is FlowStatus.FAILED and refused.error.status == 429
    h.tick(h.config.router.request_timeout_s + 1)  # no KV became free in time
    assert waiting.status is FlowStatus.FAILED and waiting.error.status == 429
    for flow in (waiting, refused):
        h.release(flow)
    h.check_no_leaks()


def test_no_live_decode_worker_is_a_503_and_a_prompt_no_cache_holds_is_a_400():
    h = Harness(decode=1)
    too_long = h.submit("big", list(range(2000)))
    assert too_long.error.status == 400 and too_long.error.code == "context_length_exceeded"
    h.core.mark_dead("decode-0", "gone", h.now)
    nobody = h.submit("r")
    assert nobody.error.status == 503 and nobody.error.code == "no_workers"
    for flow in (too_long, nobody):
        h.release(flow)
    h.check_no_leaks()


# ---- a worker's death, an abort, draining ------------------------------------------------------------------------


def test_a_reservation_pending_on_a_worker_marked_dead_moves_on_at_once():
    h = Harness()
    flow = h.submit()
    [(dead, _)] = h.sent(Reserve)
    h.core.mark_dead(dead, "no heartbeat", h.now)
    [(other, reserve)] = h.sent(Reserve)
    assert other != dead and reserve.rid == "r.1" and flow.status is FlowStatus.RESERVING
    h.grant(other, "r.1")
    h.release(flow)
    h.check_no_leaks()


@pytest.mark.parametrize("who", ["prefill", "decode"])
def test_a_worker_that_dies_before_the_client_got_anything_is_retried_transparently(who):
    h = Harness()
    flow = h.submit()
    [(decode, _)] = h.sent(Reserve)
    h.grant(decode, "r")
    [(prefill, _)] = h.sent(Prefill)
    if who == "decode":
        h.tokens(prefill, "r", [7], "a")  # pushed, never taken by the client
        h.sent()
    h.core.mark_dead(prefill if who == "prefill" else decode, "gone", h.now)
    assert {name for name, cmd in h.sent(Abort) if cmd.rid == "r"} == {prefill, decode}  # told, dead or not
    [(again, reserve)] = h.sent(Reserve)
    assert reserve.rid == "r.1" and flow.retries == 1 and flow.status is FlowStatus.RESERVING
    assert flow.take() is None and flow.error is None  # the old dispatch's token is gone with it
    assert h.core.metrics.local_value("pdserve_errors_total", reason="retried_after_worker_death") == 1
    h.release(flow)
    h.check_no_leaks()


def test_a_worker_that_dies_after_the_client_got_a_token_fails_the_request_with_a_503():
    h = Harness()
    flow, decode, prefill = _disaggregated_to_decoding(h)
    assert flow.take().text == "a"  # the client has it
    h.sent()
    h.core.mark_dead(decode, "gone", h.now)
    assert flow.status is FlowStatus.FAILED and flow.error.code == "worker_died" and flow.error.status == 503
    h.release(flow)
    h.check_no_leaks()


def test_retries_are_bounded():
    h = Harness(decode=1)
    flow = h.submit()
    for _ in range(MAX_RETRIES + 1):
        [(decode, reserve)] = h.sent(Reserve)
        h.grant(decode, reserve.rid)
        h.sent()
        h.core.mark_dead("prefill-0", "gone", h.now)
        h.core.add_worker("prefill-0", "prefill", "tcp://prefill-0", None, h.now)  # restarted
        h.heartbeat("prefill-0")
    assert flow.status is FlowStatus.FAILED and flow.retries == MAX_RETRIES
    h.release(flow)
    h.check_no_leaks()


@pytest.mark.parametrize("status", ["queued", "reserving", "prefilling", "decoding"])
def test_a_client_that_goes_away_frees_the_request_on_every_worker_at_every_status(status):
    h = Harness(decode=1)
    if status == "queued":
        h.heartbeat("decode-0", free_blocks=0)
    flow = h.submit()
    holders = set()
    if status != "queued":
        [(decode, reserve)] = h.sent(Reserve)
        holders.add(decode)
        if status in ("prefilling", "decoding"):
            h.grant(decode, reserve.rid)
            [(prefill, _)] = h.sent(Prefill)
            holders.add(prefill)
            if status == "decoding":
                h.tokens(prefill, reserve.rid, [7])
    assert flow.status.value == status
    h.sent()
    h.release(flow)
    assert {name for name, cmd in h.sent(Abort)} == holders
    assert h.core.metrics.local_value("pdserve_requests_total", outcome="aborted") == 1
    h.check_no_leaks()


def test_a_draining_worker_gets_nothing_new_and_finishes_what_it_holds():
    h = Harness()
    flow, decode, _ = _disaggregated_to_decoding(h)
    h.core.drain(decode, 30.0)
    assert h.sent(Drain) == [(decode, Drain(deadline_s=30.0))]
    h.sent()
    later = h.submit("later")
    [(name, _)] = h.sent(Reserve)
    assert name != decode
    h.tokens(decode, "r", [9], "", FinishReason.STOP)  # it still streams what it holds
    assert flow.status is FlowStatus.DONE
    h.core.remove_worker(decode, h.now)
    for f in (flow, later):
        h.release(f)
    h.check_no_leaks()


def test_a_request_left_on_a_removed_worker_gets_an_explicit_error():
    """After a grace for the worker's own answer (sent before it said it was idle): the router's error then."""
    from cluster.routing.core import REMOVAL_GRACE_S

    h = Harness()
    flow, decode, _ = _disaggregated_to_decoding(h)
    flow.take()
    h.core.remove_worker(decode, h.now)
    assert flow.status is FlowStatus.DECODING and decode not in h.core.members.workers  # nothing new goes there
    h.tick(REMOVAL_GRACE_S)
    assert flow.status is FlowStatus.FAILED and "scale-down" in str(flow.error)
    h.release(flow)
    h.check_no_leaks()


def test_a_removed_workers_own_error_in_flight_is_the_one_the_client_gets():
    """Past its drain deadline the worker fails what it holds, then says it is idle; the pool then removes it, which
    may reach the router before the worker's error does: the worker's reason wins, not a generic one."""
    h = Harness()
    flow, decode, _ = _disaggregated_to_decoding(h)
    flow.take()
    h.core.remove_worker(decode, h.now)
    reason = "worker removed by scale-down: its drain deadline passed before the request finished"
    h.core.on_event(ErrorEvent(worker=decode, rid=flow.wire_id, message=reason, code=ErrorCode.WORKER_ERROR), h.now)
    assert flow.status is FlowStatus.FAILED and "drain deadline" in str(flow.error)
    h.tick(10.0)
    h.release(flow)
    h.check_no_leaks()


def test_a_request_past_its_timeout_is_a_504_and_its_workers_are_told():
    h = Harness()
    flow, decode, prefill = _disaggregated_to_decoding(h)
    h.sent()
    h.tick(h.config.router.request_timeout_s)
    assert flow.error.status == 504 and flow.error.code == "timeout"
    assert {name for name, _ in h.sent(Abort)} == {decode, prefill}
    h.release(flow)
    h.check_no_leaks()


# ---- load, preference, events that are not the flow's -----------------------------------------------------------


def test_concurrent_reservations_see_each_other_and_spread_over_the_decode_workers():
    """Two requests ordered before either answer comes: the first ask counts as load at once, so least_loaded sends
    the second elsewhere; a refused ask stops counting, a granted reservation counts until the end."""
    for seed in range(20):  # the tie between equal workers breaks at random: many draws
        h = Harness(decode=3, decode_policy="least_loaded")
        h.core.placer.policies["decode"] = make_policy("least_loaded", random.Random(seed))
        flows = [h.submit(f"r{i}") for i in range(2)]
        asks = h.sent(Reserve)
        assert len({name for name, _ in asks}) == 2, asks
        for name, reserve in asks:
            h.grant(name, reserve.rid)
        assert sorted(n for n in h.load().values() if n) == [1, 1, 2]  # two decode workers, the prefill one twice
        for flow in flows:
            h.release(flow)
        h.check_no_leaks()


def test_the_preferred_decode_worker_is_asked_first_when_it_has_room_and_gives_way_when_not():
    h = Harness(decode=3)
    first, _, _ = _disaggregated_to_decoding(h, "first")
    home = first.decode
    h.sent()
    follower = h.submit("follower", affinity="first")
    [(asked, _)] = h.sent(Reserve)
    assert asked == home
    h.heartbeat(home, free_blocks=0)  # no room there now: the policy decides
    other = h.submit("other", affinity="first")
    [(asked, _)] = h.sent(Reserve)
    assert asked != home
    for flow in (first, follower, other):
        h.release(flow)
    h.check_no_leaks()


def test_events_from_a_worker_that_does_not_hold_the_request_are_ignored():
    h = Harness()
    flow, decode, prefill = _disaggregated_to_decoding(h)
    flow.take()
    h.tokens(prefill, "r", [1], "late")  # the prefill worker's part is over
    h.tokens("decode-9", "r", [1], "lying")
    h.tokens(decode, "nobody", [1], "?")
    assert flow.take() is None and flow.status is FlowStatus.DECODING
    h.release(flow)
    h.check_no_leaks()
