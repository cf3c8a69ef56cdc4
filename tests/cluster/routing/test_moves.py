"""Moving a decoding request between decode workers, in the router core: typed events in, commands out, no socket.

A move is the KV hand-off with a decoding source: the target reserves the flow's context (Reserve with
context_tokens); the source ships its KV (Export: its full blocks while it streams on), stops the request (Frozen:
its tokens) and ships the rest; the target gets the tokens (Start) and the move ends when it streams. Every way it
can go: it completes (the stream continues from the target, under a new wire id, and the source's id is forgotten;
it stood still only from the stop); the pre-copy fails (the move is tried again without one, everything then going
after the stop); the source cannot export it (it runs on); the target refuses or dies before it has the KV (the
source runs on, resumed if it may have stopped); the rest of the KV fails after the stop (the target recomputes, the
source lets go); the source dies after the target got the tokens (the target recomputes); the source dies before it
stopped (the request fails explicitly); the request finishes on the source meanwhile; the client leaves mid-move
(both ends are told). And: a drain moves a decode worker's streams; rebalancing moves one off a worker about to
preempt.
"""

from __future__ import annotations

from cluster.routing.admission import Admission
from cluster.routing.core import RouterCore
from cluster.routing.flow import Flow, FlowStatus
from cluster.routing.metrics import RouterMetrics
from engine.request import FinishReason, SamplingParams
from tests.helpers.cluster import tiny_cluster_config
from worker.messages import (
    Abort,
    ErrorCode,
    ErrorEvent,
    Export,
    Frozen,
    Prefill,
    Reserve,
    Reserved,
    Resume,
    Start,
    Stats,
    TokenItem,
    Tokens,
    WorkerCounters,
    WorkerLoad,
)

PROMPT = list(range(1, 40))
PARAMS = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)


def stats(name: str, role: str, free: int = 150, running: int = 0) -> Stats:
    load = WorkerLoad(free_blocks=free, total_blocks=160, running=running, requests=running, max_requests=64)
    return Stats(worker=name, role=role, address=f"tcp://{name}", load=load, counters=WorkerCounters())


def cluster(**router) -> RouterCore:
    config = tiny_cluster_config("unused-model", router=router)
    core = RouterCore(config, RouterMetrics(), Admission(8))
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
        core.add_worker(name, role, f"tcp://{name}", f"tcp://{name}/kv", 0.0)
        core.on_event(stats(name, role), 0.0)
    return core


def sent(core: RouterCore, kind: type) -> list:
    """The commands of one kind sent since the last call, as (worker, command); the outbox is emptied."""
    out = [(w, c) for w, c in core.outbox if isinstance(c, kind)]
    core.outbox.clear()
    return out


def decoding(core: RouterCore, tokens: int = 3) -> tuple[Flow, str]:
    """A request decoding on decode-0 (``tokens`` of them received)."""
    core.on_event(stats("decode-1", "decode", free=100), 0.0)  # decode-0 has more room: the reservation goes there
    flow = core.submit("r", PROMPT, PARAMS.copy(), 0.0)
    [(decode, reserve)] = sent(core, Reserve)
    assert decode == "decode-0"
    core.on_event(Reserved(rid=reserve.rid, worker=decode, ok=True, blocks=[1, 2, 3], kv_address="tcp://kv"), 0.1)
    [(prefill, _)] = sent(core, Prefill)
    core.on_event(Tokens(worker=prefill, items=[TokenItem(flow.wire_id, [7], "a")]), 0.2)
    assert sent(core, Start)
    core.on_event(Tokens(worker=decode, items=[TokenItem(flow.wire_id, [8] * (tokens - 1), "b" * (tokens - 1))]), 0.3)
    assert flow.status is FlowStatus.DECODING and flow.received_tokens == tokens
    return flow, flow.wire_id


