"""`shm` backend (and `auto`): KV payload through a shared-memory ring, everything else exactly as the zmq backend.

The classes subclass ZmqSender / ZmqReceiver and replace only how payload frames travel, so the hello/welcome handshake
(cluster secret, session keys, sequence numbers), the wire header (fingerprint, transfer id, layer, destination blocks,
dtypes, shapes, byte counts, xxh3_64), the receiver's checks, leases, deadlines, session and outbox bounds, acks, nacks
and aborts are the same code. Data flow:

    address    "shm+ipc://path" or "shm+tcp://host:port": a zmq control address the receiver binds, marked as
               offering shared memory; a plain "tcp://" or "ipc://" address is a zmq receiver (spoken to as zmq)
    hello      S->R transport "shm" and the sender's node id (transfer/shm_ring.py node_id)
    welcome    R->S on the same node: `shm` [name, size, token] of a ring the receiver just created for this session
               (transfer/shm_ring.py); another node, no room in /dev/shm, or `max_rings` reached: no ring
    sender     maps the ring (name pattern, owner, size and token checked), unlinks its name; per piece: encode (xxh3
               over the source, as zmq), wait for room (the receiver's tail in the ring), copy the frames in, send the
               sealed header alone with `shm` [positions..., end]
    receiver   admit the header (all zmq checks) -> check the positions against its own ring (shm_ring.check_positions)
               -> views over the ring -> length and xxh3 checks -> sink -> release the region (tail = end)
A piece larger than the whole ring, or any piece of a session without a ring, travels inline as zmq frames over the
same session, so `auto` is zmq across nodes and shared memory within one. The ring is per session: its name is
unlinked as soon as the sender mapped it, and again (if still there) when the session ends on the receiver
(done, expiry, close); a sender drops its mapping with the peer (send timeout, lease expiry, close).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import zmq

from transfer.base import TransferConfig
from transfer.errors import ProtocolError
from transfer.inbound import Sink
from transfer.outbox import Outgoing, Peer, check_peer_frame_bound
from transfer.sessions import Session
from transfer.shm_ring import (
    MAX_RING_BYTES,
    MIN_RING_BYTES,
    RingOwner,
    RingWriter,
    ShmUnavailable,
    node_id,
    sweep_stale,
)
from transfer.wire import ModelFingerprint, PieceHeader, frame_view, pack_header, with_checksums
from transfer.zmq_receiver import ZmqReceiver
from transfer.zmq_sender import ZmqSender

log = logging.getLogger(__name__)

SCHEME = "shm+"
DEFAULT_RING_BYTES = 32 << 20  # per sender session: pieces up to this size go through it, larger ones inline
DEFAULT_MAX_RINGS = 16  # per receiver: at most this many sessions hold a ring (16 x 32 MiB of /dev/shm)
RING_POLL_S = 5e-5  # the sender's first nap while the ring is full: the receiver frees room as fast as it copies
RING_NAP_MAX_S = 5e-4  # naps double up to this while the ring stays full (a 2 MiB piece is copied out in ~0.3 ms)
RING_WAIT_S = 2e-3  # at most this long in one wait for room, then the I/O loop looks at commands and replies again


def control_address(address: str) -> str:
    """The ZeroMQ address behind a shm address ("shm+tcp://h:p" -> "tcp://h:p"); plain addresses are unchanged."""
    return address[len(SCHEME) :] if address.startswith(SCHEME) else address


class ShmSender(ZmqSender):
    """ZmqSender whose pieces go through the receiver's ring when it announced one (see module docstring)."""

    transport = "shm"

    def __init__(self, fingerprint: ModelFingerprint, config: TransferConfig | None = None) -> None:
        self._ring_wait: tuple[RingWriter, int] | None = None  # set by _send (I/O thread): a piece waits for room
        self.shm_pieces = 0  # pieces that went through a ring (the rest went inline)
        super().__init__(fingerprint, config)

    def _connect(self, address: str) -> Peer:
        """A socket to the control address; the peer stays keyed by the full address its leases name."""
        target = control_address(address)
        if target == address:
            return super()._connect(address)
        plain = self._peers.get(target)  # a zmq receiver at the same control address: keep it
        peer = super()._connect(target)
        if plain is not None:
            self._peers[target] = plain
        else:
            del self._peers[target]
        peer.address = address
        self._peers[address] = peer
        return peer

    def _hello_fields(self, peer: Peer) -> dict[str, Any]:
        fields = super()._hello_fields(peer)
        if peer.address.startswith(SCHEME):
            fields["node"] = node_id()
        else:
            fields["transport"] = "zmq"  # a plain zmq receiver: speak zmq to it
        return fields

    def _on_welcome(self, peer: Peer, h: dict[str, Any]) -> None:
        announced = h.get("shm")
        if announced is None:
            if peer.address.startswith(SCHEME):
                log.info("receiver %s gave no shared-memory ring (another node?): KV goes inline", peer.address)
            return
        try:
            peer.link = RingWriter.open(announced)  # closed with the peer (ZmqSender._close_peer)
        except (ShmUnavailable, OSError) as e:
            log.warning("KV to %s goes inline over ZeroMQ: %s", peer.address, e)

    def _drain_commands(self, budget: int = 64) -> bool:
        """A few commands at a time, so that encoding (the sender's checksum pass) and ring copies interleave and the
        receiver starts on the first piece at once."""
        return super()._drain_commands(min(budget, 2))

    def _send(self, peer: Peer, out: Outgoing) -> None:
        ring: RingWriter | None = peer.link
        if out.piece is None:
            super()._send(peer, out)
            return
        if ring is None:
            self._send_inline(peer, out)
            return
        check_peer_frame_bound(peer, out.piece)
        sizes = [f.nbytes for f in out.piece.frames]
        if not ring.fits(sizes):
            self._send_inline(peer, out)  # larger than the whole ring
            return
        if not int(peer.sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
            raise zmq.Again()  # copy only what can leave now
        where = ring.reserve(sizes)
        if where is None:
            self._ring_wait = (ring, ring.end_of(sizes))
            raise zmq.Again()  # the receiver has not freed room yet: stuck logic, send_timeout_s as for a full HWM
        copies = [ring.write(pos, t) for pos, t in zip(where, out.tensors)]
        # xxh3 over the ring's copy, just written and still in cache (a second pass over the source would read it
        # from memory again): the receiver checks the very bytes it reads
        piece = with_checksums(out.piece, copies) if self.cfg.checksum else out.piece
        header = self._seal(peer, pack_header({**piece.to_wire(peer.session), "shm": where}))
        peer.sock.send(header, zmq.NOBLOCK)  # raises zmq.Again: nothing committed, the next try rewrites it
        ring.commit(where[-1])
        self.shm_pieces += 1

    @property
    def _checksum_early(self) -> bool:
        return False  # _send checksums the ring's copy, or the source just before a piece goes inline

    def _send_inline(self, peer: Peer, out: Outgoing) -> None:
        """A piece as zmq payload frames (no ring, or larger than it), checksummed over its source first."""
        assert out.piece is not None
        if self.cfg.checksum and any(f.xxh3 is None for f in out.piece.frames):
            out.piece = with_checksums(out.piece, [frame_view(t) for t in out.tensors])  # once, even if it waits
        super()._send(peer, out)

    def _read_replies(self) -> bool:
        """Ask the sockets whether a reply waits (~1 µs each) before reading: the I/O loop turns once or twice per
        piece, and a read that finds nothing raises zmq.Again (~20 µs of Python on this box, 1.3 ms per 64 MiB)."""
        if not any(int(p.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN for p in self._peers.values()):
            return False
        return super()._read_replies()

    def _idle_wait(self) -> None:
        """A piece waits for room: nap and look at the ring's tail only (a few µs), not the whole I/O loop (tens of
        µs of Python per turn, on the core the receiver needs to free the room), for up to RING_WAIT_S."""
        if self._ring_wait is None:
            super()._idle_wait()
            return
        ring, end = self._ring_wait
        self._ring_wait = None
        nap, until = RING_POLL_S, time.monotonic() + RING_WAIT_S
        while not self._stop.wait(nap) and not ring.has_room(end) and time.monotonic() < until:
            nap = min(2 * nap, RING_NAP_MAX_S)


class ShmReceiver(ZmqReceiver):
    """ZmqReceiver that gives each sender session on its node a ring and reads pieces from it (module docstring)."""

    transport = "shm"

    def __init__(
        self,
        fingerprint: ModelFingerprint,
        sink: Sink,
        address: str,
        config: TransferConfig | None = None,
        *,
        ring_bytes: int = DEFAULT_RING_BYTES,
        max_rings: int = DEFAULT_MAX_RINGS,
    ) -> None:
        if not MIN_RING_BYTES <= ring_bytes <= MAX_RING_BYTES or max_rings < 0:
            raise ValueError(f"ring_bytes must be in [{MIN_RING_BYTES}, {MAX_RING_BYTES}] and max_rings >= 0")
        self.ring_bytes, self.max_rings = ring_bytes, max_rings
        self._header: dict[str, Any] | None = None  # the authenticated header being handled (see _decode)
        self.shm_pieces = 0  # pieces read from a ring (the rest came inline)
        swept = sweep_stale()
        if swept:
            log.info("unlinked %d shared-memory rings of dead receivers", swept)
        super().__init__(fingerprint, sink, control_address(address), config)
        self.address = SCHEME + self.address

    def rings(self) -> int:
        """Sessions that hold a ring now."""
        return sum(1 for s in self._sessions.values() if s.link is not None)

    def _welcome_extra(self, session: bytes, key: bytes, h: dict[str, Any]) -> dict[str, Any]:
        if h.get("node") != node_id():
            return {}  # another node (or a sender that cannot map): inline frames
        if self.rings() >= self.max_rings:
            log.warning("%d sender sessions hold a ring already: this one goes inline", self.max_rings)
            return {}
        try:
            ring = RingOwner(self.ring_bytes)
        except (ShmUnavailable, OSError) as e:
            log.warning("no shared-memory ring for a sender session, KV goes inline: %s", e)
            return {}
        return {"shm": ring.announce(), "_link": ring}

    def _decode(self, body: memoryview) -> dict[str, Any] | None:
        """Keep the header _handle is about to act on: its `shm` positions are read in _on_piece / _on_bad_piece."""
        self._header = super()._decode(body)
        return self._header

    def _on_piece(self, sess: Session, piece: PieceHeader, bufs: list[Any]) -> None:
        where = self._header.get("shm") if self._header is not None else None
        if where is None:
            super()._on_piece(sess, piece, bufs)  # inline frames, checked as on zmq
            return
        ring: RingOwner | None = sess.link
        if ring is None or bufs:
            raise ProtocolError("shm positions in a session without a ring, or with inline frames as well")
        sizes: Sequence[int] = [f.nbytes for f in piece.frames]  # checked by admit against our own fingerprint
        views, end = ring.views(where, sizes)
        try:
            self._table.complete(piece, views)  # lengths, xxh3, sink (which copies out)
        finally:
            del views
            ring.release(end)
        self.shm_pieces += 1

    def _on_bad_piece(self, sess: Session, session: bytes, h: dict[str, Any]) -> None:
        """A refused piece's region is free again at once (its positions' end, if it is a sane one)."""
        where = h.get("shm")
        if sess.link is not None and isinstance(where, list) and where:
            sess.link.release(where[-1])
