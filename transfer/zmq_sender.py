"""ZeroMQ KV sender: the prefill side of the `zmq` backend (and the control half of `nccl`).

Data flow:
    caller thread: begin / send_layer / finish / abort  --bounded queue.Queue-->  I/O thread
                   (device KV: send_layer starts its copy to pinned host buffers on a copy stream, after an event on
                   the caller's stream; the I/O thread waits on the copy, bounded: transfer/staging.py)
    I/O thread:    per receiver address one DEALER socket; handshake first (hello -> welcome with a
                   session token, or reject; both sides prove the cluster secret, see transfer/auth.py),
                   then for each piece: encode (int8 optional, xxh3 per frame) and send [sealed header,
                   k bytes, v bytes] zero-copy, NOBLOCK; replies (ack, nack, renew), MAC-checked before
                   they are decoded, update the lease table (this inward half, and the timeouts below,
                   live in transfer/sender_replies.py).
    caller thread: poll() -> released leases (free the source blocks).
Bounded everywhere: a full queue fails the transfer after enqueue_timeout_s, a handshake has
connect_timeout_s, a message that cannot leave (HWM reached, peer gone) fails its peer after
send_timeout_s, and a lease without word from the receiver expires after lease_s. The outboxes hold at most
max_outbox_bytes (plus one piece): at the bound the I/O thread takes no command, so the queue above fills and
send_layer fails instead of memory growing (transfer/outbox.py). A peer with no lease and nothing sent for
idle_session_s / 2 is closed (the receiver drops its side after idle_session_s). An I/O thread that dies records
why (io_problem(), which makes the prefill worker degraded) and fails every lease, present and future.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import zmq

from transfer.auth import NO_SESSION, NONCE_BYTES, OVERHEAD, handshake_key, seal
from transfer.base import KVSender, TransferConfig, check_layer_args
from transfer.errors import PeerGone, TransferAborted, TransferError, TransferTimeout
from transfer.outbox import FrameTooLargeForPeer, Meter, Outbox, Outgoing, Peer, check_peer_frame_bound
from transfer.sender_replies import SenderReplies
from transfer.sockets import configure
from transfer.staging import StagedTensors, Stager
from transfer.state import LeaseTable, TransferEvent
from transfer.wire import MAX_HEADER_BYTES, ModelFingerprint, encode_piece, frame_view, pack_header

log = logging.getLogger(__name__)


class ZmqSender(SenderReplies, KVSender):
    """See module docstring. Thread-safe API; all sockets live in one I/O thread."""

    transport = "zmq"

    def __init__(self, fingerprint: ModelFingerprint, config: TransferConfig | None = None) -> None:
        self.fp = fingerprint
        self.cfg = config or TransferConfig()
        self._hs_key = handshake_key(self.cfg.secret)
        self.rejected = 0  # replies dropped: unauthenticated, replayed or multipart
        self._leases = LeaseTable(self.cfg.lease_s)
        self._cmds: queue.Queue[tuple[Any, ...]] = queue.Queue(maxsize=self.cfg.queue_size)
        self._ctx = zmq.Context()
        self._peers: dict[str, Peer] = {}
        self._pieces: dict[str, int] = {}
        self._meter = Meter()  # bytes queued in every peer's outbox (bounded by max_outbox_bytes)
        self._keepalive_s = min(self.cfg.lease_s, self.cfg.idle_session_s) / 3
        self._next_sweep = 0.0  # of idle peers, and of the outboxes of ended transfers when they are full
        self._stop = threading.Event()
        self._crash: BaseException | None = None
        self._link_problem = ""  # nccl backend: a pair-link thread died of a bug
        self._stager = Stager(self.cfg.staging_bytes)  # device KV -> pinned host buffers on a copy stream
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller-thread API

    def begin(self, transfer_id: str, peer: str) -> None:
        if self._stop.is_set():
            raise RuntimeError("sender is closed")
        self._leases.begin(transfer_id, peer)
        self._put(transfer_id, ("begin", transfer_id, peer))

    def send_layer(
        self, transfer_id: str, layer: int, dst_block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor
    ) -> bool:
        check_layer_args(self.fp, layer, dst_block_ids, k, v)
        if self._leases.get(transfer_id) is None:
            return False  # already failed/aborted: its event is (or was) in poll()
        return self._put(transfer_id, ("kv", transfer_id, layer, list(dst_block_ids), self._handover(k, v)))

    def _handover(self, k: torch.Tensor, v: torch.Tensor) -> StagedTensors:
        """In the caller's thread, when the KV is handed over: device tensors start their copy to pinned host memory
        on the copy stream, ordered after the caller's (compute) stream by an event (transfer/staging.py); host ones
        pass through. Overridden by nccl, which moves device tensors as they are."""
        if k.is_cuda or v.is_cuda:
            return self._stager.stage([k, v])
        return StagedTensors([k, v])

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

    def io_problem(self) -> str:
        if self._crash is not None:
            return f"kv-sender I/O thread died: {type(self._crash).__name__}: {self._crash}"[:500]
        if not self._stop.is_set() and not self._thread.is_alive():
            return "kv-sender I/O thread is not running"
        return self._link_problem

    @property
    def outbox_bytes(self) -> int:
        """Bytes queued towards receivers now (payload plus HEADER_COST per message)."""
        return self._meter.nbytes

    @property
    def outbox_peak(self) -> int:
        """The most that were ever queued: at most max_outbox_bytes plus one piece."""
        return self._meter.peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=max(2.0, self.cfg.send_timeout_s))
        self._leases.fail_all(PeerGone("sender closed"))
        if not self._thread.is_alive():
            self._ctx.destroy(linger=0)

    def _put(self, transfer_id: str, cmd: tuple[Any, ...]) -> bool:
        if self._fail_if_dead(transfer_id):
            return False
        try:
            self._cmds.put(cmd, timeout=self.cfg.enqueue_timeout_s)
            return True
        except queue.Full:
            self._leases.release(
                transfer_id,
                TransferTimeout(
                    f"send queue stayed full for {self.cfg.enqueue_timeout_s}s (receiver slow or gone: "
                    f"{self._meter.nbytes} bytes queued towards receivers)"
                ),
            )
            return False

    def _fail_if_dead(self, transfer_id: str) -> bool:
        """No I/O thread to move it: the transfer fails now (poll() reports it), rather than wait for nothing."""
        if self._thread.is_alive():
            return False
        self._leases.release(transfer_id, TransferError(self.io_problem() or "sender I/O thread stopped"))
        return True

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
        except BaseException as e:  # noqa: BLE001 - surfaced through io_problem() and poll()
            self._crash = e  # first: from here on begin/send_layer fail at once instead of queueing
            log.exception("kv-sender I/O thread died; every transfer of this sender fails")
            self._leases.fail_all(TransferError(f"sender I/O thread died: {e!r}"))
        finally:
            for p in list(self._peers.values()):
                try:
                    self._close_peer(p)
                except Exception:  # noqa: BLE001 - closing what is left; the cause is already recorded
                    log.exception("closing a kv-sender peer")

    def _has_room(self) -> bool:
        """Whether the outboxes may take another command (backpressure on the caller's queue when not)."""
        return self._meter.nbytes < self.cfg.max_outbox_bytes

    def _idle_wait(self) -> None:
        """Sleep until a command arrives (instant wake-up) or briefly, to look at replies again."""
        if not self._has_room():
            self._stop.wait(0.002)
            return
        try:
            cmd = self._cmds.get(timeout=0.002 if self._peers else 0.05)
        except queue.Empty:
            return
        self._handle_command(cmd)

    def _drain_commands(self, budget: int = 64) -> bool:
        n = 0
        while n < budget and self._has_room():
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
                p.outbox.discard(lambda o: o.transfer_id == tid)
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
            _, _, layer, blocks, staged = cmd
            try:
                k, v = staged.wait(self.cfg.send_timeout_s)  # the staging copy (device KV), bounded
            except TransferError as e:
                self._fail_transfer(peer, tid, e)
                return
            header, tensors = encode_piece(
                self.fp,
                tid,
                layer,
                blocks,
                self._stage(k),
                self._stage(v),
                self.cfg.kv_wire_dtype,
                self._checksum_early,
            )
            nbytes = sum(f.nbytes for f in header.frames)
            peer.outbox.append(Outgoing(tid, {}, tensors, nbytes, header, ready=staged.ready))
            self._pieces[tid] = self._pieces.get(tid, 0) + 1
        elif kind == "finish":
            peer.outbox.append(Outgoing(tid, {"kind": "finish", "tid": tid, "pieces": self._pieces.pop(tid, 0)}))

    @property
    def _checksum_early(self) -> bool:
        """Whether pieces are checksummed as they are encoded (zmq: the frames leave as they are); a transport that
        copies the frames first (shm) checksums the copy instead, in its _send."""
        return self.cfg.checksum

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        """Where payload tensors must live for this transport: host memory for ZeroMQ."""
        return t.detach().to("cpu").contiguous()

    def _connect(self, address: str) -> Peer:
        # replies are headers only: anything larger is refused by ZeroMQ before it is buffered
        sock = configure(self._ctx.socket(zmq.DEALER), self.cfg, max_msg_bytes=MAX_HEADER_BYTES + OVERHEAD)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a receiver that is not connected
        sock.connect(address)
        peer = Peer(address, sock, time.monotonic(), Outbox(self._meter), nonce=os.urandom(NONCE_BYTES))
        self._peers[address] = peer
        return peer

    def _hello_fields(self, peer: Peer) -> dict[str, Any]:
        return {"kind": "hello", "fp": self.fp.to_wire(), "transport": self.transport, "nonce": peer.nonce}

    def _seal(self, peer: Peer, header: bytes) -> bytes:
        """A header frame of this peer's session: MAC under the session key, next sequence number."""
        peer.seq_out += 1
        return seal(peer.key, peer.session, peer.seq_out, header)

    def _pump(self) -> bool:
        sent = False
        for peer in list(self._peers.values()):
            if peer.state == "connecting":
                try:
                    hello = seal(self._hs_key, NO_SESSION, 0, pack_header(self._hello_fields(peer)))
                    peer.sock.send(hello, zmq.NOBLOCK)
                    peer.state = "hello_sent"
                except zmq.Again:
                    pass
                continue
            while peer.state == "ready" and peer.outbox:
                out = peer.outbox.peek()
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
                peer.last_sent = time.monotonic()
                sent = True
                if out.tensors:
                    self._leases.note_sent(out.transfer_id, out.nbytes)
        return sent

    def _send(self, peer: Peer, out: Outgoing) -> None:
        """Send one message (raises zmq.Again when it cannot leave now). Overridden by nccl."""
        if out.piece is None:
            peer.sock.send(self._seal(peer, pack_header({**out.fields, "session": peer.session})), zmq.NOBLOCK)
            return
        check_peer_frame_bound(peer, out.piece)
        header = self._seal(peer, pack_header(out.piece.to_wire(peer.session)))
        peer.sock.send_multipart([header, *(frame_view(t) for t in out.tensors)], flags=zmq.NOBLOCK, copy=False)

    def _fail_transfer(self, peer: Peer, tid: str, error: TransferError) -> None:
        if self._leases.release(tid, error):
            peer.outbox.append(Outgoing(tid, {"kind": "abort", "tid": tid, "reason": str(error)}))

    def _note_link_crash(self, what: str) -> None:
        """Called from a pair-link thread whose top level caught an unexpected exception (transfer/pairgroup.py)."""
        self._link_problem = self._link_problem or f"kv-sender pair-link thread died: {what}"[:500]
