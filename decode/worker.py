"""The decode worker: reserves KV for requests, imports their KV from prefill workers, decodes them in one batch.

A thin adapter between the engine's remote-KV API, the transfer receiver and the control plane. A request's state
is the engine's ``Request`` (status WAITING_FOR_REMOTE_KV until the scheduler admits it; ``RequestTiming.remote``
for its stamps), so this file keeps no table of requests. A request's path:
1. ``reserve`` from the router: the engine reserves blocks for the prompt, the first token and the headroom
   (``engine.blocks.reserved_blocks``, the count the router plans with), or refuses at once when they are not free
   (memory is never overcommitted), and the receiver is told to expect the KV into the prompt's blocks. The prompt's
   leading full blocks that this engine's prefix cache holds (a chat's history it just decoded) are shared, not
   reserved anew: ``reserved`` says how many tokens they cover (``cached_tokens``), and only the missing blocks are
   expected, sent and written. ``prefill_here`` instead (the router's choice for a short uncached part) has the
   engine compute the rest itself: no transfer, and the first token comes from here, in the ``tokens`` events.
2. While prefill computes, the receiver (polled without blocking, between steps) checks each arriving layer piece
   and writes it through ``engine.write_remote_kv``, which only writes into that request's reserved prompt blocks.
3. ``start`` from the router brings the first token that prefill sampled (``remote_first_token``); the receiver's
   DONE is ``remote_kv_done``. In whichever order they come, the scheduler admits the request at the next step
   (continuous batching).
4. Each step sends the new tokens of every running request, with their text (detokenized by the engine, continuing
   from the first token's text that the prefill worker sent) and their logprobs if asked for, to the router in one
   message (the first token's logprobs and the prompt's went with the prefill worker's first token); a request's timing
   (``DecodeTiming``, from the engine's record) goes with its first decoded token and with its finish. A request that
   finishes frees its blocks; an abort frees them whatever the state; a failed transfer fails the request
   (``failure_policy: fail``) or, with ``recompute``, has it prefilled here (``remote_kv_failed``), counted either
   way. A reservation whose first token never comes expires (``expire_remote``).

Who reports a failed transfer: this side reports its own failures (``kv_transfer_failed``, policy ``fail``); one the
prefill worker aborted on purpose (``SenderAborted``) stays silent here, since that worker or the router already
told the client why.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
import uuid

from engine.kv_connector import RemoteKV
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestOutput, RequestStatus, RequestTiming, SamplingParams
from transfer.base import KVReceiver, make_receiver
from transfer.errors import SenderAborted
from transfer.state import TransferEvent
from transfer.wire import ModelFingerprint
from worker.messages import (
    Command,
    DecodeTiming,
    ErrorCode,
    PrefillHere,
    Reserve,
    Reserved,
    Start,
    TokenItem,
    Tokens,
    Unreserve,
    WorkerCounters,
    WorkerLoad,
)
from worker.role import Emit, Role, computed_here_item
from worker.runtime import WorkerRuntime
from worker.spec import FailurePolicy, WorkerRole, WorkerSpec

logger = logging.getLogger(__name__)

EXPIRY_CHECK_INTERVAL_S = 0.5  # how often reservations are checked for a first token that never came


class DecodeRole(Role):
    kind = WorkerRole.DECODE

    def __init__(
        self,
        name: str,
        engine: LLMEngine,
        receiver: KVReceiver,
        emit: Emit,
        *,
        failure_policy: FailurePolicy = "fail",
        headroom_tokens: int = 0,
        start_deadline_s: float = 30.0,
        counters: WorkerCounters | None = None,
    ) -> None:
        """``receiver``'s sink must be ``engine.write_remote_kv`` (``from_spec`` builds it so)."""
        super().__init__(name, engine, emit, counters)
        self.receiver = receiver
        self.failure_policy = failure_policy
        self.headroom_tokens = headroom_tokens
        # a reservation whose first token (``start``) has not come this long after it was made is freed: the
        # router lost it or died; the transfer's own deadline bounds the KV, this bounds the rest
        self.start_deadline_s = start_deadline_s
        self._next_expiry_check_s = 0.0
        # the router's attempt that each open reservation answers last (``unreserve`` undoes that attempt only): the
        # one fact about a request the engine does not hold. An entry leaves when the first token comes (an
        # unreserve can no longer apply), when the request ends here (abort, failed transfer, expiry), and in any
        # case with the expiry check once the engine no longer holds the request.
        self._attempts: dict[str, int] = {}
        # reservations this worker prefills itself because the reservation said so (``Reserve.local_prefill_
        # max_tokens``), before the router has the answer: an ``unreserve`` of their attempt still aborts them
        self._local: set[str] = set()

    @classmethod
    def from_spec(cls, spec: WorkerSpec, engine: LLMEngine, emit: Emit) -> DecodeRole:
        receiver = make_receiver(
            spec.transfer_backend,
            ModelFingerprint.from_spec(engine.kv_spec),
            engine.write_remote_kv,
            receiver_address(spec),
            dataclasses.replace(spec.transfer, kv_device=engine.config.device),  # GPU cache: side-stream writes
        )
        return cls(
            spec.name,
            engine,
            receiver,
            emit,
            failure_policy=spec.failure_policy,
            headroom_tokens=spec.reserve_headroom_tokens,
            start_deadline_s=spec.transfer.deadline_s,
        )

    def info(self) -> dict:
        return {"kv_address": self.receiver.address}

    # ---- commands ----------------------------------------------------------------------------------------------

    def handle(self, command: Command, arrival_s: float) -> None:
        if isinstance(command, Reserve):
            self._reserve(
                command.rid, command.prompt, command.params, command.attempt, command.local_prefill_max_tokens
            )
        elif isinstance(command, Unreserve):  # our answer to that attempt came too late; a later attempt's stays
            if self._attempts.get(command.rid) != command.attempt:
                return
            request = self._reservation(command.rid)
            if (request is not None and _remote(request).first_token_id is None) or command.rid in self._local:
                self.abort(command.rid)  # (a local prefill that attempt started: the router sent it elsewhere)
        elif isinstance(command, Start):
            if command.rid not in self.engine.requests:
                raise KeyError(f"request {command.rid!r} has no reservation here")
            self.engine.remote_first_token(command.rid, command.first_token)  # admitted by the next step
            self._attempts.pop(command.rid, None)
        elif isinstance(command, PrefillHere):
            self._prefill_here(command.rid)
        else:
            super().handle(command, arrival_s)

    def _reserve(
        self, rid: str, prompt: list[int], params: SamplingParams, attempt: int = -1, local_max_tokens: int = 0
    ) -> None:
        held = self._reservation(rid)
        if held is not None and _remote(held).kv_failed:
            # its KV failed (recompute policy) before its first token came, and the router reserves it anew: the
            # new reservation replaces it, KV expected again
            self.engine.abort(rid)
            held = None
        if held is None and rid in self._local:
            # a local prefill an earlier attempt started, whose answer the router gave up on (it asks again): the
            # new reservation replaces it
            self.abort(rid)
        if held is None or held.prompt_token_ids != prompt:  # (else the router asks again after our answer came
            # too late: the same reservation is answered again, idempotent)
            if self.engine.reserve_remote(prompt, params, rid, self.headroom_tokens, prefix_cache=True) is None:
                self.counters.reservations_refused += 1
                reason = "max_num_seqs" if self.engine.at_seq_limit() else "kv_full"
                self.emit(Reserved(rid=rid, worker=self.name, ok=False, attempt=attempt, reason=reason))
                return
            held = self.engine.requests[rid]
            missing = self.engine.missing_prompt_blocks(held)  # the prefix-cached blocks are shared, not written
            self.receiver.expect(rid, missing, num_layers=self.engine.kv_spec.num_layers)
        self._attempts[rid] = attempt
        first = held.num_cached_tokens // self.engine.kv_spec.block_size
        # what this worker lacks is short: it computes it now, in this turn of its loop (the router's rule, applied
        # where the cache is, without a second command to wait for); never a reservation already taking its KV
        remote = _remote(held)
        untouched = remote.first_token_id is None and remote.kv_done_s is None and not remote.kv_failed
        local = untouched and 0 < len(prompt) - held.num_cached_tokens <= local_max_tokens
        self.emit(
            Reserved(
                rid=rid,
                worker=self.name,
                ok=True,
                attempt=attempt,
                blocks=held.block_ids[first:],
                kv_address=self.receiver.address,
                cached_tokens=held.num_cached_tokens,
                prefill_local=local,
            )
        )
        if local:
            self._prefill_here(rid, keep_attempt=True)

    def _prefill_here(self, rid: str, keep_attempt: bool = False) -> None:
        """This reservation is computed here: no KV will come, so the receiver stops expecting it (its end,
        reported by ``poll``, finds the request no longer waiting and is ignored), and the engine prefills the
        missing tokens and samples the first token itself. ``keep_attempt``: started by the reservation itself,
        before the router has its answer: an ``unreserve`` of that attempt (the answer came too late) still aborts
        it; after a ``prefill_here`` command the router has it, and none can come."""
        request = self._reservation(rid)
        if request is None:
            raise KeyError(f"request {rid!r} has no open reservation here")
        self.engine.prefill_here(rid)  # raises, changing nothing, for a reservation already taking its KV
        self.receiver.abort(rid, "prefilled on the decode worker")
        if keep_attempt:
            self._local.add(rid)
        else:
            self._attempts.pop(rid, None)  # an unreserve can no longer apply: it is running
        self.counters.local_prefills += 1

    def _reservation(self, rid: str) -> Request | None:
        """The request if it is an open reservation: waiting for its KV or first token, not yet queued to join."""
        request = self.engine.requests.get(rid)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            return None
        return request if _remote(request).ready_s is None else None

    def abort(self, rid: str) -> None:
        request = self.engine.requests.get(rid)
        if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.receiver.abort(rid, "aborted by router")  # its sender is told, and releases its lease
        self._attempts.pop(rid, None)
        self._local.discard(rid)
        self.engine.abort(rid)

    # ---- the loop ----------------------------------------------------------------------------------------------

    def tick(self) -> None:
        self._expire_reservations()
        for event in self.receiver.poll():
            self._transfer_ended(event)
        if self.engine.has_unfinished():
            self._send(self.engine.step())

    def _transfer_ended(self, event: TransferEvent) -> None:
        rid = event.transfer_id
        request = self.engine.requests.get(rid)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            return  # aborted or expired meanwhile: its blocks are already free
        remote = _remote(request)
        if remote.kv_done_s is not None or remote.kv_failed:
            return  # not this transfer's news: the request's own transfer has already ended
        if event.ok:
            self.counters.transfers_ok += 1
            self.counters.transfer_bytes += event.nbytes
            self.engine.remote_kv_done(rid)  # admitted by the next step if its first token is here
            return
        self.counters.transfers_failed += 1
        if self.failure_policy == "recompute":  # the reserved blocks are freed now; prefilled here once started
            self.engine.remote_kv_failed(rid, recompute=True)
            return
        self.engine.remote_kv_failed(rid, recompute=False)  # ends it, no output: the cause is reported here or not
        self._attempts.pop(rid, None)
        if not isinstance(event.error, SenderAborted):
            self.emit_error(rid, f"KV transfer failed: {event.error}", ErrorCode.KV_TRANSFER_FAILED)
        # else the prefill worker gave up on purpose and tells the router why itself (its own error, or the
        # router's abort): reporting the transfer too would race its cause to the client

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        if now < self._next_expiry_check_s:
            return
        self._next_expiry_check_s = now + EXPIRY_CHECK_INTERVAL_S
        for rid in self.engine.expire_remote(self.start_deadline_s):
            logger.warning(
                "%s: reservation %s got no start in %.0f s; freeing it", self.name, rid, self.start_deadline_s
            )
            self.counters.reservations_expired += 1
            self.receiver.abort(rid, "reservation expired")  # a transfer still under way: its sender is told
            self.emit_error(
                rid,
                f"no first token reached the decode worker within {self.start_deadline_s:.0f} s",
                ErrorCode.RESERVATION_EXPIRED,
            )
        for rid in [rid for rid in self._attempts if rid not in self.engine.requests]:
            del self._attempts[rid]
        self._local.intersection_update(self.engine.requests)

    def _send(self, outputs: list[RequestOutput]) -> None:
        items = []
        for output in outputs:
            if output.error is not None:  # finish_reason ERROR (blocks already freed): an error for that request only
                self.counters.errors += 1
                self.emit_error(output.request_id, output.error, ErrorCode.from_engine(output.error_code))
                continue
            if not (output.new_token_ids or output.text_delta or output.finished):
                continue
            if output.timing is not None and output.timing.remote is None:
                # prefilled here (``prefill_here``): it reports as a colocated worker does (its prefill's timing,
                # the prompt's logprobs and prefix-cache hit with the first token, which it sampled itself)
                items.append(computed_here_item(output))
                continue
            # the timing goes with the first decoded token (the second of the request; the first was the prefill
            # worker's) and with the finish, not every step; an admission's output has no token of its own (its text,
            # if any, continues the first token's), so no logprobs either: the first token's went with FirstToken,
            # as did the prompt's (a recompute here after a failed transfer reports none of them again)
            timing = decode_timing(output.timing) if output.finished or output.num_output_tokens == 2 else None
            logprobs = output.logprobs if output.new_token_ids else None
            items.append(
                TokenItem(
                    output.request_id, output.new_token_ids, output.text_delta, output.finish_reason, timing, logprobs
                )
            )
        if items:
            self.emit(Tokens(worker=self.name, items=items))

    # ---- health and load ---------------------------------------------------------------------------------------

    def health_problem(self) -> str:
        """A dead KV receiver I/O thread (nccl pair links): transfers into this worker would fail."""
        return self.receiver.io_problem()

    def load(self) -> WorkerLoad:
        load = super().load()
        load.awaiting_kv = sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KV for r in self.engine.requests.values())
        return load

    def totals(self) -> WorkerCounters:
        counters = super().totals()
        counters.kv_rejected = self.receiver.rejected  # KV-plane messages dropped unread (the receiver counts)
        return counters

    def close(self) -> None:
        self.receiver.close()


