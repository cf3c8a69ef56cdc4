"""In-process KV hand-off (`local` backend): colocated mode and unit tests, same interface as zmq.

Data flow: make_receiver("local", ..., "local://name") registers the receiver in a `LocalHub`.
LocalSender.begin looks the receiver up (missing -> PeerGone, other model -> FingerprintMismatch);
send_layer encodes the piece exactly like the wire backends (so int8 and the header checks are the same
code) and appends it with its tensors to the receiver's inbox, a deque (thread-safe appends); finish and abort
go the same way, as the wire's Finish and Abort. The receiver's poll() runs them through InboundTable; Ack, Nack
and Renew go back into the sender's inbox.
No bytes are copied: the payload tensors are handed over by reference, checksummed as on the wire when
``checksum`` is on (the receiver checks them before its sink writes a byte).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from transfer.base import KVReceiver, KVSender, check_layer_args
from transfer.config import TransferConfig
from transfer.errors import (
    FingerprintMismatch,
    PeerGone,
    SenderAborted,
    TransferAborted,
    TransferError,
    error_from_code,
)
from transfer.inbound import InboundTable, Sink
from transfer.state import LeaseTable, TransferEvent
from transfer.wire import Abort, Ack, Finish, ModelFingerprint, Nack, PieceHeader, Renew, encode_piece


@dataclass(slots=True)
class Delivery:
    """A message in a local receiver's inbox: the tensors of a piece are handed over by reference."""

    session: bytes
    message: PieceHeader | Finish | Abort
    tensors: list[torch.Tensor] = field(default_factory=list)


class LocalHub:
    """Name -> receiver registry of one process (tests may create their own hub)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._receivers: dict[str, LocalReceiver] = {}

    def register(self, name: str, receiver: LocalReceiver) -> None:
        with self._lock:
            if name in self._receivers:
                raise ValueError(f"local receiver {name!r} already exists")
            self._receivers[name] = receiver

    def unregister(self, name: str) -> None:
        with self._lock:
            self._receivers.pop(name, None)

    def lookup(self, name: str) -> LocalReceiver | None:
        with self._lock:
            return self._receivers.get(name)


DEFAULT_HUB = LocalHub()


def _name(address: str) -> str:
    if not address.startswith("local://") or len(address) <= len("local://"):
        raise ValueError(f"local address must be local://name, not {address!r}")
    return address[len("local://") :]


class LocalReceiver(KVReceiver):
    def __init__(
        self,
        fingerprint: ModelFingerprint,
        sink: Sink,
        address: str,
        config: TransferConfig | None = None,
        hub: LocalHub | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: what deadlines and renewals go by (a simulation passes its own)."""
        self.fp = fingerprint
        self.cfg = config or TransferConfig()
        self.address = address
        self._hub = hub or DEFAULT_HUB
        self.clock = clock
        self._table = InboundTable(fingerprint, sink, self.cfg.max_frame_bytes, self.cfg.deadline_s, clock)
        self._inbox: deque[Delivery] = deque()
        self._senders: dict[bytes, LocalSender] = {}
        self._hub.register(_name(address), self)

    def connect(self, sender: LocalSender) -> bytes:
        """The local handshake: same checks as the zmq hello, returns a session token."""
        if sender.fp != self.fp:
            raise FingerprintMismatch(f"sender model {sender.fp} != receiver model {self.fp}")
        session = os.urandom(16)
        self._senders[session] = sender
        return session

    def deliver(self, delivery: Delivery) -> None:
        self._inbox.append(delivery)

    def poll(self, max_messages: int = 256) -> list[TransferEvent]:
        for _ in range(max_messages):
            try:
                d = self._inbox.popleft()
            except IndexError:
                break
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
                        self._table.complete_tensors(msg, d.tensors)  # handed over by reference: nothing to decode
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
        for rec in self._table.expire():
            if rec.session:
                self._reply(rec.session, Nack(rec.transfer_id, "timeout", "receiver deadline passed"))
        now = self.clock()
        for rec in self._table.items():  # keep the producer's lease alive while we wait
            if rec.session and now - rec.last_renew >= self.cfg.lease_s / 3:
                rec.last_renew = now
                self._reply(rec.session, Renew(rec.transfer_id))
        return self._table.drain()

    def _reply(self, session: bytes, reply: Ack | Nack | Renew) -> None:
        sender = self._senders.get(session)
        if sender is not None:
            sender.inbox.append(reply)

    def abort(self, transfer_id: str, reason: str = "aborted by receiver") -> None:
        rec = self._table.fail(transfer_id, TransferAborted(reason))
        if rec is not None and rec.session:
            self._reply(rec.session, Nack(transfer_id, "aborted", reason))

    def close(self) -> None:
        self._hub.unregister(_name(self.address))
        for tid in self._table.ids():
            self._table.fail(tid, PeerGone("receiver closed"))


