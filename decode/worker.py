"""The decode worker: reserves KV for requests, imports their KV from prefill workers, decodes them in one batch.

A request's state is the engine's ``Request`` (WAITING_FOR_REMOTE_KV until admitted); this role keeps no table.
``reserve`` takes blocks for the prompt, first token and headroom (sharing what the prefix cache holds) or refuses at
once; a short rest (``local_prefill_max_tokens``) is computed here, else the receiver expects the missing blocks.
``start`` brings the first token; with the KV complete too, the next step admits the request, and every step sends
the running requests' tokens in one ``tokens`` event. ``migrate_in``, ``migrate_send``, ``freeze``,
``migrate_tail`` and ``resume`` move a running request to another decode worker by pre-copy. Failures, expiry and
moves step by step: docs/request-lifecycle.md and docs/architecture.md ("Failure handling", "Moving running requests").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import tempfile
import time
import uuid
from collections.abc import Callable

import torch

from engine.llm_engine import LLMEngine
from engine.request import RemoteKV, Request, RequestStatus, SamplingParams
from transfer.base import KVReceiver, KVSender, make_receiver, make_sender
from transfer.errors import SenderAborted
from transfer.inbound import Sink
from transfer.kv_segment import KVSegment
from transfer.pair_path import gpu_uuid
from transfer.shm_ring import ShmUnavailable
from transfer.state import TransferEvent
from transfer.wire import ModelFingerprint
from worker.messages import (
    PRECOPY_SUFFIX,
    Command,
    ErrorCode,
    Freeze,
    Frozen,
    Migrated,
    MigrateIn,
    MigrateSend,
    MigrateTail,
    RefusalReason,
    Reserve,
    Reserved,
    Resume,
    Start,
    WorkerCounters,
    WorkerLoad,
    precopy_transfer_id,
)
from worker.role import Emit, Role
from worker.spec import FailurePolicy, WorkerRole, WorkerSpec

logger = logging.getLogger(__name__)

EXPIRY_CHECK_INTERVAL_S = 0.5  # how often reservations are checked for a first token that never came
# a pre-copy ships its layers over this many loop turns: the worker's other streams pay a share of the copy in each
# of a few steps instead of all of it in one, and the move waits only a few steps for it
PRECOPY_TURNS = 4


@dataclasses.dataclass(slots=True)
class _Precopy:
    """A running request's full blocks on their way to the worker it moves to, a few layers per loop turn."""

    rid: str
    src: list[int]  # its blocks here
    dst: list[int]  # the target's
    layer: int = 0  # the next to send


