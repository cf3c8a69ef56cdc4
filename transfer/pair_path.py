"""The torch.distributed payload path (backends `nccl`, and `gloo` = the same code on CPU tensors).

    welcome   the receiver's rendezvous store port; both ends start a PairLink (transfer/pairgroup.py)
    sender    per piece: the sealed header over ZeroMQ with one p2p tag per frame and no payload frames, then the
              tensors to the link thread (pg.send, bounded wait)
    receiver  admit the header -> allocate the frame tensors -> link thread (pg.recv, bounded) -> next poll():
              checksum (CPU tensors) -> sink -> ack when complete
A refused piece is still received, into scratch sized by the same per-frame checks, so the p2p stream stays aligned.
CUDA streams and two workers on one GPU (`same_gpu`: a ring or inline frames, no pair): docs/transfer.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch
import zmq

from transfer.auth import pair_group_key
from transfer.config import TransferConfig
from transfer.errors import PeerGone, ProtocolError, TransferError
from transfer.outbox import Outgoing
from transfer.pairgroup import LinkJob, PairLink, host_of, local_ip_towards, make_store_server
from transfer.path import Peer, ReceiveHost, SendHost, Session
from transfer.wire import Named, PieceHeader, dtype_from_name, frame_nbytes, frame_view, with_checksums

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


def consumer_event(tensors: list[torch.Tensor]) -> Any:
    """An event on the current stream of the thread that made `tensors` (CUDA only), for another stream to wait on."""
    if not tensors or not tensors[0].is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensors[0].device))
    return event


def rendezvous_store(cfg: TransferConfig, address: str) -> torch.distributed.TCPStore:
    """The receiver's one store for all its pairs: it listens on the host of its own address only, never on every
    interface."""
    return make_store_server(host_of(address), cfg.group_timeout_s)


class PairSend:
    name = "pair"
    device_kv = True  # NCCL sends device tensors as they are
    batch_piece_bytes = batch_bytes = 0  # each piece's tensors follow its header on the pair's p2p stream
    command_budget = 64

    def __init__(self, link: PairLink, checksum: bool) -> None:
        self.link = link
        self.checksum = checksum

    @classmethod
    def join(cls, cfg: TransferConfig, peer: Peer, store_port: int, on_crash: Callable[[str], None]) -> PairSend:
        """Rank 1 of the pair, at the store the receiver's welcome names (on the host of its address)."""
        host = host_of(peer.address)
        link = PairLink(
            backend=_pg_backend(cfg),
            rank=1,
            key=pair_group_key(peer.key),
            store_host=host,
            store_port=store_port,
            local_host=local_ip_towards(host),
            timeout_s=cfg.group_timeout_s,
            auth_key=peer.key,
            on_crash=on_crash,
            device=cfg.device,
        )
        return cls(link, cfg.checksum)

    def send(self, host: SendHost, peer: Peer, outs: Sequence[Outgoing]) -> None:
        [out] = outs
        assert out.piece is not None
        if self.link.broken is not None:
            raise zmq.Again()  # the sender's timeout check drops the peer
        tags = self.link.next_tags(len(out.tensors))
        piece = msgspec.structs.replace(out.piece, tags=tags)
        if self.checksum and not any(t.is_cuda for t in out.tensors):  # gloo: xxh3 as inline; NCCL: none
            piece = with_checksums(piece, [frame_view(t) for t in out.tensors])
        peer.sock.send(peer.seal(piece), zmq.NOBLOCK)
        # the header left: its tensors must follow, in order, or the pair's p2p stream desynchronizes
        self.link.submit(LinkJob(out.transfer_id, out.tensors, tags, ready=out.ready))

    def collect(self) -> tuple[TransferError | None, list[tuple[str, TransferError]]]:
        """(why the link broke, or None; the transfers whose sends failed)."""
        failed = [(job.transfer_id, err) for job, err in self.link.pop_done() if err is not None]
        return self.link.broken, failed

    def close(self) -> None:
        self.link.close()


class PairReceive:
    name = "pair"

    def __init__(self, link: PairLink, store_port: int, cfg: TransferConfig) -> None:
        self.link = link
        self.store_port = store_port  # what the welcome tells the sender
        self.device = cfg.device
        self.max_frame_bytes = cfg.max_frame_bytes

    @classmethod
    def host(
        cls,
        cfg: TransferConfig,
        address: str,
        store: torch.distributed.TCPStore,
        session_key: bytes,
        on_crash: Callable[[str], None],
    ) -> PairReceive:
        """Rank 0 of the pair, at the receiver's store (`rendezvous_store`)."""
        host = host_of(address)
        link = PairLink(
            backend=_pg_backend(cfg),
            rank=0,
            key=pair_group_key(session_key),
            store_host=host,
            store_port=store.port,
            local_host=host,
            timeout_s=cfg.group_timeout_s,
            store=store,
            auth_key=session_key,
            on_crash=on_crash,
            device=cfg.device,
        )
        return cls(link, store.port, cfg)

    def on_piece(self, host: ReceiveHost, sess: Session, piece: PieceHeader, frames: list[Any]) -> None:
        if frames or piece.tags is None:
            raise ProtocolError("dist pieces carry p2p tags and no payload frames")
        tensors = [torch.empty(f.shape, dtype=dtype_from_name(f.dtype), device=self.device) for f in piece.frames]
        self.link.submit(LinkJob(piece.transfer_id, tensors, piece.tags, piece, ready=consumer_event(tensors)))

    def on_bad_piece(self, host: ReceiveHost, sess: Session, h: PieceHeader | Named, error: TransferError) -> None:
        """Still receive a refused piece's tensors (into scratch) so the p2p stream stays aligned; if even its sizes
        are unusable, the pair is unrecoverable: drop the session and its transfers."""
        try:
            if not isinstance(h, PieceHeader):
                raise error
            if h.tags is None:
                raise ProtocolError("a dist piece without p2p tags")
            sizes = [frame_nbytes(f, self.max_frame_bytes) for f in h.frames]
            scratch = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
            self.link.submit(LinkJob(h.transfer_id, scratch, h.tags, None, ready=consumer_event(scratch)))
        except TransferError as e:
            host.drop_session(sess, PeerGone(f"pair stream unrecoverable: {e}"))

    def poll(self, host: ReceiveHost, sess: Session) -> None:
        """Finish the pieces whose tensors arrived; a broken link drops its session (a new hello pairs anew)."""
        for job, err in self.link.pop_done():
            if job.piece is None:
                continue  # scratch receive of a refused piece
            if err is None and job.ready is not None:  # the consumer's stream waits for the receive (not the host)
                torch.cuda.current_stream(job.tensors[0].device).wait_event(job.ready)
            host.arrived(sess, job.piece, job.tensors, err)
        if self.link.broken is not None:
            host.drop_session(sess, self.link.broken)

    def alive(self) -> bool:
        return self.link.alive()

    def close(self, join_s: float = 2.0) -> None:
        self.link.close(join_s)
