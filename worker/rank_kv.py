"""A worker's KV plane across its tensor-parallel ranks: every hand-off in parts, each rank sending and taking its
own heads.

A hand-off between a worker of S ranks and one of R ranks is split by ``engine.tensor_parallel.handoff_parts``: one
part per (sender rank, receiver rank) pair with heads in common, each part a transfer of the KV plane between those
two ranks (its id ``handoff#r.s``; the hand-off's own id when S = R = 1), so no byte crosses a rank 0 it does not
belong to. ``RankKV`` is one rank's endpoints: a receiver holding that rank's heads, a sender per receiving rank's
fingerprint, and the parts under way here. Rank 0 speaks for the worker: ``HandoffSender`` and ``HandoffReceiver``
are what the roles use, telling the other ranks what to do through the step channel's control messages (``Expect``,
``Begin``, ``ExportHeld``, ``Finish``, ``Abort``, ``Poll``: msgspec, in order with the steps) and joining every
part's end into one event per hand-off; the first part to fail ends the hand-off and aborts the others. The other
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
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated

import msgspec
import torch

from engine.kv_cache import KVCache
from engine.kv_connector import KVBlocksReady, KVSink
from engine.tensor_parallel import (
    ExportSpan,
    HandoffPart,
    HeadSplit,
    StepChannel,
    export_slot,
    handoff_parts,
    head_split,
)
from transfer.base import KVReceiver, KVSender, make_receiver, make_sender
from transfer.config import TransferConfig
from transfer.errors import ProtocolError, TransferAborted, TransferError, error_from_code
from transfer.inbound import Sink
from transfer.kv_segment import KVSegment
from transfer.pair_path import gpu_uuid
from transfer.shm_ring import ShmUnavailable
from transfer.state import TransferEvent, TransferState
from transfer.wire import MAX_BATCH_PIECES, ModelFingerprint
from worker.messages import join_kv_address, split_kv_address
from worker.spec import WorkerSpec

logger = logging.getLogger(__name__)

MAX_RANKS = 64
# rank 0 asks the other ranks for their parts' ends at most this often once only their parts of a hand-off are left;
# while its own are under way too, at most every FOLLOWER_WATCH_INTERVAL_S (to hear of a failure there): each ask
# stops rank 0 and every follower for a round trip of the step channel, which the parts' own I/O would wait behind
FOLLOWER_POLL_INTERVAL_S = 0.002
FOLLOWER_WATCH_INTERVAL_S = 0.02
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
            return _encoder.encode([PartNews.of(e) for e in events])
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


# ---- rank 0: the worker's hand-offs, every rank's parts joined -----------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Handoff:
    transfer_id: str
    parts: dict[str, int]  # part id -> the rank it runs on, for the parts not yet ended
    nbytes: int = 0
    elapsed_s: float = 0.0
    num_blocks: set[int] = dataclasses.field(default_factory=set)


class _Join:
    """Rank 0's hand-offs on one side: each part's end, on any rank, joined into one event per hand-off. The other
    ranks are asked for their parts' ends (``Poll``) only while some are pending there."""

    def __init__(self, side: Side, kv: RankKV, channel: StepChannel | None) -> None:
        self.side, self.kv, self.channel = side, kv, channel
        self.handoffs: dict[str, _Handoff] = {}
        self._handoff_of: dict[str, str] = {}  # part id -> hand-off id
        self._next_poll_s = 0.0
        self._aborted: list[TransferEvent] = []  # hand-offs ended by an abort here, until the next poll

    def add(self, transfer_id: str, parts: dict[str, int]) -> None:
        self.handoffs[transfer_id] = _Handoff(transfer_id, dict(parts))
        self._handoff_of.update((pid, transfer_id) for pid in parts)

    def tell(self, message: Control, wait: bool = False) -> None:
        """A message to the other ranks (none at degree 1); ``wait``: return once every rank has applied it."""
        if self.channel is not None:
            self.channel.control(_encoder.encode(message), reply=wait)

    def abort(self, transfer_id: str, reason: str) -> None:
        """End a hand-off now (as a plain endpoint's abort does: it is no longer pending; ``ended`` reports it)."""
        handoff = self.handoffs.get(transfer_id)
        if handoff is not None:
            self._aborted.append(self.end(handoff, TransferAborted(reason), reason))

    def ended(self, own: list[TransferEvent]) -> list[TransferEvent]:
        news = list(own)
        now = time.monotonic()
        pending_elsewhere = any(rank for h in self.handoffs.values() for rank in h.parts.values())
        if self.channel is not None and pending_elsewhere and now >= self._next_poll_s:
            only_elsewhere = any(h.parts and 0 not in h.parts.values() for h in self.handoffs.values())
            self._next_poll_s = now + (FOLLOWER_POLL_INTERVAL_S if only_elsewhere else FOLLOWER_WATCH_INTERVAL_S)
            for answer in self.channel.control(_encoder.encode(Poll(self.side)), reply=True)[1:]:
                news += [item.event() for item in _news.decode(answer)] if answer else []
        out, self._aborted = self._aborted, []
        for event in news:
            transfer_id = self._handoff_of.pop(event.transfer_id, None)
            handoff = self.handoffs.get(transfer_id) if transfer_id is not None else None
            if handoff is None:
                continue  # a part of a hand-off that has ended already (another part failed first)
            handoff.parts.pop(event.transfer_id, None)
            handoff.nbytes += event.nbytes
            handoff.elapsed_s = max(handoff.elapsed_s, event.elapsed_s)
            if not event.ok:
                assert event.error is not None
                out.append(self.end(handoff, event.error))
                continue
            handoff.num_blocks.add(event.num_blocks)
            if not handoff.parts:
                if len(handoff.num_blocks) > 1:
                    runs = sorted(handoff.num_blocks)
                    out.append(self.end(handoff, ProtocolError(f"the ranks' parts filled different runs: {runs}")))
                else:
                    out.append(self.end(handoff, None))
        return out

    def end(self, handoff: _Handoff, error: TransferError | None, reason: str = "") -> TransferEvent:
        """The hand-off's one event; a failure aborts its parts still under way, on every rank."""
        del self.handoffs[handoff.transfer_id]
        for pid in handoff.parts:
            self._handoff_of.pop(pid, None)
        if error is not None and handoff.parts:
            reason = reason or f"another part of the hand-off failed: {error}"
            if any(handoff.parts.values()):
                self.tell(Abort(handoff.transfer_id, self.side, reason))
            if 0 in handoff.parts.values():
                abort = self.kv.abort_send if self.side is Side.SEND else self.kv.abort_receive
                abort(handoff.transfer_id, reason)
        state = TransferState.DONE if error is None else TransferState.FAILED
        blocks = next(iter(handoff.num_blocks), 0) if error is None else 0
        return TransferEvent(handoff.transfer_id, state, error, handoff.nbytes, handoff.elapsed_s, blocks)


