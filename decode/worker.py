"""The decode worker: reserves KV for requests, imports their KV from prefill workers, decodes them in one batch.

A request's path through this worker:
1. ``reserve`` from the router: blocks for the prompt and the first token are reserved (or refused at once when
   they are not free: memory is never overcommitted) and the transfer receiver is told to expect the KV.
2. While prefill computes, the receiver (polled without blocking, between steps) writes arriving layer pieces into
   the reserved blocks, checking each frame.
3. ``start`` from the router brings the first token that prefill sampled. When both the token and the complete KV
   are here, the request joins the running batch between two steps (continuous batching).
4. Each step sends the new tokens of every running request, with their text (detokenized by the engine, continuing
   from the first token's text that the prefill worker sent), to the router in one message. A request that finishes
   (length, EOS, stop) frees its blocks; an abort frees them whatever the state; a failed transfer fails the request
   (``failure_policy: fail``) or, with ``recompute``, prefills it here instead, counted either way.
"""

from __future__ import annotations

import logging
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from worker.messages import (Command, DecodeTiming, ErrorCode, Reserve, Reserved, Start, Stats, TokenItem, Tokens,
                             Unreserve)
from worker.runtime import WorkerRuntime
from worker.spec import WorkerSpec
from engine.request import RequestOutput, SamplingParams
from transfer.base import make_receiver
from transfer.errors import SenderAborted
from transfer.wire import ModelFingerprint

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RemoteRequest:
    prompt: list[int]
    params: SamplingParams
    expected_s: float = field(default_factory=time.monotonic)
    first_token: int | None = None
    start_s: float | None = None
    kv_done_s: float | None = None
    kv_failed: bool = False
    attempt: int = -1  # the router's latest reservation attempt this reservation answers


@dataclass(slots=True)
class PendingTiming:
    """An admitted request's timing until it is sent (with its first decoded token, and again with its finish)."""

    timing: DecodeTiming
    admitted_s: float = field(default_factory=time.monotonic)  # joined the batch (decode_queue_s counts from here)


