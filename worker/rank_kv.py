"""A worker's KV plane across its tensor-parallel ranks: every hand-off in parts, each rank sending and taking its
own heads.

A hand-off between a worker of S ranks and one of R ranks is split by ``engine.tensor_parallel.handoff_parts``: one
part per (sender rank, receiver rank) pair with heads in common, each part a transfer of the KV plane between those
two ranks (its id ``handoff#r.s``; the hand-off's own id when S = R = 1), so no byte crosses a rank 0 it does not
belong to. ``RankKV`` is one rank's endpoints: a receiver holding that rank's heads, a sender per receiving rank's
fingerprint, and the parts under way here. Rank 0 speaks for the worker (``worker.handoff_join``: what the roles use),
telling the other ranks what to do through the step channel's control messages defined here (``Expect``, ``Begin``,
``ExportHeld``, ``Finish``, ``Abort``, ``Poll``: msgspec, in order with the steps) and joining every part's end into
one event per hand-off; the first part to fail ends the hand-off and aborts the others. The other
ranks' receivers are polled by a thread of their own, so their arrivals never wait for rank 0; the KV they send
streams from inside their forward (``RankKV.export``, the follower's layer hook) or, for a move, between steps
(``ExportHeld``). A worker's receiver address is every rank's, joined by ``|``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated

import msgspec
import torch

from engine.kv_cache import KVCache
from engine.tensor_parallel import (
    ExportSpan,
    HandoffPart,
    HeadSplit,
    export_slot,
    handoff_parts,
    head_split,
)
from transfer.base import KVReceiver, KVSender, make_receiver, make_sender
from transfer.config import TransferConfig
from transfer.errors import ProtocolError, TransferError, error_from_code
from transfer.inbound import Sink
from transfer.kv_segment import KVSegment
from transfer.pair_path import gpu_uuid
from transfer.shm_ring import ShmUnavailable
from transfer.state import TransferEvent, TransferState
from transfer.wire import MAX_BATCH_PIECES, ModelFingerprint
from worker.spec import WorkerSpec

logger = logging.getLogger(__name__)

MAX_RANKS = 64
POLLER_WAIT_S = 0.001  # a follower's receiver thread: the longest it waits for an arrival before polling again


@dataclasses.dataclass(frozen=True, slots=True)
class HandoffLayout:
    """What both ends of a hand-off compute its parts from: the model's KV fingerprint and attention heads, and this
    end's degree (the ways its ranks cut the heads), rank and ranks (the degree, or more that each hold every head)."""

    whole: ModelFingerprint  # every KV head of the model
    num_heads: int  # the model's attention (query) heads: where a replicated KV head lies (engine.tensor_parallel)
    degree: int = 1
    rank: int = 0
    ranks: int = 1

    def __post_init__(self) -> None:
        if self.degree not in (1, self.ranks):
            raise ValueError(
                f"{self.ranks} ranks cut the heads {self.ranks} ways or hold them whole, not {self.degree}"
            )

    def fingerprint(self, degree: int, rank: int) -> ModelFingerprint:
        """The fingerprint of rank ``rank`` of a worker of ``degree`` ranks: its slice of the model's heads."""
        if degree == 1:
            return self.whole
        split = head_split(self.num_heads, self.whole.num_kv_heads, degree, rank)
        return self.whole.slice(split.kv_start, split.kv_heads)

    def parts(self, sender_degree: int, receiver_degree: int, receiver_ranks: int | None = None) -> list[HandoffPart]:
        return _parts(self.num_heads, self.whole.num_kv_heads, sender_degree, receiver_degree, receiver_ranks)


@functools.lru_cache(maxsize=64)
def _parts(
    num_heads: int, num_kv_heads: int, sender_degree: int, receiver_degree: int, receiver_ranks: int | None
) -> list[HandoffPart]:
    return handoff_parts(num_heads, num_kv_heads, sender_degree, receiver_degree, receiver_ranks)