class HandoffSender:
    """The sending side of a worker's hand-offs (a prefill worker's, a move's source), on rank 0: the roles' KV
    sender. ``begin`` splits a hand-off into parts for the receiving worker's ranks, each rank of this worker sending
    its heads; ``poll`` reports each hand-off's end once, when every part's lease ended (or the first failed)."""

    def __init__(self, kv: RankKV, channel: StepChannel | None = None) -> None:
        if kv.layout.ranks > 1 and channel is None:
            raise ValueError("a worker of several ranks reaches them through its step channel")
        self.kv = kv
        self.channel = channel
        self.degree = kv.layout.degree
        self._join = _Join(Side.SEND, kv, channel)

    @classmethod
    def over(cls, sender: KVSender, layout: HandoffLayout) -> HandoffSender:
        """A worker of one rank whose sender is made already (tests, the planner's simulation): it reaches
        receivers that hold every head of the model (workers of one rank) only."""

        def only(fingerprint: ModelFingerprint) -> KVSender:
            if fingerprint != layout.whole:
                raise ValueError("this sender reaches workers of one rank only (it holds one fingerprint)")
            return sender

        return cls(RankKV(layout, make_sender=only))

    def begin(self, transfer_id: str, peer: str, dst_blocks: Sequence[int] = (), first_block: int = 0) -> None:
        """Start a hand-off to the worker whose receiver address is ``peer``; ``dst_blocks`` (from logical block
        ``first_block`` on) is where the KV that streams from the forward goes on the other ranks."""
        if transfer_id in self._join.handoffs:
            raise ValueError(f"transfer {transfer_id!r} already begun")
        address = split_kv_address(peer)
        parts = self.kv.layout.parts(self.degree, address.degree, len(address.ranks))
        message = Begin(transfer_id, address.ranks, address.degree, list(dst_blocks), first_block)
        self._join.tell(message)
        try:
            self.kv.begin(message)
        except BaseException:
            self._join.tell(Abort(transfer_id, Side.SEND, "the hand-off could not begin on rank 0"))
            raise
        self._join.add(transfer_id, {part_id(transfer_id, p, len(parts)): p.sender_rank for p in parts})

    def send_layer(
        self, transfer_id: str, layer: int, dst_block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor
    ) -> bool:
        """Rank 0's heads of one layer of some blocks (the other ranks send theirs themselves)."""
        return self.kv.send(transfer_id, layer, dst_block_ids, k, v)

    def sink(self, transfer_id: str, dst_blocks: list[int], first_block: int = 0) -> KVSink:
        """The engine's sink for one hand-off (a prefill's streamed export, a move's held blocks): logical blocks
        ``[first, end)`` onto the receiver's reserved blocks, which start at logical block ``first_block``."""

        def send(ready: KVBlocksReady) -> None:
            dst = dst_blocks[ready.first_block - first_block : ready.end_block - first_block]
            self.send_layer(transfer_id, ready.layer, dst, ready.k, ready.v)

        return send

    def send_held(self, transfer_id: str, src_blocks: list[int], dst_blocks: list[int], layers: range) -> None:
        """The other ranks' heads of blocks held between steps (a move's source): rank 0 sends its own through
        ``sink`` (``engine.kv_connector.KVExporter.export_held``)."""
        if layers and transfer_id in self._join.handoffs:
            self._join.tell(ExportHeld(transfer_id, src_blocks, dst_blocks, layers.start, layers.stop))

    def finish(self, transfer_id: str) -> None:
        if transfer_id in self._join.handoffs:
            self._join.tell(Finish(transfer_id))
            self.kv.finish(transfer_id)

    def abort(self, transfer_id: str, reason: str = "aborted by sender") -> None:
        """Every part's lease ends (reported by ``poll`` as FAILED, once)."""
        self._join.abort(transfer_id, reason)

    def poll(self) -> list[TransferEvent]:
        return self._join.ended(self.kv.poll_send())

    def active_transfers(self) -> list[str]:
        return list(self._join.handoffs)

    def paths(self) -> dict[str, str]:
        return self.kv.paths()

    def io_problem(self) -> str:
        return self.kv.io_problem()

    def close(self) -> None:
        self.kv.close()


