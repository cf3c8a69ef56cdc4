"""Moving a decoding request to another decode worker, by pre-copy: the router core's second idea (core.py places).

The target reserves the flow's whole context under a new wire id (reserving); the source ships its full blocks while
it decodes on (precopying); the source stops it (freezing: its stream stands still from here); the target takes its
tokens (adopting), the source ships the rest (moving) and reports the end. Rebalancing moves a request off a decode
worker about to preempt, without the pre-copy. The core hands ``Moves`` every event that concerns a move (a reply for
a target wire id, ``Frozen``, ``Migrated``, an error or death of either end, the move's deadline, the flow's end) and
``Moves`` acts through the core's outbox, flow table and failure path.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from cluster.routing.errors import RequestFailed
from cluster.routing.flow import Flow, FlowStatus, Move
from cluster.routing.membership import WorkerHandle, free_blocks
from worker.messages import (
    Abort,
    ErrorCode,
    ErrorEvent,
    Freeze,
    Frozen,
    Migrated,
    MigrateIn,
    MigrateSend,
    MigrateTail,
    Reserved,
    Resume,
    Stats,
)

if TYPE_CHECKING:
    from cluster.routing.core import RouterCore

logger = logging.getLogger(__name__)


def computed_tokens(flow: Flow) -> int:
    """The tokens a decoding flow's KV holds: its prompt and every output token but the newest."""
    return len(flow.prompt) + flow.received_tokens - 1