def reserved(core: RouterCore, flow: Flow, **migrate) -> Reserve:
    """The move begins: the target is asked to reserve; the stream goes on from the source meanwhile."""
    source_wire = flow.wire_id
    assert core.migrate(flow, 1.0, **migrate) == ""
    [(target, command)] = sent(core, Reserve)
    assert target == "decode-1" and command.rid != source_wire
    assert command.context_tokens == len(PROMPT) + flow.received_tokens - 1
    assert flow.status is FlowStatus.MIGRATING and flow.decode == "decode-0" and flow.wire_id == source_wire
    return command


def exporting(core: RouterCore, flow: Flow) -> Reserve:
    """Reserved there; the source is told to ship its KV, and one more token streams from it meanwhile."""
    source_wire = flow.wire_id
    command = reserved(core, flow)
    core.on_event(Reserved(rid=command.rid, worker="decode-1", ok=True, blocks=[5, 6, 7, 8], kv_address="tcp://b"), 1.1)
    [(source, export)] = sent(core, Export)
    assert source == "decode-0" and export.rid == source_wire and export.target_rid == command.rid
    assert export.dst_blocks == [5, 6, 7, 8] and export.kv_address == "tcp://b" and export.precopy
    core.on_event(Tokens(worker="decode-0", items=[TokenItem(source_wire, [8], "b")]), 1.15)  # it streams on
    assert flow.received_tokens == 4 and flow.decode == "decode-0"
    return command


def frozen(core: RouterCore, flow: Flow, tokens: int = 4, now: float = 1.3) -> Start:
    """The source stopped it: its tokens go to the target, whose stream the client reads from now on."""
    source_wire = flow.wire_id
    core.on_event(Frozen(rid=source_wire, worker="decode-0", output_token_ids=[7] + [8] * (tokens - 1)), now)
    [(target, command)] = sent(core, Start)
    assert target == "decode-1" and command.rid == flow.move.target_wire == flow.wire_id
    assert command.tokens == [7, 8, 8, 8] and flow.decode == "decode-1" and flow.status is FlowStatus.MIGRATING
    return command


def handing_off(core: RouterCore) -> tuple[Flow, str]:
    """A flow whose source stopped it and whose target has its tokens: the rest of its KV is on its way."""
    flow, source_wire = decoding(core)
    exporting(core, flow)
    frozen(core, flow)
    return flow, source_wire


def test_a_move_completes_and_the_stream_goes_on_from_the_target():
    core = cluster()
    flow, source_wire = handing_off(core)
    assert {w.name for w in core.members.workers.values() if flow in w.flows} == {"decode-0", "decode-1"}
    core.on_event(Tokens(worker="decode-1", items=[TokenItem(flow.wire_id, [9], "c")]), 1.6)  # it streams there
    assert sent(core, Abort) == [("decode-0", Abort(source_wire))]  # the source lets go
    assert flow.status is FlowStatus.DECODING and flow.move is None and flow.received_tokens == 5
    assert source_wire not in core.flows and core.flows[flow.wire_id] is flow
    assert flow.migrations == 1 and abs(flow.migration_s - 0.3) < 1e-9  # from the stop, not from the start
    assert flow.timing.response()["migrations"] == 1.0
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="moved") == 1
    assert {w.name for w in core.members.workers.values() if flow in w.flows} == {"decode-1"}
    core.on_event(Tokens(worker="decode-0", items=[TokenItem(source_wire, [1], "x")]), 1.65)  # stale: dropped
    assert flow.received_tokens == 5
    core.on_event(Tokens(worker="decode-1", items=[TokenItem(flow.wire_id, [9], "d", finish_reason=None)]), 1.7)
    assert flow.take().text == "abbbcd"


