"""The direct payload path: a same-node sender writes KV into the receiver's cache (backends `shm` and `auto` on a
CPU; `nccl`, `shm` and `auto` on a GPU the sender sees, through CUDA IPC instead of an NCCL pair or a ring).

welcome   [pid, fd, token, blocks] (+ [gpu, IPC handles]) of the receiver's transfer/kv_segment.py segment, to a
          sender in its node and PID namespace; expect() tags the reserved blocks with the transfer's owner tag
sender    per piece, under the segment's flock: check the blocks' tags, copy K and V in, xxh3 of the destination
          (host caches); then the header with `direct` and no payload frames
receiver  admit -> xxh3 over the destination blocks -> count it (no sink: the bytes are in place)
Pieces of a sender that cannot write directly (an int8 wire) come inline in the same session.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from transfer.errors import ProtocolError
from transfer.kv_segment import DirectPiece, KVSegment, SegmentWriter
from transfer.outbox import Outgoing, Peer
from transfer.receiver import InlineReceive, Receiver
from transfer.sessions import Session
from transfer.wire import PieceHeader, Pieces, with_digests

if TYPE_CHECKING:
    from transfer.sender import Sender


class DirectSend:
    batches = True
    # only headers travel: pieces of any size are announced together, up to a few layers' worth, so that the
    # receiver's checks still run while later layers are written
    batch_piece_bytes, batch_bytes = 8 << 20, 8 << 20

    def __init__(self, writer: SegmentWriter) -> None:
        self.writer = writer
        self.name = "cuda-ipc" if writer.on_device else "shm-direct"  # as /status names the peer's path
        self.device_kv = writer.on_device  # a GPU cache takes device KV device to device, never through the host

    def send(self, sender: Sender, peer: Peer, out: Outgoing) -> None:
        if sender.cfg.kv_wire_dtype != "raw":
            sender.send_inline(peer, out)  # an int8 wire is for the network: its pieces go as frames
            return
        self.send_batch(sender, peer, [out])  # a batch of one: the receiver takes it as any

    def send_batch(self, sender: Sender, peer: Peer, outs: list[Outgoing]) -> None:
        """Each piece written, then one message announcing them all; a piece whose blocks are not its transfer's
        any more fails that transfer only."""
        if sender.cfg.kv_wire_dtype != "raw":
            sender.send_inline_batch(peer, outs)
            return
        if not int(peer.sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
            raise zmq.Again()
        pieces = [_direct_piece(out) for out in outs]
        digest = sender.cfg.checksum and not self.writer.on_device  # as over NCCL: no hash of device memory
        headers = []
        for out, result in zip(outs, self.writer.write_all(pieces, digest)):
            piece = out.piece
            assert piece is not None
            if isinstance(result, ProtocolError):
                sender.fail_transfer(peer, piece.transfer_id, result)
                continue
            headers.append(
                msgspec.structs.replace(piece if result is None else with_digests(piece, result), direct=True)
            )
        if headers:
            peer.sock.send(sender.seal_for(peer, Pieces(pieces=tuple(headers))), zmq.NOBLOCK)
        sender.direct_pieces += len(headers)

    def collect(self) -> tuple[None, list[Any]]:
        return None, []

    def close(self) -> None:
        self.writer.close()


class DirectReceive(InlineReceive):
    """A session of the direct path: its pieces are in place, or inline frames (an int8 wire)."""

    def __init__(self, segment: KVSegment) -> None:
        self.segment = segment  # the receiver's (its engine's cache), not the session's: closing a session leaves it

    def on_piece(self, receiver: Receiver, sess: Session, piece: PieceHeader, bufs: list[Any]) -> None:
        if not piece.direct:
            super().on_piece(receiver, sess, piece, bufs)
            return
        if bufs or piece.shm is not None or piece.tags is not None:
            raise ProtocolError("a direct piece with payload frames, shm positions or p2p tags")
        self.segment.verify(piece.layer, piece.blocks, piece.frames)
        receiver._table.landed(piece)
        receiver.direct_pieces += 1


def _direct_piece(out: Outgoing) -> DirectPiece:
    piece = out.piece
    assert piece is not None
    k, v = out.tensors
    return DirectPiece(piece.transfer_id, piece.layer, piece.blocks, k, v, out.ready)