def part_id(transfer_id: str, part: HandoffPart, num_parts: int) -> str:
    """The KV plane's id of one part of a hand-off: the hand-off's own when it has one part (degree 1 to degree 1)."""
    return transfer_id if num_parts == 1 else f"{transfer_id}#{part.receiver_rank}.{part.sender_rank}"


# ---- the control messages rank 0 sends the other ranks (engine.tensor_parallel.StepChannel.control) -----------------


class Side(enum.Enum):
    SEND = "send"
    RECEIVE = "receive"


class Hello(msgspec.Struct, tag="hello"):
    """Answered with the rank's receiver address ("" without one)."""


class Expect(msgspec.Struct, tag="expect"):
    transfer_id: str
    blocks: list[int]
    num_layers: int
    deadline_s: float | None
    leading_run: bool
    source_degree: Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]


class Begin(msgspec.Struct, tag="begin"):
    transfer_id: str
    addresses: list[str]  # the receiving worker's ranks
    receiver_degree: Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]  # the ways they cut the heads (KVAddress)
    dst_blocks: list[int]  # where the KV streamed from the forward goes: logical block first_block + i onto dst[i]
    first_block: int


class ExportHeld(msgspec.Struct, tag="export_held"):
    """Blocks ``src_blocks`` (physical) of layers [layer_start, layer_end) onto the receiver's ``dst_blocks``."""

    transfer_id: str
    src_blocks: list[int]
    dst_blocks: list[int]
    layer_start: int
    layer_end: int


class Finish(msgspec.Struct, tag="finish"):
    transfer_id: str


class Abort(msgspec.Struct, tag="abort"):
    transfer_id: str
    side: Side
    reason: str


class Poll(msgspec.Struct, tag="poll"):
    """Answered with the news of the rank's parts on ``side`` that ended since the last poll."""

    side: Side


Control = Hello | Expect | Begin | ExportHeld | Finish | Abort | Poll
_control = msgspec.msgpack.Decoder(Control)
_encoder = msgspec.msgpack.Encoder()


def encode_control(message: Control | list[PartNews]) -> bytes:
    """A control message for the other ranks (or a follower's answer to a ``Poll``), as the step channel carries it."""
    return _encoder.encode(message)


class PartNews(msgspec.Struct, array_like=True):
    """One part's end on another rank, as rank 0 reads it (a ``TransferEvent``, the error by its code)."""

    part_id: str
    ok: bool
    nbytes: int
    elapsed_s: float
    num_blocks: int
    error_code: str = ""
    error_message: str = ""
    from_peer: bool = False

    @classmethod
    def of(cls, event: TransferEvent) -> PartNews:
        error = event.error
        code, message = (error.code, str(error)) if error is not None else ("", "")
        peer = bool(error is not None and error.from_peer)
        return cls(event.transfer_id, event.ok, event.nbytes, event.elapsed_s, event.num_blocks, code, message, peer)

    def event(self) -> TransferEvent:
        error = None
        if not self.ok:
            error = error_from_code(self.error_code, self.error_message)
            error.from_peer = self.from_peer
        state = TransferState.DONE if self.ok else TransferState.FAILED
        return TransferEvent(self.part_id, state, error, self.nbytes, self.elapsed_s, self.num_blocks)


_news = msgspec.msgpack.Decoder(list[PartNews])


def decode_news(answer: bytes) -> list[PartNews]:
    """A follower's answer to a ``Poll``."""
    return _news.decode(answer)


# ---- one rank's endpoints ----------------------------------------------------------------------------------------


# (hand-off id, layer, block ids, k, v, heads): a rank's arrived KV into its cache
LandKV = Callable[[str, int, list[int], torch.Tensor, torch.Tensor, "tuple[int, int] | None"], None]


@dataclasses.dataclass(slots=True)
class _Outbound:
    """A hand-off this rank sends its heads of: its parts from here, and where streamed KV goes."""

    parts: list[tuple[str, HandoffPart, KVSender]]  # (part id, part, the sender for its receiver's fingerprint)
    dst_blocks: list[int]
    first_block: int
    receiver_heads: list[int]  # each receiving rank's count of heads


