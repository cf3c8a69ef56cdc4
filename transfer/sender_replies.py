"""What the ZeroMQ KV sender does with its receivers' replies, and with peers that fall silent.

Why a module of its own: transfer/zmq_sender.py moves work outwards (caller API, command queue, encoding, sending);
this is the inward half of the same I/O thread, which decides what becomes of leases and peers:
    replies:  recv (NOBLOCK, one frame) -> _open (MAC under the handshake or session key, sequence, kind)
              -> _on_reply: welcome (session key, peer ready; _on_welcome is the shm/nccl hook), reject (peer
              dropped), ack / nack (lease released), renew (lease extended)
    timeouts: _check_timeouts each turn: no handshake within connect_timeout_s or a message stuck for
              send_timeout_s drops the peer (its leases fail); renew keepalives for live leases; expired leases
              send an abort; _sweep closes idle peers and, when the outboxes are full, drops what ended transfers
              left in them.
`SenderReplies` is a base class of ZmqSender, not usable alone: it works on the sender's state, declared below,
and runs only in the sender's I/O thread. Subclasses (transfer/shm_backend.py, transfer/dist_backend.py) override
these methods by the same names.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from transfer.auth import NO_SESSION, NONCE_BYTES, session_key, split, verify
from transfer.base import TransferConfig
from transfer.errors import AuthError, PeerGone, ProtocolError, TransferError, error_from_code
from transfer.outbox import Outgoing, Peer, discard_rest
from transfer.state import LeaseTable
from transfer.wire import field as hfield
from transfer.wire import unpack_header

log = logging.getLogger(__name__)


class SenderReplies:
    """Reply handling and the lease/peer timeouts of ZmqSender (see module docstring)."""

    # the sender's state these methods work on (set in ZmqSender.__init__)
    cfg: TransferConfig
    rejected: int
    _hs_key: bytes
    _leases: LeaseTable
    _peers: dict[str, Peer]
    _pieces: dict[str, int]
    _keepalive_s: float
    _next_sweep: float

    def _has_room(self) -> bool:
        """Whether the outboxes may take another command (ZmqSender)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ replies

    def _read_replies(self) -> bool:
        got = False
        for peer in list(self._peers.values()):
            for _ in range(256):
                try:
                    data = peer.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got = True
                try:
                    if peer.sock.getsockopt(zmq.RCVMORE):
                        discard_rest(peer.sock)
                        raise AuthError("a multipart reply (replies are one frame)")
                    self._on_reply(peer, self._open(peer, data))
                except TransferError as e:
                    self.rejected += isinstance(e, AuthError)
                    log.warning("bad reply from %s: %s", peer.address, e)
                if peer.address not in self._peers:
                    break
        return got

    def _open(self, peer: Peer, data: bytes) -> dict[str, Any]:
        """Check a reply's MAC (constant time), then decode it. Under the handshake key only a welcome (to our
        hello) or a reject can come; under the session key, ack/nack/renew in increasing sequence."""
        _, session, seq, body = split(data)
        if session == NO_SESSION:
            if not verify(self._hs_key, data):
                error = AuthError("unauthenticated reply")
                if peer.state == "hello_sent":  # the receiver answered our hello but cannot prove the secret
                    error = AuthError(
                        f"receiver {peer.address} refused or did not authenticate the handshake: "
                        "a different cluster secret?"
                    )
                    self._drop_peer(peer, error)
                raise error
            h = unpack_header(body)
            if h["kind"] == "reject" or h["kind"] == "welcome" and peer.state == "hello_sent":
                return h
            raise AuthError(f"unexpected {h['kind']!r:.20} under the handshake key")
        if not peer.key or session != peer.session or not verify(peer.key, data):
            raise AuthError("reply not authenticated for this session")
        if seq <= peer.seq_in:
            raise AuthError(f"replayed reply (sequence {seq} <= {peer.seq_in})")
        peer.seq_in = seq
        h = unpack_header(body)
        if h["kind"] not in ("ack", "nack", "renew"):
            raise ProtocolError(f"unexpected {h['kind']!r:.20} from the receiver")
        return h

    def _on_reply(self, peer: Peer, h: dict[str, Any]) -> None:
        kind = h["kind"]
        if kind == "welcome":
            if hfield(h, "nonce", bytes) != peer.nonce:
                raise AuthError("a welcome that does not answer our hello (replayed?)")
            session, rnonce = hfield(h, "session", bytes), hfield(h, "rnonce", bytes)
            if len(session) != len(NO_SESSION) or session == NO_SESSION or len(rnonce) != NONCE_BYTES:
                raise ProtocolError("malformed welcome")
            peer.session = session
            peer.key = session_key(self._hs_key, peer.nonce, rnonce, session)
            peer.max_frame_bytes = hfield(h, "max_frame_bytes", int)
            self._on_welcome(peer, h)
            peer.state = "ready"
            peer.last_sent = time.monotonic()  # the receiver's idle clock for this session starts about now
        elif kind == "reject":
            self._drop_peer(
                peer,
                error_from_code(
                    str(h.get("code")), f"receiver {peer.address} refused the handshake: {h.get('reason')}"
                ),
            )
        elif kind == "ack":
            self._leases.release(hfield(h, "tid", str))
        elif kind == "nack":
            err = error_from_code(str(h.get("code")), f"receiver: {h.get('reason')}")
            self._leases.release(hfield(h, "tid", str), err)
            if h.get("code") == "peer_gone":  # receiver no longer knows our session: start over
                self._drop_peer(peer, err)
        elif kind == "renew":
            self._leases.renew(hfield(h, "tid", str))

    def _on_welcome(self, peer: Peer, h: dict[str, Any]) -> None:
        """Hook for the nccl backend (forms the pair process group)."""

    # ------------------------------------------------------------------ timeouts and idle peers

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        for peer in list(self._peers.values()):
            if peer.state != "ready" and now - peer.created > self.cfg.connect_timeout_s:
                self._drop_peer(
                    peer,
                    PeerGone(
                        f"no handshake with {peer.address} within {self.cfg.connect_timeout_s}s (receiver not running?)"
                    ),
                )
            elif peer.stuck_since is not None and now - peer.stuck_since > self.cfg.send_timeout_s:
                self._drop_peer(
                    peer,
                    PeerGone(
                        f"could not send to {peer.address} for {self.cfg.send_timeout_s}s (receiver gone or stalled)"
                    ),
                )
        for tid, address in self._leases.due_keepalives(self._keepalive_s):
            kept = self._peers.get(address)
            if kept is not None and kept.state == "ready":  # tells the receiver we are alive
                kept.outbox.append(Outgoing(tid, {"kind": "renew", "tid": tid}))
        for tid, address in self._leases.expire():
            self._pieces.pop(tid, None)
            expired = self._peers.get(address)
            if expired is not None:
                expired.outbox.append(Outgoing(tid, {"kind": "abort", "tid": tid, "reason": "sender lease expired"}))
        if now >= self._next_sweep:
            self._next_sweep = now + min(0.05, self.cfg.idle_session_s / 8)
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Close peers that carry no lease and sent nothing for idle_session_s / 2 (the receiver drops its side
        after idle_session_s: closing first, we never send into a dropped session); when the outboxes are full,
        drop what they hold for transfers that ended meanwhile, so the live ones can move again."""
        busy = self._leases.peers()
        for peer in list(self._peers.values()):
            if (
                peer.state == "ready"
                and not peer.outbox
                and peer.address not in busy
                and now - peer.last_sent > self.cfg.idle_session_s / 2
            ):
                log.debug("closing idle kv peer %s", peer.address)
                self._close_peer(peer)
                self._peers.pop(peer.address, None)
        if not self._has_room():
            for peer in self._peers.values():
                peer.outbox.discard(
                    lambda o: o.fields.get("kind") != "abort" and self._leases.get(o.transfer_id) is None
                )

    def _drop_peer(self, peer: Peer, error: TransferError) -> None:
        self._close_peer(peer)
        self._peers.pop(peer.address, None)
        for tid in self._leases.release_peer(peer.address, error):
            self._pieces.pop(tid, None)

    def _close_peer(self, peer: Peer) -> None:
        peer.outbox.clear()
        if peer.link is not None:
            peer.link.close()
        peer.sock.close(linger=0)