def _host(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" and not t.requires_grad else t.detach().cpu()


class LocalSender(KVSender):
    def __init__(
        self,
        fingerprint: ModelFingerprint,
        config: TransferConfig | None = None,
        hub: LocalHub | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: what leases expire by (a simulation passes its own)."""
        self.fp = fingerprint
        self.cfg = config or TransferConfig()
        self._hub = hub or DEFAULT_HUB
        self._leases = LeaseTable(self.cfg.lease_s, clock)
        self._route: dict[str, tuple[LocalReceiver, bytes]] = {}
        self._pieces: dict[str, int] = {}
        self.inbox: deque[Ack | Nack | Renew] = deque()

    def begin(self, transfer_id: str, peer: str) -> None:
        self._leases.begin(transfer_id, peer)
        receiver = self._hub.lookup(_name(peer))
        if receiver is None:
            self._leases.release(transfer_id, PeerGone(f"no local receiver at {peer}"))
            return
        try:
            session = receiver.connect(self)
        except TransferError as e:
            self._leases.release(transfer_id, e)
            return
        self._route[transfer_id] = (receiver, session)
        self._pieces[transfer_id] = 0

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
        route = self._route.get(transfer_id)
        if route is None or self._leases.get(transfer_id) is None:
            return False
        wire = self.cfg.kv_wire_dtype
        piece, tensors = encode_piece(
            self.fp, transfer_id, layer, dst_block_ids, _host(k), _host(v), wire, self.cfg.checksum, heads=heads
        )
        route[0].deliver(Delivery(route[1], piece, tensors))
        self._pieces[transfer_id] += 1
        self._leases.note_sent(transfer_id, sum(f.nbytes for f in piece.frames))
        return True

    def finish(self, transfer_id: str) -> None:
        route = self._route.get(transfer_id)
        if route is not None:
            route[0].deliver(Delivery(route[1], Finish(transfer_id, self._pieces.get(transfer_id, 0))))

    def abort(self, transfer_id: str, reason: str = "aborted by sender") -> None:
        route = self._route.pop(transfer_id, None)
        self._pieces.pop(transfer_id, None)
        if self._leases.release(transfer_id, TransferAborted(reason)) and route is not None:
            route[0].deliver(Delivery(route[1], Abort(transfer_id, reason)))

    def poll(self) -> list[TransferEvent]:
        while self.inbox:
            reply = self.inbox.popleft()
            match reply:
                case Ack():
                    self._leases.release(reply.tid)
                case Nack():
                    self._leases.release(reply.tid, error_from_code(reply.code, f"receiver: {reply.reason}"))
                case Renew():
                    self._leases.renew(reply.tid)
        for tid, _ in self._leases.expire():
            route = self._route.get(tid)
            if route is not None:
                route[0].deliver(Delivery(route[1], Abort(tid, "sender lease expired")))
        events = self._leases.drain()
        for ev in events:
            self._route.pop(ev.transfer_id, None)
            self._pieces.pop(ev.transfer_id, None)
        return events

    def close(self) -> None:
        self._leases.fail_all(PeerGone("sender closed"))