class RankKV:
    """One rank's KV-plane endpoints for its worker's hand-offs: ``receiver`` (made with this object's sink, which
    maps a part's id to its hand-off and calls ``land``) and a sender per receiving rank's fingerprint
    (``make_sender``); each call names a hand-off, and the parts of it on this rank are its own to run. On a rank
    other than 0 ``control`` applies rank 0's messages and ``export`` sends its heads of a step's exported blocks."""

    def __init__(
        self,
        layout: HandoffLayout,
        kv_cache: KVCache | None = None,
        *,
        make_receiver: Callable[[ModelFingerprint, Sink], KVReceiver] | None = None,
        land: LandKV | None = None,
        make_sender: Callable[[ModelFingerprint], KVSender] | None = None,
    ) -> None:
        self.layout = layout
        self.kv_cache = kv_cache
        self.fingerprint = layout.fingerprint(layout.degree, layout.rank)
        self._land = land
        self._make_sender = make_sender
        self._senders: dict[ModelFingerprint, KVSender] = {}
        self._outbound: dict[str, _Outbound] = {}  # by hand-off id
        self._slots: dict[int, str] = {}  # a streamed export's slot (engine.tensor_parallel.export_slot) -> hand-off
        self._part_of: dict[str, str] = {}  # an inbound part's id -> its hand-off's
        self._inbound: dict[str, list[str]] = {}  # hand-off id -> its inbound parts here not yet ended
        self._lock = threading.Lock()  # the receiver: a follower's poller thread and rank 0's messages
        self._received: list[TransferEvent] = []  # a follower's: parts the poller saw end, until rank 0 asks
        self._failed_sends: list[TransferEvent] = []  # outbound parts that could not begin here
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self.receiver = make_receiver(self.fingerprint, self._sink) if make_receiver is not None else None
        if make_sender is not None:  # the sender to workers of one rank, the common peer, made at start: its I/O
            try:  # thread's health is the worker's from then on (a dead one degrades the worker before any hand-off)
                self._sender(layout.fingerprint(1, 0))
            except BaseException:
                self.close()
                raise

    # ---- receiving -----------------------------------------------------------------------------------------------

    def _sink(
        self,
        part: str,
        layer: int,
        block_ids: list[int],
        k: torch.Tensor,
        v: torch.Tensor,
        heads: tuple[int, int] | None = None,
        /,
    ) -> None:
        handoff = self._part_of.get(part)
        if handoff is None or self._land is None:
            raise ValueError(f"KV for transfer {part!r}, which no hand-off here expects")
        self._land(handoff, layer, block_ids, k, v, heads)

    def expect(self, message: Expect) -> list[str]:
        """This rank's parts of an inbound hand-off, expected on its receiver; their ids."""
        if self.receiver is None:
            raise ValueError("this worker takes no KV: it has no receiver")
        if message.transfer_id in self._inbound:
            raise ValueError(f"transfer {message.transfer_id!r} already expected")
        parts = self.layout.parts(message.source_degree, self.layout.degree, self.layout.ranks)
        mine = [p for p in parts if p.receiver_rank == self.layout.rank]
        local_heads = self.fingerprint.num_kv_heads
        ids: list[str] = []
        with self._lock:
            try:
                for part in mine:
                    pid = part_id(message.transfer_id, part, len(parts))
                    heads = None if part.count == local_heads else (part.receiver_first, part.count)
                    self._part_of[pid] = message.transfer_id
                    self.receiver.expect(
                        pid,
                        message.blocks,
                        num_layers=message.num_layers,
                        deadline_s=message.deadline_s,
                        leading_run=message.leading_run,
                        heads=heads,
                    )
                    ids.append(pid)
            except BaseException:
                for pid in ids:
                    self.receiver.abort(pid, "its hand-off could not be expected whole")
                raise
            self._inbound[message.transfer_id] = list(ids)
        return ids

    def abort_receive(self, transfer_id: str, reason: str) -> None:
        """Fail this rank's parts of an inbound hand-off now and forget them (their ends are no news)."""
        with self._lock:
            for pid in self._inbound.pop(transfer_id, []):
                self._part_of.pop(pid, None)
                if self.receiver is not None:
                    self.receiver.abort(pid, reason)

    def poll_receive(self) -> list[TransferEvent]:
        """Inbound parts that ended (rank 0: its receiver polled now; another rank: what its poller saw)."""
        with self._lock:
            if self._poller is None:
                self._poll_receiver()
            events, self._received = self._received, []
        return events

    def _poll_receiver(self) -> None:
        assert self.receiver is not None
        for event in self.receiver.poll():
            handoff = self._part_of.pop(event.transfer_id, None)
            if handoff is None:
                continue
            left = self._inbound.get(handoff, [])
            if event.transfer_id in left:
                left.remove(event.transfer_id)
            if not left:
                self._inbound.pop(handoff, None)
            self._received.append(event)

    def start_polling(self) -> None:
        """A rank other than 0: a thread takes its receiver's arrivals as they come (rank 0's worker loop polls)."""
        if self.receiver is not None and self._poller is None:
            self._poller = threading.Thread(target=self._poll_loop, name="rank-kv-poller", daemon=True)
            self._poller.start()

    def _poll_loop(self) -> None:
        receiver = self.receiver
        assert receiver is not None
        while not self._stop.is_set():
            if not self._part_of:
                self._stop.wait(POLLER_WAIT_S)
                continue
            with self._lock:
                self._poll_receiver()
                receiver.wait(POLLER_WAIT_S)

    # ---- sending -----------------------------------------------------------------------------------------------

    def _sender(self, fingerprint: ModelFingerprint) -> KVSender:
        sender = self._senders.get(fingerprint)
        if sender is None:
            if self._make_sender is None:
                raise ValueError("this worker sends no KV: it has no sender")
            sender = self._senders[fingerprint] = self._make_sender(fingerprint)
        return sender

    def begin(self, message: Begin) -> None:
        """This rank's parts of an outbound hand-off, begun on the senders for their receivers."""
        if message.transfer_id in self._outbound:
            raise ValueError(f"transfer {message.transfer_id!r} already begun")
        receiver_degree, receiver_ranks = message.receiver_degree, len(message.addresses)
        parts = self.layout.parts(self.layout.degree, receiver_degree, receiver_ranks)
        mine = [p for p in parts if p.sender_rank == self.layout.rank]
        begun: list[tuple[str, HandoffPart, KVSender]] = []
        try:
            for part in mine:
                pid = part_id(message.transfer_id, part, len(parts))
                sender = self._sender(self.layout.fingerprint(receiver_degree, part.receiver_rank))
                sender.begin(pid, message.addresses[part.receiver_rank])
                begun.append((pid, part, sender))
        except BaseException:
            for pid, _, sender in begun:
                sender.abort(pid, "its hand-off could not begin whole")
            raise
        heads = [self.layout.fingerprint(receiver_degree, r).num_kv_heads for r in range(receiver_ranks)]
        self._outbound[message.transfer_id] = _Outbound(begun, message.dst_blocks, message.first_block, heads)
        self._slots[export_slot(message.transfer_id)] = message.transfer_id

    def send(self, transfer_id: str, layer: int, dst_blocks: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> bool:
        """This rank's heads of some blocks of one layer (``[blocks, block_size, heads, head_dim]``) to every
        receiving rank that holds some of them; False when some part has failed (its piece is dropped)."""
        out = self._outbound.get(transfer_id)
        if out is None:
            return False
        ok = True
        for pid, part, sender in out.parts:
            first, count = part.sender_first, part.count
            whole = count == out.receiver_heads[part.receiver_rank]
            heads = None if whole else (part.receiver_first, count)
            if count == k.shape[2]:
                pk, pv = k, v
            else:
                pk, pv = k[:, :, first : first + count].contiguous(), v[:, :, first : first + count].contiguous()
            ok = sender.send_layer(pid, layer, dst_blocks, pk, pv, heads) and ok
        return ok

    def export(self, layer: int, spans: list[ExportSpan], k: torch.Tensor, v: torch.Tensor) -> None:
        """A follower's layer hook: its heads of a step's exported blocks (``spans`` in order, as ``k``/``v`` hold
        them) to the hand-offs they belong to."""
        offset = 0
        for span in spans:
            n = span.end_block - span.first_block
            transfer_id = self._slots.get(span.slot)
            out = self._outbound.get(transfer_id) if transfer_id is not None else None
            if transfer_id is not None and out is not None:
                dst = out.dst_blocks[span.first_block - out.first_block : span.end_block - out.first_block]
                self.send(transfer_id, layer, dst, k[offset : offset + n], v[offset : offset + n])
            offset += n

    def export_held(self, message: ExportHeld) -> None:
        """Blocks of a request held here (a move's source), this rank's heads, layer by layer."""
        if self.kv_cache is None or message.transfer_id not in self._outbound:
            return
        index = self.kv_cache.block_index(message.src_blocks)
        for layer in range(message.layer_start, message.layer_end):
            k, v = self.kv_cache.read_blocks(layer, index)
            self.send(message.transfer_id, layer, message.dst_blocks, k, v)

    def finish(self, transfer_id: str) -> None:
        out = self._outbound.get(transfer_id)
        for pid, _, sender in out.parts if out is not None else []:
            sender.finish(pid)

    def abort_send(self, transfer_id: str, reason: str) -> None:
        """End this rank's parts of an outbound hand-off now and forget them (their ends are no news)."""
        out = self._outbound.pop(transfer_id, None)
        self._slots.pop(export_slot(transfer_id), None)
        for pid, _, sender in out.parts if out is not None else []:
            sender.abort(pid, reason)

    def poll_send(self) -> list[TransferEvent]:
        """Outbound parts whose lease ended (acknowledged, failed or aborted)."""
        events, self._failed_sends = self._failed_sends, []
        events += [event for sender in self._senders.values() for event in sender.poll()]
        for event in events:
            self._forget_sent(event.transfer_id)
        return events

    def _forget_sent(self, pid: str) -> None:
        for transfer_id, out in list(self._outbound.items()):
            kept = [p for p in out.parts if p[0] != pid]
            if len(kept) != len(out.parts):
                out.parts = kept
                if not kept:
                    del self._outbound[transfer_id]
                    self._slots.pop(export_slot(transfer_id), None)
                return

    # ---- the rest ------------------------------------------------------------------------------------------------

    def control(self, data: bytes) -> bytes:
        """A rank other than 0: apply one of rank 0's messages; its answer (b"" for none)."""
        message = _control.decode(data)
        if isinstance(message, Hello):
            return (self.receiver.address if self.receiver is not None else "").encode()
        if isinstance(message, Poll):
            events = self.poll_receive() if message.side is Side.RECEIVE else self.poll_send()
            return encode_control([PartNews.of(e) for e in events])
        try:
            if isinstance(message, Expect):
                self.expect(message)
            elif isinstance(message, Begin):
                self.begin(message)
            elif isinstance(message, ExportHeld):
                self.export_held(message)
            elif isinstance(message, Finish):
                self.finish(message.transfer_id)
            elif isinstance(message, Abort):
                (self.abort_send if message.side is Side.SEND else self.abort_receive)(
                    message.transfer_id, message.reason
                )
        except Exception as exc:  # noqa: BLE001 - a part that cannot start fails: rank 0 hears of it by its poll
            logger.warning("rank %d: %s failed: %s", self.layout.rank, type(message).__name__, exc)
            self._fail_here(message, exc)
        return b""

    def _fail_here(self, message: Control, exc: Exception) -> None:
        """A control message that could not be applied: its hand-off's parts here fail (so rank 0's join ends it)."""
        transfer_id = getattr(message, "transfer_id", "")
        error = exc if isinstance(exc, TransferError) else ProtocolError(f"rank {self.layout.rank}: {exc}")
        if isinstance(message, Expect):
            parts = self.layout.parts(message.source_degree, self.layout.degree, self.layout.ranks)
            ids = [part_id(transfer_id, p, len(parts)) for p in parts if p.receiver_rank == self.layout.rank]
            with self._lock:
                self._received += [TransferEvent(pid, TransferState.FAILED, error) for pid in ids]
        elif isinstance(message, Begin):
            parts = self.layout.parts(self.layout.degree, message.receiver_degree, len(message.addresses))
            ids = [part_id(transfer_id, p, len(parts)) for p in parts if p.sender_rank == self.layout.rank]
            self._failed_sends += [TransferEvent(pid, TransferState.FAILED, error) for pid in ids]

    def pending(self) -> int:
        """Parts under way here, in and out: 0 once every hand-off this rank took part in has ended."""
        return sum(map(len, self._inbound.values())) + sum(len(out.parts) for out in self._outbound.values())

    def paths(self) -> dict[str, str]:
        return {address: path for sender in self._senders.values() for address, path in sender.paths().items()}

    def endpoints(self) -> list[KVSender | KVReceiver]:
        """The transfer endpoints this rank holds now: a sender per receiving rank's fingerprint met so far, and its
        receiver."""
        return [*self._senders.values(), *([self.receiver] if self.receiver else [])]

    def io_problem(self) -> str:
        return next((problem for end in self.endpoints() if (problem := end.io_problem())), "")

    def close(self) -> None:
        """Idempotent: a decode worker's sender and receiver share their rank's endpoints."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._poller is not None:
            self._poller.join(5.0)
        for sender in self._senders.values():
            sender.close()
        if self.receiver is not None:
            self.receiver.close()


# ---- building a rank's endpoints from the worker's spec ------------------------------------------------------------


def handoff_layout(kv_spec: object, split: HeadSplit | None) -> HandoffLayout:
    """The layout of a rank whose cache is ``kv_spec`` (its heads) and whose heads ``split`` says (None: a worker of
    one rank whose runner names none, as the planner's simulated one)."""
    if split is None:
        whole = ModelFingerprint.from_spec(kv_spec)
        return HandoffLayout(whole, whole.num_kv_heads)
    whole = ModelFingerprint.from_spec(dataclasses.replace(kv_spec, num_kv_heads=split.kv_total))  # type: ignore[type-var]
    return HandoffLayout(whole, split.q_heads * split.degree, split.degree, split.rank, split.size)


def cache_land(cache: KVCache) -> LandKV:
    """A follower rank's landing: a part's KV straight into its cache's blocks (rank 0 lands through the engine's
    importer, which checks them against its reservation)."""

    def land(_handoff: str, layer: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor, heads=None) -> None:
        cache.write_blocks(layer, blocks, k, v, heads)

    return land


def plain_rank_kv(
    kv_spec: object,
    split: HeadSplit | None,
    kv_cache: KVCache,
    backend: str,
    config: TransferConfig,
    land: LandKV | None = None,
    address: str = "tcp://127.0.0.1:0",
) -> RankKV:
    """A rank's endpoints without a worker's spec (benchmarks, the GPU check, tests): on ``backend`` with ``config``,
    a receiver bound at ``address`` when it takes KV (``land`` given), and no cache offered for direct writes."""

    def receiver(fingerprint: ModelFingerprint, sink: Sink) -> KVReceiver:
        return make_receiver(backend, fingerprint, sink, address, config)

    return RankKV(
        handoff_layout(kv_spec, split),
        kv_cache,
        make_receiver=receiver if land is not None else None,
        land=land,
        make_sender=functools.partial(make_sender, backend, config=config),
    )


def rank_kv(spec: WorkerSpec, kv_cache: KVCache, layout: HandoffLayout, land: LandKV | None) -> RankKV:
    """A rank's endpoints on the pool's backend: a receiver when it takes KV (``land`` given: a decode worker), bound
    as ``receiver_address`` says and offering the rank's cache to same-node senders where the backend can; senders
    made as hand-offs need them."""
    make = None
    if land is not None:
        device_transfer = dataclasses.replace(  # GPU: side-stream writes
            spec.transfer,
            kv_device=spec.engine.device,
            max_frame_bytes=frame_bound(kv_cache, spec.transfer.max_frame_bytes),
        )

        def make(fingerprint: ModelFingerprint, sink: Sink) -> KVReceiver:
            segment = shared_kv_cache(spec, kv_cache, fingerprint)
            return make_receiver(
                spec.transfer_backend, fingerprint, sink, receiver_address(spec), device_transfer, segment
            )

    senders = functools.partial(make_sender, spec.transfer_backend, config=spec.transfer)
    return RankKV(layout, kv_cache, make_receiver=make, land=land, make_sender=senders)


# a batch's payload frame: its pieces' bytes (under the largest path's batch bound, 8 MiB on the direct path) and the
# 64-byte alignment of each (transfer/wire.py batch_layout), with room to spare
MAX_BATCH_FRAME_BYTES = 16 * 1024 * 1024 + 64 * MAX_BATCH_PIECES


def frame_bound(cache: KVCache, configured: int) -> int:
    """A receiver's ``max_frame_bytes``: its largest legitimate frame, if under the configured bound. A piece's frame
    holds K or V of some of one layer's blocks, at most the whole layer's cache; a batch's one payload frame holds
    small pieces up to its byte bound. ZeroMQ drops a peer that sends more (MAXMSGSIZE), before buffering it."""
    layer = max(t.nbytes for t in cache.kv)
    return min(configured, max(layer, MAX_BATCH_FRAME_BYTES))


def shared_kv_cache(spec: WorkerSpec, cache: KVCache, fingerprint: ModelFingerprint) -> KVSegment | None:
    """A rank's cache (its heads: ``fingerprint``) offered to same-node senders, which write KV in place
    (transfer/direct_path.py): a CPU cache moved into shared memory (shm, auto), or a GPU cache's CUDA IPC handles
    (nccl, shm, auto). None: a ring, a pair group or frames instead."""
    on_gpu = cache.kv[0].device.type == "cuda"
    backends = ("nccl", "shm", "auto") if on_gpu else ("shm", "auto")
    if spec.transfer_backend not in backends or not spec.transfer.direct_write:
        return None
    num_blocks = cache.kv[0].shape[1]
    try:
        if on_gpu:
            config = dataclasses.replace(spec.transfer, device=spec.engine.device)
            return KVSegment(fingerprint, num_blocks, device_layers=cache.kv, gpu=gpu_uuid(config))
        segment = KVSegment(fingerprint, num_blocks)
    except (ShmUnavailable, ValueError) as e:
        logger.warning("the KV cache is not offered to same-node senders (a ring or a pair group instead): %s", e)
        return None
    cache.rehome(segment.layers)
    return segment


def receiver_address(spec: WorkerSpec) -> str:
    """Where a rank's KV receiver binds: a free TCP port, a fresh Unix socket, or an in-process name. ``shm+`` (read
    by the sender) offers the node's senders a shared-memory ring (transfer/ring_path.py): ``shm`` (one node) with
    its control channel on a Unix socket, ``auto`` on TCP so that senders on other nodes reach it too, inline as
    zmq."""
    if spec.transfer_backend == "local":
        return f"local://{spec.name}-{uuid.uuid4().hex[:8]}"
    if spec.transfer_backend == "auto":
        return f"shm+tcp://{spec.runtime.host}:0"
    if spec.transfer_backend == "shm" or spec.zmq_transport == "ipc":
        scheme = "shm+" if spec.transfer_backend == "shm" else ""
        return f"{scheme}ipc://{tempfile.gettempdir()}/pdserve-{spec.name}-{uuid.uuid4().hex[:8]}.sock"
    return f"tcp://{spec.runtime.host}:0"
