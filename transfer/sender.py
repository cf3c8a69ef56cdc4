"""The KV sender of every socket backend (zmq, shm, auto, nccl, gloo): the prefill side of a transfer.

    caller thread: begin / send_layer / finish / abort --bounded queue--> I/O thread (device KV starts its copy
                   to pinned host memory first, transfer/staging.py; NCCL keeps it on the device)
    I/O thread:    one DEALER per receiver: hello -> welcome (transfer/auth.py), which picks the peer's payload path:
                   inline frames, a shm ring, the receiver's cache (direct) or a torch.distributed pair
    replies:       ack / nack / renew, MAC-checked, update the lease table; poll() hands out ended leases
Every wait is bounded (queue, handshake, stuck sends, leases, outbox bytes, idle peers: docs/transfer.md); a dead I/O
thread fails every lease (io_problem()).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import zmq

from transfer import cuda_ipc
from transfer.auth import NO_SESSION, NONCE_BYTES, OVERHEAD, handshake_key, seal, session_key, split, verify
from transfer.base import KVSender, check_layer_args
from transfer.config import TransferConfig
from transfer.direct_path import DirectSend
from transfer.errors import (
    AuthError,
    PeerGone,
    ProtocolError,
    TransferAborted,
    TransferError,
    TransferTimeout,
    error_from_code,
)
from transfer.kv_segment import SegmentWriter, pid_namespace
from transfer.outbox import Meter, Outbox, Outgoing, Peer, PieceRefused, check_peer_frame_bound, discard_rest
from transfer.pair_path import PairSend, consumer_event, gpu_uuid, same_gpu
from transfer.ring_path import SCHEME, RingSend, control_address
from transfer.shm_ring import RingWriter, ShmUnavailable, node_id
from transfer.sockets import configure
from transfer.staging import StagedTensors, Stager
from transfer.state import LeaseTable, TransferEvent
from transfer.wire import (
    MAX_BATCH_PIECES,
    MAX_HEADER_BYTES,
    Abort,
    Ack,
    Finish,
    Header,
    Hello,
    ModelFingerprint,
    Nack,
    PieceHeader,
    Pieces,
    Reject,
    Renew,
    Welcome,
    batch_layout,
    encode_piece,
    frame_bytes,
    frame_view,
    pack_header,
    unpack_header,
    with_checksums,
)

log = logging.getLogger(__name__)


TIMERS_EVERY_S = 0.002  # how often the I/O loop looks at handshakes, stuck peers, leases and keepalives
IDLE_LOOK_S = 0.05  # ... while no transfer is under way and nothing waits to be sent (keepalives are seconds apart)
BATCH_PIECE_BYTES = 256 << 10  # inline: pieces up to this size share a message with those queued after them
BATCH_BYTES = 4 << 20  # inline: at most this many payload bytes go in one message
BURST_WAIT_S = 5e-5  # after an idle wake by a piece: look again this often while more pieces keep arriving
BURST_MAX_S = 1e-3  # and gather a burst for at most this long
DRAIN_BYTES = 8 << 20  # the I/O loop stops taking commands for a turn once this much waits in its outboxes


class InlineSend:
    """Payload frames in the header's ZeroMQ message: any receiver, any node."""

    name = "inline"
    batches = True
    # whether the path moves device tensors itself (an NCCL pair, a GPU cache written through CUDA IPC); the others
    # get host copies, staged on a copy stream
    device_kv = False
    batch_piece_bytes, batch_bytes = BATCH_PIECE_BYTES, BATCH_BYTES

    def send(self, sender: Sender, peer: Peer, out: Outgoing) -> None:
        sender.send_inline(peer, out)

    def send_batch(self, sender: Sender, peer: Peer, outs: list[Outgoing]) -> None:
        sender.send_inline_batch(peer, outs)

    def collect(self) -> tuple[TransferError | None, list[tuple[str, TransferError]]]:
        return None, []

    def close(self) -> None:
        pass


INLINE = InlineSend()


