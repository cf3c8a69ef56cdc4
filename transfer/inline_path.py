"""The inline payload path: a piece's frames travel in its header's ZeroMQ message. Any receiver, any node; and what
every other path falls back on (a piece larger than a ring, an int8 wire to a receiver's cache).

sender    one piece: its sealed header, then its frames, zero-copy, xxh3 over the source; small pieces that wait
          together: one sealed `kvs` header and one payload frame they are copied into (64-byte aligned, xxh3 over
          each copy while in cache), one socket frame instead of two per piece on each side
receiver  the frames -> host.complete (lengths, xxh3, sink)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from transfer.errors import ProtocolError, TransferError
from transfer.outbox import Outgoing
from transfer.path import Peer, ReceiveHost, SendHost, Session
from transfer.wire import Named, PieceHeader, Pieces, batch_layout, frame_bytes, frame_view, with_checksums

BATCH_PIECE_BYTES = 256 << 10  # pieces up to this size share a message with those queued after them
BATCH_BYTES = 4 << 20  # at most this many payload bytes go in one message


def send_frames(peer: Peer, outs: Sequence[Outgoing], checksum: bool) -> None:
    """A piece, or several as one message (raises zmq.Again when it cannot leave now)."""
    if len(outs) == 1:
        _send_one(peer, outs[0], checksum)
    else:
        _send_batch(peer, outs, checksum)


def _send_one(peer: Peer, out: Outgoing, checksum: bool) -> None:
    """Payload frames after the header, checksummed over their source (once, even if the piece waits)."""
    assert out.piece is not None
    if checksum and any(f.xxh3 is None for f in out.piece.frames):
        out.message = with_checksums(out.piece, [frame_view(t) for t in out.tensors])
    header = peer.seal(out.message)
    peer.sock.send_multipart([header, *(frame_view(t) for t in out.tensors)], flags=zmq.NOBLOCK, copy=False)


def _send_batch(peer: Peer, outs: Sequence[Outgoing], checksum: bool) -> None:
    frames = [frame_bytes(t) for out in outs for t in out.tensors]
    offsets, total = batch_layout([f.nbytes for f in frames])
    payload = np.empty(total, dtype=np.uint8)
    for at, frame in zip(offsets, frames):
        np.copyto(payload[at : at + frame.nbytes], frame)
    headers: list[PieceHeader] = []
    i = 0
    for out in outs:
        piece = out.piece
        assert piece is not None
        n = len(piece.frames)
        if checksum:
            copies = [payload[at : at + f.nbytes] for at, f in zip(offsets[i : i + n], frames[i : i + n])]
            piece = with_checksums(piece, copies)
        headers.append(piece)
        i += n
    header = peer.seal(Pieces(pieces=tuple(headers)))
    peer.sock.send_multipart([header, payload.data], flags=zmq.NOBLOCK, copy=False)


class InlineSend:
    name = "inline"
    device_kv = False
    batch_piece_bytes, batch_bytes = BATCH_PIECE_BYTES, BATCH_BYTES
    command_budget = 64  # many: pieces ready together leave as one batch

    def __init__(self, checksum: bool) -> None:
        self.checksum = checksum

    def send(self, host: SendHost, peer: Peer, outs: Sequence[Outgoing]) -> None:
        send_frames(peer, outs, self.checksum)

    def collect(self) -> tuple[TransferError | None, list[tuple[str, TransferError]]]:
        return None, []

    def close(self) -> None:
        pass


class InlineReceive:
    def on_piece(self, host: ReceiveHost, sess: Session, piece: PieceHeader, frames: list[Any]) -> None:
        if piece.shm is not None or piece.tags is not None:
            raise ProtocolError("shm positions or p2p tags in a session without a ring or a pair group")
        host.complete(piece, frames)

    def on_bad_piece(self, host: ReceiveHost, sess: Session, h: PieceHeader | Named, error: TransferError) -> None:
        pass

    def poll(self, host: ReceiveHost, sess: Session) -> None:
        pass

    def alive(self) -> bool:
        return False

    def close(self, join_s: float = 0.0) -> None:
        pass


INLINE_RECEIVE = InlineReceive()
