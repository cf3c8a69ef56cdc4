"""The direct payload path: a same-node sender writes KV into the receiver's cache (backends `shm` and `auto` on a
CPU; `nccl`, `shm` and `auto` on a GPU the sender sees, through CUDA IPC instead of an NCCL pair or a ring).

welcome   [socket, token, blocks] (+ [gpu, IPC handles]) of the receiver's transfer/kv_segment.py segment, to a
          sender in its node and PID namespace, which proves the token on the socket for the cache's descriptors
          (transfer/fd_pass.py); expect() tags the reserved blocks with the transfer's owner tag
sender    per piece, under the segment's flock: check the blocks' tags, copy K and V in, xxh3 of the destination
          (host caches); then the header with `direct` and no payload frames
receiver  admit -> xxh3 over the destination blocks -> count it (no sink: the bytes are in place)
Pieces of a sender that cannot write directly (an int8 wire, or some of a block's heads only: a tensor-parallel
sender's share) come inline in the same session.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from transfer.errors import ProtocolError, TransferError
from transfer.inline_path import InlineReceive, send_frames
from transfer.kv_segment import DirectPiece, KVSegment, SegmentWriter
from transfer.outbox import Outgoing
from transfer.path import Peer, ReceiveHost, SendHost, Session
from transfer.wire import PieceHeader, Pieces, with_digests


def _name(on_device: bool) -> str:
    return "cuda-ipc" if on_device else "shm-direct"  # as /status names the peer's path


class DirectSend:
    # only headers travel: pieces of any size are announced together, up to a few layers' worth, so that the
    # receiver's checks still run while later layers are written
    batch_piece_bytes, batch_bytes = 8 << 20, 8 << 20
    command_budget = 64

    def __init__(self, writer: SegmentWriter, checksum: bool, raw_wire: bool) -> None:
        self.writer = writer
        self.name = _name(writer.on_device)
        self.device_kv = writer.on_device  # a GPU cache takes device KV device to device, never through the host
        self.checksum = checksum
        self.raw_wire = raw_wire  # an int8 wire is for the network: its pieces go as frames

    def send(self, host: SendHost, peer: Peer, outs: Sequence[Outgoing]) -> None:
        """Each piece written, then one message announcing them all (a batch of one is taken as any); a piece whose
        blocks are not its transfer's any more fails that transfer only."""
        if not self.raw_wire:
            send_frames(peer, outs, self.checksum)
            return
        some = [out for out in outs if out.piece is not None and out.piece.heads is not None]
        if some:  # some of the receiver's heads in each block: strided, so as frames (a tensor-parallel sender)
            send_frames(peer, some, self.checksum)
            outs = [out for out in outs if out.piece is None or out.piece.heads is None]
            if not outs:
                return
        if not int(peer.sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
            raise zmq.Again()
        pieces = [_direct_piece(out) for out in outs]
        digest = self.checksum and not self.writer.on_device  # as over NCCL: no hash of device memory
        headers = []
        for out, result in zip(outs, self.writer.write_all(pieces, digest)):
            piece = out.piece
            assert piece is not None
            if isinstance(result, ProtocolError):
                host.fail_transfer(peer, piece.transfer_id, result)
                continue
            headers.append(
                msgspec.structs.replace(piece if result is None else with_digests(piece, result), direct=True)
            )
        if headers:
            peer.sock.send(peer.seal(Pieces(pieces=tuple(headers))), zmq.NOBLOCK)
        host.count_pieces(self.name, len(headers))

    def collect(self) -> tuple[TransferError | None, list[tuple[str, TransferError]]]:
        return None, []

    def close(self) -> None:
        self.writer.close()


class DirectReceive(InlineReceive):
    """A session of the direct path: its pieces are in place, or inline frames (an int8 wire)."""

    def __init__(self, segment: KVSegment) -> None:
        self.segment = segment  # the receiver's (its engine's cache), not the session's: closing a session leaves it
        self.name = _name(segment.on_device)

    def on_piece(self, host: ReceiveHost, sess: Session, piece: PieceHeader, frames: list[Any]) -> None:
        if not piece.direct:
            super().on_piece(host, sess, piece, frames)
            return
        if frames or piece.shm is not None or piece.tags is not None:
            raise ProtocolError("a direct piece with payload frames, shm positions or p2p tags")
        self.segment.verify(piece.layer, piece.blocks, piece.frames)
        host.land(piece)
        host.count_pieces(self.name, 1)


def _direct_piece(out: Outgoing) -> DirectPiece:
    piece = out.piece
    assert piece is not None
    k, v = out.tensors
    return DirectPiece(piece.transfer_id, piece.layer, piece.blocks, k, v, out.ready)