class Sender(KVSender):
    """Thread-safe API; all sockets live in one I/O thread. `transport` is what the hello says: "zmq", "shm" or
    "dist" (nccl/gloo)."""

    def __init__(self, fingerprint: ModelFingerprint, config: TransferConfig | None = None, transport: str = "zmq"):
        self.fp = fingerprint
        self.cfg = config or TransferConfig()
        self.transport = transport
        self._hs_key = handshake_key(self.cfg.secret)
        self.rejected = 0  # replies dropped: unauthenticated, replayed or multipart
        self.shm_pieces = 0  # pieces that went through a ring
        self.direct_pieces = 0  # pieces written into a same-node receiver's cache
        self.same_gpu_peers = 0  # dist: receivers on this GPU (no pair group: ring or inline)
        self._gpu = gpu_uuid(self.cfg) if transport == "dist" else None
        # where payload tensors live for the path: NCCL moves device tensors, everything else host ones
        self._payload_device = self.cfg.device if transport == "dist" else "cpu"
        # commands taken per loop turn: a ring path lowers it to a few, so that encoding and ring copies interleave
        # and the receiver starts at once; else many, so that pieces ready together leave as one batch
        self._command_budget = 64
        self._leases = LeaseTable(self.cfg.lease_s)
        self._cmds: queue.Queue[tuple[Any, ...]] = queue.Queue(maxsize=self.cfg.queue_size)
        self._ctx = zmq.Context()
        self._peers: dict[str, Peer] = {}
        self._pieces: dict[str, int] = {}
        self._meter = Meter()  # bytes queued in every peer's outbox (bounded by max_outbox_bytes)
        self._keepalive_s = min(self.cfg.lease_s, self.cfg.idle_session_s) / 3
        self._next_sweep = 0.0
        self._next_timers = 0.0
        self._room_wait: Callable[[threading.Event], None] | None = None  # a ring piece waits for room
        self._stop = threading.Event()
        self._crash: BaseException | None = None
        self._link_problem = ""  # dist: a pair-link thread died of a bug
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
        """In the caller's thread: NCCL keeps device KV where it is, with an event on the caller's stream that the
        link's send waits on; other device KV starts its copy to pinned host memory; host KV passes through."""
        if k.is_cuda or v.is_cuda:
            if self._payload_device.startswith("cuda"):
                k, v = k.contiguous(), v.contiguous()
                return StagedTensors([k, v], ready=consumer_event([k, v]))
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

    def paths(self) -> dict[str, str]:
        # a copy of the I/O thread's table: its entries change only there, and a dict copy is atomic under the GIL
        peers = dict(self._peers)
        return {address: peer.path.name for address, peer in peers.items() if peer.path is not None}

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
        if not self._thread.is_alive():  # no I/O thread to move it: fail now rather than wait for nothing
            self._leases.release(transfer_id, TransferError(self.io_problem() or "sender I/O thread stopped"))
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

    # ------------------------------------------------------------------ I/O thread: commands and sends

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self._drain_commands()
                busy |= self._pump()
                busy |= self._read_replies()
                now = time.monotonic()
                if now >= self._next_timers:  # timeouts are seconds: every few ms, not every turn
                    self._next_timers = now + TIMERS_EVERY_S
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
        """Sleep until a command arrives (instant wake-up) or briefly, to look at replies again; a ring piece that
        waits for room naps on the ring's tail only (a few µs a look, not a turn of the whole loop)."""
        if self._room_wait is not None:
            wait, self._room_wait = self._room_wait, None
            wait(self._stop)
            return
        if not self._has_room():
            self._stop.wait(0.002)
            return
        try:
            # replies (acks, renewals) come only while transfers are under way: an idle sender looks at its sockets
            # every IDLE_LOOK_S, not every 2 ms (measured: 2 % of a core, against the next rows of bench transfer)
            busy = self._peers and (
                len(self._leases) or any(p.outbox or p.state != "ready" for p in self._peers.values())
            )
            cmd = self._cmds.get(timeout=TIMERS_EVERY_S if busy else IDLE_LOOK_S)
        except queue.Empty:
            return
        self._handle_command(cmd)
        if cmd[0] == "kv" and self._command_budget > 2 and sum(t.nbytes for t in cmd[4].host) <= BATCH_PIECE_BYTES:
            self._gather_burst()  # (a large piece goes at once: it would not share a message anyway)

    def _gather_burst(self) -> None:
        """Woken by a piece: let the rest of the caller's burst (every layer of a chunk, handed over in a loop whose
        torch calls hand us the GIL between pieces) queue up, so that it leaves as one batch instead of a message
        each. A lone piece (one layer streamed while the next computes) waits BURST_WAIT_S."""
        seen, end = -1, time.monotonic() + BURST_MAX_S
        while (queued := self._cmds.qsize()) != seen and time.monotonic() < end:
            seen = queued
            time.sleep(BURST_WAIT_S)

    def _drain_commands(self) -> bool:
        """Commands into outboxes, until a batch's worth waits: the first piece of a transfer leaves before the
        rest are encoded, and pieces ready together still leave together."""
        n = 0
        while n < self._command_budget and self._has_room() and self._meter.nbytes < DRAIN_BYTES:
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
                p.outbox.append(Outgoing(tid, Abort(tid, cmd[2][:1000])))
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
                self.fail_transfer(peer, tid, e)
                return
            # checksums are taken by the path, over the bytes as they leave (the ring's copy, or the source inline)
            header, tensors = encode_piece(
                self.fp, tid, layer, blocks, self._stage(k), self._stage(v), self.cfg.kv_wire_dtype, False
            )
            nbytes = sum(f.nbytes for f in header.frames)
            peer.outbox.append(Outgoing(tid, header, tensors, nbytes, ready=staged.ready))
            self._pieces[tid] = self._pieces.get(tid, 0) + 1
        elif kind == "finish":
            peer.outbox.append(Outgoing(tid, Finish(tid, self._pieces.pop(tid, 0))))

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda and self._payload_device.startswith("cuda"):
            return t
        if self._payload_device == "cpu" and not t.is_cuda and not t.requires_grad and t.is_contiguous():
            return t  # (a handed-over CPU tensor: as it is, with no torch call per piece beyond these)
        return t.detach().to(self._payload_device).contiguous()

    def _connect(self, address: str) -> Peer:
        """A DEALER to the control address ("shm+tcp://h:p" -> "tcp://h:p"), keyed by the address leases name."""
        # replies are headers only: anything larger is refused by ZeroMQ before it is buffered
        sock = configure(self._ctx.socket(zmq.DEALER), self.cfg, max_msg_bytes=MAX_HEADER_BYTES + OVERHEAD)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a receiver that is not connected
        sock.connect(control_address(address))
        peer = Peer(address, sock, time.monotonic(), Outbox(self._meter), nonce=os.urandom(NONCE_BYTES), path=INLINE)
        self._peers[address] = peer
        return peer

    def _hello(self, peer: Peer) -> Hello:
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
        return Hello(self.fp, transport, peer.nonce, node_id(), self._gpu, pidns, gpus)

    def seal_for(self, peer: Peer, header: Header) -> bytes:
        """A header of this peer's session: MAC under the session key, next sequence number."""
        peer.seq_out += 1
        return seal(peer.key, peer.session, peer.seq_out, pack_header(header))

    def _pump(self) -> bool:
        sent = False
        for peer in list(self._peers.values()):
            if peer.state == "connecting":
                try:
                    hello = seal(self._hs_key, NO_SESSION, 0, pack_header(self._hello(peer)))
                    peer.sock.send(hello, zmq.NOBLOCK)
                    peer.state = "hello_sent"
                except zmq.Again:
                    pass
                continue
            while peer.state == "ready" and peer.outbox:
                out = peer.outbox.peek()
                if not isinstance(out.message, Abort) and self._leases.get(out.transfer_id) is None:
                    peer.outbox.popleft()  # its transfer ended meanwhile
                    continue
                batch = self._batch(peer)
                try:
                    if batch:
                        peer.path.send_batch(self, peer, batch)
                    else:
                        self._send(peer, out)
                except zmq.Again as e:
                    self._room_wait = getattr(e, "wait", None)
                    peer.stuck_since = peer.stuck_since or time.monotonic()
                    break
                except PieceRefused as e:
                    peer.outbox.popleft()
                    self.fail_transfer(peer, out.transfer_id, e.error)
                    continue
                peer.stuck_since = None
                peer.last_sent = time.monotonic()
                sent = True
                sent_bytes: dict[str, int] = {}  # per transfer: one lease update for a batch's pieces
                for done in batch or [out]:
                    peer.outbox.popleft()
                    if done.tensors:
                        sent_bytes[done.transfer_id] = sent_bytes.get(done.transfer_id, 0) + done.nbytes
                for tid, nbytes in sent_bytes.items():
                    self._leases.note_sent(tid, nbytes)
        return sent

    def _batch(self, peer: Peer) -> list[Outgoing]:
        """The small pieces at the head of a peer's outbox, if its path sends batches and there are two or more:
        pieces ready together share one message (one seal, MAC, header decode and socket call for all)."""
        if not getattr(peer.path, "batches", False):
            return []
        outs: list[Outgoing] = []
        total = 0
        live: set[str] = set()  # transfers whose lease was looked up for this batch
        for out in peer.outbox:
            piece = out.piece
            if (
                piece is None
                or len(outs) == MAX_BATCH_PIECES
                or out.nbytes > peer.path.batch_piece_bytes
                or total + out.nbytes > peer.path.batch_bytes
                or out.transfer_id not in live
                and self._leases.get(out.transfer_id) is None
                or not peer.path.device_kv
                and any(t.is_cuda for t in out.tensors)
                or peer.max_frame_bytes  # the batch's one payload frame must pass the receiver's frame bound too
                and total + out.nbytes > peer.max_frame_bytes
            ):
                break
            live.add(out.transfer_id)
            outs.append(out)
            total += out.nbytes
        return outs if len(outs) > 1 else []

    def _send(self, peer: Peer, out: Outgoing) -> None:
        """Send one message by the peer's path (raises zmq.Again when it cannot leave now)."""
        if out.piece is None:
            peer.sock.send(self.seal_for(peer, out.message), zmq.NOBLOCK)
            return
        check_peer_frame_bound(peer, out.piece)
        if not peer.path.device_kv and any(t.is_cuda for t in out.tensors):
            # NCCL handed over device KV, but this receiver shares our GPU: host bytes through the ring or inline
            staged = self._stager.stage(out.tensors, after=out.ready)
            out.tensors, out.ready = staged.wait(self.cfg.send_timeout_s), None
        peer.path.send(self, peer, out)

    def send_inline_batch(self, peer: Peer, outs: list[Outgoing]) -> None:
        """Pieces as one message: their headers in one sealed `Pieces`, their frames copied into one payload frame
        (one socket frame instead of two per piece on each side), each checksummed over its copy while in cache."""
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
            if self.cfg.checksum:
                copies = [payload[at : at + f.nbytes] for at, f in zip(offsets[i : i + n], frames[i : i + n])]
                piece = with_checksums(piece, copies)
            headers.append(piece)
            i += n
        header = self.seal_for(peer, Pieces(pieces=tuple(headers)))
        peer.sock.send_multipart([header, payload.data], flags=zmq.NOBLOCK, copy=False)

    def send_inline(self, peer: Peer, out: Outgoing) -> None:
        """A piece as payload frames after its header, checksummed over its source (once, even if it waits)."""
        assert out.piece is not None
        if self.cfg.checksum and any(f.xxh3 is None for f in out.piece.frames):
            out.message = with_checksums(out.piece, [frame_view(t) for t in out.tensors])
        header = self.seal_for(peer, out.message)
        peer.sock.send_multipart([header, *(frame_view(t) for t in out.tensors)], flags=zmq.NOBLOCK, copy=False)

    def fail_transfer(self, peer: Peer, tid: str, error: TransferError) -> None:
        """A transfer whose piece cannot go fails (an Abort tells the receiver); paths call it for one of a batch."""
        if self._leases.release(tid, error):
            peer.outbox.append(Outgoing(tid, Abort(tid, str(error)[:1000])))

    def _note_link_crash(self, what: str) -> None:
        """Called from a pair-link thread whose top level caught an unexpected exception (transfer/pairgroup.py)."""
        self._link_problem = self._link_problem or f"kv-sender pair-link thread died: {what}"[:500]

    # ------------------------------------------------------------------ I/O thread: replies

    def _read_replies(self) -> bool:
        """Ask each socket whether a reply waits (~1 µs) before reading: a read that finds nothing raises zmq.Again,
        ~20 µs of Python, and the loop turns once or twice per piece."""
        got = False
        for peer in list(self._peers.values()):
            if not int(peer.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                continue
            for _ in range(256):
                try:
                    data = peer.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got = True
                try:
                    if peer.sock.getsockopt(zmq.RCVMORE):
                        discard_rest(peer.sock)
                        raise AuthError("a multipart reply (replies are one frame)")
                    self._on_reply(peer, self._open(peer, data))
                except TransferError as e:
                    self.rejected += isinstance(e, AuthError)
                    log.warning("bad reply from %s: %s", peer.address, e)
                if peer.address not in self._peers:
                    break
        return got

    def _open(self, peer: Peer, data: bytes) -> Header:
        """Check a reply's MAC (constant time), then decode it. Under the handshake key only a welcome (to our
        hello) or a reject can come; under the session key, ack/nack/renew in increasing sequence."""
        _, session, seq, body = split(data)
        if session == NO_SESSION:
            if not verify(self._hs_key, data):
                error = AuthError("unauthenticated reply")
                if peer.state == "hello_sent":  # the receiver answered our hello but cannot prove the secret
                    error = AuthError(
                        f"receiver {peer.address} refused or did not authenticate the handshake: "
                        "a different cluster secret?"
                    )
                    self._drop_peer(peer, error)
                raise error
            h = unpack_header(body)
            if isinstance(h, Reject) or isinstance(h, Welcome) and peer.state == "hello_sent":
                return h
            raise AuthError(f"unexpected {h.kind!r} under the handshake key")
        if not peer.key or session != peer.session or not verify(peer.key, data):
            raise AuthError("reply not authenticated for this session")
        if seq <= peer.seq_in:
            raise AuthError(f"replayed reply (sequence {seq} <= {peer.seq_in})")
        peer.seq_in = seq
        h = unpack_header(body)
        if not isinstance(h, Ack | Nack | Renew):
            raise ProtocolError(f"unexpected {h.kind!r} from the receiver")
        return h

    def _on_reply(self, peer: Peer, h: Header) -> None:
        if isinstance(h, Welcome):
            if h.nonce != peer.nonce:
                raise AuthError("a welcome that does not answer our hello (replayed?)")
            if h.session == NO_SESSION:
                raise ProtocolError("malformed welcome")
            peer.session = h.session
            peer.key = session_key(self._hs_key, peer.nonce, h.rnonce, h.session)
            peer.max_frame_bytes = h.max_frame_bytes
            peer.path = self._path_from_welcome(peer, h)
            peer.state = "ready"
            peer.last_sent = time.monotonic()  # the receiver's idle clock for this session starts about now
        elif isinstance(h, Reject):
            self._drop_peer(peer, error_from_code(h.code, f"receiver {peer.address} refused the handshake: {h.reason}"))
        elif isinstance(h, Ack):
            self._leases.release(h.tid)
        elif isinstance(h, Nack):
            err = error_from_code(h.code, f"receiver: {h.reason}")
            self._leases.release(h.tid, err)
            if h.code == "peer_gone":  # the receiver has forgotten our session: start over
                self._drop_peer(peer, err)
        elif isinstance(h, Renew):
            self._leases.renew(h.tid)

    def _path_from_welcome(self, peer: Peer, h: Welcome) -> Any:
        """The peer's payload path, as the receiver's welcome offers it: a pair group (dist, unless both ends share
        a GPU), else its shm ring, else inline frames; the receiver's cache itself first, if it offers it."""
        if h.direct is not None:
            try:
                return DirectSend(SegmentWriter.open(self.fp, h.direct))
            except (ShmUnavailable, OSError) as e:
                log.warning("KV to %s goes inline over ZeroMQ (its cache could not be mapped): %s", peer.address, e)
                return INLINE
        if h.same_gpu:
            if not same_gpu(self._gpu, h.gpu):
                raise ProtocolError("a same_gpu welcome from a receiver on another GPU")
            self.same_gpu_peers += 1
            log.info(
                "receiver %s is on this GPU (%s): KV goes the same-node path, no NCCL pair", peer.address, self._gpu
            )
        elif self.transport == "dist":
            if h.store_port is None:
                raise ProtocolError("a dist welcome without the pair group's store port")
            return PairSend.join(self.cfg, peer, h.store_port, self._note_link_crash)
        announced = h.shm
        if announced is None:
            if peer.address.startswith(SCHEME):
                log.info("receiver %s gave no shared-memory ring (another node?): KV goes inline", peer.address)
            return INLINE
        try:
            ring = RingSend(RingWriter.open(announced))
            self._command_budget = 2
            return ring
        except (ShmUnavailable, OSError) as e:
            log.warning("KV to %s goes inline over ZeroMQ: %s", peer.address, e)
            return INLINE

    # ------------------------------------------------------------------ I/O thread: timeouts and idle peers

    def _check_timeouts(self) -> None:
        for peer in list(self._peers.values()):
            broken, failed = peer.path.collect()
            if broken is not None:  # first: once its transfers' failures show, the peer is gone
                self._drop_peer(peer, broken)  # the link aborted its group; the next begin() pairs anew
            for tid, err in failed:
                self._leases.release(tid, err)
        now = time.monotonic()
        for peer in list(self._peers.values()):
            if peer.state != "ready" and now - peer.created > self.cfg.connect_timeout_s:
                why = f"no handshake with {peer.address} within {self.cfg.connect_timeout_s}s (receiver not running?)"
            elif peer.stuck_since is not None and now - peer.stuck_since > self.cfg.send_timeout_s:
                why = f"could not send to {peer.address} for {self.cfg.send_timeout_s}s (receiver gone or stalled)"
            else:
                continue
            self._drop_peer(peer, PeerGone(why))
        for tid, address in self._leases.due_keepalives(self._keepalive_s):
            kept = self._peers.get(address)
            if kept is not None and kept.state == "ready":  # tells the receiver we are alive
                kept.outbox.append(Outgoing(tid, Renew(tid)))
        for tid, address in self._leases.expire():
            self._pieces.pop(tid, None)
            expired = self._peers.get(address)
            if expired is not None:
                expired.outbox.append(Outgoing(tid, Abort(tid, "sender lease expired")))
        if now >= self._next_sweep:
            self._next_sweep = now + min(0.05, self.cfg.idle_session_s / 8)
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Close peers that carry no lease and sent nothing for idle_session_s / 2 (the receiver drops its side
        after idle_session_s: closing first, we never send into a dropped session); when the outboxes are full,
        drop what they hold for transfers that ended meanwhile, so the live ones can move again."""
        busy = self._leases.peers()
        for peer in list(self._peers.values()):
            if (
                peer.state == "ready"
                and not peer.outbox
                and peer.address not in busy
                and now - peer.last_sent > self.cfg.idle_session_s / 2
            ):
                log.debug("closing idle kv peer %s", peer.address)
                self._close_peer(peer)
                self._peers.pop(peer.address, None)
        if not self._has_room():
            for peer in self._peers.values():
                peer.outbox.discard(
                    lambda o: not isinstance(o.message, Abort) and self._leases.get(o.transfer_id) is None
                )

    def _drop_peer(self, peer: Peer, error: TransferError) -> None:
        self._close_peer(peer)
        self._peers.pop(peer.address, None)
        for tid in self._leases.release_peer(peer.address, error):
            self._pieces.pop(tid, None)

    def _close_peer(self, peer: Peer) -> None:
        peer.outbox.clear()
        peer.path.close()
        peer.sock.close(linger=0)
