"""KV transfers in simulated time: a ``KVSender`` / ``KVReceiver`` pair (transfer/base.py's interface) joining the
planner's simulated prefill and decode workers.

The prefill role begins a transfer, its KV connector's sink sends the pieces and the role finishes it, as over any
backend. The pieces wait for the end of the step that made them (the simulated worker calls ``ship`` once the step's
profiled time has passed), then for the sender's link, which carries one transfer at a time (a simpy resource), for
``transfer_s`` of the real model's bytes: the blocks sent times the profile's KV bytes per block, not the few bytes of
the simulated cache (planner/sim_engine.py). Then they reach the receiver, whose ``poll`` (a turn of the decode
role's loop) checks and writes them with the receivers' own table (transfer/inbound.py: only the blocks the transfer
expects, every layer and block, then DONE or FAILED) and acknowledges; the sender's lease ends at its next ``poll``
and the prefill role releases the blocks. Aborts go both ways as on the local backend (transfer/local_backend.py).

Time is the simulation's only: the receiver's deadline (``deadline_s`` after ``expect``) is in simulated seconds; a
lease never expires and is never renewed (a simulated receiver is never silent). Failures are not modelled otherwise.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import simpy
import torch

from transfer.base import KVReceiver, KVSender, check_layer_args
from transfer.errors import (
    FingerprintMismatch,
    PeerGone,
    SenderAborted,
    TransferAborted,
    TransferError,
    TransferTimeout,
    error_from_code,
)
from transfer.inbound import InboundTable, Sink
from transfer.local_backend import Delivery
from transfer.state import LeaseTable, TransferEvent
from transfer.wire import Abort, Ack, Finish, ModelFingerprint, Nack, PieceHeader, encode_piece

MAX_FRAME_BYTES = 1 << 30


def _wire_bytes_per_block(fp: ModelFingerprint) -> int:
    """What one block of one layer of the simulated cache weighs in a piece (K and V)."""
    return 2 * math.prod(fp.block_shape) * fp.torch_dtype.itemsize


class SimReceiver(KVReceiver):
    """A decode worker's KV receiver; ``wake`` tells its worker that something arrived. ``bytes_per_block``: the real
    model's KV of one block, every layer (what a transfer event reports it received)."""

    def __init__(
        self,
        env: simpy.Environment,
        fingerprint: ModelFingerprint,
        sink: Sink,
        address: str,
        deadline_s: float,
        bytes_per_block: int,
        wake: Callable[[], None],
    ) -> None:
        self.env, self.fp, self.address = env, fingerprint, address
        self.deadline_s = deadline_s
        self._scale = (bytes_per_block // fingerprint.num_layers, _wire_bytes_per_block(fingerprint))
        self._wake = wake
        # its own deadlines are never read: ``poll`` fails a transfer by ``_deadlines``, in simulated seconds
        self._table = InboundTable(fingerprint, sink, MAX_FRAME_BYTES, deadline_s)
        self._deadlines: dict[str, float] = {}
        self._inbox: deque[Delivery] = deque()
        self._senders: dict[bytes, SimSender] = {}

    def connect(self, sender: SimSender) -> bytes:
        """The handshake's check, as the local backend's: the same model, or FingerprintMismatch."""
        if sender.fp != self.fp:
            raise FingerprintMismatch(f"sender model {sender.fp} != receiver model {self.fp}")
        self._senders[sender.session] = sender
        return sender.session

    def expect(
        self,
        transfer_id: str,
        dst_block_ids: Sequence[int],
        *,
        num_layers: int | None = None,
        deadline_s: float | None = None,
        leading_run: bool = False,
        heads: tuple[int, int] | None = None,
    ) -> None:
        super().expect(
            transfer_id,
            dst_block_ids,
            num_layers=num_layers,
            deadline_s=deadline_s,
            leading_run=leading_run,
            heads=heads,
        )
        self._deadlines[transfer_id] = self.env.now + (deadline_s or self.deadline_s)

    def deliver(self, delivery: Delivery) -> None:
        self._inbox.append(delivery)
        self._wake()

    def poll(self, max_messages: int = 256) -> list[TransferEvent]:
        """Everything that arrived (no bound: a turn left over would wait for the worker's next wake-up), then the
        deadlines; the events report the real model's bytes."""
        while self._inbox:
            d = self._inbox.popleft()
            msg = d.message
            tid = msg.transfer_id if isinstance(msg, PieceHeader) else msg.tid
            if self._table.get(tid) is None:
                if isinstance(msg, PieceHeader):
                    self._reply(d.session, Nack(tid, "protocol", "unknown transfer"))
                continue
            try:
                match msg:
                    case PieceHeader():
                        self._table.admit(d.session, msg)
                        self._table.complete_tensors(msg, d.tensors)
                    case Finish():
                        self._table.on_finish(d.session, tid, msg.pieces)
                    case Abort():
                        self._table.fail(tid, SenderAborted(f"sender aborted: {msg.reason}"))
                        continue
            except TransferError as e:
                self._table.fail(tid, e)
                self._reply(d.session, Nack(tid, e.code, str(e)))
                continue
            if self._table.get(tid) is None:
                self._reply(d.session, Ack(tid))
        now = self.env.now
        for tid, deadline in list(self._deadlines.items()):
            if self._table.get(tid) is None:
                del self._deadlines[tid]
            elif now > deadline:
                del self._deadlines[tid]
                rec = self._table.fail(tid, TransferTimeout(f"transfer {tid!r} missed its deadline"))
                if rec is not None and rec.session:
                    self._reply(rec.session, Nack(tid, "timeout", "receiver deadline passed"))
        events = self._table.drain()
        real, simulated = self._scale
        for event in events:
            event.nbytes = event.nbytes // simulated * real
        return events

    def _reply(self, session: bytes, reply: Ack | Nack) -> None:
        sender = self._senders.get(session)
        if sender is not None:
            sender.hear(reply)

    def abort(self, transfer_id: str, reason: str = "aborted by receiver") -> None:
        rec = self._table.fail(transfer_id, TransferAborted(reason))
        if rec is not None and rec.session:
            self._reply(rec.session, Nack(transfer_id, "aborted", reason))

    def wait(self, timeout_s: float) -> bool:
        return True  # the simulated worker's loop waits in simulated time, never here

    def close(self) -> None:
        for tid in self._table.ids():
            self._table.fail(tid, PeerGone("receiver closed"))


@dataclass(slots=True)
class _Outgoing:
    receiver: SimReceiver
    pieces: list[Delivery] = field(default_factory=list)
    nbytes: int = 0  # what the real model's KV of these blocks weighs
    finished: bool = False


class SimSender(KVSender):
    """A prefill worker's KV sender and its link (one transfer at a time); ``wake`` tells its worker that an answer
    came. ``bytes_per_block``: the real model's KV of one block, every layer."""

    def __init__(
        self,
        env: simpy.Environment,
        fingerprint: ModelFingerprint,
        name: str,
        receivers: Mapping[str, SimReceiver],
        bytes_per_block: int,
        transfer_s: Callable[[int], float],
        wake: Callable[[], None],
    ) -> None:
        self.env, self.fp, self.session = env, fingerprint, name.encode()
        self.receivers = receivers
        self.bytes_per_block = bytes_per_block
        self.transfer_s = transfer_s
        self._wake = wake
        self.link = simpy.Resource(env, capacity=1)
        self._leases = LeaseTable(math.inf)  # never expired: ``expire`` is not called
        self._out: dict[str, _Outgoing] = {}
        self._began: dict[str, float] = {}  # each lease's start, in simulated seconds
        self._finished: list[str] = []  # finished in the step under way: they leave when it ends (``ship``)
        self._inbox: deque[Ack | Nack] = deque()

    def begin(self, transfer_id: str, peer: str) -> None:
        self._leases.begin(transfer_id, peer)
        self._began[transfer_id] = self.env.now
        receiver = self.receivers.get(peer)
        if receiver is None:
            self._leases.release(transfer_id, PeerGone(f"no simulated receiver at {peer}"))
            return
        try:
            receiver.connect(self)
        except TransferError as e:
            self._leases.release(transfer_id, e)
            return
        self._out[transfer_id] = _Outgoing(receiver)

    def send_layer(
        self,
        transfer_id: str,
        layer: int,
        dst_block_ids: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        heads: tuple[int, int] | None = None,
    ) -> bool:
        check_layer_args(self.fp, layer, dst_block_ids, k, v, heads)
        out = self._out.get(transfer_id)
        if out is None or out.finished:
            return False
        piece, tensors = encode_piece(self.fp, transfer_id, layer, dst_block_ids, k, v, "raw", False, heads)
        out.pieces.append(Delivery(self.session, piece, tensors))
        nbytes = len(dst_block_ids) * self.bytes_per_block // self.fp.num_layers
        out.nbytes += nbytes
        self._leases.note_sent(transfer_id, nbytes)
        return True

    def finish(self, transfer_id: str) -> None:
        out = self._out.get(transfer_id)
        if out is not None and not out.finished:
            out.finished = True
            self._finished.append(transfer_id)

    def ship(self) -> None:
        """The step that finished these transfers has ended: each takes its turn on the link."""
        for transfer_id in self._finished:
            self.env.process(self._carry(transfer_id, self._out[transfer_id]))
        self._finished.clear()

    def _carry(self, transfer_id: str, out: _Outgoing):
        with self.link.request() as turn:
            yield turn
            if self._out.get(transfer_id) is not out:
                return  # aborted while it waited: nothing goes
            yield self.env.timeout(self.transfer_s(out.nbytes))
        if self._out.get(transfer_id) is not out:
            return  # aborted on the way: the receiver heard the abort
        pieces, out.pieces = out.pieces, []
        for delivery in pieces:
            out.receiver.deliver(delivery)
        out.receiver.deliver(Delivery(self.session, Finish(transfer_id, len(pieces))))

    def hear(self, reply: Ack | Nack) -> None:
        self._inbox.append(reply)
        self._wake()

    def abort(self, transfer_id: str, reason: str = "aborted by sender") -> None:
        out = self._out.pop(transfer_id, None)
        if transfer_id in self._finished:
            self._finished.remove(transfer_id)
        if self._leases.release(transfer_id, TransferAborted(reason)) and out is not None:
            out.receiver.deliver(Delivery(self.session, Abort(transfer_id, reason)))

    def poll(self) -> list[TransferEvent]:
        while self._inbox:
            reply = self._inbox.popleft()
            if isinstance(reply, Ack):
                self._leases.release(reply.tid)
            else:
                self._leases.release(reply.tid, error_from_code(reply.code, f"receiver: {reply.reason}"))
        events = self._leases.drain()
        for event in events:
            self._out.pop(event.transfer_id, None)
            event.elapsed_s = self.env.now - self._began.pop(event.transfer_id)  # the lease's, in simulated time
        return events

    def close(self) -> None:
        self._leases.fail_all(PeerGone("sender closed"))
