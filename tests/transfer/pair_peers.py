"""Peers that stop in the middle of a piece, for the pair-group abort tests (spawned processes; importable without
pytest). Each is the real dist backend with one fault: from layer `stall_layer` on, the sender sends the piece's
header but never its tensors, or the receiver admits the header but never posts the receive, as a process that froze
or died between the two would. The survivor, in the test process, is the code under test."""

from __future__ import annotations

import time
from typing import Any

from tests.helpers.kv import Cache, fingerprint, make_kv
from transfer.config import TransferConfig
from transfer.outbox import Outgoing
from transfer.pair_path import PairSend
from transfer.path import Peer, Session
from transfer.receiver import Receiver
from transfer.sender import Sender
from transfer.wire import PieceHeader


class HeaderOnlySender(Sender):
    """Sends the headers of layers >= stall_layer without their tensors."""

    stall_layer = 1

    def _send(self, peer: Peer, out: Outgoing) -> None:
        if out.piece is None or out.piece.layer < self.stall_layer or not isinstance(peer.path, PairSend):
            super()._send(peer, out)
            return
        p = out.piece
        tags = peer.path.link.next_tags(len(out.tensors))
        piece = PieceHeader(p.transfer_id, p.layer, p.blocks, p.wire, p.frames, p.fingerprint, tags)
        peer.sock.send(peer.seal(piece))


class NeverReceives(Receiver):
    """Admits the headers of layers >= stall_layer but never receives their tensors."""

    stall_layer = 1

    def _on_piece(self, sess: Session, piece: PieceHeader, bufs: list[Any]) -> None:
        if piece.layer < self.stall_layer:
            super()._on_piece(sess, piece, bufs)


def stalling_sender_main(address: str, tid: str, dst: list[int], out) -> None:
    fp = fingerprint("float32")
    s = HeaderOnlySender(fp, TransferConfig(group_timeout_s=30.0, lease_s=30.0), "dist")
    s.begin(tid, address)
    for layer in range(fp.num_layers):
        s.send_layer(tid, layer, dst, *make_kv(fp, layer, len(dst), seed=5))
    out.put("sent")
    time.sleep(3600)  # frozen: the test kills it


def stalling_receiver_main(tid: str, dst: list[int], out) -> None:
    fp = fingerprint("float32")
    r = NeverReceives(
        fp, Cache(fp).sink, "tcp://127.0.0.1:0", TransferConfig(group_timeout_s=30.0, deadline_s=60.0), "dist"
    )
    r.expect(tid, dst)
    out.put(r.address)
    end = time.monotonic() + 3600
    while time.monotonic() < end:
        r.poll()
        time.sleep(0.001)