class HandoffReceiver:
    """The receiving side of a worker's hand-offs (a decode worker's), on rank 0: the roles' KV receiver.
    ``expect`` splits a hand-off into parts from the sending worker's ranks (``source_degree``) for each rank of this
    worker; ``poll`` reports each hand-off's end once, when every rank holds its heads (or a part failed first).
    ``address`` is every rank's receiver, joined."""

    def __init__(self, kv: RankKV, channel: StepChannel | None = None, *, whole_only: bool = False) -> None:
        if kv.receiver is None:
            raise ValueError("a hand-off receiver needs a rank receiver")
        if kv.layout.ranks > 1 and channel is None:
            raise ValueError("a worker of several ranks reaches them through its step channel")
        self.kv = kv
        self.receiver = kv.receiver
        self.channel = channel
        self.degree = kv.layout.degree
        self._whole_only = whole_only
        self._join = _Join(Side.RECEIVE, kv, channel)
        addresses = [self.receiver.address]
        if channel is not None:  # the other ranks' receivers, bound as their ranks started
            addresses += [answer.decode() for answer in channel.control(_encoder.encode(Hello()), reply=True)[1:]]
        self.address = join_kv_address(addresses, self.degree)

    @classmethod
    def over(cls, receiver: KVReceiver, layout: HandoffLayout) -> HandoffReceiver:
        """A worker of one rank whose receiver is made already, with its sink (tests, the planner's simulation): it
        takes hand-offs from workers of one rank only (a part's id would reach its sink)."""
        return cls(RankKV(layout, make_receiver=lambda _fp, _sink: receiver), whole_only=True)

    def expect(
        self,
        transfer_id: str,
        dst_block_ids: Sequence[int],
        *,
        num_layers: int | None = None,
        deadline_s: float | None = None,
        leading_run: bool = False,
        source_degree: int = 1,
    ) -> None:
        """Announce a hand-off from a worker of ``source_degree`` ranks before it sends (every rank expects its
        parts); as ``KVReceiver.expect`` otherwise."""
        if self._whole_only and source_degree != 1:
            raise ValueError(f"this receiver takes KV from workers of one rank, not {source_degree}")
        if transfer_id in self._join.handoffs:
            raise ValueError(f"transfer {transfer_id!r} already expected")
        layers = num_layers or self.kv.fingerprint.num_layers
        message = Expect(transfer_id, list(dst_block_ids), layers, deadline_s, leading_run, source_degree)
        parts = self.kv.layout.parts(source_degree, self.degree, self.kv.layout.ranks)
        self.kv.expect(message)
        # every rank expects its parts before rank 0's caller names this worker to the sender: a piece for a part not
        # yet expected would be dropped (transfer/inbound.py)
        self._join.tell(message, wait=True)
        self._join.add(transfer_id, {part_id(transfer_id, p, len(parts)): p.receiver_rank for p in parts})

    def poll(self, max_messages: int = 256) -> list[TransferEvent]:
        return self._join.ended(self.kv.poll_receive())

    def abort(self, transfer_id: str, reason: str = "aborted by receiver") -> None:
        """Every rank's parts fail now, and their senders are told (reported by ``poll`` as FAILED, once)."""
        self._join.abort(transfer_id, reason)

    def wait(self, timeout_s: float) -> bool:
        return self.receiver.wait(timeout_s)

    def pending_transfers(self) -> list[str]:
        return list(self._join.handoffs)

    def io_problem(self) -> str:
        return self.receiver.io_problem()

    @property
    def rejected(self) -> int:
        return self.receiver.rejected

    @property
    def handshake_refused(self) -> int:
        return self.receiver.handshake_refused

    def close(self) -> None:
        self.kv.close()


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
