"""`nccl` backend: headers over ZeroMQ, KV tensors by torch.distributed point-to-point in a pair group.

Same protocol and state machines as `zmq` (it subclasses the shm classes, themselves the zmq ones); only the payload
path differs:
    sender I/O thread:  hello(transport="dist", node, gpu) -> welcome(store_port) -> PairLink(rank 1), whose store
                        prefix and first exchange (a proof of the session key each way) come from the session key
                        per piece: send the header (with one p2p tag per frame, no payload frames)
                        over ZeroMQ, then hand the tensors to the link thread (pg.send, bounded wait)
    receiver poll():    admit header -> allocate the frame tensors -> link thread (pg.recv, bounded
                        wait) -> next poll(): checksum (CPU tensors) -> sink -> ack when complete
The pair group is NCCL when TransferConfig.device is "cuda" and gloo on "cpu" (how it is tested).
Ranks and rendezvous are explained in transfer/pairgroup.py and docs/transfer.md. Nothing is allocated from a
header before `InboundTable.admit` checked it (dtype and shape re-derived from our fingerprint, nbytes equal to
shape x itemsize and under max_frame_bytes); a refused piece's scratch buffers are sized only after the same
per-frame checks.

Streams (NCCL): `send_layer` records an event on the caller's (compute) stream when the KV is handed over; the link
thread's own stream waits on it before the send. The receiver records an event on its consumer stream when it
allocates the receive buffers (the link's stream waits on it), and the link records one after the receive, which the
consumer's stream waits on before the sink reads the data. No host thread of the engine ever waits on the network.

One GPU, two workers: NCCL refuses two ranks on one device. The hello and the welcome carry each end's GPU UUID
(`TransferConfig.gpu_uuid`, read from torch.cuda when unset; none on the CPU). When both are equal, the receiver
forms no pair group: it welcomes with `same_gpu` and a shared-memory ring (as the shm backend does; inline ZeroMQ
frames if the ring cannot be had), the sender stages the device KV through pinned host memory (transfer/staging.py),
and both log it and count it (`same_gpu_sessions` / `same_gpu_peers`).
"""

from __future__ import annotations

import logging
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
from transfer.shm_backend import ShmReceiver, ShmSender, control_address
from transfer.shm_ring import RingOwner, node_id
from transfer.staging import StagedTensors
from transfer.wire import ModelFingerprint, PieceHeader, dtype_from_name, frame_nbytes, pack_header
from transfer.wire import field as hfield
from transfer.zmq_sender import ZmqSender

log = logging.getLogger(__name__)


def _pg_backend(cfg: TransferConfig) -> str:
    return "nccl" if cfg.device.startswith("cuda") else "gloo"


def gpu_uuid(cfg: TransferConfig) -> str | None:
    """This end's GPU as the handshake names it: the configured UUID, else the CUDA device's; None on the CPU."""
    if cfg.gpu_uuid is not None:
        return cfg.gpu_uuid
    if not cfg.device.startswith("cuda") or not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(torch.device(cfg.device)).uuid)


def same_gpu(mine: str | None, theirs: Any) -> bool:
    """Both ends on one GPU (both UUIDs known and equal): NCCL would refuse the pair."""
    return mine is not None and isinstance(theirs, str) and theirs == mine


def _consumer_event(tensors: list[torch.Tensor]) -> Any:
    """An event on the current stream of the thread that made `tensors` (CUDA only), for another stream to wait on."""
    if not tensors or not tensors[0].is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensors[0].device))
    return event


class DistSender(ShmSender):
    transport = "dist"

    def __init__(self, fingerprint: ModelFingerprint, config: TransferConfig | None = None) -> None:
        self.same_gpu_peers = 0  # peers on this GPU: KV through the same-node path, no pair group
        self._gpu = gpu_uuid(config or TransferConfig())  # before the I/O thread starts (it sends the hellos)
        super().__init__(fingerprint, config)

    def _handover(self, k: torch.Tensor, v: torch.Tensor) -> StagedTensors:
        """NCCL: the tensors stay on the device (made contiguous here, on the caller's stream) and an event on the
        caller's stream orders the link's send after the KV gather. gloo with device KV (a GPU worker told to use
        gloo): pinned staging on the copy stream, as zmq does. Host KV passes through."""
        if self.cfg.device.startswith("cuda") and (k.is_cuda or v.is_cuda):
            k, v = k.contiguous(), v.contiguous()
            return StagedTensors([k, v], ready=_consumer_event([k, v]))
        return super()._handover(k, v)

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        """gloo moves host tensors; NCCL moves device tensors (no host staging at all)."""
        return t if t.is_cuda and self.cfg.device.startswith("cuda") else t.detach().to(self.cfg.device).contiguous()

    def _hello_fields(self, peer: Peer) -> dict[str, Any]:
        fields = ZmqSender._hello_fields(self, peer)
        fields["node"] = node_id()
        if self._gpu is not None:
            fields["gpu"] = self._gpu
        return fields

    def _drain_commands(self, budget: int = 64) -> bool:
        return ZmqSender._drain_commands(self, budget)

    def _on_welcome(self, peer: Peer, h: dict[str, Any]) -> None:
        if h.get("same_gpu") is True:
            if not same_gpu(self._gpu, h.get("gpu")):
                raise ProtocolError("a same_gpu welcome from a receiver on another GPU")
            self.same_gpu_peers += 1
            log.info(
                "receiver %s is on this GPU (%s): KV goes the same-node path, no NCCL pair", peer.address, self._gpu
            )
            super()._on_welcome(peer, h)  # a ring if one was announced, else inline frames
            return
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
            device=self.cfg.device,
        )

    def _send(self, peer: Peer, out: Outgoing) -> None:
        if out.piece is None:
            super()._send(peer, out)
            return
        if not isinstance(peer.link, PairLink):  # same GPU: host bytes through the ring or inline
            if any(t.is_cuda for t in out.tensors):
                staged = self._stager.stage(out.tensors, after=out.ready)
                out.tensors, out.ready = staged.wait(self.cfg.send_timeout_s), None
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
        peer.link.submit(LinkJob(out.transfer_id, out.tensors, tags, ready=out.ready))

    def _check_timeouts(self) -> None:
        for peer in list(self._peers.values()):
            if not isinstance(peer.link, PairLink):
                continue
            done = peer.link.pop_done()
            if peer.link.broken is not None:  # first: once its transfers' failures show, the peer is gone
                self._drop_peer(peer, peer.link.broken)  # the link aborted its group; the next begin() pairs anew
            for job, err in done:
                if err is not None:
                    self._leases.release(job.transfer_id, err)
        super()._check_timeouts()


