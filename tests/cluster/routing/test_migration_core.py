"""Moving a decoding request between decode workers, in the router core: typed events in, commands out, no socket.

Every way a move can go: it completes (the stream continues from the target, under a new wire id, and the source's
id is forgotten); the source cannot stop it (it runs on); the target refuses or dies before it has the KV (the
source resumes it); the transfer fails (the target recomputes, the source lets go); the source dies while it ships
(the target recomputes); the source dies before (the request fails explicitly); the client leaves mid-move (both
ends are told). And: a drain moves a decode worker's streams; rebalancing moves one off a worker about to preempt.
"""

from __future__ import annotations

from cluster.routing.admission import Admission
from cluster.routing.core import RouterCore
from cluster.routing.flow import Flow, FlowStatus
from cluster.routing.metrics import RouterMetrics
from engine.request import SamplingParams
from tests.helpers.cluster import tiny_cluster_config
from worker.messages import (
    Abort,
    Freeze,
    Frozen,
    Migrated,
    MigrateIn,
    MigrateSend,
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


def frozen(core: RouterCore, flow: Flow, source_wire: str, tokens: int = 3, now: float = 1.1) -> MigrateIn:
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
    [(target, command)] = sent(core, MigrateIn)
    assert target == "decode-1" and command.rid == flow.wire_id != source_wire
    assert command.output_token_ids == [7, 8, 8] and command.num_computed_tokens == len(PROMPT) + 2
    return command


def moving(core: RouterCore) -> tuple[Flow, str]:
    """A flow past the target's reservation: the source was told to ship."""
    flow, source_wire = decoding(core)
    assert core.migrate(flow, 1.0) == ""
    assert sent(core, Freeze) == [("decode-0", Freeze(source_wire))]
    command = frozen(core, flow, source_wire)
    core.on_event(Reserved(rid=command.rid, worker="decode-1", ok=True, blocks=[5, 6, 7, 8], kv_address="tcp://b"), 1.2)
    [(source, send)] = sent(core, MigrateSend)
    assert source == "decode-0" and send.rid == source_wire and send.target_rid == flow.wire_id
    assert send.dst_blocks == [5, 6, 7, 8] and send.kv_address == "tcp://b"
    assert flow.decode == "decode-1" and flow.status is FlowStatus.MIGRATING
    return flow, source_wire


def test_a_move_completes_and_the_stream_goes_on_from_the_target():
    core = cluster()
    flow, source_wire = moving(core)
    assert {w.name for w in core.members.workers.values() if flow in w.flows} == {"decode-0", "decode-1"}
    core.on_event(Tokens(worker="decode-1", items=[TokenItem(flow.wire_id, [9], "c")]), 1.3)  # before the news
    core.on_event(Migrated(rid=source_wire, worker="decode-0", ok=True, nbytes=1000), 1.4)
    assert flow.status is FlowStatus.DECODING and flow.move is None and flow.received_tokens == 4
    assert source_wire not in core.flows and core.flows[flow.wire_id] is flow
    assert flow.migrations == 1 and abs(flow.migration_s - 0.4) < 1e-9
    assert flow.timing.response()["migrations"] == 1.0
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="moved") == 1
    assert {w.name for w in core.members.workers.values() if flow in w.flows} == {"decode-1"}
    core.on_event(Tokens(worker="decode-0", items=[TokenItem(source_wire, [1], "x")]), 1.5)  # stale: dropped
    assert flow.received_tokens == 4
    core.on_event(Tokens(worker="decode-1", items=[TokenItem(flow.wire_id, [9], "d", finish_reason=None)]), 1.6)
    assert flow.take().text == "abbcd"


def test_the_source_cannot_stop_it_and_it_runs_on():
    core = cluster()
    flow, source_wire = decoding(core)
    core.migrate(flow, 1.0)
    sent(core, Freeze)
    core.on_event(Frozen(rid=source_wire, worker="decode-0", ok=False, reason="still prefilling"), 1.1)
    assert flow.status is FlowStatus.DECODING and flow.decode == "decode-0" and flow.move is None
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="refused") == 1


def test_a_target_that_refuses_or_dies_before_the_kv_leaves_it_on_the_source():
    for ending in ("refused", "died", "silent"):
        core = cluster()
        flow, source_wire = decoding(core)
        core.migrate(flow, 1.0)
        command = frozen(core, flow, source_wire)
        if ending == "refused":
            core.on_event(Reserved(rid=command.rid, worker="decode-1", ok=False, reason="kv_full"), 1.2)
        elif ending == "died":
            core.mark_dead("decode-1", "killed", 1.2)
        else:
            core.on_tick(1.1 + core.config.router.worker_timeout_s + 1)
        assert ("decode-0", Resume(source_wire)) in core.outbox, ending
        assert flow.status is FlowStatus.DECODING and flow.decode == "decode-0" and flow.wire_id == source_wire
        assert command.rid not in core.flows
        if ending == "silent":  # it may still answer: it is told to let go of what it reserved
            assert ("decode-1", Abort(command.rid)) in core.outbox


