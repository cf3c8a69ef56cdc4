"""Moving a decoding request between decode workers, in the router core: typed events in, commands out, no socket.

A move is a pre-copy: the target reserves (MigrateIn), the source ships its full blocks while it streams on
(MigrateSend precopy), then stops (Freeze/Frozen); the target adopts its tokens (MigrateTail) and the source ships the
rest (MigrateSend). Every way it can go: it completes (the stream continues from the target, under a new wire id, and
the source's id is forgotten; it stood still only from the freeze); the pre-copy fails (everything goes with the
tail); the source cannot stop it (it runs on); the target refuses or dies before it has the KV (the source runs on,
resumed if it stopped); the tail fails (the target recomputes, the source lets go); the source dies while it ships or
after the target got the tokens (the target recomputes); the source dies before it stopped (the request fails
explicitly); the request finishes on the source meanwhile; the client leaves mid-move (both ends are told). And: a
drain moves a decode worker's streams; rebalancing moves one off a worker about to preempt.
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
    Freeze,
    Frozen,
    Migrated,
    MigrateIn,
    MigrateSend,
    MigrateTail,
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


def reserved(core: RouterCore, flow: Flow, **migrate) -> MigrateIn:
    """The move begins: the target is asked to reserve; the stream goes on from the source meanwhile."""
    source_wire = flow.wire_id
    assert core.moves.migrate(flow, 1.0, **migrate) == ""
    [(target, command)] = sent(core, MigrateIn)
    assert target == "decode-1" and command.rid != source_wire
    assert command.num_computed_tokens == len(PROMPT) + flow.received_tokens - 1 and command.precopy_blocks == 2
    assert flow.status is FlowStatus.MIGRATING and flow.decode == "decode-0" and flow.wire_id == source_wire
    return command


def precopied(core: RouterCore, flow: Flow, ok: bool = True) -> MigrateIn:
    """Reserved there; the source ships its first full blocks while one more token streams from it; then it stops."""
    source_wire = flow.wire_id
    command = reserved(core, flow)
    core.on_event(Reserved(rid=command.rid, worker="decode-1", ok=True, blocks=[5, 6, 7, 8], kv_address="tcp://b"), 1.1)
    [(source, send)] = sent(core, MigrateSend)
    assert source == "decode-0" and send.precopy and send.rid == source_wire and send.target_rid == command.rid
    assert send.dst_blocks == [5, 6] and send.kv_address == "tcp://b"
    core.on_event(Tokens(worker="decode-0", items=[TokenItem(source_wire, [8], "b")]), 1.15)  # it streams on
    assert not sent(core, Freeze) and flow.received_tokens == 4
    core.on_event(Migrated(rid=source_wire, worker="decode-0", ok=ok, precopy=True, error="" if ok else "nack"), 1.2)
    assert sent(core, Freeze) == [("decode-0", Freeze(source_wire))]
    return command


def frozen(core: RouterCore, flow: Flow, tokens: int = 4, now: float = 1.3) -> MigrateTail:
    source_wire = flow.wire_id
    core.on_event(
        Frozen(
            rid=source_wire,
            worker="decode-0",
            ok=True,
            output_token_ids=[7] + [8] * (tokens - 1),
            num_computed_tokens=len(PROMPT) + tokens - 1,
        ),
        now,
    )
    [(target, command)] = sent(core, MigrateTail)
    assert target == "decode-1" and command.rid == flow.move.target_wire
    assert command.output_token_ids == [7, 8, 8, 8] and command.num_computed_tokens == len(PROMPT) + 3
    return command


def moving(core: RouterCore, precopy_ok: bool = True) -> tuple[Flow, str]:
    """A flow past the target's adoption: the source was told to ship the rest."""
    flow, source_wire = decoding(core)
    precopied(core, flow, ok=precopy_ok)
    tail = frozen(core, flow)
    assert tail.first_block == (2 if precopy_ok else 0)
    blocks = [7] if precopy_ok else [5, 6, 7]
    core.on_event(Reserved(rid=tail.rid, worker="decode-1", ok=True, blocks=blocks, kv_address="tcp://b"), 1.4)
    [(source, send)] = sent(core, MigrateSend)
    assert source == "decode-0" and send.rid == source_wire and send.target_rid == flow.wire_id == tail.rid
    assert send.dst_blocks == blocks and send.first_block == tail.first_block and not send.precopy
    assert flow.decode == "decode-1" and flow.status is FlowStatus.MIGRATING
    return flow, source_wire