def test_a_failed_precopy_moves_again_with_every_block_after_the_stop():
    core = cluster()
    flow, source_wire = decoding(core)
    first = exporting(core, flow)
    failed = ErrorEvent(rid=first.rid, worker="decode-0", message="nack", code=ErrorCode.KV_TRANSFER_FAILED)
    core.on_event(failed, 1.2)
    assert ("decode-1", Abort(first.rid)) in core.outbox and first.rid not in core.flows
    assert not [c for _, c in core.outbox if isinstance(c, Resume)]  # it never stopped: it streams on
    [(target, again)] = sent(core, Reserve)
    assert target == "decode-1" and again.rid not in (first.rid, source_wire) and flow.move is not None
    core.on_event(Reserved(rid=again.rid, worker="decode-1", ok=True, blocks=[5, 6, 7, 8], kv_address="b"), 1.25)
    [(_, export)] = sent(core, Export)
    assert not export.precopy  # everything goes once it stops
    frozen(core, flow, now=1.3)
    core.on_event(Tokens(worker="decode-1", items=[TokenItem(flow.wire_id, [9], "c")]), 1.5)
    assert flow.move is None and flow.migrations == 1 and flow.decode == "decode-1"
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="failed") == 1
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="moved") == 1


def test_the_source_cannot_export_it_and_it_runs_on():
    core = cluster()
    flow, source_wire = decoding(core)
    command = exporting(core, flow)
    refused = ErrorEvent(rid=source_wire, worker="decode-0", message="preempted", code=ErrorCode.INVALID_REQUEST)
    core.on_event(refused, 1.3)
    assert flow.status is FlowStatus.DECODING and flow.decode == "decode-0" and flow.move is None
    assert sent(core, Abort) == [("decode-1", Abort(command.rid))]  # the target lets go; the source never stopped
    assert not [c for _, c in core.outbox if isinstance(c, Resume)]
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="refused") == 1


def test_a_target_that_refuses_dies_or_is_silent_before_it_has_the_kv_leaves_it_on_the_source():
    for phase in ("reserving", "exporting", "handing_off"):
        for ending in ("refused", "died", "silent"):
            if ending == "silent" and phase != "reserving":
                continue  # only the reservation waits for an answer; later its transfer's deadline governs
            core = cluster()
            flow, source_wire = decoding(core)
            command = reserved(core, flow) if phase == "reserving" else exporting(core, flow)
            target_wire = command.rid
            if phase == "handing_off":
                frozen(core, flow)
            if ending == "refused" and phase == "reserving":
                core.on_event(Reserved(rid=target_wire, worker="decode-1", ok=False, reason="kv_full"), 1.4)
            elif ending == "refused":  # it could not take the tokens, or its reservation expired
                error = ErrorEvent(rid=target_wire, worker="decode-1", message="no", code=ErrorCode.INVALID_REQUEST)
                core.on_event(error, 1.4)
            elif ending == "died":
                core.mark_dead("decode-1", "killed", 1.4)
            else:
                core.on_tick(1.0 + core.config.router.worker_timeout_s + 1)
            resumed = ("decode-0", Resume(source_wire)) in core.outbox
            assert resumed == (phase != "reserving"), (phase, ending)  # told to run on once it may have stopped
            assert flow.status is FlowStatus.DECODING and flow.decode == "decode-0" and flow.wire_id == source_wire
            assert target_wire not in core.flows and flow.move is None
            if not (ending == "refused" and phase == "reserving"):  # it may hold something: it is told to let go
                assert ("decode-1", Abort(target_wire)) in core.outbox


def test_a_failed_transfer_after_the_stop_is_recomputed_on_the_target_and_released_on_the_source():
    core = cluster()
    flow, source_wire = handing_off(core)
    failed = ErrorEvent(rid=flow.wire_id, worker="decode-0", message="deadline", code=ErrorCode.KV_TRANSFER_FAILED)
    core.on_event(failed, 1.5)
    assert ("decode-1", Resume(flow.wire_id)) in core.outbox  # now, not at its transfer's deadline
    assert sent(core, Abort) == [("decode-0", Abort(source_wire))]
    assert flow.status is FlowStatus.DECODING and flow.decode == "decode-1" and flow.migrations == 1
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="recomputed") == 1