def decode_timing(timing: RequestTiming | None) -> DecodeTiming:
    """Where a request's time went here before its first decoded token, from the engine's record (None: not
    reached; a recomputed request has no KV figures)."""
    if timing is None:
        return DecodeTiming()
    return DecodeTiming(
        kv_done_mono=timing.kv_done_mono,
        kv_transfer_s=timing.kv_transfer_s,
        kv_wait_after_first_token_s=timing.kv_wait_after_first_token_s,
        decode_queue_s=timing.decode_queue_s,
        recomputed=timing.recomputed,
    )


def _remote(request: Request) -> RemoteKV:
    remote = request.remote
    assert remote is not None  # every WAITING_FOR_REMOTE_KV request has one (LLMEngine.reserve_remote)
    return remote


def receiver_address(spec: WorkerSpec) -> str:
    """Where the KV receiver binds: a free TCP port, a fresh Unix socket, or an in-process name. ``shm`` and ``auto``
    mark the address ``shm+`` (the receiver offers its node's senders a shared-memory ring; transfer/shm_backend.py):
    ``shm`` (one node) with the control channel on a Unix socket, ``auto`` on TCP, so that senders on other nodes
    reach it too and send inline, as zmq. The sender reads the scheme: ``shm+`` or plain zmq."""
    if spec.transfer_backend == "local":
        return f"local://{spec.name}-{uuid.uuid4().hex[:8]}"
    if spec.transfer_backend == "auto":
        return f"shm+tcp://{spec.runtime.host}:0"
    if spec.transfer_backend == "shm" or spec.zmq_transport == "ipc":
        scheme = "shm+" if spec.transfer_backend == "shm" else ""
        return f"{scheme}ipc://{tempfile.gettempdir()}/pdserve-{spec.name}-{uuid.uuid4().hex[:8]}.sock"
    return f"tcp://{spec.runtime.host}:0"


class DecodeWorker(WorkerRuntime):
    """The decode role in a worker process (sockets, loop, heartbeat)."""

    role: DecodeRole

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec, DecodeRole)

    @property
    def receiver(self) -> KVReceiver:
        return self.role.receiver
