"""The shared-memory payload path (backends `shm`, `auto`, and `nccl` between two workers on one GPU).

address   "shm+ipc://path" or "shm+tcp://host:port": the receiver's ZeroMQ control address, marked as offering a
          ring; headers, handshake, checks and replies are those of every socket backend (transfer/path.py)
welcome   on the sender's node: [name, size, token] of a ring the receiver made for this session
          (transfer/shm_ring.py); another node, no room in /dev/shm or `max_rings` reached: inline frames
sender    per piece: wait for room, copy the frames in, xxh3 over the copy, send the header with `shm`
          [positions..., end]; a piece larger than the whole ring goes inline
receiver  check the positions against its own ring -> views -> length and xxh3 checks -> sink -> release
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

from transfer.errors import ProtocolError, TransferError
from transfer.inline_path import send_frames
from transfer.outbox import Outgoing
from transfer.path import Peer, ReceiveHost, SendHost, Session
from transfer.shm_ring import RingOwner, RingWriter, ShmUnavailable, node_id
from transfer.wire import Hello, Named, PieceHeader, with_checksums

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


class NoRoom(zmq.Again):
    """The ring has no room for the piece yet: the sender treats it as a full socket, and naps with `wait`."""

    def __init__(self, wait: Callable[[threading.Event], None]) -> None:
        super().__init__()
        self.wait = wait


class RingSend:
    name = "shm-ring"
    device_kv = False
    batch_piece_bytes = batch_bytes = 0  # one piece a message: each is copied in as soon as it is encoded
    command_budget = 2  # ... so encoding and ring copies interleave, and the receiver starts at once

    def __init__(self, ring: RingWriter, checksum: bool) -> None:
        self.ring = ring
        self.checksum = checksum

    def send(self, host: SendHost, peer: Peer, outs: Sequence[Outgoing]) -> None:
        [out] = outs
        assert out.piece is not None
        sizes = [f.nbytes for f in out.piece.frames]
        if not self.ring.fits(sizes):
            send_frames(peer, outs, self.checksum)  # larger than the whole ring
            return
        if not int(peer.sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
            raise zmq.Again()  # copy only what can leave now
        where = self.ring.reserve(sizes)
        if where is None:
            end = self.ring.end_of(sizes)
            raise NoRoom(lambda stop: self._wait_for_room(stop, end))
        copies = [self.ring.write(pos, t) for pos, t in zip(where, out.tensors)]
        # xxh3 over the copy, just written and still in cache: the receiver checks the very bytes it reads
        piece = with_checksums(out.piece, copies) if self.checksum else out.piece
        peer.sock.send(peer.seal(msgspec.structs.replace(piece, shm=where)), zmq.NOBLOCK)
        self.ring.commit(where[-1])  # after the send: a zmq.Again above commits nothing, the next try rewrites it
        host.count_pieces(self.name, 1)

    def _wait_for_room(self, stop: threading.Event, end: int) -> None:
        """Nap on the ring's tail only (a few µs a look) for up to RING_WAIT_S, not on turns of the whole I/O loop
        (tens of µs of Python each, on the core the receiver needs to free the room)."""
        nap, until = RING_POLL_S, time.monotonic() + RING_WAIT_S
        while not stop.wait(nap) and not self.ring.has_room(end) and time.monotonic() < until:
            nap = min(2 * nap, RING_NAP_MAX_S)

    def collect(self) -> tuple[TransferError | None, list[tuple[str, TransferError]]]:
        return None, []

    def close(self) -> None:
        self.ring.close()


class RingReceive:
    name = "shm-ring"

    def __init__(self, ring: RingOwner) -> None:
        self.ring = ring

    @classmethod
    def offer(cls, hello: Hello, ring_bytes: int, rings_held: int, max_rings: int) -> RingReceive | None:
        """A ring for a sender on this node, if one can be had (else its KV goes inline)."""
        if hello.node != node_id():
            return None  # another node (or a sender that cannot map)
        if rings_held >= max_rings:
            log.warning("%d sender sessions hold a ring already: this one goes inline", max_rings)
            return None
        try:
            return cls(RingOwner(ring_bytes))
        except (ShmUnavailable, OSError) as e:
            log.warning("no shared-memory ring for a sender session, KV goes inline: %s", e)
            return None

    def on_piece(self, host: ReceiveHost, sess: Session, piece: PieceHeader, frames: list[Any]) -> None:
        where = piece.shm
        if piece.tags is not None:
            raise ProtocolError("p2p tags in a session without a pair group")
        if where is None:
            host.complete(piece, frames)  # inline frames (a piece larger than the ring)
            return
        if frames:
            raise ProtocolError("shm positions and inline frames in one message")
        sizes: Sequence[int] = [f.nbytes for f in piece.frames]  # checked by admit against our own fingerprint
        views, end = self.ring.views(where, sizes)
        try:
            host.complete(piece, views)  # lengths, xxh3, sink (which copies out)
        finally:
            del views
            self.ring.release(end)
        host.count_pieces(self.name, 1)

    def on_bad_piece(self, host: ReceiveHost, sess: Session, h: PieceHeader | Named, error: TransferError) -> None:
        """A refused piece's region is free again at once (its positions' end, if it is a sane one)."""
        where = h.shm
        if isinstance(where, list) and where:
            self.ring.release(where[-1])

    def poll(self, host: ReceiveHost, sess: Session) -> None:
        pass

    def alive(self) -> bool:
        return False  # no thread of its own (the receiver keeps closed links until their thread ends)

    def close(self, join_s: float = 0.0) -> None:
        self.ring.close()