def kv_sink(engine: LLMEngine) -> Sink:
    """The receiver's sink: arrived KV into the engine's reserved blocks, a move's pre-copy into its request's."""

    def sink(transfer_id: str, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        engine.write_remote_kv(transfer_id.removesuffix(PRECOPY_SUFFIX), layer, block_ids, k, v)

    return sink


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
        make_migration_sender: Callable[[], KVSender] | None = None,
    ) -> None:
        """``receiver``'s sink must be ``kv_sink(engine)``; ``make_migration_sender`` makes the sender of running
        requests' KV to other decode workers at the first move (None: this worker moves nothing out)."""
        super().__init__(name, engine, emit, counters)
        self.receiver = receiver
        self._make_sender = make_migration_sender
        self.sender: KVSender | None = None
        self._moving: dict[str, str] = {}  # transfer id (the target's request id) -> the frozen request's id here
        self._precopies: dict[str, _Precopy] = {}  # transfer id -> a running request's full blocks on their way
        self.failure_policy = failure_policy
        self.headroom_tokens = headroom_tokens
        # a reservation still without its first token this long after it was made is freed: the router lost it
        self.start_deadline_s = start_deadline_s
        self._next_expiry_check_s = 0.0

    @classmethod
    def from_spec(cls, spec: WorkerSpec, engine: LLMEngine, emit: Emit) -> DecodeRole:
        fingerprint = ModelFingerprint.from_spec(engine.handoff_spec)
        receiver = make_receiver(
            spec.transfer_backend,
            fingerprint,
            kv_sink(engine),
            receiver_address(spec),
            dataclasses.replace(spec.transfer, kv_device=engine.config.device),  # GPU cache: side-stream writes
            shared_kv_cache(spec, engine),
        )
        return cls(
            spec.name,
            engine,
            receiver,
            emit,
            failure_policy=spec.failure_policy,
            headroom_tokens=spec.reserve_headroom_tokens,
            start_deadline_s=spec.transfer.deadline_s,
            # the pool's backend, as a prefill worker's sender
            make_migration_sender=functools.partial(make_sender, spec.transfer_backend, fingerprint, spec.transfer),
        )

    def info(self) -> dict:
        return {"kv_address": self.receiver.address}

    # ---- commands ----------------------------------------------------------------------------------------------

    def handle(self, command: Command, arrival_s: float) -> None:
        if isinstance(command, Reserve):
            self._reserve(command.rid, command.prompt, command.params, command.local_prefill_max_tokens)
        elif isinstance(command, Start):
            if command.rid not in self.engine.requests:
                raise KeyError(f"request {command.rid!r} has no reservation here")
            self.engine.remote_first_token(command.rid, command.first_token)
        elif isinstance(command, Freeze):
            self._freeze(command.rid)
        elif isinstance(command, Resume):
            self._resume(command.rid)
        elif isinstance(command, MigrateIn):
            self._migrate_in(command)
        elif isinstance(command, MigrateTail):
            self._migrate_tail(command)
        elif isinstance(command, MigrateSend):
            self._migrate_send(command)
        else:
            super().handle(command, arrival_s)

    # ---- migration ---------------------------------------------------------------------------------------------

    def _freeze(self, rid: str) -> None:
        """Stop the request between steps; every token it made went out in this turn's ``tokens`` events already."""
        try:
            tokens, computed = self.engine.freeze(rid)
        except (KeyError, ValueError) as exc:  # gone, finished or still prefilling: it runs on, the router learns why
            self.emit(Frozen(rid=rid, worker=self.name, ok=False, reason=str(exc)))
            return
        self.emit(Frozen(rid=rid, worker=self.name, ok=True, output_token_ids=tokens, num_computed_tokens=computed))

    def _resume(self, rid: str) -> None:
        """Run the request on here: a frozen one whose move was called off, or a moved one whose KV will not come
        (its source gave up or died: it is recomputed from its tokens now, not at the transfer's deadline)."""
        request = self.engine.requests.get(rid)
        if request is None:
            raise KeyError(f"unknown request {rid!r}")
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KV and _remote(request).resume_at is not None:
            self.receiver.abort(rid, "the source gave up the move")
            self.engine.remote_kv_failed(rid, recompute=True)
            self.counters.transfers_failed += 1
            return
        self.engine.resume(rid)

    def _migrate_in(self, command: MigrateIn) -> None:
        engine, rid = self.engine, command.rid
        precopy = command.precopy_blocks
        blocks = engine.reserve_migration(
            command.prompt, command.params, rid, command.num_computed_tokens, precopy, self.headroom_tokens
        )
        if blocks is None:
            self.counters.reservations_refused += 1
            reason: RefusalReason = "max_num_seqs" if engine.at_seq_limit() else "kv_full"
            self.emit(Reserved(rid=rid, worker=self.name, ok=False, reason=reason))
            return
        if precopy:
            self.receiver.expect(precopy_transfer_id(rid), blocks[:precopy], num_layers=engine.kv_spec.num_layers)
        self.emit(Reserved(rid=rid, worker=self.name, ok=True, blocks=blocks, kv_address=self.receiver.address))

    def _migrate_tail(self, command: MigrateTail) -> None:
        engine, rid = self.engine, command.rid
        self.receiver.abort(precopy_transfer_id(rid), "the tail comes")  # one still under way failed its purpose
        tail = engine.adopt_migrated(
            rid, command.output_token_ids, command.num_computed_tokens, command.first_block, self.headroom_tokens
        )
        if tail is None:
            self.counters.reservations_refused += 1
            self.emit(Reserved(rid=rid, worker=self.name, ok=False, reason="kv_full"))
            return
        self.receiver.expect(rid, tail, num_layers=engine.kv_spec.num_layers)
        self.counters.migrations_in += 1
        self.emit(Reserved(rid=rid, worker=self.name, ok=True, blocks=tail, kv_address=self.receiver.address))

    def _migrate_send(self, command: MigrateSend) -> None:
        """Pre-copy: begin shipping the running request's first full blocks (``_precopy_step``, over a few turns).
        Tail: every layer of the frozen request's blocks from ``first_block``, then the transfer's end (``tick``)."""
        engine, rid = self.engine, command.rid
        num_blocks = len(command.dst_blocks) if command.precopy else None
        src = engine.kv_blocks(rid, command.first_block, num_blocks)
        if len(command.dst_blocks) < len(src):
            raise ValueError(f"the target reserved {len(command.dst_blocks)} blocks, the request fills {len(src)}")
        sender = self._migration_sender()
        dst = list(command.dst_blocks[: len(src)])
        if command.precopy:
            transfer_id = precopy_transfer_id(command.target_rid)
            sender.begin(transfer_id, command.kv_address)
            self._precopies[transfer_id] = _Precopy(rid, list(src), dst)
            return
        target = command.target_rid
        sender.begin(target, command.kv_address)
        self._moving[target] = rid
        try:
            index = engine.kv_cache.block_index(src)
            for layer in range(engine.kv_spec.num_layers):
                k, v = engine.kv_cache.read_blocks(layer, index)
                sender.send_layer(target, layer, dst, k, v)
            sender.finish(target)
        except Exception as exc:  # noqa: BLE001 - the transfer ends failed (poll reports it); the request stays frozen
            logger.warning("%s: moving %s failed: %s", self.name, rid, exc)
            sender.abort(target, f"migration failed: {exc}")

    def _migration_sender(self) -> KVSender:
        if self.sender is None:
            if self._make_sender is None:
                raise ValueError("this decode worker has no KV sender: it moves no request out")
            self.sender = self._make_sender()
        return self.sender

    def _precopy_step(self) -> None:
        """The next layers of each pre-copy under way (a ``PRECOPY_TURNS``th of them). The blocks are full, so their
        KV stays as it is while the request decodes on; one that left them (finished, aborted, preempted) ends its
        pre-copy failed."""
        sender, engine = self.sender, self.engine
        num_layers = engine.kv_spec.num_layers
        for transfer_id, job in list(self._precopies.items()):
            if job.layer == num_layers or sender is None:
                continue  # all sent: its end comes from the sender
            request = engine.requests.get(job.rid)
            if (
                request is None
                or request.status not in (RequestStatus.RUNNING, RequestStatus.FROZEN)
                or request.block_ids[: len(job.src)] != job.src
            ):
                sender.abort(transfer_id, "the request left its blocks")
                continue
            try:
                index = engine.kv_cache.block_index(job.src)
                for layer in range(job.layer, min(num_layers, job.layer + -(-num_layers // PRECOPY_TURNS))):
                    k, v = engine.kv_cache.read_blocks(layer, index)
                    if not sender.send_layer(transfer_id, layer, job.dst, k, v):  # failed, or its queue stayed full
                        raise RuntimeError(f"layer {layer} could not be queued")
                    job.layer = layer + 1
                if job.layer == num_layers:
                    sender.finish(transfer_id)
            except Exception as exc:  # noqa: BLE001 - reported by poll; the request decodes on here
                logger.warning("%s: pre-copying %s failed: %s", self.name, job.rid, exc)
                sender.abort(transfer_id, f"pre-copy failed: {exc}")

    def _migration_ended(self, transfer_id: str, ok: bool, nbytes: int, error: str) -> None:
        precopy = self._precopies.pop(transfer_id, None)
        rid = precopy.rid if precopy is not None else self._moving.pop(transfer_id)
        if ok:
            self.counters.migration_bytes += nbytes
            if precopy is None:
                self.counters.migrations_out += 1
                if rid in self.engine.requests:
                    self.engine.release(rid)
        self.emit(Migrated(rid=rid, worker=self.name, ok=ok, precopy=precopy is not None, nbytes=nbytes, error=error))

    def _reserve(self, rid: str, prompt: list[int], params: SamplingParams, local_max_tokens: int = 0) -> None:
        engine = self.engine
        if engine.reserve_remote(prompt, params, rid, self.headroom_tokens, prefix_cache=True) is None:
            self.counters.reservations_refused += 1
            reason: RefusalReason = "max_num_seqs" if engine.at_seq_limit() else "kv_full"
            self.emit(Reserved(rid=rid, worker=self.name, ok=False, reason=reason))
            return
        held = engine.requests[rid]
        uncached = len(prompt) - held.num_cached_tokens
        local = 0 < uncached <= local_max_tokens
        if not local:
            self.receiver.expect(rid, engine.missing_prompt_blocks(held), num_layers=engine.kv_spec.num_layers)
        first = held.num_cached_tokens // engine.kv_spec.block_size
        self.emit(
            Reserved(
                rid=rid,
                worker=self.name,
                ok=True,
                blocks=held.block_ids[first:],
                kv_address=self.receiver.address,
                cached_tokens=held.num_cached_tokens,
                prefill_local=local,
            )
        )
        if local:  # computed now, in this turn of the loop; its first token comes in the tokens events
            engine.prefill_here(rid)
            self.counters.local_prefills += 1

    def abort(self, rid: str) -> None:
        request = self.engine.requests.get(rid)
        if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self._stop_transfers(rid, "aborted by router")
        self.engine.abort(rid)

    # ---- the loop ----------------------------------------------------------------------------------------------

    def tick(self) -> None:
        self._expire_reservations()
        for event in self.receiver.poll():
            self._transfer_ended(event)
        if self.sender is not None:
            self._precopy_step()
            for sent in self.sender.poll():
                if sent.transfer_id in self._moving or sent.transfer_id in self._precopies:
                    error = "" if sent.ok else str(sent.error)
                    self._migration_ended(sent.transfer_id, sent.ok, sent.nbytes, error)
        if self.engine.has_unfinished():
            self.emit_outputs(self.engine.step())

    def _stop_transfers(self, rid: str, reason: str) -> None:
        """Fail what is still coming for a reservation (a move's pre-copy too): each sender is told, and releases
        its lease; nothing lands in the blocks once they are free."""
        self.receiver.abort(rid, reason)
        self.receiver.abort(precopy_transfer_id(rid), reason)

    def _transfer_ended(self, event: TransferEvent) -> None:
        rid = event.transfer_id
        # a move's first blocks: the rest comes with its tail (or all, if these failed)
        if rid.endswith(PRECOPY_SUFFIX):
            moving = self.engine.requests.get(rid.removesuffix(PRECOPY_SUFFIX))
            if event.ok and moving is not None and moving.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                self.engine.precopy_done(moving.request_id)
                self.counters.transfer_bytes += event.nbytes
            return
        request = self.engine.requests.get(rid)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            return  # aborted or expired meanwhile: its blocks are already free
        remote = _remote(request)
        if remote.kv_done_s is not None or remote.kv_failed:
            return  # not this transfer's news: the request's own transfer has already ended
        if event.ok:
            self.counters.transfers_ok += 1
            self.counters.transfer_bytes += event.nbytes
            self.engine.remote_kv_done(rid)
            return
        self.counters.transfers_failed += 1
        if self.failure_policy == "recompute" or remote.resume_at is not None:  # a moved request has its tokens here
            self.engine.remote_kv_failed(rid, recompute=True)
            return
        self.engine.remote_kv_failed(rid, recompute=False)  # ends it, no output: the cause is reported here or not
        if not isinstance(event.error, SenderAborted):
            self.emit_error(rid, f"KV transfer failed: {event.error}", ErrorCode.KV_TRANSFER_FAILED)
        # else the prefill worker gave up on purpose and tells the router why itself

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
            self._stop_transfers(rid, "reservation expired")
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
        return counters

    def has_work(self) -> bool:
        return super().has_work() or bool(self._moving)

    def close(self) -> None:
        self.receiver.close()
        if self.sender is not None:
            self.sender.close()


def _remote(request: Request) -> RemoteKV:
    remote = request.remote
    assert remote is not None  # every WAITING_FOR_REMOTE_KV request has one (LLMEngine.reserve_remote)
    return remote


def shared_kv_cache(spec: WorkerSpec, engine: LLMEngine) -> KVSegment | None:
    """The engine's cache offered to same-node senders, which write KV in place (transfer/direct_path.py): a CPU cache
    moved into shared memory (shm, auto), or a GPU cache's CUDA IPC handles (nccl, shm, auto); one rank holding every
    head. None: a ring, a pair group or frames instead."""
    cache = engine.kv_cache
    on_gpu = cache.kv[0].device.type == "cuda"
    backends = ("nccl", "shm", "auto") if on_gpu else ("shm", "auto")
    if spec.transfer_backend not in backends or not spec.transfer.direct_write or engine.handoff_spec != engine.kv_spec:
        return None
    fp, num_blocks = ModelFingerprint.from_spec(engine.kv_spec), cache.kv[0].shape[1]
    try:
        if on_gpu:
            cfg = dataclasses.replace(spec.transfer, device=engine.config.device)
            return KVSegment(fp, num_blocks, device_layers=cache.kv, gpu=gpu_uuid(cfg))
        segment = KVSegment(fp, num_blocks)
    except (ShmUnavailable, ValueError) as e:
        logger.warning("the KV cache is not offered to same-node senders (a ring or a pair group instead): %s", e)
        return None
    cache.rehome(segment.layers)
    return segment


def receiver_address(spec: WorkerSpec) -> str:
    """Where the KV receiver binds: a free TCP port, a fresh Unix socket, or an in-process name. ``shm+`` (read by
    the sender) offers the node's senders a shared-memory ring (transfer/ring_path.py): ``shm`` (one node) with its
    control channel on a Unix socket, ``auto`` on TCP so that senders on other nodes reach it too, inline as zmq."""
    if spec.transfer_backend == "local":
        return f"local://{spec.name}-{uuid.uuid4().hex[:8]}"
    if spec.transfer_backend == "auto":
        return f"shm+tcp://{spec.runtime.host}:0"
    if spec.transfer_backend == "shm" or spec.zmq_transport == "ipc":
        scheme = "shm+" if spec.transfer_backend == "shm" else ""
        return f"{scheme}ipc://{tempfile.gettempdir()}/pdserve-{spec.name}-{uuid.uuid4().hex[:8]}.sock"
    return f"tcp://{spec.runtime.host}:0"