def test_the_target_dying_after_it_streamed_fails_the_request_rather_than_repeat_tokens():
    core = cluster()
    flow, _ = handing_off(core)
    core.on_event(Tokens(worker="decode-1", items=[TokenItem(flow.wire_id, [9], "c")]), 1.45)
    assert flow.take() is not None  # the client got its tokens, the target's too
    core.mark_dead("decode-1", "killed", 1.5)
    assert flow.status is FlowStatus.FAILED and flow.error is not None and flow.error.status == 503
    assert not [c for _, c in core.outbox if isinstance(c, Resume)]


def test_the_source_dying_after_the_target_got_the_tokens_leaves_it_to_the_target_which_recomputes():
    core = cluster()
    flow, source_wire = handing_off(core)
    core.mark_dead("decode-0", "killed", 1.35)
    assert ("decode-1", Resume(flow.wire_id)) in core.outbox  # what did not come is computed from the tokens
    assert flow.status is FlowStatus.DECODING and flow.decode == "decode-1" and source_wire not in core.flows
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="recomputed") == 1


def test_the_source_dying_before_it_stopped_fails_the_request_explicitly():
    for stage in ("reserving", "exporting"):
        core = cluster()
        flow, _ = decoding(core)
        command = reserved(core, flow) if stage == "reserving" else exporting(core, flow)
        core.mark_dead("decode-0", "killed", 1.3)
        assert flow.status is FlowStatus.FAILED and flow.error is not None and flow.error.status == 503, stage
        assert ("decode-1", Abort(command.rid)) in core.outbox
        assert not [w for w in core.members.workers.values() if flow in w.flows]
        core.release(flow, 1.4)  # the response side took the error
        assert not core.flows


def test_a_request_that_finishes_on_the_source_before_it_stops_lets_the_target_go():
    core = cluster()
    flow, source_wire = decoding(core)
    command = reserved(core, flow)
    core.on_event(
        Tokens(worker="decode-0", items=[TokenItem(source_wire, [8], "b", finish_reason=FinishReason.STOP)]), 1.1
    )
    assert flow.status is FlowStatus.DONE and flow.move is None and flow.migrations == 0
    assert sent(core, Abort) == [("decode-1", Abort(command.rid))]
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="finished") == 1


def test_a_late_stop_of_a_called_off_move_is_answered():
    core = cluster()
    flow, source_wire = decoding(core)
    exporting(core, flow)
    core.mark_dead("decode-1", "killed", 1.2)  # called off: the source is told to run on
    sent(core, Resume)
    core.on_event(Frozen(rid=source_wire, worker="decode-0", output_token_ids=[7, 8, 8, 8]), 1.25)  # crossed it
    assert sent(core, Resume) == [("decode-0", Resume(source_wire))] and flow.decode == "decode-0"
    late = ErrorEvent(rid="r.1", worker="decode-0", message="peer gone", code=ErrorCode.KV_TRANSFER_FAILED)
    core.on_event(late, 1.3)  # its export's failure, about a wire id given up: no news
    assert flow.status is FlowStatus.DECODING


def test_a_client_leaving_mid_move_is_told_to_both_ends():
    for stage in ("exporting", "handing_off"):
        core = cluster()
        if stage == "handing_off":
            flow, source_wire = handing_off(core)
        else:
            flow, source_wire = decoding(core)
            exporting(core, flow)
        target_wire = flow.move.target_wire
        core.release(flow, 1.5)
        aborts = {(worker, command.rid) for worker, command in sent(core, Abort)}
        assert {("decode-0", source_wire), ("decode-1", target_wire)} <= aborts, stage
        assert not core.flows


