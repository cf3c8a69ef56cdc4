"""The session handshake, both ends: a hello, its checks, the welcome (or reject), and the payload path it picks.

    sender (Initiator)                             receiver (Acceptor)
    hello: fingerprint, transport, nonce,    --->  check: fresh nonce, same fingerprint and transport (the receiver
           node, GPU, PID namespace, GPUs          then makes room in its session table, transfer/sessions.py)
                                                   open: session token, rnonce, session key; the path: its cache
                                                   (direct), a pair group (dist), a ring (this node), else inline
    welcomed: nonce echoed, session key,     <---  welcome [session, nonce, rnonce, max_frame_bytes, what the path
              the path the welcome names           needs], or reject [code, reason] (any TransferError)
Hello, welcome and reject are sealed under the handshake key (transfer/auth.py), everything after under the session
key both ends derive here. Sockets, retries and timeouts are the endpoints' (transfer/sender.py, receiver.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from transfer import cuda_ipc
from transfer.auth import NO_SESSION, NONCE_BYTES, NonceCache, handshake_key, seal, session_key, verify
from transfer.config import TransferConfig
from transfer.direct_path import DirectReceive, DirectSend
from transfer.errors import AuthError, FingerprintMismatch, ProtocolError, TransferError, error_from_code
from transfer.inline_path import INLINE_RECEIVE, InlineSend
from transfer.kv_segment import KVSegment, SegmentWriter, pid_namespace
from transfer.pair_path import PairReceive, PairSend, gpu_uuid, rendezvous_store, same_gpu
from transfer.path import Peer, PeerState, ReceivePath, SendPath, Session
from transfer.ring_path import SCHEME, RingReceive, RingSend
from transfer.shm_ring import RingWriter, ShmUnavailable, node_id
from transfer.wire import Hello, ModelFingerprint, Reject, Welcome, pack_header, unpack_header

log = logging.getLogger(__name__)


def handshake_frame(key: bytes, header: Hello | Welcome | Reject) -> bytes:
    """A hello, welcome or reject: sealed under the handshake key, outside any session."""
    return seal(key, NO_SESSION, 0, pack_header(header))


def reject(error: TransferError) -> Reject:
    """A refused hello's answer (or a message's for a session the receiver does not know): the sender fails that
    receiver's transfers with the same error class (`Initiator.answer`)."""
    return Reject(error.code, str(error)[:1000])


class Initiator:
    """The sender's end: the hello it sends each receiver, and what the answer makes of the peer."""

    def __init__(
        self, fp: ModelFingerprint, cfg: TransferConfig, transport: str, on_link_crash: Callable[[str], None]
    ) -> None:
        self.fp, self.cfg, self.transport = fp, cfg, transport
        self.key = handshake_key(cfg.secret)
        self.gpu = gpu_uuid(cfg) if transport == "dist" else None
        self.inline = InlineSend(cfg.checksum)  # every peer's path until its welcome, and the fallback
        self.same_gpu_peers = 0  # dist: receivers on this GPU (no pair group: ring or inline)
        self._on_link_crash = on_link_crash

    def hello(self, peer: Peer) -> Hello:
        transport = self.transport
        if transport == "shm" and not peer.address.startswith(SCHEME):
            transport = "zmq"  # a plain zmq receiver: speak zmq to it
        # the receiver's cache, written in place: over shm host KV (staged from a GPU: one copy onto the GPU cache);
        # over dist device KV, raw bytes only
        direct = self.cfg.direct_write and (
            transport == "shm" or (transport == "dist" and self.cfg.kv_wire_dtype == "raw")
        )
        pidns = pid_namespace() if direct else None
        gpus = cuda_ipc.visible_gpus() if direct else None  # a GPU cache is offered to a sender that sees its GPU
        return Hello(self.fp, transport, peer.nonce, node_id(), self.gpu, pidns, gpus)

    def answer(self, peer: Peer, data: bytes, body: memoryview) -> TransferError | None:
        """A reply outside the session (`data`, its header `body`). None: welcomed, the peer is ready. An error: the
        handshake failed (a reject, or an answer to our hello that cannot prove the secret): drop the peer with it.
        Raises TransferError for a reply to ignore."""
        if not verify(self.key, data):
            if peer.state is not PeerState.HELLO_SENT:
                raise AuthError("unauthenticated reply")
            return AuthError(
                f"receiver {peer.address} refused or did not authenticate the handshake: a different cluster secret?"
            )
        h = unpack_header(body)
        if isinstance(h, Reject):
            return error_from_code(h.code, f"receiver {peer.address} refused the handshake: {h.reason}")
        if not isinstance(h, Welcome) or peer.state is not PeerState.HELLO_SENT:
            raise AuthError(f"unexpected {h.kind!r} under the handshake key")
        if h.nonce != peer.nonce:
            raise AuthError("a welcome that does not answer our hello (replayed?)")
        if h.session == NO_SESSION:
            raise ProtocolError("malformed welcome")
        peer.session = h.session
        peer.key = session_key(self.key, peer.nonce, h.rnonce, h.session)
        peer.max_frame_bytes = h.max_frame_bytes
        peer.path = self._path(peer, h)
        peer.state = PeerState.READY
        peer.last_sent = time.monotonic()  # the receiver's idle clock for this session starts about now
        return None

    def _path(self, peer: Peer, h: Welcome) -> SendPath:
        """The peer's payload path, as the welcome offers it: the receiver's cache itself, else a pair group (dist,
        unless both ends share a GPU), else its shm ring, else inline frames."""
        if h.direct is not None:
            try:
                return DirectSend(
                    SegmentWriter.open(self.fp, h.direct), self.cfg.checksum, self.cfg.kv_wire_dtype == "raw"
                )
            except (ShmUnavailable, OSError) as e:
                log.warning("KV to %s goes inline over ZeroMQ (its cache could not be mapped): %s", peer.address, e)
                return self.inline
        if h.same_gpu:
            if not same_gpu(self.gpu, h.gpu):
                raise ProtocolError("a same_gpu welcome from a receiver on another GPU")
            self.same_gpu_peers += 1
            log.info(
                "receiver %s is on this GPU (%s): KV goes the same-node path, no NCCL pair", peer.address, self.gpu
            )
        elif self.transport == "dist":
            if h.store_port is None:
                raise ProtocolError("a dist welcome without the pair group's store port")
            return PairSend.join(self.cfg, peer, h.store_port, self._on_link_crash)
        if h.shm is None:
            if peer.address.startswith(SCHEME):
                log.info("receiver %s gave no shared-memory ring (another node?): KV goes inline", peer.address)
            return self.inline
        try:
            return RingSend(RingWriter.open(h.shm), self.cfg.checksum)
        except (ShmUnavailable, OSError) as e:
            log.warning("KV to %s goes inline over ZeroMQ: %s", peer.address, e)
            return self.inline