class DecodeWorker(WorkerRuntime):
    role = "decode"

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)  # self.spec: resolved in this process (device chosen)
        spec = self.spec
        self.fingerprint = ModelFingerprint.from_spec(self.engine.kv_spec)
        self.receiver = make_receiver(
            spec.transfer_backend, self.fingerprint, self._write_kv, receiver_address(spec), spec.transfer
        )
        self.failure_policy = spec.failure_policy
        self.headroom_tokens = spec.reserve_headroom_tokens
        # a reservation whose first token (``start``) has not come this long after it was made is freed: the
        # router lost it or died; the transfer's own deadline bounds the KV, this bounds the rest
        self.start_deadline_s = spec.transfer.deadline_s
        self._next_expiry_check_s = 0.0
        self.remote: dict[str, RemoteRequest] = {}
        self.timing: dict[str, PendingTiming] = {}

    def info(self) -> dict:
        return {**super().info(), "kv_address": self.receiver.address}

    def has_work(self) -> bool:
        return self.engine.has_unfinished() or bool(self.remote)

    def _write_kv(self, transfer_id: str, layer: int, dst_block_ids: list[int], k, v) -> None:
        self.engine.write_kv_blocks(layer, dst_block_ids, k, v)

    def handle(self, command: Command, arrival_s: float) -> None:
        if isinstance(command, Reserve):
            self._reserve(command.rid, command.prompt, command.params, command.attempt)
        elif isinstance(command, Unreserve):  # our answer to that attempt came too late; a later attempt's stays
            remote = self.remote.get(command.rid)
            if remote is not None and remote.first_token is None and remote.attempt == command.attempt:
                self.abort(command.rid)
        elif isinstance(command, Start):
            remote = self.remote.get(command.rid)
            if remote is None:
                raise KeyError(f"request {command.rid!r} has no reservation here")
            remote.first_token = command.first_token
            remote.start_s = time.monotonic()
            self._maybe_admit(command.rid)
        else:
            super().handle(command, arrival_s)

    def _reserve(self, rid: str, prompt: list[int], params: SamplingParams, attempt: int = -1) -> None:
        held = self.engine.requests.get(rid)
        if rid in self.remote and held is not None and held.prompt_token_ids == prompt:
            # the router asks again after our answer came too late: answer again with the same blocks (idempotent)
            blocks: list[int] | None = list(held.block_ids)
        else:
            blocks = self.engine.reserve_remote(prompt, params, rid, self.headroom_tokens)
            if blocks is not None:
                num_src = self.engine.block_manager.blocks_for(len(prompt))
                self.receiver.expect(rid, blocks[:num_src], num_layers=self.engine.kv_spec.num_layers)
                self.remote[rid] = RemoteRequest(prompt, params)
        if blocks is None:
            self.counters.reservations_refused += 1
            self.emit(Reserved(rid=rid, worker=self.name, ok=False, attempt=attempt, reason="kv_full"))
            return
        self.remote[rid].attempt = attempt
        self.emit(Reserved(rid=rid, worker=self.name, ok=True, attempt=attempt, blocks=blocks,
                           kv_address=self.receiver.address))

    def _maybe_admit(self, rid: str) -> None:
        remote = self.remote[rid]
        if remote.first_token is None:
            return
        if remote.kv_failed:
            self._recompute(rid, remote)
            return
        if remote.kv_done_s is None:
            return
        del self.remote[rid]
        self.timing[rid] = PendingTiming(DecodeTiming(
            kv_done_mono=remote.kv_done_s,
            kv_transfer_s=remote.kv_done_s - remote.expected_s,
            kv_wait_after_first_token_s=max(0.0, remote.kv_done_s - remote.start_s),
        ))
        # the first token and its text were already streamed by the router: only a finish needs reporting here
        self._send(self.engine.complete_remote(rid, remote.first_token), skip_first=True)

    def _recompute(self, rid: str, remote: RemoteRequest) -> None:
        """failure_policy=recompute: prefill here what the transfer failed to bring, first token included."""
        del self.remote[rid]
        self.counters.recomputes += 1
        self.timing[rid] = PendingTiming(DecodeTiming(recomputed=True))
        # the first token counts towards max_tokens (and may finish the request) and its text is not sent again
        self._send(self.engine.add_resumed_request(remote.prompt, remote.params, rid, remote.first_token),
                   skip_first=True)

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        if now < self._next_expiry_check_s:
            return
        self._next_expiry_check_s = now + 0.5
        for rid, remote in list(self.remote.items()):
            if remote.first_token is None and now - remote.expected_s > self.start_deadline_s:
                logger.warning("%s: reservation %s got no start in %.0f s; freeing it", self.name, rid,
                               self.start_deadline_s)
                self.counters.reservations_expired += 1
                self.abort(rid)
                self.emit_error(rid, f"no first token reached the decode worker within {self.start_deadline_s:.0f} s",
                                ErrorCode.RESERVATION_EXPIRED)

    def tick(self) -> None:
        self._expire_reservations()
        for event in self.receiver.poll():
            remote = self.remote.get(event.transfer_id)
            if remote is None:
                continue  # aborted meanwhile: its blocks are already free
            if event.ok:
                self.counters.transfers_ok += 1
                self.counters.transfer_bytes += event.nbytes
                remote.kv_done_s = time.monotonic()
                self._maybe_admit(event.transfer_id)
                continue
            self.counters.transfers_failed += 1
            rid = event.transfer_id
            self.engine.abort(rid)  # frees the reserved blocks
            if self.failure_policy == "recompute":
                remote.kv_failed = True
                self._maybe_admit(rid)
            elif isinstance(event.error, SenderAborted):
                # the prefill worker gave up on purpose and tells the router why itself (its own error, or the
                # router's abort): reporting the transfer too would race its cause to the client
                del self.remote[rid]
            else:
                del self.remote[rid]
                self.emit_error(rid, f"KV transfer failed: {event.error}", ErrorCode.KV_TRANSFER_FAILED)
        if self.engine.has_unfinished():
            self._send(self.engine.step())

    def _send(self, outputs: list[RequestOutput], skip_first: bool = False) -> None:
        items = []
        for output in outputs:
            if output.error is not None:  # finish_reason ERROR (blocks already freed): an error for that request only
                self.timing.pop(output.request_id, None)
                self.counters.errors += 1
                self.emit_error(output.request_id, output.error, ErrorCode.from_engine(output.error_code))
                continue
            tokens = [] if skip_first else output.new_token_ids
            timing = None
            if output.finished or output.request_id in self.timing:
                timing = self._timing(output.request_id, output.finished)
            if tokens or output.text_delta or output.finished:
                items.append(TokenItem(output.request_id, tokens, output.text_delta, output.finish_reason, timing))
        if items:
            self.emit(Tokens(worker=self.name, items=items))

    def _timing(self, rid: str, finished: bool) -> DecodeTiming | None:
        """The request's timing, sent with its first decoded token and again with its finish, not every step."""
        pending = self.timing.get(rid)
        if pending is None:
            return None
        first = pending.timing.decode_queue_s is None
        if first:
            pending.timing.decode_queue_s = time.monotonic() - pending.admitted_s
        if finished:
            self.timing.pop(rid, None)
        elif not first:
            return None
        return pending.timing

    def abort(self, rid: str) -> None:
        if self.remote.pop(rid, None) is not None:
            self.receiver.abort(rid, "aborted by router")
        self.timing.pop(rid, None)
        self.engine.abort(rid)

    def health_problem(self) -> str:
        """A dead KV receiver I/O thread (nccl pair links): transfers into this worker would fail."""
        return self.receiver.io_problem()

    def stats(self) -> Stats:
        stats = super().stats()
        stats.load.awaiting_kv = len(self.remote)
        stats.counters.kv_rejected = self.receiver.rejected  # KV-plane messages dropped unread (the receiver counts)
        return stats

    def close(self) -> None:
        self.receiver.close()
        super().close()


def receiver_address(spec: WorkerSpec) -> str:
    """Where the KV receiver binds: a free TCP port, a fresh Unix socket, or an in-process name."""
    if spec.transfer_backend == "local":
        return f"local://{spec.name}-{uuid.uuid4().hex[:8]}"
    if spec.zmq_transport == "ipc":
        return f"ipc://{tempfile.gettempdir()}/pdserve-{spec.name}-{uuid.uuid4().hex[:8]}.sock"
    return f"tcp://{spec.runtime.host}:0"
