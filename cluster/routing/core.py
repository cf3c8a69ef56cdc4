"""The router's request logic with no sockets and no event loop: typed events in, commands and flow updates out.

Every entry point (``submit``, ``on_event``, ``on_tick``, membership changes, ``release``) appends (worker, command)
to ``outbox`` and flows with news to ``updated``, for the caller to deliver: the live router (router.py) over ZeroMQ,
the planner's simulator in simulated time. A worker's load is the flows it holds (``Flow.holders``). Disaggregated
(docs/request-lifecycle.md): reserve on a decode worker (a fresh wire id per attempt; queued when none has room),
prefill on a prefill worker or on the decode worker when what it lacks is short, then forward the first token to the
decode worker (``Start``). Colocated: one worker does all. A move is the same hand-off with a decoding request as its
source: the target reserves the flow's context, the source ships its KV (``Export``) and stops the request
(``Frozen``), the target gets its tokens (``Start``) and the move ends when it streams; when and where to move:
moves.py.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

from cluster.config import ClusterConfig
from cluster.routing import moves
from cluster.routing.admission import Admission
from cluster.routing.errors import NoWorkers, Overloaded, RequestFailed
from cluster.routing.flow import Flow, FlowStatus, Move, MovePhase
from cluster.routing.membership import Membership, SwitchPhase, SwitchView, WorkerHandle, free_blocks
from cluster.routing.metrics import TTFT_STAGES, RouterMetrics
from cluster.routing.placement import Placer
from cluster.routing.policies import Placements, Policy
from engine.blocks import prompt_block_hashes
from engine.request import SamplingParams
from worker.messages import (
    Abort,
    Command,
    Drain,
    ErrorCode,
    ErrorEvent,
    Event,
    Export,
    Frozen,
    Generate,
    KvEvents,
    Prefill,
    Reserve,
    Reserved,
    Resume,
    Start,
    Stats,
    Tokens,
    Undrain,
    split_kv_address,
)

logger = logging.getLogger(__name__)

MAX_RECORDS = 10_000  # finished requests' timing and recent requests' placements kept (oldest dropped first)
MAX_RETRIES = 2  # re-dispatches of a request whose worker died before anything reached its client
MAX_WORKERS_TRIED = 3  # decode workers asked per round before the request waits for capacity
QUEUE_RETRY_S = 0.5  # a queued request asks again at least this often, heartbeats or not
# a worker removed after its drain said it was idle once it had failed what it held; those errors are on their way
# (the pool reads "drained" from the worker, not from this router's events): its requests wait this long for them
REMOVAL_GRACE_S = 2.0


def _room(stats: Stats | None) -> float:
    """The blocks a heartbeat says its worker could reserve (none at its request limit; unknown: any)."""
    if stats is None:
        return float("inf")
    load = stats.load
    return 0 if 0 < load.max_requests <= load.requests else load.free_blocks


class RouterCore:
    def __init__(
        self,
        config: ClusterConfig,
        metrics: RouterMetrics,
        admission: Admission | None = None,
        members: Membership | None = None,
        policies: dict[str, Policy] | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.admission = admission or Admission(config.router.queue_size)
        self.members = members or Membership(metrics)
        self.placer = Placer(config, self.members, metrics, policies)
        self.flows: dict[str, Flow] = {}  # by current wire id: the requests in flight
        self.placements = Placements(MAX_RECORDS)  # where recent requests went, for later ones' ``affinity``
        self.last_timing: OrderedDict[str, dict[str, float]] = OrderedDict()  # finished requests', for the response
        self.outbox: deque[tuple[str, Command]] = deque()
        self.updated: list[Flow] = []
        self._queue: deque[Flow] = deque()  # waiting for decode KV, oldest first
        self._next_queue_retry_s = 0.0
        self._removed: dict[str, float] = {}  # workers removed by scale-down -> when their requests are failed

    # ---- requests in and out -----------------------------------------------------------------------------------

    def submit(
        self, rid: str, prompt: list[int], params: SamplingParams, now: float, affinity: str | None = None
    ) -> Flow:
        """A new request's flow, already on its way (or FAILED)."""
        config = self.config
        flow = Flow(
            rid,
            prompt,
            params,
            prompt_block_hashes(prompt, config.transfer.block_size),
            started_s=now,
            deadline_s=now + config.router.request_timeout_s,
            affinity=affinity,
        )
        self.metrics.inflight.inc()
        self._new_wire_id(flow)
        flow.blocks_needed = self.placer.blocks_needed(len(prompt), params.max_tokens)
        try:
            self.placer.check_fits(self._first_role, len(prompt), params.max_tokens)
        except RequestFailed as error:
            self.fail(flow, error)
            return flow
        self._place(flow, now)
        return flow

    def release(self, flow: Flow, now: float) -> None:
        """The response side is done with the flow (the client got its end, or went away): its one way out."""
        if not flow.status.ended:
            self.metrics.errors.labels("client_disconnected").inc()
            self.metrics.requests.labels("aborted").inc()
            self._abort_workers(flow)
            flow.closed = True
            flow.status = FlowStatus.FAILED
            self.sync(flow)
            self._leave_queue(flow)
        if self.flows.pop(flow.wire_id, None) is not None:
            self.metrics.inflight.dec()
            self._wake(now)

    @property
    def _first_role(self) -> str:
        return "colocated" if self.config.mode == "colocated" else "decode"

    def _place(self, flow: Flow, now: float) -> None:
        if self.config.mode != "colocated":
            self._reserve_next(flow, now)
            return
        prefer = self._preferred(flow)
        try:
            worker = self.placer.pick("colocated", len(flow.prompt), flow.block_hashes, prefer and prefer.decode)
        except NoWorkers as error:
            self.fail(flow, error)
            return
        flow.decode, flow.status, flow.wire_used = worker.name, FlowStatus.PREFILLING, True
        self._dispatched(flow, now)
        self.send(worker.name, Generate(flow.wire_id, flow.prompt, flow.params))

    def _preferred(self, flow: Flow):
        return self.placements.get(flow.affinity) if flow.affinity is not None else None

    def _dispatched(self, flow: Flow, now: float) -> None:
        flow.timing.router_queue_s = now - flow.started_s
        self.placements.record(flow.rid, flow.prefill, flow.decode)
        self.sync(flow)

    # ---- decode reservations -----------------------------------------------------------------------------------

    def _reserve_next(self, flow: Flow, now: float) -> None:
        """Ask the next decode worker with room; after ``MAX_WORKERS_TRIED`` refusals, or none with room, queue."""
        workers = self.members.routable("decode")
        if not workers:
            self.fail(flow, NoWorkers("no live decode worker"))
            return
        fits = [w for w in workers if w.name not in flow.tried and free_blocks(w) >= flow.blocks_needed]
        if fits and len(flow.tried) < MAX_WORKERS_TRIED:
            prefer = self._preferred(flow)
            match = self.placer.prefix_match(len(flow.prompt), flow.block_hashes)
            worker = self.placer.order("decode", fits, match, prefer and prefer.decode)[0]
            if flow.wire_used:  # every attempt has an id of its own: a late answer names the attempt it answers
                self.retire(flow.wire_id, flow)
                self._new_wire_id(flow)
            flow.wire_used = True
            flow.asking, flow.asked_s, flow.status = worker.name, now, FlowStatus.RESERVING
            self.sync(flow)
            local_max = self.config.router.local_prefill_max_tokens
            # the KV comes from a prefill worker, whose ranks each send their heads (the pool's degree)
            source = self.config.pools.prefill.tensor_parallel_size
            command = Reserve(
                flow.wire_id, flow.prompt, flow.params, local_prefill_max_tokens=local_max, source_degree=source
            )
            self.send(worker.name, command)
            return
        flow.tried.clear()  # a new round once capacity may have been freed
        flow.status = FlowStatus.QUEUED
        self.sync(flow)
        if flow.queued:
            return
        if not self.admission.enter():  # one limit across every router process
            self.fail(flow, Overloaded("every decode worker's KV cache is reserved and the queue is full"))
            return
        flow.queued = True
        if not self._queue:
            self._next_queue_retry_s = now + QUEUE_RETRY_S
        self._queue.append(flow)
        self.metrics.queue_depth.set(len(self._queue))

    def _on_reserved(self, reply: Reserved, worker: WorkerHandle | None, now: float) -> None:
        flow = self.flows.get(reply.rid)
        if flow is not None and flow.move is not None and reply.rid == flow.move.target_wire:
            self._move_reserved(flow, flow.move, reply, now)
            return
        if flow is None or flow.status is not FlowStatus.RESERVING or flow.asking != reply.worker:
            if reply.ok and worker is not None:  # an answer that came after the router gave up: undo it there
                self.send(worker.name, Abort(reply.rid))
            return
        flow.asking = None
        if not reply.ok:
            flow.tried.append(reply.worker)
            self._reserve_next(flow, now)
            return
        self._leave_queue(flow)
        flow.decode = reply.worker
        flow.timing.decode_cached_tokens = reply.cached_tokens
        self.metrics.decode_cached_tokens.inc(reply.cached_tokens)
        placer, decode = self.placer, self.members.get(reply.worker)
        match = placer.prefix_match(len(flow.prompt), flow.block_hashes)
        prefer = self._preferred(flow)
        if decode is not None:
            placer.count_decision("decode", decode, self.members.routable("decode"), match, prefer and prefer.decode)
            placer.expect(decode, flow.block_hashes)
        flow.status = FlowStatus.PREFILLING
        if reply.prefill_local:  # the decode worker computes what it lacks itself: no prefill worker, no transfer
            self.metrics.prefill_path.labels("local").inc()
            flow.timing.prefill_local = True
            self._dispatched(flow, now)
            return
        try:
            prefill = placer.pick("prefill", len(flow.prompt), flow.block_hashes, prefer and prefer.prefill)
        except NoWorkers as error:
            self.fail(flow, error)
            return
        flow.prefill = prefill.name
        self.metrics.prefill_path.labels("remote").inc()
        self._dispatched(flow, now)
        command = Prefill(
            flow.wire_id, flow.prompt, flow.params, reply.kv_address, reply.blocks, cached_tokens=reply.cached_tokens
        )
        self.send(prefill.name, command)

    def _leave_queue(self, flow: Flow) -> None:
        if flow.queued:
            flow.queued = False
            self.admission.leave()
            self._queue.remove(flow)
            self.metrics.queue_depth.set(len(self._queue))

    def _wake(self, now: float) -> None:
        """Capacity may have been freed: every queued request that fits somewhere asks again."""
        self._next_queue_retry_s = now + QUEUE_RETRY_S
        waiting = [f for f in self._queue if f.status is FlowStatus.QUEUED]
        if not waiting:
            return
        workers = self.members.routable("decode")
        most_free = max((free_blocks(w) for w in workers), default=-1)
        for flow in waiting:
            if workers and flow.blocks_needed > most_free:
                continue  # no worker has room for it (a smaller one behind it may fit)
            self._reserve_next(flow, now)  # (no worker at all: it fails with a 503)
            if flow.status is FlowStatus.RESERVING:  # that worker's room is less by the ask now
                most_free = max((free_blocks(w) for w in workers), default=-1)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    # ---- events ------------------------------------------------------------------------------------------------

    def on_event(self, event: Event, now: float) -> None:
        if isinstance(event, Stats):
            self._on_stats(event, now)
            return
        worker = self.members.heard_from(event.worker, now)
        if isinstance(event, Tokens):
            self._on_tokens(event, now)
        elif isinstance(event, Reserved):
            self._on_reserved(event, worker, now)
        elif isinstance(event, ErrorEvent):
            self._on_error(event, now)
        elif isinstance(event, KvEvents):
            self.members.on_kv_events(event, worker)
        elif isinstance(event, Frozen):
            self._on_frozen(event, now)

    def _on_stats(self, stats: Stats, now: float) -> None:
        before = self.members.get(stats.worker)
        room_before = _room(before.stats) if before is not None else -1
        worker = self.members.heard_from(stats.worker, now, stats)
        if worker is None:
            return
        self.metrics.observe_worker(stats)
        if worker.role == "decode" and _room(stats) > room_before:  # capacity freed there: the queue asks again
            self._wake(now)
        if worker.role == "decode" and self.config.router.rebalance.enabled:
            others = [w for w in self.members.routable("decode") if w.name != worker.name]
            limit = self.config.router.rebalance.max_moves_per_worker
            if picked := moves.rebalance_pick(worker, stats, others, self.placer, limit):
                self.migrate(picked[0], now, picked[1].name, reason="rebalance")

    def _on_tokens(self, event: Tokens, now: float) -> None:
        name, flows = event.worker, self.flows
        for item in event.items:
            flow = flows.get(item.rid)
            if flow is None:
                continue
            if flow.status is FlowStatus.PREFILLING and name == flow.prefill:
                # the prefill worker's first token: to the client, and to the decode worker, which holds the KV
                flow.status = FlowStatus.DECODING
                self.sync(flow)
                if item.token_ids and flow.decode is not None:
                    self.send(flow.decode, Start(flow.wire_id, item.token_ids[:1]))
            elif name != flow.decode or flow.status not in (
                FlowStatus.PREFILLING,
                FlowStatus.DECODING,
                FlowStatus.MIGRATING,  # the source's tokens before its freeze, the target's after its reservation
            ):
                continue  # not (or no longer) this worker's request: a stale or lying event
            elif flow.status is FlowStatus.PREFILLING:  # prefilled where it decodes: its first token
                flow.status = FlowStatus.DECODING
                self.sync(flow)
            first, last_token_s = flow.first_token_s is None, flow.last_token_s
            if flow.push(item, now):
                self.updated.append(flow)
                if item.token_ids and last_token_s is not None:
                    self.metrics.itl.observe(now - last_token_s)
                if flow.move is not None and name == flow.move.target:  # the target streams: it holds the request
                    self._move_landed(flow, flow.move, now)
                if first and flow.first_token_s is not None:
                    self.metrics.ttft.observe(flow.first_token_s - flow.started_s)
                if item.finish_reason is not None:
                    self._finish(flow, now)
            elif flow.error is not None:  # the item failed the flow (a worker's bug)
                self.fail(flow, flow.error)
                self.updated.append(flow)

    def _on_error(self, error: ErrorEvent, now: float) -> None:
        flow = self.flows.get(error.rid)
        if flow is None:
            return
        if flow.status is FlowStatus.RESERVING and error.worker == flow.asking:
            if error.code is ErrorCode.INVALID_REQUEST:  # refused for what it is: no other worker or wait helps
                self.fail(flow, RequestFailed(error.message, error.code.value, 400))
                return
            flow.asking = None  # the worker could not even try: the next one is asked
            flow.tried.append(error.worker)
            self._reserve_next(flow, now)
        elif flow.move is not None and error.worker in (flow.move.source, flow.move.target):
            self._move_error(flow, flow.move, error, now)
        elif error.worker in (flow.prefill, flow.decode):
            status = 400 if error.code is ErrorCode.INVALID_REQUEST else 500
            self.fail(flow, RequestFailed(error.message, error.code.value, status))

    def on_tick(self, now: float) -> None:
        """Deadlines: request timeouts, unanswered reservations, queue retries, removed workers' requests."""
        for name, until in list(self._removed.items()):
            if now >= until:
                del self._removed[name]
                self._worker_gone(name, "worker removed by scale-down", now)
        worker_timeout_s = self.config.router.worker_timeout_s
        for flow in list(self.flows.values()):
            if flow.status.ended:
                continue
            if now >= flow.deadline_s:
                if flow.status in (FlowStatus.QUEUED, FlowStatus.RESERVING):
                    self.fail(flow, Overloaded("no decode KV became free before the request timed out"))
                else:
                    self.fail(flow, RequestFailed("request timed out", "timeout", 504))
            elif flow.status is FlowStatus.RESERVING and now - flow.asked_s > worker_timeout_s:
                logger.warning("decode worker %s did not answer a reservation in time", flow.asking)
                flow.tried.append(flow.asking or "")
                flow.asking = None
                self._reserve_next(flow, now)
            elif (move := flow.move) is not None and move.phase is MovePhase.RESERVING:
                if now - move.phase_s > worker_timeout_s:  # the target is silent: the request runs on at the source
                    logger.warning("decode worker %s did not answer a move's reservation in time", move.target)
                    self._call_off(flow, move, "resumed", now, resume_source=False)
        if self._queue and now >= self._next_queue_retry_s:
            self._wake(now)

    # ---- moves: the hand-off with a decoding request as its source (when and where: moves.py) -------------------

    def migrate(self, flow: Flow, now: float, target: str | None = None, reason: str = "admin") -> str:
        """Start moving a decoding flow off its decode worker, to ``target`` or the one the policy picks among those
        with room for its context; returns "" or why it cannot move now."""
        if self.config.mode == "colocated":
            return "colocated workers do not move requests"
        if flow.status is not FlowStatus.DECODING or flow.decode is None:
            return f"request is {flow.status.value}, not decoding"
        others = [w for w in self.members.routable("decode") if w.name != flow.decode]
        if target is not None:
            others = [w for w in others if w.name == target]
            if not others:
                return f"{target} is not another live decode worker"
        # a worker about to preempt needs the request out of its batch now (a stopped one grows no more), not after
        # the few steps a pre-copy takes
        precopy = reason != "rebalance"
        chosen = moves.pick_target(flow, others, self.placer, precopy)
        if chosen is None:
            self.metrics.migrations.labels(reason, "refused").inc()
            return "no other decode worker has room for it"
        self._reserve_move(flow, chosen.name, now, reason, precopy)
        return ""

    def _reserve_move(self, flow: Flow, target: str, now: float, reason: str, precopy: bool) -> None:
        assert flow.decode is not None
        move = Move(flow.decode, flow.wire_id, target, self.next_wire_id(flow), now, reason, phase_s=now)
        move.blocks_needed, move.precopy = moves.blocks_needed(self.placer, flow, precopy), precopy
        flow.move, flow.status = move, FlowStatus.MIGRATING
        self.sync(flow)
        context, slack = moves.computed_tokens(flow), moves.slack_tokens(precopy)
        source = self.members.get(flow.decode)
        degree = split_kv_address(source.kv_address).degree if source is not None and source.kv_address else 1
        command = Reserve(
            move.target_wire,
            flow.prompt,
            flow.params,
            context_tokens=context,
            extra_headroom_tokens=slack,
            source_degree=degree,  # the source's ranks each send the heads they hold first
        )
        self.send(target, command)

    def _move_reserved(self, flow: Flow, move: Move, reply: Reserved, now: float) -> None:
        """The target's answer: where a prompt's reservation sends ``Prefill``, a move's sends ``Export``."""
        if reply.worker != move.target or move.phase is not MovePhase.RESERVING:
            return
        if not reply.ok:
            self._end_move(flow, move, "refused", now)  # nothing is held anywhere: the source never stopped
            return
        move.phase, move.phase_s = MovePhase.EXPORTING, now
        command = Export(move.source_wire, move.target_wire, reply.kv_address, reply.blocks, precopy=move.precopy)
        self.send(move.source, command)

    def _on_frozen(self, event: Frozen, now: float) -> None:
        """The source stopped the request: its tokens go to the target, whose stream the client reads from now."""
        flow = self.flows.get(event.rid)
        move = flow.move if flow is not None else None
        if flow is None or move is None or move.phase is not MovePhase.EXPORTING or event.worker != move.source:
            if self.members.get(event.worker) is not None:  # nobody waits for it there any more
                self.send(event.worker, Abort(event.rid) if flow is None else Resume(event.rid))
            return
        if len(event.output_token_ids) != flow.received_tokens:  # every token came before the freeze: a bug
            frozen, arrived = len(event.output_token_ids), flow.received_tokens
            logger.warning("request %s stopped after %d tokens, %d arrived", flow.rid, frozen, arrived)
            self._call_off(flow, move, "refused", now, resume_source=True)
            return
        move.phase, move.phase_s, move.frozen_s = MovePhase.HANDING_OFF, now, now
        flow.decode, flow.wire_id = move.target, move.target_wire  # its tokens come from there from now on
        self.sync(flow)
        self.send(move.target, Start(move.target_wire, event.output_token_ids))

    def _move_landed(self, flow: Flow, move: Move, now: float) -> None:
        """The target streams the flow: the source lets go of what it held."""
        self._abort_at(move.source, move.source_wire)
        self._end_move(flow, move, "moved", now)

    def _move_error(self, flow: Flow, move: Move, error: ErrorEvent, now: float) -> None:
        """An error from either end while the flow moves. About the move (the target cannot take it, the source's
        export failed or was refused), the move is called off, or, once the target has the tokens, the target
        computes what did not come; a failed pre-copy is tried once more without one. Else (the request itself
        failed at the source) the flow fails."""
        if error.worker == move.target and error.rid == move.target_wire:  # the target cannot take it
            self._call_off(flow, move, "refused", now, resume_source=move.phase is not MovePhase.RESERVING)
            return
        export_failed = error.worker == move.source and error.rid == move.target_wire
        refused = (
            error.worker == move.source and error.rid == move.source_wire and error.code is ErrorCode.INVALID_REQUEST
        )
        if export_failed or refused:
            if move.phase is MovePhase.HANDING_OFF:
                self._recompute_on_target(flow, move, now)
                return
            self._call_off(flow, move, "failed" if export_failed else "refused", now, resume_source=False)
            if export_failed and move.precopy and move.target in {w.name for w in self.members.routable("decode")}:
                self._reserve_move(flow, move.target, now, move.reason, precopy=False)  # all goes once it stops
            return
        if error.rid not in (move.source_wire, move.target_wire):
            return  # about an attempt already given up
        status = 400 if error.code is ErrorCode.INVALID_REQUEST else 500
        self.fail(flow, RequestFailed(error.message, error.code.value, status))

    def _move_worker_gone(self, flow: Flow, move: Move, name: str, reason: str, now: float) -> None:
        if name == move.target:  # the source still holds the request: it runs on there
            self._call_off(flow, move, "resumed", now, resume_source=move.phase is not MovePhase.RESERVING)
        elif move.phase is MovePhase.HANDING_OFF:  # the target has the tokens: it computes what did not come
            self._recompute_on_target(flow, move, now)
        else:  # the source died before it said what it had generated: nobody can go on
            self._abort_at(move.target, move.target_wire)
            self._end_move(flow, move, "failed", now)
            self.fail(flow, RequestFailed(f"{reason} ({name}) while the request moved", "worker_died", 503))

    def _recompute_on_target(self, flow: Flow, move: Move, now: float) -> None:
        """The KV will not come whole: the target computes it from the tokens now, not at its transfer's deadline."""
        self.send(move.target, Resume(move.target_wire))
        self._abort_at(move.source, move.source_wire)
        self._end_move(flow, move, "recomputed", now)

    def _call_off(self, flow: Flow, move: Move, result: str, now: float, resume_source: bool) -> None:
        """Back to the source under its old id: the target lets go of what it reserved; the source, if it may have
        begun the export or stopped the request, is told to run on."""
        self._abort_at(move.target, move.target_wire)
        flow.decode, flow.wire_id = move.source, move.source_wire
        if resume_source and self.members.get(move.source) is not None:
            self.send(move.source, Resume(move.source_wire))
        self._end_move(flow, move, result, now)

    def _end_move(self, flow: Flow, move: Move, result: str, now: float) -> None:
        self._forget_move(flow, move)
        self.metrics.migrations.labels(move.reason, result).inc()
        if result in ("moved", "recomputed"):
            stall_s = now - (move.frozen_s if move.frozen_s is not None else now)
            flow.migrations += 1
            flow.migration_s += stall_s
            flow.timing.migrations, flow.timing.migration_s = flow.migrations, flow.migration_s
            self.metrics.migration_stall.observe(stall_s)
        if not flow.status.ended:
            flow.status = FlowStatus.DECODING
            self.sync(flow)

    def _forget_move(self, flow: Flow, move: Move) -> None:
        flow.move = None
        self.retire(move.source_wire if flow.wire_id == move.target_wire else move.target_wire, flow)

    def _abort_at(self, name: str, wire_id: str) -> None:
        if self.members.get(name) is not None:
            self.send(name, Abort(wire_id))

    # ---- membership --------------------------------------------------------------------------------------------

    def add_worker(
        self,
        name: str,
        role: str,
        command_address: str,
        kv_address: str | None,
        now: float,
        switch_result: str | None = None,
    ) -> None:
        """Register a worker, again after a restart, or in its new role after a switch (``switch_result``: "done",
        or "restarted" when it died mid-switch and came back in the new role): it then joins its new pool afresh,
        routable, its old role's flows ended."""
        old = self.members.get(name)
        switched = old is not None and old.role != role
        if switched:
            self._worker_gone(name, f"worker switched to {role}", now)  # drained: nothing is left, normally
            self.members.remove(name)
            self.metrics.role_switches.labels(role, switch_result or "done").inc()
        if self.members.add(name, role, command_address, kv_address, now):
            self._worker_gone(name, "worker restarted", now)  # what the old process held is gone with it
        if switched:
            self._wake(now)  # queued requests may fit there now

    def mark_dead(self, name: str, reason: str, now: float) -> None:
        if self.members.mark_dead(name, reason):
            self._worker_gone(name, reason, now)

    def drain(self, name: str, deadline_s: float, now: float = 0.0, switch_to: str | None = None) -> None:
        """The worker gets nothing new and finishes what it holds (``Drain``: it says when it is idle); a decode
        worker's running requests move to the others (``router.migrate_on_drain``; always when it is to switch role,
        ``switch_to``: then what it holds at the deadline is kept, and the switch called off)."""
        if self.members.drain(name):
            self.send(name, Drain(deadline_s=deadline_s, fail_at_deadline=switch_to is None))
            worker = self.members.get(name)
            if worker is not None and switch_to is not None:
                worker.switch = SwitchView(switch_to, SwitchPhase.DRAINING, now)
            migrate = self.config.router.migrate_on_drain or switch_to is not None
            if migrate and worker is not None and worker.role == "decode":
                for flow in list(self.flows.values()):
                    if flow.decode == name and flow.status is FlowStatus.DECODING:
                        self.migrate(flow, now, reason="drain")

    def switch_phase(self, name: str, phase: str, now: float) -> None:
        """A role switch moved on (shown in ``/status``): "reconfiguring" once drained, "called_off" when it could not
        drain in its deadline (the worker serves on in its old role)."""
        worker = self.members.get(name)
        if worker is None or worker.switch is None:
            return
        if phase == SwitchPhase.CALLED_OFF:
            self.metrics.role_switches.labels(worker.switch.to, "called_off").inc()
            self.members.undrain(name)
            self.send(name, Undrain())
            self._wake(now)
        else:
            worker.switch.phase = SwitchPhase(phase)

    def remove_worker(self, name: str, now: float) -> None:
        """Forget a worker the pool stopped after its drain. What it still held gets an error or a retry
        ``REMOVAL_GRACE_S`` later (``on_tick``), unless the worker's own answer, already sent, ends it first: past its
        drain deadline the worker fails each request with the reason, then says it is idle."""
        self.members.remove(name)
        self._removed[name] = now + REMOVAL_GRACE_S
        self._wake(now)

    def _worker_gone(self, name: str, reason: str, now: float) -> None:
        """A dead worker's requests: a reservation moves on; a request is retried if nothing reached the client,
        else fails. A prefill worker's requests only until their first token: then the decode worker holds the KV."""
        for flow in list(dict.fromkeys(self.flows.values())):  # a moving flow is there under two wire ids
            if flow.status.ended:
                continue
            if flow.move is not None and name in (flow.move.source, flow.move.target):
                self._move_worker_gone(flow, flow.move, name, reason, now)
            elif flow.status is FlowStatus.RESERVING and flow.asking == name:
                flow.asking = None
                flow.tried.append(name)
                self._reserve_next(flow, now)
            elif name == flow.decode or (name == flow.prefill and flow.status is FlowStatus.PREFILLING):
                if flow.num_output_tokens == 0 and flow.retries < MAX_RETRIES:
                    self._retry(flow, now)
                else:
                    self.fail(flow, RequestFailed(f"{reason} ({name})", "worker_died", 503))

    def _retry(self, flow: Flow, now: float) -> None:
        self._abort_workers(flow)
        self.metrics.errors.labels("retried_after_worker_death").inc()
        flow.retries += 1
        flow.reset()
        flow.status = FlowStatus.QUEUED
        self.sync(flow)
        self.retire(flow.wire_id, flow)
        self._new_wire_id(flow)
        self.updated.append(flow)
        self._place(flow, now)

    def retire(self, wire_id: str, flow: Flow) -> None:
        if self.flows.get(wire_id) is flow:
            del self.flows[wire_id]

    # ---- ends --------------------------------------------------------------------------------------------------

    def _finish(self, flow: Flow, now: float) -> None:
        flow.status = FlowStatus.DONE
        if flow.move is not None:  # it finished at the source before it stopped: the target lets go
            self._abort_at(flow.move.target, flow.move.target_wire)
            self._end_move(flow, flow.move, "finished", now)
        self.sync(flow)
        metrics, timing = self.metrics, flow.timing
        metrics.requests.labels("finished").inc()
        metrics.e2e.observe(now - flow.started_s)
        metrics.prompt_tokens.inc(len(flow.prompt))
        metrics.generated_tokens.inc(flow.received_tokens)
        first = flow.first_token_s if flow.first_token_s is not None else now
        if flow.received_tokens > 1:
            metrics.tpot.observe((now - first) / (flow.received_tokens - 1))
        timing.ttft_s, timing.e2e_s = first - flow.started_s, now - flow.started_s
        known = sum(t or 0.0 for t in (timing.router_queue_s, timing.prefill_queue_s, timing.prefill_compute_s))
        timing.first_token_delivery_s = max(0.0, timing.ttft_s - known)
        for stage in TTFT_STAGES:
            if (seconds := getattr(timing, f"{stage}_s")) is not None:
                metrics.ttft_stage.labels(stage).observe(seconds)
        if timing.prefill_end_mono is not None and timing.kv_done_mono is not None:  # same-host monotonic stamps
            timing.kv_after_prefill_s = timing.kv_done_mono - timing.prefill_end_mono
            metrics.kv_after_prefill.observe(timing.kv_after_prefill_s)
        if timing.kv_transfer_s is not None:
            metrics.kv_transfer.observe(timing.kv_transfer_s)
        self.last_timing[flow.rid] = timing.response()
        while len(self.last_timing) > MAX_RECORDS:  # a client that never collects its timing cannot grow this
            self.last_timing.popitem(last=False)

    def fail(self, flow: Flow, error: RequestFailed) -> None:
        if flow.status.ended:
            return
        self.metrics.errors.labels(error.code).inc()
        self.metrics.requests.labels("error").inc()
        self._abort_workers(flow)
        flow.fail(error)  # (an item the flow refused may have failed it already: that error stands)
        flow.status = FlowStatus.FAILED
        self.sync(flow)
        self._leave_queue(flow)
        self.updated.append(flow)

    def _abort_workers(self, flow: Flow) -> None:
        """Abort on every worker that may hold the flow, those marked dead too (one only cut off must not keep it)."""
        holders = {(name, flow.wire_id) for name in (flow.prefill, flow.decode, flow.asking) if name is not None}
        # a moving flow: the source knows it by its old wire id, the target by its new
        if flow.move is not None:
            holders |= {(flow.move.source, flow.move.source_wire), (flow.move.target, flow.move.target_wire)}
            self._forget_move(flow, flow.move)
        for name, wire_id in holders:
            if self.members.get(name) is not None:
                self.send(name, Abort(wire_id))

    # ---- bookkeeping -------------------------------------------------------------------------------------------

    def sync(self, flow: Flow) -> None:
        """Make the workers' load follow ``Flow.holders``."""
        holders = flow.holders()
        if holders == flow.held_by:
            return
        for name in flow.held_by - holders:
            worker = self.members.get(name)
            if worker is not None:
                worker.flows.discard(flow)
        for name in holders - flow.held_by:
            worker = self.members.get(name)
            if worker is not None:
                worker.flows.add(flow)
        flow.held_by = holders

    def _new_wire_id(self, flow: Flow) -> None:
        flow.wire_id, flow.wire_used = self.next_wire_id(flow), False

    def next_wire_id(self, flow: Flow) -> str:
        flow.attempts += 1
        wire_id = flow.rid if flow.attempts == 1 else f"{flow.rid}.{flow.attempts - 1}"
        self.flows[wire_id] = flow
        return wire_id

    def send(self, name: str, command: Command) -> None:
        self.outbox.append((name, command))

    def take_updated(self) -> list[Flow]:
        updated, self.updated = self.updated, []
        return updated