class Acceptor:
    """The receiver's end: a hello's checks, and the session and welcome it opens. `address`: the receiver's own
    (its pair groups' store listens on its host); `segment`: its cache in shared memory, offered to senders that can
    write it in place."""

    def __init__(
        self,
        fp: ModelFingerprint,
        cfg: TransferConfig,
        transport: str,
        address: str,
        segment: KVSegment | None,
        ring_bytes: int,
        max_rings: int,
        on_link_crash: Callable[[str], None],
    ) -> None:
        self.fp, self.cfg, self.transport, self.address = fp, cfg, transport, address
        self.segment, self.ring_bytes, self.max_rings = segment, ring_bytes, max_rings
        self.key = handshake_key(cfg.secret)
        self.gpu = gpu_uuid(cfg) if transport == "dist" else None
        self.store: torch.distributed.TCPStore | None = None  # dist: made at the first pair, idle ones cost nothing
        self.same_gpu_sessions = 0  # dist: sender sessions from this GPU (ring or inline, no pair group)
        self._nonces = NonceCache()
        self._on_link_crash = on_link_crash

    def check(self, h: Hello) -> None:
        """Raises what the reject says: a replayed hello (AuthError), another model, another transport."""
        if not self._nonces.add(h.nonce):
            raise AuthError("replayed hello")
        if h.fp != self.fp:
            raise FingerprintMismatch(f"sender model {h.fp} != receiver model {self.fp}")
        if h.transport != self.transport:
            raise ProtocolError(f"sender uses transport {h.transport!r}, receiver {self.transport!r}")

    def open(self, identity: bytes, h: Hello, rings_held: int) -> tuple[Session, Welcome]:
        """A checked hello's session (`rings_held`: how many sessions hold a ring now) and the welcome naming it."""
        token, rnonce = os.urandom(len(NO_SESSION)), os.urandom(NONCE_BYTES)
        key = session_key(self.key, h.nonce, rnonce, token)
        offer, path = self._path(key, h, rings_held)
        return Session(identity, path, key, token), Welcome(token, h.nonce, rnonce, self.cfg.max_frame_bytes, **offer)

    def _path(self, key: bytes, h: Hello, rings_held: int) -> tuple[dict[str, Any], ReceivePath]:
        """The session's payload path and what the welcome says of it: the cache itself for a sender on this node
        that can map it (shm: host memory; dist: CUDA IPC on a GPU it sees), a pair group (dist, unless both ends
        share a GPU), a ring for a sender on this node (shm, and dist on one GPU), else inline frames."""
        fields: dict[str, Any] = {}
        if self.segment is not None and self._offers_cache_to(self.segment, h):
            return {"direct": self.segment.announce()}, DirectReceive(self.segment)
        if self.transport == "dist":
            if not same_gpu(self.gpu, h.gpu):
                if self.store is None:
                    self.store = rendezvous_store(self.cfg, self.address)
                pair = PairReceive.host(self.cfg, self.address, self.store, key, self._on_link_crash)
                return {"store_port": pair.store_port, "gpu": self.gpu}, pair
            self.same_gpu_sessions += 1
            log.info("a KV sender on this GPU (%s): same-node path instead of an NCCL pair", self.gpu)
            fields = {"same_gpu": True, "gpu": self.gpu}
        elif self.transport == "zmq":
            return fields, INLINE_RECEIVE
        ring = RingReceive.offer(h, self.ring_bytes, rings_held, self.max_rings)
        if ring is None:
            return fields, INLINE_RECEIVE
        return {**fields, "shm": ring.ring.announce()}, ring

    def _offers_cache_to(self, segment: KVSegment, h: Hello) -> bool:
        """A sender on this node and PID namespace that asked for it; a GPU cache, to one that sees its GPU (Ray
        gives each actor its own CUDA_VISIBLE_DEVICES); a host cache, to shm senders (dist ones hand over device KV)."""
        if h.node != node_id() or not h.pidns or h.pidns != pid_namespace():
            return False
        if not segment.on_device:
            return self.transport == "shm"
        return h.gpus is not None and segment.gpu in h.gpus