def test_a_move_completes_and_the_stream_goes_on_from_the_target():
    core = cluster()
    flow, source_wire = moving(core)
    assert {w.name for w in core.members.workers.values() if flow in w.flows} == {"decode-0", "decode-1"}
    core.on_event(Tokens(worker="decode-1", items=[TokenItem(flow.wire_id, [9], "c")]), 1.45)  # before the news
    core.on_event(Migrated(rid=source_wire, worker="decode-0", ok=True, nbytes=1000), 1.5)
    assert flow.status is FlowStatus.DECODING and flow.move is None and flow.received_tokens == 5
    assert source_wire not in core.flows and core.flows[flow.wire_id] is flow
    assert flow.migrations == 1 and abs(flow.migration_s - 0.3) < 1e-9  # from the freeze, not from the start
    assert flow.timing.response()["migrations"] == 1.0
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="moved") == 1
    assert {w.name for w in core.members.workers.values() if flow in w.flows} == {"decode-1"}
    core.on_event(Tokens(worker="decode-0", items=[TokenItem(source_wire, [1], "x")]), 1.55)  # stale: dropped
    assert flow.received_tokens == 5
    core.on_event(Tokens(worker="decode-1", items=[TokenItem(flow.wire_id, [9], "d", finish_reason=None)]), 1.6)
    assert flow.take().text == "abbbcd"


def test_a_failed_precopy_sends_every_block_with_the_tail():
    core = cluster()
    flow, source_wire = moving(core, precopy_ok=False)
    core.on_event(Migrated(rid=source_wire, worker="decode-0", ok=True, nbytes=1000), 1.5)
    assert flow.move is None and flow.migrations == 1


def test_the_source_cannot_stop_it_and_it_runs_on():
    core = cluster()
    flow, source_wire = decoding(core)
    command = precopied(core, flow)
    core.on_event(Frozen(rid=source_wire, worker="decode-0", ok=False, reason="preempted"), 1.3)
    assert flow.status is FlowStatus.DECODING and flow.decode == "decode-0" and flow.move is None
    assert sent(core, Abort) == [("decode-1", Abort(command.rid))]  # the target lets go; the source never stopped
    assert not [c for _, c in core.outbox if isinstance(c, Resume)]
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="refused") == 1


def test_a_target_that_refuses_dies_or_is_silent_before_it_has_the_kv_leaves_it_on_the_source():
    for phase in ("reserving", "adopting"):
        for ending in ("refused", "died", "silent"):
            core = cluster()
            flow, source_wire = decoding(core)
            if phase == "reserving":
                command = reserved(core, flow)
                target_wire = command.rid
            else:
                precopied(core, flow)
                target_wire = frozen(core, flow).rid
            if ending == "refused":
                core.on_event(Reserved(rid=target_wire, worker="decode-1", ok=False, reason="kv_full"), 1.4)
            elif ending == "died":
                core.mark_dead("decode-1", "killed", 1.4)
            else:
                core.on_tick(1.3 + core.config.router.worker_timeout_s + 1)
            resumed = ("decode-0", Resume(source_wire)) in core.outbox
            assert resumed == (phase == "adopting"), (phase, ending)  # told to run on only once it stopped
            assert flow.status is FlowStatus.DECODING and flow.decode == "decode-0" and flow.wire_id == source_wire
            assert target_wire not in core.flows and flow.move is None
            if ending != "refused":  # it may still answer: it is told to let go of what it reserved
                assert ("decode-1", Abort(target_wire)) in core.outbox


def test_a_failed_transfer_is_recomputed_on_the_target_and_released_on_the_source():
    core = cluster()
    flow, source_wire = moving(core)
    core.on_event(Migrated(rid=source_wire, worker="decode-0", ok=False, error="deadline"), 1.5)
    assert ("decode-1", Resume(flow.wire_id)) in core.outbox  # now, not at its transfer's deadline
    assert sent(core, Abort) == [("decode-0", Abort(source_wire))]
    assert flow.status is FlowStatus.DECODING and flow.decode == "decode-1" and flow.migrations == 1
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="recomputed") == 1


def test_the_target_dying_while_the_kv_moves_leaves_it_on_the_source():
    core = cluster()
    flow, source_wire = moving(core)
    core.mark_dead("decode-1", "killed", 1.5)
    assert ("decode-0", Resume(source_wire)) in core.outbox
    assert flow.status is FlowStatus.DECODING and flow.decode == "decode-0" and flow.wire_id == source_wire


def test_the_target_dying_after_it_streamed_fails_the_request_rather_than_repeat_tokens():
    core = cluster()
    flow, _ = moving(core)
    core.on_event(Tokens(worker="decode-1", items=[TokenItem(flow.wire_id, [9], "c")]), 1.45)
    core.mark_dead("decode-1", "killed", 1.5)
    assert flow.status is FlowStatus.FAILED and flow.error is not None and flow.error.status == 503
    assert not [c for _, c in core.outbox if isinstance(c, Resume)]