class Moves:
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    def migrate(self, flow: Flow, now: float, target: str | None = None, reason: str = "admin") -> str:
        """Start moving a decoding flow off its decode worker, to ``target`` or the one the policy picks among
        those with room for its whole context; returns "" or why it cannot move now."""
        core = self.core
        if core.config.mode == "colocated":
            return "colocated workers do not move requests"
        if flow.status is not FlowStatus.DECODING or flow.decode is None:
            return f"request is {flow.status.value}, not decoding"
        source = flow.decode
        if target is not None and (target == source or target not in self._routable_decode()):
            return f"{target} is not another live decode worker"
        computed = computed_tokens(flow)
        needed = self.blocks_needed(flow)
        workers = [w for w in core.members.routable("decode") if w.name != source and target in (None, w.name)]
        fits = [w for w in workers if free_blocks(w) >= needed]
        if not fits:
            core.metrics.migrations.labels(reason, "refused").inc()
            return "no other decode worker has room for it"
        chosen = core.placer.order("decode", fits, core.placer.prefix_match(0, []))[0]
        move = Move(source, flow.wire_id, chosen.name, core.next_wire_id(flow), now, reason=reason, phase_s=now)
        move.blocks_needed = needed
        # every full block but one for the tail; none when rebalancing: a worker about to preempt needs the request
        # out of its batch now (a frozen request grows no more), not after the few steps a pre-copy takes
        if reason != "rebalance":
            move.precopy_blocks = max(0, (computed - 1) // core.config.transfer.block_size)
        flow.move, flow.status = move, FlowStatus.MIGRATING
        core.sync(flow)
        command = MigrateIn(
            move.target_wire, flow.prompt, flow.params, num_computed_tokens=computed, precopy_blocks=move.precopy_blocks
        )
        core.send(chosen.name, command)
        return ""

    def rebalance(self, worker: WorkerHandle, stats: Stats, now: float) -> None:
        """A decode worker about to preempt (fewer free blocks than running requests) moves the request with the
        most tokens to go to the worker with the most room, if that one holds it and stays above the same line."""
        core, load = self.core, stats.load
        if load.free_blocks >= load.running or load.running < 2:
            return
        mine = [f for f in worker.flows if f.decode == worker.name]
        moving = sum(1 for f in mine if f.move is not None)
        if moving >= core.config.router.rebalance.max_moves_per_worker:
            return
        decoding = [f for f in mine if f.status is FlowStatus.DECODING]
        if not decoding:
            return
        flow = max(decoding, key=lambda f: f.params.max_tokens - f.received_tokens)
        needed = self.blocks_needed(flow)
        others = [w for w in core.members.routable("decode") if w.name != worker.name and w.stats is not None]
        roomy = [w for w in others if free_blocks(w) - needed >= w.stats.load.running + 1]  # type: ignore[union-attr]
        if roomy:
            target = max(roomy, key=free_blocks)
            self.migrate(flow, now, target.name, reason="rebalance")

    def blocks_needed(self, flow: Flow) -> int:
        """What a target reserves for a decoding flow: its context so far, as a prompt, and the tokens still to come."""
        remaining = flow.params.max_tokens - flow.received_tokens
        return self.core.placer.blocks_needed(computed_tokens(flow), remaining + 1)

    def _routable_decode(self) -> list[str]:
        return [w.name for w in self.core.members.routable("decode")]

    # ---- the ends' answers -------------------------------------------------------------------------------------

    def on_reserved(self, flow: Flow, reply: Reserved, now: float) -> None:
        """The target's answer: to the reservation (pre-copy next, or the freeze), or to the tokens (the tail next)."""
        core, move = self.core, flow.move
        assert move is not None
        if reply.worker != move.target or move.phase not in ("reserving", "adopting"):
            return
        if move.phase == "reserving":
            if not reply.ok:
                self.end(flow, "refused", now)  # nothing is held anywhere: the source never stopped
                return
            move.kv_address = reply.kv_address
            if not move.precopy_blocks:
                self._freeze(flow, now)
                return
            move.phase, move.phase_s = "precopying", now
            dst = reply.blocks[: move.precopy_blocks]
            core.send(move.source, MigrateSend(move.source_wire, move.target_wire, reply.kv_address, dst, precopy=True))
            return
        if move.source_lost:  # the target was told to recompute what it adopts (``worker_gone``)
            if reply.ok:
                self.end(flow, "recomputed", now)
            else:
                self.end(flow, "failed", now)
                core.fail(
                    flow, RequestFailed(f"its decode worker {move.source} died while it moved", "worker_died", 503)
                )
            return
        if not reply.ok:
            self.call_off(flow, "refused", now)
            return
        move.phase, move.phase_s = "moving", now
        flow.decode, flow.wire_id = move.target, move.target_wire  # its tokens come from there from now on
        core.sync(flow)
        command = MigrateSend(
            move.source_wire, move.target_wire, move.kv_address, reply.blocks, first_block=move.precopy_blocks
        )
        core.send(move.source, command)

    def _freeze(self, flow: Flow, now: float) -> None:
        move = flow.move
        assert move is not None
        move.phase, move.phase_s, move.frozen_s = "freezing", now, now
        self.core.send(move.source, Freeze(move.source_wire))

    def on_frozen(self, event: Frozen, now: float) -> None:
        core = self.core
        flow = core.flows.get(event.rid)
        move = flow.move if flow is not None else None
        if flow is None or move is None or move.phase != "freezing" or event.worker != move.source:
            if event.ok and core.members.get(event.worker) is not None:  # nobody waits for it any more
                core.send(event.worker, Abort(event.rid) if flow is None else Resume(event.rid))
            return
        if not event.ok:
            logger.info("request %s did not move off %s: %s", flow.rid, move.source, event.reason)
            self.call_off(flow, "refused", now)
            return
        move.phase, move.phase_s, move.frozen_tokens = "adopting", now, len(event.output_token_ids)
        if move.frozen_tokens != flow.received_tokens:  # every token came before the freeze: a bug
            frozen, arrived = move.frozen_tokens, flow.received_tokens
            logger.warning("request %s froze after %d tokens, %d arrived", flow.rid, frozen, arrived)
            self.call_off(flow, "refused", now)
            return
        command = MigrateTail(
            move.target_wire,
            output_token_ids=event.output_token_ids,
            num_computed_tokens=event.num_computed_tokens,
            first_block=move.precopy_blocks,
        )
        core.send(move.target, command)

    def on_migrated(self, event: Migrated, now: float) -> None:
        core = self.core
        flow = core.flows.get(event.rid)
        move = flow.move if flow is not None else None
        if flow is None or move is None or event.worker != move.source:
            return
        if event.precopy:
            if move.phase == "precopying":
                if not event.ok:  # its blocks go with the tail
                    logger.info("pre-copy of %s to %s failed: %s", flow.rid, move.target, event.error)
                    move.precopy_blocks = 0
                self._freeze(flow, now)
            return
        if move.phase != "moving":
            return
        if event.ok:
            self.end(flow, "moved", now)
        elif move.target in self._routable_decode():  # the target recomputes from the tokens; the source lets go
            core.send(move.source, Abort(move.source_wire))
            core.send(move.target, Resume(move.target_wire))
            self.end(flow, "recomputed", now)
        else:
            self.call_off(flow, "resumed", now)

    def on_error(self, flow: Flow, error: ErrorEvent, now: float) -> None:
        """An error from either end while the flow moves: about the move itself, it is called off (or, its tail
        refused by the source, recomputed on the target); else (the request failed there) the flow fails."""
        core, move = self.core, flow.move
        assert move is not None
        about_move = error.code is ErrorCode.INVALID_REQUEST
        if error.worker == move.target and error.rid == move.target_wire and move.phase != "moving":
            if not move.source_lost:
                self.call_off(flow, "refused", now)  # the target could not take it over (or let it expire)
                return
        elif error.worker == move.source and error.rid == move.source_wire and about_move:
            if move.phase != "moving":
                self.call_off(flow, "refused", now)  # the source could not ship or stop it: it runs on there
            else:
                core.send(move.target, Resume(move.target_wire))
                self.end(flow, "recomputed", now)
            return
        status = 400 if about_move else 500
        core.fail(flow, RequestFailed(error.message, error.code.value, status))

    def worker_gone(self, flow: Flow, name: str, reason: str, now: float) -> None:
        core, move = self.core, flow.move
        assert move is not None
        if name == move.target:
            if flow.received_tokens > move.frozen_tokens and move.phase == "moving":  # the target streamed already
                self.end(flow, "failed", now)
                core.fail(flow, RequestFailed(f"{reason} ({name})", "worker_died", 503))
            else:  # the source still holds it: it runs on there
                self.call_off(flow, "resumed", now)
        elif move.phase == "moving":  # the target recomputes what did not come
            core.send(move.target, Resume(move.target_wire))
            self.end(flow, "recomputed", now)
        elif move.phase == "adopting":
            # the target has the tokens: once it has adopted them (commands to it stay in order), it recomputes
            move.source_lost = True
            flow.decode, flow.wire_id = move.target, move.target_wire
            core.send(move.target, Resume(move.target_wire))
            core.sync(flow)
        else:  # it died before it said what it had generated: nobody can go on
            core.send(move.target, Abort(move.target_wire))
            self.end(flow, "failed", now)
            core.fail(flow, RequestFailed(f"{reason} ({name}) while the request moved", "worker_died", 503))

    def check_deadline(self, flow: Flow, now: float) -> None:
        """A target that does not answer a reservation or the tokens in time: the request runs on at the source."""
        move = flow.move
        if (
            move is not None
            and move.phase in ("reserving", "adopting")
            and now - move.phase_s > self.core.config.router.worker_timeout_s
            and not move.source_lost
        ):
            logger.warning("decode worker %s did not answer a move's %s in time", move.target, move.phase)
            self.call_off(flow, "resumed", now)

    # ---- ends --------------------------------------------------------------------------------------------------

    def on_finish(self, flow: Flow, now: float) -> None:
        """The flow finished while it moved: on the target (the source lets go), or on the source (the target does)."""
        core, move = self.core, flow.move
        if move is None:
            return
        if flow.decode == move.target:  # finished there before the source said its KV went
            if core.members.get(move.source) is not None:
                core.send(move.source, Abort(move.source_wire))
            self.end(flow, "moved", now)
        else:
            if core.members.get(move.target) is not None:
                core.send(move.target, Abort(move.target_wire))
            self.end(flow, "finished", now)

    def forget(self, flow: Flow) -> set[tuple[str, str]]:
        """A flow's move, dropped (ended, or failing): the (worker, wire id) pairs that may hold it, for the core to
        abort when failing."""
        move = flow.move
        if move is None:
            return set()
        flow.move = None
        self.core.retire(move.source_wire if flow.wire_id == move.target_wire else move.target_wire, flow)
        return {(move.source, move.source_wire), (move.target, move.target_wire)}

    def call_off(self, flow: Flow, result: str, now: float) -> None:
        """Back to the source under its old id: the target lets go of what it reserved, the source runs on (told to,
        once it stopped)."""
        core, move = self.core, flow.move
        assert move is not None
        if core.members.get(move.target) is not None:
            core.send(move.target, Abort(move.target_wire))
        flow.decode, flow.wire_id = move.source, move.source_wire
        if move.phase in ("adopting", "moving") and core.members.get(move.source) is not None:
            core.send(move.source, Resume(move.source_wire))
        self.end(flow, result, now)

    def end(self, flow: Flow, result: str, now: float) -> None:
        core, move = self.core, flow.move
        assert move is not None
        self.forget(flow)
        core.metrics.migrations.labels(move.reason, result).inc()
        if result in ("moved", "recomputed"):
            stall_s = now - (move.frozen_s if move.frozen_s is not None else now)
            flow.migrations += 1
            flow.migration_s += stall_s
            flow.timing.migrations, flow.timing.migration_s = flow.migrations, flow.migration_s
            core.metrics.migration_stall.observe(stall_s)
        if not flow.status.ended:
            flow.status = FlowStatus.DECODING
            core.sync(flow)