def test_a_failed_transfer_is_recomputed_on_the_target_and_released_on_the_source():
    core = cluster()
    flow, source_wire = moving(core)
    core.on_event(Migrated(rid=source_wire, worker="decode-0", ok=False, error="deadline"), 1.4)
    assert ("decode-1", Resume(flow.wire_id)) in core.outbox  # now, not at its transfer's deadline
    assert sent(core, Abort) == [("decode-0", Abort(source_wire))]
    assert flow.status is FlowStatus.DECODING and flow.decode == "decode-1" and flow.migrations == 1
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="recomputed") == 1


def test_the_target_dying_while_the_kv_moves_leaves_it_on_the_source():
    core = cluster()
    flow, source_wire = moving(core)
    core.mark_dead("decode-1", "killed", 1.3)
    assert ("decode-0", Resume(source_wire)) in core.outbox
    assert flow.status is FlowStatus.DECODING and flow.decode == "decode-0" and flow.wire_id == source_wire


def test_the_source_dying_while_it_ships_leaves_it_to_the_target_which_recomputes():
    core = cluster()
    flow, source_wire = moving(core)
    core.mark_dead("decode-0", "killed", 1.3)
    assert ("decode-1", Resume(flow.wire_id)) in core.outbox
    assert flow.status is FlowStatus.DECODING and flow.decode == "decode-1" and source_wire not in core.flows
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="recomputed") == 1


def test_the_source_dying_after_the_target_got_the_tokens_leaves_it_to_the_target():
    core = cluster()
    flow, source_wire = decoding(core)
    core.migrate(flow, 1.0)
    command = frozen(core, flow, source_wire)
    core.mark_dead("decode-0", "killed", 1.2)
    assert ("decode-1", Resume(command.rid)) in core.outbox  # after its MigrateIn: it recomputes once reserved
    core.on_event(Reserved(rid=command.rid, worker="decode-1", ok=True, blocks=[5, 6], kv_address="tcp://b"), 1.3)
    assert not [c for _, c in core.outbox if isinstance(c, MigrateSend)]
    assert flow.status is FlowStatus.DECODING and flow.decode == "decode-1" and source_wire not in core.flows
    assert core.metrics.local_value("pdserve_migrations_total", reason="admin", result="recomputed") == 1


def test_the_source_dying_before_it_said_what_it_generated_fails_the_request_explicitly():
    core = cluster()
    flow, source_wire = decoding(core)
    core.migrate(flow, 1.0)
    core.mark_dead("decode-0", "killed", 1.2)
    assert flow.status is FlowStatus.FAILED and flow.error is not None and flow.error.status == 503
    assert not [w for w in core.members.workers.values() if flow in w.flows]
    core.release(flow, 1.3)  # the response side took the error
    assert not core.flows


def test_a_client_leaving_mid_move_is_told_to_both_ends():
    core = cluster()
    flow, source_wire = moving(core)
    core.release(flow, 1.3)
    aborts = {(worker, command.rid) for worker, command in sent(core, Abort)}
    assert {("decode-0", source_wire), ("decode-1", flow.wire_id)} <= aborts
    assert not core.flows


def test_only_a_decoding_request_moves_and_only_to_another_live_decode_worker():
    core = cluster()
    flow = core.submit("r", PROMPT, PARAMS.copy(), 0.0)
    assert "not decoding" in core.migrate(flow, 0.1)
    core = cluster()
    flow, _ = decoding(core)
    assert "not another live decode worker" in core.migrate(flow, 1.0, target="decode-0")
    assert "not another live decode worker" in core.migrate(flow, 1.0, target="prefill-0")


def test_a_drain_moves_the_workers_streams():
    core = cluster()
    flow, source_wire = decoding(core)
    core.drain("decode-0", 60.0, 1.0)
    assert ("decode-0", Freeze(source_wire)) in core.outbox
    frozen(core, flow, source_wire)
    assert core.metrics.local_value("pdserve_migrations_total", reason="drain", result="moved") == 0


def test_a_drain_without_migration_waits():
    core = cluster(migrate_on_drain=False)
    flow, _ = decoding(core)
    core.drain("decode-0", 60.0, 1.0)
    assert not [c for _, c in core.outbox if isinstance(c, Freeze)] and flow.status is FlowStatus.DECODING


def test_rebalancing_moves_the_longest_to_go_off_a_worker_about_to_preempt():
    core = cluster(rebalance={"enabled": True})
    flow, source_wire = decoding(core)
    core.on_event(stats("decode-0", "decode", free=5, running=2), 1.0)  # room enough
    assert not [c for _, c in core.outbox if isinstance(c, Freeze)]
    core.on_event(stats("decode-0", "decode", free=1, running=2), 1.0)  # one block for two requests
    assert ("decode-0", Freeze(source_wire)) in core.outbox and flow.move is not None
    assert flow.move.reason == "rebalance" and flow.move.requested == "decode-1"
