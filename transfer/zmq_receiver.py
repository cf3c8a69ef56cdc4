"""ZeroMQ KV receiver: the decode side of the `zmq` backend (and the control half of `nccl`).

Data flow (all in the thread that calls `poll()`, never blocking):
    ROUTER socket <- [identity, header, frames...] from any number of sender DEALERs
    hello   -> fingerprint, secret and transport checked -> welcome(session token) or reject
    kv      -> session known? -> InboundTable.admit (checks, claims blocks) -> payload:
               zmq: the frames of this message (viewed in place) -> InboundTable.complete -> sink
               nccl: handed to the pair link, which receives it by torch.distributed (see dist_backend)
    finish  -> lost pieces fail now;   abort -> FAILED
    replies -> ack (DONE), nack (FAILED, with the error's code), renew (keeps the sender's lease alive)
A malformed message fails only the transfer it names (if any); the receiver keeps serving the others.
"""
from __future__ import annotations

import hmac
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import zmq

from transfer.base import KVReceiver, TransferConfig
from transfer.errors import FingerprintMismatch, PeerGone, ProtocolError, TransferError
from transfer.inbound import InboundTable, Sink
from transfer.sockets import bind_address, configure
from transfer.state import Inbound, TransferEvent
from transfer.wire import MAX_HEADER_BYTES, ModelFingerprint, PieceHeader, pack_header, unpack_header

log = logging.getLogger(__name__)
MAX_SESSIONS = 1024


@dataclass(slots=True)
class Session:
    identity: bytes
    transport: str
    link: Any = None  # nccl backend: the pair process group link


