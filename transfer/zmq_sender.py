"""ZeroMQ KV sender: the prefill side of the `zmq` backend (and the control half of `nccl`).

Data flow:
    caller thread: begin / send_layer / finish / abort  --bounded queue.Queue-->  I/O thread
    I/O thread:    per receiver address one DEALER socket; handshake first (hello -> welcome with a
                   session token, or reject), then for each piece: encode (int8 optional, xxh3 per
                   frame) and send [header, k bytes, v bytes] zero-copy, NOBLOCK; replies (ack, nack,
                   renew) update the lease table.
    caller thread: poll() -> released leases (free the source blocks).
Bounded everywhere: a full queue fails the transfer after enqueue_timeout_s, a handshake has
connect_timeout_s, a message that cannot leave (HWM reached, peer gone) fails its peer after
send_timeout_s, and a lease without word from the receiver expires after lease_s.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import zmq

from transfer.base import KVSender, TransferConfig, check_layer_args
from transfer.errors import FrameTooLarge, PeerGone, TransferAborted, TransferError, TransferTimeout, error_from_code
from transfer.sockets import configure
from transfer.state import LeaseTable, TransferEvent
from transfer.wire import (ModelFingerprint, PieceHeader, encode_piece, field as hfield, frame_view,
                           pack_header, unpack_header)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outgoing:
    """One queued message: header fields (session added at send time) plus payload tensors."""

    transfer_id: str
    fields: dict[str, Any]
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    piece: PieceHeader | None = None  # "kv" messages only


@dataclass(slots=True)
class Peer:
    address: str
    sock: zmq.Socket
    created: float
    state: str = "connecting"  # connecting -> hello_sent -> ready
    session: bytes = b""
    max_frame_bytes: int = 0
    outbox: deque[Outgoing] = field(default_factory=deque)
    stuck_since: float | None = None
    link: Any = None  # nccl backend: the pair process group link


class ZmqSender(KVSender):
    """See module docstring. Thread-safe API; all sockets live in one I/O thread."""

    transport = "zmq"

    def __init__(self, fingerprint: ModelFingerprint, config: TransferConfig | None = None) -> None:
        self.fp = fingerprint
        self.cfg = config or TransferConfig()
        self._leases = LeaseTable(self.cfg.lease_s)
        self._cmds: queue.Queue[tuple[Any, ...]] = queue.Queue(maxsize=self.cfg.queue_size)
        self._ctx = zmq.Context()
        self._peers: dict[str, Peer] = {}
        self._pieces: dict[str, int] = {}
        self._stop = threading.Event()
        self._crash: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller-thread API

    def begin(self, transfer_id: str, peer: str) -> None:
        if self._stop.is_set():
            raise RuntimeError("sender is closed")
        self._leases.begin(transfer_id, peer)
        self._put(transfer_id, ("begin", transfer_id, peer))

    def send_layer(self, transfer_id: str, layer: int, dst_block_ids: Sequence[int],
                   k: torch.Tensor, v: torch.Tensor) -> bool:
        check_layer_args(self.fp, layer, dst_block_ids, k, v)
        if self._leases.get(transfer_id) is None:
            return False  # already failed/aborted: its event is (or was) in poll()
        return self._put(transfer_id, ("kv", transfer_id, layer, list(dst_block_ids), k, v))

    def finish(self, transfer_id: str) -> None:
        if self._leases.get(transfer_id) is not None:
            self._put(transfer_id, ("finish", transfer_id))

    def abort(self, transfer_id: str, reason: str = "aborted by sender") -> None:
        lease = self._leases.get(transfer_id)
        if lease is not None and self._leases.release(transfer_id, TransferAborted(reason)):
            try:
                self._cmds.put_nowait(("abort", transfer_id, reason, lease.peer))
            except queue.Full:
                pass  # the receiver's deadline frees its side

    def poll(self) -> list[TransferEvent]:
        if not self._thread.is_alive() and self._leases.ids():
            self._leases.fail_all(TransferError(f"sender I/O thread stopped: {self._crash!r}"))
        return self._leases.drain()

    def active_transfers(self) -> list[str]:
        return self._leases.ids()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=max(2.0, self.cfg.send_timeout_s))
        self._leases.fail_all(PeerGone("sender closed"))
        if not self._thread.is_alive():
            self._ctx.destroy(linger=0)

    def _put(self, transfer_id: str, cmd: tuple[Any, ...]) -> bool:
        try:
            self._cmds.put(cmd, timeout=self.cfg.enqueue_timeout_s)
            return True
        except queue.Full:
            self._leases.release(transfer_id, TransferTimeout(
                f"send queue stayed full for {self.cfg.enqueue_timeout_s}s"))
            return False

    # ------------------------------------------------------------------ I/O thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self._drain_commands()
                busy |= self._pump()
                busy |= self._read_replies()
                self._check_timeouts()
                if not busy:
                    self._idle_wait()
        except BaseException as e:  # noqa: BLE001 - surfaced through poll()
            log.exception("kv sender I/O thread crashed")
            self._crash = e
            self._leases.fail_all(TransferError(f"sender I/O thread crashed: {e!r}"))
        finally:
            for p in list(self._peers.values()):
                self._close_peer(p)

    def _idle_wait(self) -> None:
        """Sleep until a command arrives (instant wake-up) or briefly, to look at replies again."""
        try:
            cmd = self._cmds.get(timeout=0.002 if self._peers else 0.05)
        except queue.Empty:
            return
        self._handle_command(cmd)

    def _drain_commands(self, budget: int = 64) -> bool:
        n = 0
        while n < budget:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            self._handle_command(cmd)
            n += 1
        return n > 0

    def _handle_command(self, cmd: tuple[Any, ...]) -> None:
        kind, tid = cmd[0], cmd[1]
        if kind == "abort":
            self._pieces.pop(tid, None)
            p = self._peers.get(cmd[3])
            if p is not None:
                p.outbox = deque(o for o in p.outbox if o.transfer_id != tid)
                p.outbox.append(Outgoing(tid, {"kind": "abort", "tid": tid, "reason": cmd[2]}))
            return
        lease = self._leases.get(tid)
        if lease is None:
            self._pieces.pop(tid, None)
            return
        peer = self._peers.get(lease.peer) or self._connect(lease.peer)
        if kind == "begin":
            self._pieces[tid] = 0
        elif kind == "kv":
            _, _, layer, blocks, k, v = cmd
            header, tensors = encode_piece(self.fp, tid, layer, blocks, self._stage(k), self._stage(v),
                                           self.cfg.wire_dtype, self.cfg.checksum)
            peer.outbox.append(Outgoing(tid, {}, tensors, sum(f.nbytes for f in header.frames), header))
            self._pieces[tid] = self._pieces.get(tid, 0) + 1
        elif kind == "finish":
            peer.outbox.append(Outgoing(tid, {"kind": "finish", "tid": tid,
                                              "pieces": self._pieces.pop(tid, 0)}))

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        """Where payload tensors must live for this transport: host memory for ZeroMQ."""
        return t.detach().to("cpu").contiguous()

    def _connect(self, address: str) -> Peer:
        sock = configure(self._ctx.socket(zmq.DEALER), self.cfg)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a receiver that is not connected
        sock.connect(address)
        peer = Peer(address, sock, time.monotonic())
        self._peers[address] = peer
        return peer

    def _hello_fields(self) -> dict[str, Any]:
        return {"kind": "hello", "fp": self.fp.to_wire(), "secret": self.cfg.secret or "",
                "transport": self.transport}

    def _pump(self) -> bool:
        sent = False
        for peer in list(self._peers.values()):
            if peer.state == "connecting":
                try:
                    peer.sock.send(pack_header(self._hello_fields()), zmq.NOBLOCK)
                    peer.state = "hello_sent"
                except zmq.Again:
                    pass
                continue
            while peer.state == "ready" and peer.outbox:
                out = peer.outbox[0]
                if out.fields.get("kind") != "abort" and self._leases.get(out.transfer_id) is None:
                    peer.outbox.popleft()  # its transfer ended meanwhile
                    continue
                try:
                    self._send(peer, out)
                except zmq.Again:
                    peer.stuck_since = peer.stuck_since or time.monotonic()
                    break
                except FrameTooLargeForPeer as e:
                    peer.outbox.popleft()
                    self._fail_transfer(peer, out.transfer_id, e.error)
                    continue
                peer.outbox.popleft()
                peer.stuck_since = None
                sent = True
                if out.tensors:
                    self._leases.note_sent(out.transfer_id, out.nbytes)
        return sent

    def _send(self, peer: Peer, out: Outgoing) -> None:
        """Send one message (raises zmq.Again when it cannot leave now). Overridden by nccl."""
        if out.piece is None:
            peer.sock.send(pack_header({**out.fields, "session": peer.session}), zmq.NOBLOCK)
            return
        check_peer_frame_bound(peer, out.piece)
        header = pack_header(out.piece.to_wire(peer.session))
        peer.sock.send_multipart([header, *(frame_view(t) for t in out.tensors)],
                                 flags=zmq.NOBLOCK, copy=False)

    def _fail_transfer(self, peer: Peer, tid: str, error: TransferError) -> None:
        if self._leases.release(tid, error):
            peer.outbox.append(Outgoing(tid, {"kind": "abort", "tid": tid, "reason": str(error)}))

    def _read_replies(self) -> bool:
        got = False
        for peer in list(self._peers.values()):
            for _ in range(256):
                try:
                    data = peer.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got = True
                try:
                    self._on_reply(peer, unpack_header(data))
                except TransferError as e:
                    log.warning("bad reply from %s: %s", peer.address, e)
                if peer.address not in self._peers:
                    break
        return got

    def _on_reply(self, peer: Peer, h: dict[str, Any]) -> None:
        kind = h["kind"]
        if kind == "welcome":
            peer.session = hfield(h, "session", bytes)
            peer.max_frame_bytes = hfield(h, "max_frame_bytes", int)
            self._on_welcome(peer, h)
            peer.state = "ready"
        elif kind == "reject":
            self._drop_peer(peer, error_from_code(str(h.get("code")), f"receiver {peer.address} "
                                                  f"refused the handshake: {h.get('reason')}"))
        elif kind == "ack":
            self._leases.release(hfield(h, "tid", str))
        elif kind == "nack":
            err = error_from_code(str(h.get("code")), f"receiver: {h.get('reason')}")
            self._leases.release(hfield(h, "tid", str), err)
            if h.get("code") == "peer_gone":  # receiver no longer knows our session: start over
                self._drop_peer(peer, err)
        elif kind == "renew":
            self._leases.renew(hfield(h, "tid", str))

    def _on_welcome(self, peer: Peer, h: dict[str, Any]) -> None:
        """Hook for the nccl backend (forms the pair process group)."""

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        for peer in list(self._peers.values()):
            if peer.state != "ready" and now - peer.created > self.cfg.connect_timeout_s:
                self._drop_peer(peer, PeerGone(f"no handshake with {peer.address} within "
                                               f"{self.cfg.connect_timeout_s}s (receiver not running?)"))
            elif peer.stuck_since is not None and now - peer.stuck_since > self.cfg.send_timeout_s:
                self._drop_peer(peer, PeerGone(f"could not send to {peer.address} for "
                                               f"{self.cfg.send_timeout_s}s (receiver gone or stalled)"))
        for tid, address in self._leases.due_keepalives(self.cfg.lease_s / 3):
            peer = self._peers.get(address)
            if peer is not None and peer.state == "ready":  # tells the receiver we are alive
                peer.outbox.append(Outgoing(tid, {"kind": "renew", "tid": tid}))
        for tid, address in self._leases.expire():
            self._pieces.pop(tid, None)
            peer = self._peers.get(address)
            if peer is not None:
                peer.outbox.append(Outgoing(tid, {"kind": "abort", "tid": tid,
                                                  "reason": "sender lease expired"}))

    def _drop_peer(self, peer: Peer, error: TransferError) -> None:
        self._close_peer(peer)
        self._peers.pop(peer.address, None)
        for tid in self._leases.release_peer(peer.address, error):
            self._pieces.pop(tid, None)

    def _close_peer(self, peer: Peer) -> None:
        if peer.link is not None:
            peer.link.close()
        peer.sock.close(linger=0)


class FrameTooLargeForPeer(Exception):
    """Internal: a piece exceeds the receiver's announced frame bound; fails that transfer only."""

    def __init__(self, error: TransferError) -> None:
        super().__init__(str(error))
        self.error = error


def check_peer_frame_bound(peer: Peer, piece: PieceHeader) -> None:
    biggest = max(f.nbytes for f in piece.frames)
    if peer.max_frame_bytes and biggest > peer.max_frame_bytes:
        raise FrameTooLargeForPeer(FrameTooLarge(
            f"{biggest}-byte frame > receiver {peer.address} max_frame_bytes={peer.max_frame_bytes}"))
