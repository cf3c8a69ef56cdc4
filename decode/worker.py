"""The decode worker: reserves KV for requests, imports their KV from other workers, decodes them in one batch.

Every request arrives by one hand-off, whatever its source (engine/kv_connector.py): ``Reserve`` takes blocks (for a
prompt, sharing what the prefix cache holds, or for a moved request's whole context) or refuses at once; a prompt's
short rest (``local_prefill_max_tokens``) is computed here, else the receiver expects the missing blocks; ``Start``
brings the tokens made where the KV comes from; with both in, the next step admits the request, and every step sends
the running requests' tokens in one ``tokens`` event. A request leaves by the same hand-off (``Export``): its full
blocks go to the target while it decodes on, then it stops between steps, the rest of its KV goes, it says so
(``Frozen``), and its blocks are held until the router says ``Abort`` (it moved) or ``Resume`` (called off). Failures,
expiry and moves step by step: docs/request-lifecycle.md and docs/architecture.md ("Failure handling", "Moving
running requests").
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable

import torch

from engine.kv_connector import KVSink
from engine.llm_engine import LLMEngine
from engine.request import ImportState, Request, RequestStatus
from transfer.base import KVReceiver, KVSender
from transfer.errors import SenderAborted
from transfer.inbound import Sink
from transfer.state import TransferEvent
from worker.handoff_join import HandoffReceiver, HandoffSender
from worker.messages import (
    Command,
    ErrorCode,
    Export,
    Frozen,
    RefusalReason,
    Reserve,
    Reserved,
    Resume,
    Start,
    WorkerCounters,
    WorkerLoad,
)
from worker.rank_kv import handoff_layout, rank_kv
from worker.role import Emit, Role
from worker.spec import FailurePolicy, WorkerRole, WorkerSpec

logger = logging.getLogger(__name__)

EXPIRY_CHECK_INTERVAL_S = 0.5  # how often reservations are checked for tokens that never came
# a pre-copy ships its layers over this many loop turns: the worker's other streams pay a share of the copy in each
# of a few steps instead of all of it in one, and the move waits only a few steps for it
PRECOPY_TURNS = 4
# a move's two halves, the tail of its KV and its tokens (``Start``), leave the source in one turn: once one is here
# the other is a transfer away, so the target waits up to this share of its last step for it rather than step without
# the move, which would hold the moved stream still for that whole step too; with nothing running, up to the cap
MOVE_JOIN_WAIT_SHARE = 0.25
MOVE_JOIN_WAIT_MAX_S = 0.05
MOVE_JOIN_POLL_S = 0.001  # the wait's sleep between looks (the KV is written by the receiver's thread meanwhile)


class ExportPhase(enum.Enum):
    PRECOPY = "precopy"  # its full blocks go, a few layers a turn, while it decodes on
    SENT = "sent"  # frozen; the rest of its KV is queued; the sender's lease says how the transfer ended


@dataclasses.dataclass(slots=True)
class _Export:
    """A decoding request's KV on its way to another decode worker (``Export``)."""

    rid: str
    transfer_id: str  # the target's id for the request
    dst: list[int]  # the target's reserved blocks: the KV fills a leading run of them
    src: list[int]  # its blocks here that the pre-copy reads (its full blocks when the export began)
    phase: ExportPhase = ExportPhase.PRECOPY
    layer: int = 0  # the next layer of the pre-copy
    known_to_router: bool = False  # the router called the move off or ended it: the transfer's end is not news


def kv_sink(engine: LLMEngine) -> Sink:
    """A plain receiver's sink, for a worker of one rank whose receiver is made outside (``HandoffReceiver.over``):
    arrived KV into the blocks the engine reserved for that transfer's request."""

    def sink(
        transfer_id: str,
        layer: int,
        block_ids: list[int],
        k: torch.Tensor,
        v: torch.Tensor,
        heads: tuple[int, int] | None = None,
    ) -> None:
        engine.kv_importer.write(transfer_id, layer, block_ids, k, v, heads)

    return sink