class DistReceiver(ShmReceiver):
    transport = "dist"

    def __init__(
        self, fingerprint: ModelFingerprint, sink: Sink, address: str, config: TransferConfig | None = None
    ) -> None:
        super().__init__(fingerprint, sink, address, config)
        self.address = control_address(self.address)  # a plain zmq address: the transport says "dist"
        self._store: torch.distributed.TCPStore | None = (
            None  # made at the first handshake: idle receivers cost nothing
        )
        self._gpu = gpu_uuid(self.cfg)
        self.same_gpu_sessions = 0  # sender sessions from this GPU: same-node path, no pair group

    def rings(self) -> int:
        return sum(1 for s in self._sessions.values() if isinstance(s.link, RingOwner))

    def _welcome_extra(self, session: bytes, key: bytes, h: dict[str, Any]) -> dict[str, Any]:
        if same_gpu(self._gpu, h.get("gpu")):
            self.same_gpu_sessions += 1
            log.info("a KV sender on this GPU (%s): same-node path instead of an NCCL pair", self._gpu)
            return {"same_gpu": True, "gpu": self._gpu, **super()._welcome_extra(session, key, h)}
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
            device=self.cfg.device,
        )
        extra: dict[str, Any] = {"store_port": self._store.port, "_link": link}
        if self._gpu is not None:
            extra["gpu"] = self._gpu
        return extra

    def wait(self, timeout_s: float) -> bool:
        """Payloads complete in link threads, not on the socket: wait at most 1 ms at a time."""
        return super().wait(min(timeout_s, 0.001))

    def _on_piece(self, sess: Session, piece: PieceHeader, bufs: list[Any]) -> None:
        if not isinstance(sess.link, PairLink):
            if piece.tags is not None:
                raise ProtocolError("p2p tags in a session without a pair group")
            super()._on_piece(sess, piece, bufs)  # same GPU: ring or inline frames
            return
        if bufs or piece.tags is None:
            raise ProtocolError("dist pieces carry p2p tags and no payload frames")
        tensors = self._buffers(piece)
        sess.link.submit(LinkJob(piece.transfer_id, tensors, piece.tags, piece, ready=_consumer_event(tensors)))

    def _buffers(self, piece: PieceHeader) -> list[torch.Tensor]:
        return [torch.empty(f.shape, dtype=dtype_from_name(f.dtype), device=self.cfg.device) for f in piece.frames]

    def _on_bad_piece(self, sess: Session, session: bytes, h: dict[str, Any]) -> None:
        """Still receive a refused piece's tensors (into scratch) so the p2p stream stays aligned; if
        even its sizes are unusable, the pair is unrecoverable: drop the session and its transfers."""
        if not isinstance(sess.link, PairLink):
            super()._on_bad_piece(sess, session, h)
            return
        try:
            piece = PieceHeader.from_wire(h)
            if piece.tags is None:
                raise ProtocolError("a dist piece without p2p tags")
            sizes = [frame_nbytes(f, self.cfg.max_frame_bytes) for f in piece.frames]
            scratch = [torch.empty(n, dtype=torch.uint8, device=self.cfg.device) for n in sizes]
            sess.link.submit(LinkJob(piece.transfer_id, scratch, piece.tags, None, ready=_consumer_event(scratch)))
        except TransferError as e:
            self._drop_session(session, PeerGone(f"pair stream unrecoverable: {e}"))

    def _poll_payloads(self) -> None:
        for session, sess in list(self._sessions.items()):
            if not isinstance(sess.link, PairLink):
                continue
            for job, err in sess.link.pop_done():
                if job.piece is None:
                    continue  # scratch receive of a refused piece
                tid = job.transfer_id
                known = self._table.get(tid) is not None
                try:
                    if err is not None:
                        raise err
                    if job.ready is not None:  # the consumer's stream waits for the receive (the host does not)
                        torch.cuda.current_stream(job.tensors[0].device).wait_event(job.ready)
                    self._table.complete_tensors(job.piece, job.tensors)
                except TransferError as e:
                    self._fail(tid, e)
                    continue
                if known and self._table.get(tid) is None:
                    self._reply(sess, {"kind": "ack", "tid": tid})
            if sess.link.broken is not None:
                self._drop_session(session, sess.link.broken)  # its group is aborted; a new hello pairs anew

    def _drop_session(self, session: bytes, error: TransferError) -> None:
        sess = self._sessions.pop(session, None)
        if sess is not None:
            self._close_session(sess)  # from poll(): never waits for a link thread still forming its group
        for rec in self._table.items():
            if rec.session == session:
                self._table.fail(rec.transfer_id, error)