class ZmqReceiver(KVReceiver):
    """See module docstring. Not thread-safe: one thread calls expect/poll/abort."""

    transport = "zmq"

    def __init__(self, fingerprint: ModelFingerprint, sink: Sink, address: str,
                 config: TransferConfig | None = None) -> None:
        self.fp = fingerprint
        self.cfg = config or TransferConfig()
        self._table = InboundTable(fingerprint, sink, self.cfg.max_frame_bytes, self.cfg.deadline_s)
        self._sessions: dict[bytes, Session] = {}
        self._ctx = zmq.Context()
        self._sock = configure(self._ctx.socket(zmq.ROUTER), self.cfg,
                               max_msg_bytes=max(self.cfg.max_frame_bytes, MAX_HEADER_BYTES))
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # replies to vanished peers error, not vanish
        self._sock.bind(bind_address(address))
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.dropped = 0  # messages refused before they could be attributed to a transfer
        self._closed = False

    # ------------------------------------------------------------------ API

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], *, num_layers: int | None = None,
               deadline_s: float | None = None) -> None:
        self._table.expect(transfer_id, dst_block_ids, num_layers, deadline_s)

    def poll(self, max_messages: int = 256) -> list[TransferEvent]:
        if not self._closed:
            for _ in range(max_messages):
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(frames)
            self._poll_payloads()
            self._renew_and_expire()
        return self._table.drain()

    def wait(self, timeout_s: float) -> bool:
        if self._closed:
            return False
        return bool(self._sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN))

    def abort(self, transfer_id: str, reason: str = "aborted by receiver") -> None:
        rec = self._table.abort(transfer_id, reason)
        if rec is not None:
            self._nack(rec, "aborted", reason)

    def pending_transfers(self) -> list[str]:
        return self._table.ids()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for tid in self._table.ids():
            self._table.fail(tid, PeerGone("receiver closed"))
        for s in self._sessions.values():
            if s.link is not None:
                s.link.close()
        self._sock.close(linger=0)
        self._ctx.destroy(linger=0)

    # ------------------------------------------------------------------ messages

    def _handle(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            self.dropped += 1
            return
        identity = frames[0].bytes
        try:
            h = unpack_header(frames[1].buffer)
        except TransferError as e:
            self.dropped += 1
            log.warning("dropped undecodable message: %s", e)
            return
        kind = h["kind"]
        if kind == "hello":
            self._on_hello(identity, h)
            return
        session = h.get("session")
        sess = self._sessions.get(session) if isinstance(session, bytes) else None
        tid = h.get("tid")
        if sess is None:
            self.dropped += 1
            if isinstance(tid, str):
                self._send(identity, {"kind": "nack", "tid": tid, "code": PeerGone.code,
                                      "reason": "unknown session (receiver restarted?): handshake again"})
            return
        sess.identity = identity  # a reconnected DEALER may come back under a new routing id
        if not isinstance(tid, str):
            self.dropped += 1
            return
        rec = self._table.get(tid)
        try:
            if kind == "kv":
                piece = self._table.admit(session, h)
                self._on_piece(sess, piece, [f.buffer for f in frames[2:]])
            elif kind == "finish" and isinstance(h.get("pieces"), int):
                self._table.on_finish(session, tid, h["pieces"])
            elif kind == "renew":
                self._table.heard(tid, session)
                return
            elif kind == "abort" and rec is not None and rec.session in (None, session):
                self._table.abort(tid, f"sender aborted: {str(h.get('reason'))[:200]}")
                return
            else:
                self.dropped += 1
        except TransferError as e:
            if kind == "kv":
                self._on_bad_piece(sess, session, h)
            if rec is not None and rec.session in (None, session):
                self._fail(tid, e)
            else:
                self.dropped += 1
                log.warning("dropped message for transfer %r: %s", tid, e)
                if rec is None:  # not ours (never expected, or already ended): free the sender now
                    self._send(sess.identity, {"kind": "nack", "tid": tid, "code": e.code,
                                               "reason": str(e)[:1000]})
            return
        if rec is not None and self._table.get(tid) is None:
            self._send(sess.identity, {"kind": "ack", "tid": tid})

    def _on_hello(self, identity: bytes, h: dict[str, Any]) -> None:
        try:
            fp = ModelFingerprint.from_wire(h.get("fp"))
            if fp != self.fp:
                raise FingerprintMismatch(f"sender model {fp} != receiver model {self.fp}")
            secret = h.get("secret")
            if not isinstance(secret, str) or not hmac.compare_digest(
                    secret.encode(), (self.cfg.secret or "").encode()):
                raise ProtocolError("wrong shared secret")
            if h.get("transport") != self.transport:
                raise ProtocolError(f"sender uses transport {h.get('transport')!r:.20}, "
                                    f"receiver {self.transport!r}")
            session = os.urandom(16)
            extra = self._welcome_extra(session, h)
        except TransferError as e:
            log.warning("refused handshake: %s", e)
            self._send(identity, {"kind": "reject", "code": e.code, "reason": str(e)})
            return
        if len(self._sessions) >= MAX_SESSIONS:
            old = next(iter(self._sessions))
            stale = self._sessions.pop(old)
            if stale.link is not None:
                stale.link.close()
        self._sessions[session] = Session(identity, self.transport, extra.pop("_link", None))
        self._send(identity, {"kind": "welcome", "session": session,
                              "max_frame_bytes": self.cfg.max_frame_bytes, **extra})

    def _welcome_extra(self, session: bytes, h: dict[str, Any]) -> dict[str, Any]:
        """Hook for the nccl backend: pair-group rendezvous info (and its link under "_link")."""
        return {}

    def _on_piece(self, sess: Session, piece: PieceHeader, bufs: list[Any]) -> None:
        """zmq: the payload came with the header."""
        self._table.complete(piece, bufs)

    def _on_bad_piece(self, sess: Session, session: bytes, h: dict[str, Any]) -> None:
        """Hook for the nccl backend: the refused piece's tensors are still on their way."""

    def _poll_payloads(self) -> None:
        """Hook for the nccl backend: finish pieces whose tensors arrived by torch.distributed."""

    # ------------------------------------------------------------------ replies, timers

    def _fail(self, tid: str, error: TransferError) -> None:
        rec = self._table.fail(tid, error)
        if rec is not None:
            self._nack(rec, error.code, str(error))

    def _nack(self, rec: Inbound, code: str, reason: str) -> None:
        sess = self._sessions.get(rec.session) if rec.session else None
        if sess is not None:
            self._send(sess.identity, {"kind": "nack", "tid": rec.transfer_id, "code": code,
                                       "reason": reason[:1000]})

    def _send(self, identity: bytes, fields: dict[str, Any]) -> None:
        try:
            self._sock.send_multipart([identity, pack_header(fields)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # peer gone or not reading: its lease expiry covers it

    def _renew_and_expire(self) -> None:
        for rec in self._table.expire(silence_s=self.cfg.lease_s):
            self._nack(rec, "timeout", "receiver deadline passed or sender silent")
        now = time.monotonic()
        every = self.cfg.lease_s / 3
        for rec in self._table.items():
            if rec.session is not None and now - rec.last_renew >= every:
                rec.last_renew = now
                sess = self._sessions.get(rec.session)
                if sess is not None:
                    self._send(sess.identity, {"kind": "renew", "tid": rec.transfer_id})