class DecodeRole(Role):
    kind = WorkerRole.DECODE

    def __init__(
        self,
        name: str,
        engine: LLMEngine,
        receiver: HandoffReceiver | KVReceiver,
        emit: Emit,
        *,
        failure_policy: FailurePolicy = "fail",
        headroom_tokens: int = 0,
        start_deadline_s: float = 30.0,
        counters: WorkerCounters | None = None,
        make_migration_sender: Callable[[], HandoffSender | KVSender] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``receiver``: the worker's (``from_spec``), or a plain one of a worker of one rank, whose sink is
        ``kv_sink(engine)``; ``make_migration_sender`` makes the sender of running requests' KV to other decode
        workers at the first move (None: this worker moves nothing out). ``clock``: what the reservations' expiry
        goes by (the planner's simulation gives its own, as to ``engine.kv_importer``)."""
        super().__init__(name, engine, emit, counters)
        self.layout = handoff_layout(engine.kv_spec, engine.runner.head_split)
        self.receiver = (
            receiver if isinstance(receiver, HandoffReceiver) else HandoffReceiver.over(receiver, self.layout)
        )
        self._make_sender = make_migration_sender
        self.sender: HandoffSender | None = None
        self._exports: dict[str, _Export] = {}  # by transfer id (the target's request id)
        self.failure_policy = failure_policy
        self.headroom_tokens = headroom_tokens
        # a reservation still without its tokens this long after it was made is freed: the router lost it
        self.start_deadline_s = start_deadline_s
        self.clock = clock
        self._next_expiry_check_s = 0.0
        self._last_step_s = 0.0  # the last engine step's duration (``_move_half_joined``)

    @classmethod
    def from_spec(cls, spec: WorkerSpec, engine: LLMEngine, emit: Emit) -> DecodeRole:
        # this rank's endpoints (the other ranks hold theirs: worker/tp_rank.py): KV arrives into the blocks the
        # engine reserved for its request; a move's KV leaves on the pool's backend, as a prefill worker's
        kv = rank_kv(
            spec, engine.kv_cache, handoff_layout(engine.kv_spec, engine.runner.head_split), engine.kv_importer.write
        )
        channel = engine.runner.step_channel
        try:
            receiver = HandoffReceiver(kv, channel)
        except BaseException:
            kv.close()
            raise
        sender = HandoffSender(kv, channel)
        return cls(
            spec.name,
            engine,
            receiver,
            emit,
            failure_policy=spec.failure_policy,
            headroom_tokens=spec.reserve_headroom_tokens,
            start_deadline_s=spec.transfer.deadline_s,
            make_migration_sender=lambda: sender,
        )

    def info(self) -> dict:
        return {"kv_address": self.receiver.address}

    # ---- commands ----------------------------------------------------------------------------------------------

    def handle(self, command: Command, arrival_s: float) -> None:
        if isinstance(command, Reserve):
            self._reserve(command)
        elif isinstance(command, Start):
            self.engine.kv_importer.tokens_in(command.rid, command.tokens)
        elif isinstance(command, Export):
            self._export(command)
        elif isinstance(command, Resume):
            self._resume(command.rid)
        else:
            super().handle(command, arrival_s)

    def _reserve(self, command: Reserve) -> None:
        engine, rid, moved = self.engine, command.rid, command.context_tokens is not None
        blocks = engine.kv_importer.reserve(
            command.prompt,
            command.params,
            rid,
            self.headroom_tokens + command.extra_headroom_tokens,
            prefix_cache=not moved,
            context_tokens=command.context_tokens,
        )
        if blocks is None:
            self.counters.reservations_refused += 1
            reason: RefusalReason = "max_num_seqs" if engine.at_seq_limit() else "kv_full"
            self.emit(Reserved(rid=rid, worker=self.name, ok=False, reason=reason))
            return
        held = engine.requests[rid]
        uncached = len(command.prompt) - held.num_cached_tokens
        local = not moved and 0 < uncached <= command.local_prefill_max_tokens
        if not local:
            expected = engine.kv_importer.expected_blocks(held)
            self.receiver.expect(
                rid,
                expected,
                num_layers=engine.kv_spec.num_layers,
                leading_run=moved,
                source_degree=command.source_degree,
            )
        first = held.num_cached_tokens // engine.kv_spec.block_size
        reply = Reserved(
            rid=rid,
            worker=self.name,
            ok=True,
            blocks=held.block_ids[first:],
            kv_address=self.receiver.address,
            cached_tokens=held.num_cached_tokens,
            prefill_local=local,
        )
        self.emit(reply)
        if local:  # computed now, in this turn of the loop; its first token comes in the tokens events
            engine.kv_importer.prefill_here(rid)
            self.counters.local_prefills += 1

    def abort(self, rid: str) -> None:
        request = self.engine.requests.get(rid)
        if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.receiver.abort(rid, "aborted by router")
        self._stop_exports(rid, "aborted by router")
        self.engine.abort(rid)

    # ---- a request leaving for another decode worker (a move's source) -----------------------------------------

    def _export(self, command: Export) -> None:
        """Begin shipping a decoding request's KV: its full blocks first (``_export_step``, over a few turns), unless
        ``precopy`` is off (a worker about to preempt needs it out of its batch now)."""
        request = self.engine.requests.get(command.rid)
        if request is None:
            raise KeyError(f"unknown request {command.rid!r}")
        if request.status != RequestStatus.RUNNING or request.num_computed_tokens != request.num_tokens - 1:
            raise ValueError(f"request {command.rid!r} is {request.status.name}: only a decoding request moves")
        if any(job.rid == command.rid for job in self._exports.values()):
            raise ValueError(f"request {command.rid!r} is already moving")
        if not self._fits_next_step(request, command.dst_blocks):
            raise ValueError(
                f"request {command.rid!r} has more tokens than the target's {len(command.dst_blocks)} blocks"
            )
        full = min(request.num_computed_tokens // self.engine.kv_spec.block_size, len(command.dst_blocks))
        src = request.block_ids[:full] if command.precopy else []
        self._migration_sender().begin(command.target_rid, command.kv_address)
        self._exports[command.target_rid] = _Export(command.rid, command.target_rid, list(command.dst_blocks), src)

    def _migration_sender(self) -> HandoffSender:
        if self.sender is None:
            if self._make_sender is None:
                raise ValueError("this decode worker has no KV sender: it moves no request out")
            sender = self._make_sender()
            self.sender = sender if isinstance(sender, HandoffSender) else HandoffSender.over(sender, self.layout)
        return self.sender

    def _export_step(self) -> None:
        """Before the step: the next layers of each pre-copy under way (a ``PRECOPY_TURNS``th of them); a pre-copy
        done, or whose request would outgrow the target's blocks in this step, stops the request and sends the rest
        of its KV. A request that left its blocks (finished, aborted, preempted) ends its export failed."""
        frozen: list[Frozen] = []
        try:
            self._export_turn(frozen)
        finally:
            # said together, after every tail of the turn went: the target joins them at one step boundary, not
            # stepping with the first while the rest arrive (which cost the rest a whole step of waiting)
            for event in frozen:
                self.emit(event)

    def _export_turn(self, frozen: list[Frozen]) -> None:
        engine, sender = self.engine, self.sender
        assert sender is not None
        num_layers = engine.kv_spec.num_layers
        for job in list(self._exports.values()):
            if job.phase is not ExportPhase.PRECOPY:
                continue
            request = engine.requests.get(job.rid)
            if (
                request is None
                or request.status != RequestStatus.RUNNING
                or request.block_ids[: len(job.src)] != job.src
            ):
                sender.abort(job.transfer_id, "the request left its blocks")
                continue
            try:
                if job.src and job.layer < num_layers:
                    end_layer = min(num_layers, job.layer + -(-num_layers // PRECOPY_TURNS))
                    self._send_held(job, request, 0, len(job.src), range(job.layer, end_layer))
                    job.layer = end_layer
                if job.transfer_id not in sender.active_transfers():
                    continue  # it failed already: the request runs on here, and poll reports the failure
                if job.layer == num_layers or not job.src or not self._fits_next_step(request, job.dst):
                    self._freeze_and_send(job, frozen)
            except Exception as exc:  # noqa: BLE001 - reported by poll; the request decodes on here if it can
                logger.warning("%s: moving %s failed: %s", self.name, job.rid, exc)
                sender.abort(job.transfer_id, f"migration failed: {exc}")

    def _fits_next_step(self, request: Request, dst: list[int]) -> bool:
        """Its context after one more step still fits the target's blocks ``dst`` (a step adds one token, or a
        verified proposal's worth)."""
        spec = self.engine.speculator
        step_tokens = 1 + (spec.config.num_tokens if spec is not None and request.params.speculative else 0)
        return request.num_tokens - 1 + step_tokens <= len(dst) * self.engine.kv_spec.block_size

    def _send_held(self, job: _Export, request: Request, first_block: int, end_block: int, layers: range) -> None:
        """Some layers of the request's blocks ``[first_block, end_block)``: rank 0's heads through the engine's
        exporter, the other ranks' by their own (``HandoffSender.send_held``)."""
        sender = self.sender
        assert sender is not None
        src, dst = request.block_ids[first_block:end_block], job.dst[first_block:end_block]
        sender.send_held(job.transfer_id, src, dst, layers)  # told first: the ranks send while rank 0 does
        sink: KVSink = sender.sink(job.transfer_id, job.dst)
        self.engine.kv_exporter.export_held(request, sink, first_block, end_block, layers)

    def _freeze_and_send(self, job: _Export, frozen: list[Frozen]) -> None:
        """Stop the request between steps (its tokens so far went out in earlier ``tokens`` events: its ``Frozen``,
        added to ``frozen``, names them), then send every layer's blocks the pre-copy did not: the transfer's end
        comes from the sender."""
        engine, sender = self.engine, self.sender
        assert sender is not None
        tokens = engine.freeze(job.rid)
        frozen.append(Frozen(rid=job.rid, worker=self.name, output_token_ids=tokens))
        request = engine.requests[job.rid]
        end = -(-request.num_computed_tokens // engine.kv_spec.block_size)
        sent, done = len(job.src), job.layer
        job.phase = ExportPhase.SENT
        if done and sent < end:
            self._send_held(job, request, sent, end, range(done))
        self._send_held(job, request, 0, end, range(done, engine.kv_spec.num_layers))
        sender.finish(job.transfer_id)

    def _resume(self, rid: str) -> None:
        """Run the request on here: a source's whose move was called off (its export stops), or a target's whose KV
        will not come (its source gave up or died: it is computed here from its tokens, now, not at the deadline)."""
        request = self.engine.requests.get(rid)
        if request is None:
            raise KeyError(f"unknown request {rid!r}")
        handoff = request.kv_import
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KV and handoff is not None:
            if handoff.state.awaits_kv:
                self.receiver.abort(rid, "the source gave up the move")
                self.engine.kv_importer.kv_failed(rid, recompute=True)
                self.counters.transfers_failed += 1
            return
        self._stop_exports(rid, "the move was called off")
        if request.status == RequestStatus.FROZEN:
            self.engine.resume(rid)

    def _stop_exports(self, rid: str, reason: str) -> None:
        """The router ended a move of ``rid`` (called off, or the request aborted): a pre-copy under way stops; a
        transfer whose tail went may still complete, but its end is no news."""
        for job in self._exports.values():
            if job.rid == rid and not job.known_to_router:
                job.known_to_router = True
                if job.phase is ExportPhase.PRECOPY and self.sender is not None:
                    self.sender.abort(job.transfer_id, reason)

    def _export_ended(self, event: TransferEvent) -> None:
        job = self._exports.pop(event.transfer_id)
        if event.ok:
            self.counters.migration_bytes += event.nbytes
            request = self.engine.requests.get(job.rid)
            if request is None or request.status == RequestStatus.FROZEN:  # not resumed here: it moved
                self.counters.migrations_out += 1
            return
        logger.info("%s: moving %s failed: %s", self.name, job.rid, event.error)
        if not job.known_to_router:  # named by the transfer (the target's id); the router decides what follows
            self.emit_error(job.transfer_id, f"moving its KV failed: {event.error}", ErrorCode.KV_TRANSFER_FAILED)

    # ---- the loop ----------------------------------------------------------------------------------------------

    def tick(self) -> None:
        self._expire_reservations()
        for event in self.receiver.poll():
            self._transfer_ended(event)
        if self.sender is not None:
            if self._exports:
                self._export_step()
            for sent in self.sender.poll():
                if sent.transfer_id in self._exports:
                    self._export_ended(sent)
        if self.engine.has_unfinished():
            if self._move_half_joined():
                time.sleep(MOVE_JOIN_POLL_S)
                return
            started_s = self.clock()
            outputs = self.engine.step()
            self._last_step_s = self.clock() - started_s
            self.emit_outputs(outputs)

    def _move_half_joined(self) -> bool:
        """A moved request here has had one half of its join (its KV's tail or its tokens) for less than
        ``MOVE_JOIN_WAIT_SHARE`` of the last step (``MOVE_JOIN_WAIT_MAX_S`` at most, and with nothing running): the
        next step waits for the other half."""
        running = self.engine.scheduler.running
        limit_s = (
            min(MOVE_JOIN_WAIT_MAX_S, MOVE_JOIN_WAIT_SHARE * self._last_step_s) if running else MOVE_JOIN_WAIT_MAX_S
        )
        now = self.clock()
        for request in self.engine.requests.values():
            handoff = request.kv_import
            if request.status != RequestStatus.WAITING_FOR_REMOTE_KV or handoff is None or not handoff.moved:
                continue
            if handoff.state is ImportState.KV_IN:
                half_s = handoff.kv_done_s
            elif handoff.state is ImportState.TOKENS_IN:
                half_s = handoff.tokens_in_s
            else:
                continue
            if half_s is not None and now - half_s < limit_s:
                return True
        return False

    def _transfer_ended(self, event: TransferEvent) -> None:
        rid = event.transfer_id
        request = self.engine.requests.get(rid)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            return  # aborted or expired meanwhile: its blocks are already free
        handoff = request.kv_import
        if handoff is None or not handoff.state.awaits_kv:
            return  # not this transfer's news: the request's own transfer has already ended
        importer = self.engine.kv_importer
        if event.ok:
            self.counters.transfers_ok += 1
            self.counters.transfer_bytes += event.nbytes
            if handoff.moved:
                self.counters.migrations_in += 1
            importer.kv_done(rid, event.num_blocks)
            return
        self.counters.transfers_failed += 1
        if self.failure_policy == "recompute" or handoff.moved:  # a moved request's tokens are its whole story
            importer.kv_failed(rid, recompute=True)
            return
        importer.kv_failed(rid, recompute=False)  # ends it, no output: the cause is reported here or not
        if not isinstance(event.error, SenderAborted):
            self.emit_error(rid, f"KV transfer failed: {event.error}", ErrorCode.KV_TRANSFER_FAILED)
        # else the prefill worker gave up on purpose and tells the router why itself

    def _expire_reservations(self) -> None:
        now = self.clock()
        if now < self._next_expiry_check_s:
            return
        self._next_expiry_check_s = now + EXPIRY_CHECK_INTERVAL_S
        for rid in self.engine.kv_importer.expire(self.start_deadline_s):
            logger.warning(
                "%s: reservation %s got no start in %.0f s; freeing it", self.name, rid, self.start_deadline_s
            )
            self.counters.reservations_expired += 1
            self.receiver.abort(rid, "reservation expired")
            self.emit_error(
                rid,
                f"no first token reached the decode worker within {self.start_deadline_s:.0f} s",
                ErrorCode.RESERVATION_EXPIRED,
            )

    # ---- health and load ---------------------------------------------------------------------------------------

    def health_problem(self) -> str:
        """A dead KV receiver I/O thread (nccl pair links): transfers into this worker would fail."""
        return self.receiver.io_problem()

    def kv_paths(self) -> dict[str, str]:
        return self.sender.paths() if self.sender is not None else {}  # the sender it moves requests out with

    def load(self) -> WorkerLoad:
        load = super().load()
        load.awaiting_kv = sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KV for r in self.engine.requests.values())
        return load

    def totals(self) -> WorkerCounters:
        counters = super().totals()
        counters.kv_rejected = self.receiver.rejected  # KV-plane messages dropped unread (the receiver counts)
        counters.kv_handshake_refused = self.receiver.handshake_refused  # peers dropped at connect
        return counters

    def has_work(self) -> bool:
        return super().has_work() or bool(self._exports)

    def close(self) -> None:
        self.receiver.close()
        if self.sender is not None:
            self.sender.close()
