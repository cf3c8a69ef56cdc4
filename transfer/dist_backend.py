"""`nccl` backend: headers over ZeroMQ, KV tensors by torch.distributed point-to-point in a pair group.

Same protocol and state machines as `zmq` (it subclasses ZmqSender / ZmqReceiver); only the payload path
differs:
    sender I/O thread:  hello(transport="dist") -> welcome(store_port) -> PairLink(rank 1), whose store prefix and
                        first exchange (a proof of the session key each way) come from the session key
                        per piece: send the header (with one p2p tag per frame, no payload frames)
                        over ZeroMQ, then hand the tensors to the link thread (pg.send, bounded wait)
    receiver poll():    admit header -> allocate the frame tensors -> link thread (pg.recv, bounded
                        wait) -> next poll(): checksum (CPU tensors) -> sink -> ack when complete
The pair group is NCCL when TransferConfig.device is "cuda" and gloo on "cpu" (how it is tested).
Ranks and rendezvous are explained in transfer/pairgroup.py and docs/transfer.md. Nothing is allocated from a
header before `InboundTable.admit` checked it (dtype and shape re-derived from our fingerprint, nbytes equal to
shape x itemsize and under max_frame_bytes); a refused piece's scratch buffers are sized only after the same
per-frame checks.
"""

from __future__ import annotations

from typing import Any

import torch
import zmq

from transfer.auth import pair_group_key
from transfer.base import TransferConfig
from transfer.errors import PeerGone, ProtocolError, TransferError
from transfer.inbound import Sink
from transfer.outbox import Outgoing, Peer, check_peer_frame_bound
from transfer.pairgroup import LinkJob, PairLink, host_of, local_ip_towards, make_store_server
from transfer.sessions import Session
from transfer.wire import ModelFingerprint, PieceHeader, dtype_from_name, frame_nbytes, pack_header
from transfer.wire import field as hfield
from transfer.zmq_receiver import ZmqReceiver
from transfer.zmq_sender import ZmqSender


def _pg_backend(cfg: TransferConfig) -> str:
    return "nccl" if cfg.device.startswith("cuda") else "gloo"


class DistSender(ZmqSender):
    transport = "dist"

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        """gloo moves host tensors; NCCL moves device tensors (no host staging at all)."""
        return t.detach().to(self.cfg.device).contiguous()

    def _on_welcome(self, peer: Peer, h: dict[str, Any]) -> None:
        host = host_of(peer.address)
        peer.link = PairLink(
            backend=_pg_backend(self.cfg),
            rank=1,
            key=pair_group_key(peer.key),
            store_host=host,
            store_port=hfield(h, "store_port", int),
            local_host=local_ip_towards(host),
            timeout_s=self.cfg.group_timeout_s,
            auth_key=peer.key,
            on_crash=self._note_link_crash,
        )

    def _send(self, peer: Peer, out: Outgoing) -> None:
        if out.piece is None:
            super()._send(peer, out)
            return
        if peer.link.broken is not None:
            raise zmq.Again()  # _check_timeouts drops the peer
        check_peer_frame_bound(peer, out.piece)
        tags = peer.link.next_tags(len(out.tensors))
        piece = PieceHeader(
            out.piece.transfer_id,
            out.piece.layer,
            out.piece.blocks,
            out.piece.wire,
            out.piece.frames,
            out.piece.fingerprint,
            tags,
        )
        peer.sock.send(self._seal(peer, pack_header(piece.to_wire(peer.session))), zmq.NOBLOCK)
        # Header left: its tensors must follow, in order, or the pair's p2p stream desynchronizes.
        peer.link.submit(LinkJob(out.transfer_id, out.tensors, tags))

    def _check_timeouts(self) -> None:
        for peer in list(self._peers.values()):
            if peer.link is None:
                continue
            for job, err in peer.link.pop_done():
                if err is not None:
                    self._leases.release(job.transfer_id, err)
            if peer.link.broken is not None:
                self._drop_peer(peer, peer.link.broken)
        super()._check_timeouts()


class DistReceiver(ZmqReceiver):
    transport = "dist"

    def __init__(
        self, fingerprint: ModelFingerprint, sink: Sink, address: str, config: TransferConfig | None = None
    ) -> None:
        super().__init__(fingerprint, sink, address, config)
        self._store: torch.distributed.TCPStore | None = (
            None  # made at the first handshake: idle receivers cost nothing
        )

    def _welcome_extra(self, session: bytes, key: bytes, h: dict[str, Any]) -> dict[str, Any]:
        host = host_of(self.address)  # the store listens on our own address only, never on every interface
        if self._store is None:
            self._store = make_store_server(host, self.cfg.group_timeout_s)
        link = PairLink(
            backend=_pg_backend(self.cfg),
            rank=0,
            key=pair_group_key(key),
            store_host=host,
            store_port=self._store.port,
            local_host=host,
            timeout_s=self.cfg.group_timeout_s,
            store=self._store,
            auth_key=key,
            on_crash=self._note_link_crash,
        )
        return {"store_port": self._store.port, "_link": link}

    def wait(self, timeout_s: float) -> bool:
        """Payloads complete in link threads, not on the socket: wait at most 1 ms at a time."""
        return super().wait(min(timeout_s, 0.001))

    def _on_piece(self, sess: Session, piece: PieceHeader, bufs: list[Any]) -> None:
        if bufs or piece.tags is None:
            raise ProtocolError("dist pieces carry p2p tags and no payload frames")
        sess.link.submit(LinkJob(piece.transfer_id, self._buffers(piece), piece.tags, piece))

    def _buffers(self, piece: PieceHeader) -> list[torch.Tensor]:
        return [torch.empty(f.shape, dtype=dtype_from_name(f.dtype), device=self.cfg.device) for f in piece.frames]

    def _on_bad_piece(self, sess: Session, session: bytes, h: dict[str, Any]) -> None:
        """Still receive a refused piece's tensors (into scratch) so the p2p stream stays aligned; if
        even its sizes are unusable, the pair is unrecoverable: drop the session and its transfers."""
        try:
            piece = PieceHeader.from_wire(h)
            if piece.tags is None:
                raise ProtocolError("a dist piece without p2p tags")
            sizes = [frame_nbytes(f, self.cfg.max_frame_bytes) for f in piece.frames]
            scratch = [torch.empty(n, dtype=torch.uint8, device=self.cfg.device) for n in sizes]
            sess.link.submit(LinkJob(piece.transfer_id, scratch, piece.tags, None))
        except TransferError as e:
            self._drop_session(session, PeerGone(f"pair stream unrecoverable: {e}"))

    def _poll_payloads(self) -> None:
        for session, sess in list(self._sessions.items()):
            if sess.link is None:
                continue
            for job, err in sess.link.pop_done():
                if job.piece is None:
                    continue  # scratch receive of a refused piece
                tid = job.transfer_id
                known = self._table.get(tid) is not None
                try:
                    if err is not None:
                        raise err
                    self._table.complete_tensors(job.piece, job.tensors)
                except TransferError as e:
                    self._fail(tid, e)
                    continue
                if known and self._table.get(tid) is None:
                    self._reply(sess, {"kind": "ack", "tid": tid})
            if sess.link.broken is not None:
                self._drop_session(session, sess.link.broken)

    def _drop_session(self, session: bytes, error: TransferError) -> None:
        sess = self._sessions.pop(session, None)
        if sess is not None:
            self._close_session(sess)  # from poll(): never waits for a link thread still forming its group
        for rec in self._table.items():
            if rec.session == session:
                self._table.fail(rec.transfer_id, error)