def test_the_source_dying_while_it_ships_leaves_it_to_the_target_which_recomputes():
    core = cluster()
    flow, source_wire = moving(core)
    core.mark_dead("decode-0", "killed", 1.5)
    assert ("decode-1", Resume(flow.wire_id)) in core.outbox
    assert flow.status is FlowStatus.DECODING and flow.decode == "decode-1" and source_wire not in core.flows
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="recomputed") == 1


def test_the_source_dying_after_the_target_got_the_tokens_leaves_it_to_the_target():
    core = cluster()
    flow, source_wire = decoding(core)
    precopied(core, flow)
    tail = frozen(core, flow)
    core.mark_dead("decode-0", "killed", 1.35)
    assert ("decode-1", Resume(tail.rid)) in core.outbox  # after its MigrateTail: it recomputes once it adopted
    core.on_event(Reserved(rid=tail.rid, worker="decode-1", ok=True, blocks=[7], kv_address="tcp://b"), 1.4)
    assert not [c for _, c in core.outbox if isinstance(c, MigrateSend)]
    assert flow.status is FlowStatus.DECODING and flow.decode == "decode-1" and source_wire not in core.flows
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="recomputed") == 1


def test_the_source_dying_before_it_stopped_fails_the_request_explicitly():
    for stage in ("reserving", "precopying", "freezing"):
        core = cluster()
        flow, _ = decoding(core)
        command = reserved(core, flow)
        if stage != "reserving":
            core.on_event(Reserved(rid=command.rid, worker="decode-1", ok=True, blocks=[5, 6, 7], kv_address="b"), 1.1)
        if stage == "freezing":
            core.on_event(Migrated(rid=flow.wire_id, worker="decode-0", ok=True, precopy=True), 1.2)
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


def test_a_client_leaving_mid_move_is_told_to_both_ends():
    for stage in ("precopying", "moving"):
        core = cluster()
        if stage == "moving":
            flow, source_wire = moving(core)
        else:
            flow, source_wire = decoding(core)
            command = reserved(core, flow)
            core.on_event(Reserved(rid=command.rid, worker="decode-1", ok=True, blocks=[5, 6, 7], kv_address="b"), 1.1)
        target_wire = flow.move.target_wire
        core.release(flow, 1.5)
        aborts = {(worker, command.rid) for worker, command in sent(core, Abort)}
        assert {("decode-0", source_wire), ("decode-1", target_wire)} <= aborts, stage
        assert not core.flows


def test_only_a_decoding_request_moves_and_only_to_another_live_decode_worker_with_room():
    core = cluster()
    flow = core.submit("r", PROMPT, PARAMS.copy(), 0.0)
    assert "not decoding" in core.moves.migrate(flow, 0.1)
    core = cluster()
    flow, _ = decoding(core)
    assert "not another live decode worker" in core.moves.migrate(flow, 1.0, target="decode-0")
    assert "not another live decode worker" in core.moves.migrate(flow, 1.0, target="prefill-0")
    core.on_event(stats("decode-1", "decode", free=2), 1.0)
    assert "no other decode worker has room" in core.moves.migrate(flow, 1.0)
    assert flow.status is FlowStatus.DECODING and not core.outbox


def test_a_drain_moves_the_workers_streams():
    core = cluster()
    flow, source_wire = decoding(core)
    core.drain("decode-0", 60.0, 1.0)
    [(target, command)] = sent(core, MigrateIn)
    assert target == "decode-1" and flow.move is not None and flow.move.reason == "drain"


def test_a_drain_without_migration_waits():
    core = cluster(migrate_on_drain=False)
    flow, _ = decoding(core)
    core.drain("decode-0", 60.0, 1.0)
    assert not [c for _, c in core.outbox if isinstance(c, MigrateIn)] and flow.status is FlowStatus.DECODING


def test_rebalancing_moves_the_longest_to_go_off_a_worker_about_to_preempt():
    core = cluster(rebalance={"enabled": True})
    flow, source_wire = decoding(core)
    core.on_event(stats("decode-0", "decode", free=5, running=2), 1.0)  # room enough
    assert not [c for _, c in core.outbox if isinstance(c, MigrateIn)]
    core.on_event(stats("decode-0", "decode", free=1, running=2), 1.0)  # one block for two requests
    [(target, command)] = sent(core, MigrateIn)
    assert target == "decode-1" and flow.move is not None and flow.move.reason == "rebalance"
    assert command.precopy_blocks == 0  # it must leave the batch now: the freeze follows the reservation
    core.on_event(Reserved(rid=command.rid, worker="decode-1", ok=True, blocks=[5, 6, 7], kv_address="tcp://b"), 1.1)
    assert sent(core, Freeze) == [("decode-0", Freeze(source_wire))]
