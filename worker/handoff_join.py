"""Rank 0's side of a worker's hand-offs: each hand-off split into its parts on every rank (``worker.rank_kv``), and
their ends joined into the one event per hand-off the roles see.

``HandoffSender`` (a prefill worker's, a move's source) and ``HandoffReceiver`` (a decode worker's) tell the other
ranks what to do through the step channel's control messages, in order with the steps, and ask them for their parts'
ends (``Poll``) only while some are pending there. A hand-off is done when every part is; the first part to fail ends
it and aborts the others, on every rank.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from engine.kv_connector import KVBlocksReady, KVSink
from engine.tensor_parallel import StepChannel
from transfer.base import KVReceiver, KVSender
from transfer.errors import ProtocolError, TransferAborted, TransferError
from transfer.state import TransferEvent, TransferState
from transfer.wire import ModelFingerprint
from worker.messages import join_kv_address, split_kv_address
from worker.rank_kv import (
    Abort,
    Begin,
    Control,
    Expect,
    ExportHeld,
    Finish,
    HandoffLayout,
    Hello,
    Poll,
    RankKV,
    Side,
    decode_news,
    encode_control,
    part_id,
)

# rank 0 asks the other ranks for their parts' ends at most this often once only their parts of a hand-off are left;
# while its own are under way too, at most every FOLLOWER_WATCH_INTERVAL_S (to hear of a failure there): each ask
# stops rank 0 and every follower for a round trip of the step channel, which the parts' own I/O would wait behind
FOLLOWER_POLL_INTERVAL_S = 0.002
FOLLOWER_WATCH_INTERVAL_S = 0.02


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
            self.channel.control(encode_control(message), reply=wait)

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
            for answer in self.channel.control(encode_control(Poll(self.side)), reply=True)[1:]:
                news += [item.event() for item in decode_news(answer)] if answer else []
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
            addresses += [answer.decode() for answer in channel.control(encode_control(Hello()), reply=True)[1:]]
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