def test_only_a_decoding_request_moves_and_only_to_another_live_decode_worker_with_room():
    core = cluster()
    flow = core.submit("r", PROMPT, PARAMS.copy(), 0.0)
    assert "not decoding" in core.migrate(flow, 0.1)
    core = cluster()
    flow, _ = decoding(core)
    assert "not another live decode worker" in core.migrate(flow, 1.0, target="decode-0")
    assert "not another live decode worker" in core.migrate(flow, 1.0, target="prefill-0")
    core.on_event(stats("decode-1", "decode", free=2), 1.0)
    assert "no other decode worker has room" in core.migrate(flow, 1.0)
    assert flow.status is FlowStatus.DECODING and not core.outbox


def test_a_drain_moves_the_workers_streams():
    core = cluster()
    flow, source_wire = decoding(core)
    core.drain("decode-0", 60.0, 1.0)
    [(target, command)] = sent(core, Reserve)
    assert target == "decode-1" and flow.move is not None and flow.move.reason == "drain" and command.context_tokens


def test_a_drain_without_migration_waits():
    core = cluster(migrate_on_drain=False)
    flow, _ = decoding(core)
    core.drain("decode-0", 60.0, 1.0)
    assert not [c for _, c in core.outbox if isinstance(c, Reserve)] and flow.status is FlowStatus.DECODING


def test_rebalancing_moves_the_longest_to_go_off_a_worker_about_to_preempt():
    core = cluster(rebalance={"enabled": True})
    flow, source_wire = decoding(core)
    core.on_event(stats("decode-0", "decode", free=5, running=2), 1.0)  # room enough
    assert not [c for _, c in core.outbox if isinstance(c, Reserve)]
    core.on_event(stats("decode-0", "decode", free=1, running=2), 1.0)  # one block for two requests
    [(target, command)] = sent(core, Reserve)
    assert target == "decode-1" and flow.move is not None and flow.move.reason == "rebalance"
    core.on_event(Reserved(rid=command.rid, worker="decode-1", ok=True, blocks=[5, 6, 7], kv_address="tcp://b"), 1.1)
    [(_, export)] = sent(core, Export)
    assert export.rid == source_wire and not export.precopy  # it must leave the batch now: it stops at once


def test_a_reservation_names_the_degree_of_the_worker_its_kv_comes_from():
    """Each rank of the worker the KV comes from sends its heads, so the receiving worker's ranks expect a part from
    each: a prompt's comes from the prefill pool (its tensor_parallel_size), a move's from the source worker (as many
    ranks as its KV address names)."""
    prefill_pool = {"replicas": 1, "torch_threads": 1, "kv_blocks": 96, "tensor_parallel_size": 2}
    config = tiny_cluster_config("unused-model", pools={"prefill": prefill_pool})
    core = RouterCore(config, RouterMetrics(), Admission(8))
    core.add_worker("prefill-0", "prefill", "tcp://prefill-0", None, 0.0)
    core.add_worker("decode-0", "decode", "tcp://decode-0", "tcp://a0|tcp://a1|tcp://a2|tcp://a3", 0.0)
    core.add_worker("decode-1", "decode", "tcp://decode-1", "tcp://b0", 0.0)
    for name, role, free in (("prefill-0", "prefill", 150), ("decode-0", "decode", 150), ("decode-1", "decode", 100)):
        core.on_event(stats(name, role, free=free), 0.0)
    flow = core.submit("r", PROMPT, PARAMS.copy(), 0.0)
    [(decode, reserve)] = sent(core, Reserve)
    assert decode == "decode-0" and reserve.source_degree == 2 and reserve.context_tokens is None
    core.on_event(Reserved(rid=reserve.rid, worker=decode, ok=True, blocks=[1, 2, 3], kv_address="tcp://a0"), 0.1)
    [(prefill, _)] = sent(core, Prefill)
    core.on_event(Tokens(worker=prefill, items=[TokenItem(flow.wire_id, [7], "a")]), 0.2)
    core.on_event(Tokens(worker=decode, items=[TokenItem(flow.wire_id, [8, 8], "bb")]), 0.3)
    assert core.migrate(flow, 1.0) == ""
    [(target, move)] = sent(core, Reserve)
    assert target == "decode-1" and move.context_tokens is not None and move.source_degree == 4
