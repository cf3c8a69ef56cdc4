"""The KV sender of every socket backend (zmq, shm, auto, nccl, gloo): the prefill side of a transfer.

    caller thread: begin / send_layer / finish / abort --bounded queue--> I/O thread (device KV starts its copy
                   to pinned host memory first, transfer/staging.py; NCCL keeps it on the device)
    commands:      StartTransfer, SendPiece, FinishTransfer, AbortTransfer (below), dispatched by type
    I/O thread:    one DEALER per receiver: hello -> welcome (transfer/handshake.py), which picks the peer's payload
                   path (transfer/path.py): inline frames, a shm ring, the receiver's cache or a torch.distributed pair
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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import zmq

from transfer.auth import NO_SESSION, NONCE_BYTES, OVERHEAD, split, verify
from transfer.base import KVSender, check_layer_args
from transfer.config import TransferConfig
from transfer.errors import (
    AuthError,
    PeerGone,
    ProtocolError,
    TransferAborted,
    TransferError,
    TransferTimeout,
    error_from_code,
)
from transfer.handshake import Initiator, handshake_frame
from transfer.inline_path import BATCH_PIECE_BYTES
from transfer.outbox import Meter, Outbox, Outgoing, PieceRefused, discard_rest
from transfer.pair_path import consumer_event
from transfer.path import Peer, PeerState
from transfer.ring_path import NoRoom, control_address
from transfer.sockets import configure
from transfer.staging import StagedTensors, Stager
from transfer.state import LeaseTable, TransferEvent
from transfer.wire import (
    MAX_BATCH_PIECES,
    MAX_HEADER_BYTES,
    Abort,
    Ack,
    Finish,
    ModelFingerprint,
    Nack,
    Renew,
    encode_piece,
    unpack_header,
)
from transfer.zap import connect_plain, plane_keys

log = logging.getLogger(__name__)


TIMERS_EVERY_S = 0.002  # how often the I/O loop looks at handshakes, stuck peers, leases and keepalives
IDLE_LOOK_S = 0.05  # ... while no transfer is under way and nothing waits to be sent (keepalives are seconds apart)
BURST_WAIT_S = 5e-5  # after an idle wake by a piece: look again this often while more pieces keep arriving
BURST_MAX_S = 1e-3  # and gather a burst for at most this long
DRAIN_BYTES = 8 << 20  # the I/O loop stops taking commands for a turn once this much waits in its outboxes
COMMAND_BUDGET = 64  # commands taken a turn, unless a peer's path asks for fewer (SendPath.command_budget)


@dataclass(slots=True)
class StartTransfer:
    transfer_id: str
    peer: str


@dataclass(slots=True)
class SendPiece:
    transfer_id: str
    layer: int
    blocks: list[int]
    staged: StagedTensors  # k, v (host, pinned copies on their way, or device KV for an NCCL pair)
    heads: tuple[int, int] | None = None  # of the receiver's heads only (a tensor-parallel sender's share)


@dataclass(slots=True)
class FinishTransfer:
    transfer_id: str


@dataclass(slots=True)
class AbortTransfer:
    transfer_id: str
    reason: str
    peer: str  # the lease is gone when the I/O thread takes this: where to tell


Command = StartTransfer | SendPiece | FinishTransfer | AbortTransfer


class Sender(KVSender):
    """Thread-safe API; all sockets live in one I/O thread. `transport` is what the hello says: "zmq", "shm" or
    "dist" (nccl/gloo)."""

    def __init__(self, fingerprint: ModelFingerprint, config: TransferConfig | None = None, transport: str = "zmq"):
        self.fp = fingerprint
        self.cfg = config or TransferConfig()
        self.transport = transport
        self.rejected = 0  # replies dropped: unauthenticated, replayed or multipart
        self.pieces_by_path: Counter[str] = Counter()  # pieces a ring or the receiver's cache (direct) took
        self._handshake = Initiator(fingerprint, self.cfg, transport, self._note_link_crash)
        # where payload tensors live for the path: NCCL moves device tensors, everything else host ones
        self._payload_device = self.cfg.device if transport == "dist" else "cpu"
        self._command_budget = COMMAND_BUDGET
        self._leases = LeaseTable(self.cfg.lease_s)
        self._cmds: queue.Queue[Command] = queue.Queue(maxsize=self.cfg.queue_size)
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
        self._put(transfer_id, StartTransfer(transfer_id, peer))

    def send_layer(
        self,
        transfer_id: str,
        layer: int,
        dst_block_ids: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        heads: tuple[int, int] | None = None,
    ) -> bool:
        check_layer_args(self.fp, layer, dst_block_ids, k, v, heads)
        if self._leases.get(transfer_id) is None:
            return False  # already failed/aborted: its event is (or was) in poll()
        piece = SendPiece(transfer_id, layer, list(dst_block_ids), self._handover(k, v), heads)
        return self._put(transfer_id, piece)

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
            self._put(transfer_id, FinishTransfer(transfer_id))

    def abort(self, transfer_id: str, reason: str = "aborted by sender") -> None:
        lease = self._leases.get(transfer_id)
        if lease is not None and self._leases.release(transfer_id, TransferAborted(reason)):
            try:
                self._cmds.put_nowait(AbortTransfer(transfer_id, reason, lease.peer))
            except queue.Full:
                pass  # the receiver's deadline frees its side

    def poll(self) -> list[TransferEvent]:
        if not self._thread.is_alive() and self._leases.ids():
            self._leases.fail_all(TransferError(f"sender I/O thread stopped: {self._crash!r}"))
        return self._leases.drain()

    def paths(self) -> dict[str, str]:
        # a copy of the I/O thread's table: its entries change only there, and a dict copy is atomic under the GIL
        peers = dict(self._peers)
        return {address: peer.path.name for address, peer in peers.items()}

    def io_problem(self) -> str:
        if self._crash is not None:
            return f"kv-sender I/O thread died: {type(self._crash).__name__}: {self._crash}"[:500]
        if not self._stop.is_set() and not self._thread.is_alive():
            return "kv-sender I/O thread is not running"
        return self._link_problem

    @property
    def shm_pieces(self) -> int:
        """Pieces that went through a ring."""
        return self.pieces_by_path["shm-ring"]

    @property
    def direct_pieces(self) -> int:
        """Pieces written into a same-node receiver's cache."""
        return self.pieces_by_path["shm-direct"] + self.pieces_by_path["cuda-ipc"]

    @property
    def same_gpu_peers(self) -> int:
        """dist: receivers on this GPU (no pair group: ring or inline)."""
        return self._handshake.same_gpu_peers

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

    def _put(self, transfer_id: str, cmd: Command) -> bool:
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
                len(self._leases) or any(p.outbox or p.state is not PeerState.READY for p in self._peers.values())
            )
            cmd = self._cmds.get(timeout=TIMERS_EVERY_S if busy else IDLE_LOOK_S)
        except queue.Empty:
            return
        self._handle_command(cmd)
        if (
            isinstance(cmd, SendPiece)
            and self._command_budget == COMMAND_BUDGET  # (a ring streams each piece as it comes)
            and sum(t.nbytes for t in cmd.staged.host) <= BATCH_PIECE_BYTES
        ):
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

    def _handle_command(self, cmd: Command) -> None:
        tid = cmd.transfer_id
        if isinstance(cmd, AbortTransfer):
            self._pieces.pop(tid, None)
            p = self._peers.get(cmd.peer)
            if p is not None:
                p.outbox.discard(lambda o: o.transfer_id == tid)
                p.outbox.append(Outgoing(tid, Abort(tid, cmd.reason[:1000])))
            return
        lease = self._leases.get(tid)
        if lease is None:
            self._pieces.pop(tid, None)
            return
        peer = self._peers.get(lease.peer) or self._connect(lease.peer)
        match cmd:
            case StartTransfer():
                self._pieces[tid] = 0
            case SendPiece():
                self._queue_piece(peer, cmd)
            case FinishTransfer():
                peer.outbox.append(Outgoing(tid, Finish(tid, self._pieces.pop(tid, 0))))

    def _queue_piece(self, peer: Peer, cmd: SendPiece) -> None:
        tid = cmd.transfer_id
        try:
            k, v = cmd.staged.wait(self.cfg.send_timeout_s)  # the staging copy (device KV), bounded
        except TransferError as e:
            self.fail_transfer(peer, tid, e)
            return
        # checksums are taken by the path, over the bytes as they leave (the ring's copy, or the source inline)
        header, tensors = encode_piece(
            self.fp,
            tid,
            cmd.layer,
            cmd.blocks,
            self._stage(k),
            self._stage(v),
            self.cfg.kv_wire_dtype,
            False,
            cmd.heads,
        )
        nbytes = sum(f.nbytes for f in header.frames)
        peer.outbox.append(Outgoing(tid, header, tensors, nbytes, ready=cmd.staged.ready))
        self._pieces[tid] = self._pieces.get(tid, 0) + 1

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
        connect_plain(sock, plane_keys(self.cfg.secret))  # what the receiver's ZAP handler asks of a peer
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        sock.connect(control_address(address))
        peer = Peer(
            address, sock, time.monotonic(), Outbox(self._meter), self._handshake.inline, os.urandom(NONCE_BYTES)
        )
        peer.monitor = monitor
        self._peers[address] = peer
        return peer

    def _pump(self) -> bool:
        sent = False
        for peer in list(self._peers.values()):
            if peer.state is PeerState.CONNECTING:
                try:
                    peer.sock.send(handshake_frame(self._handshake.key, self._handshake.hello(peer)), zmq.NOBLOCK)
                    peer.state = PeerState.HELLO_SENT
                except zmq.Again:
                    pass
                continue
            while peer.state is PeerState.READY and peer.outbox:
                out = peer.outbox.peek()
                if not isinstance(out.message, Abort) and self._leases.get(out.transfer_id) is None:
                    peer.outbox.popleft()  # its transfer ended meanwhile
                    continue
                batch = self._batch(peer)
                try:
                    if batch:
                        peer.path.send(self, peer, batch)
                    else:
                        self._send(peer, out)
                except zmq.Again as e:
                    self._room_wait = e.wait if isinstance(e, NoRoom) else None
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
        if not peer.path.batch_bytes:
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
            peer.sock.send(peer.seal(out.message), zmq.NOBLOCK)
            return
        peer.check_frame_bound(out.piece)
        if not peer.path.device_kv and any(t.is_cuda for t in out.tensors):
            # NCCL handed over device KV, but this receiver shares our GPU: host bytes through the ring or inline
            staged = self._stager.stage(out.tensors, after=out.ready)
            out.tensors, out.ready = staged.wait(self.cfg.send_timeout_s), None
        peer.path.send(self, peer, [out])

    # ------------------------------------------------------------------ what its payload paths may ask (SendHost)

    def fail_transfer(self, peer: Peer, transfer_id: str, error: TransferError) -> None:
        if self._leases.release(transfer_id, error):
            peer.outbox.append(Outgoing(transfer_id, Abort(transfer_id, str(error)[:1000])))

    def count_pieces(self, path: str, pieces: int) -> None:
        self.pieces_by_path[path] += pieces

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
                    self._on_reply(peer, data)
                except TransferError as e:
                    self.rejected += isinstance(e, AuthError)
                    log.warning("bad reply from %s: %s", peer.address, e)
                if peer.address not in self._peers:
                    break
        return got

    def _on_reply(self, peer: Peer, data: bytes) -> None:
        """A handshake answer (transfer/handshake.py), or ack/nack/renew under the session key in increasing
        sequence, its MAC checked (constant time) before it is decoded."""
        _, session, seq, body = split(data)
        if session == NO_SESSION:
            failed = self._handshake.answer(peer, data, body)
            if failed is None:  # welcomed
                self._command_budget = min(self._command_budget, peer.path.command_budget)
                return
            self._drop_peer(peer, failed)
            if isinstance(failed, AuthError):
                raise failed  # counted and logged as any unauthenticated reply
            return
        if not peer.key or session != peer.session or not verify(peer.key, data):
            raise AuthError("reply not authenticated for this session")
        if seq <= peer.seq_in:
            raise AuthError(f"replayed reply (sequence {seq} <= {peer.seq_in})")
        peer.seq_in = seq
        h = unpack_header(body)
        if isinstance(h, Ack):
            self._leases.release(h.tid)
        elif isinstance(h, Nack):
            err = error_from_code(h.code, f"receiver: {h.reason}")
            self._leases.release(h.tid, err)
            if h.code == "peer_gone":  # the receiver has forgotten our session: start over
                self._drop_peer(peer, err)
        elif isinstance(h, Renew):
            self._leases.renew(h.tid)
        else:
            raise ProtocolError(f"unexpected {h.kind!r} from the receiver")

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
            if peer.state is not PeerState.READY and peer.monitor is not None and peer.monitor.poll(0):
                self._drop_peer(
                    peer,
                    AuthError(
                        f"{peer.address} refused this cluster's password in ZeroMQ's handshake: a different cluster "
                        "secret?"
                    ),
                )
                continue
            if peer.state is not PeerState.READY and now - peer.created > self.cfg.connect_timeout_s:
                why = f"no handshake with {peer.address} within {self.cfg.connect_timeout_s}s (receiver not running?)"
            elif peer.stuck_since is not None and now - peer.stuck_since > self.cfg.send_timeout_s:
                why = f"could not send to {peer.address} for {self.cfg.send_timeout_s}s (receiver gone or stalled)"
            else:
                continue
            self._drop_peer(peer, PeerGone(why))
        for tid, address in self._leases.due_keepalives(self._keepalive_s):
            kept = self._peers.get(address)
            if kept is not None and kept.state is PeerState.READY:  # tells the receiver we are alive
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
                peer.state is PeerState.READY
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
        if peer.monitor is not None:
            peer.sock.disable_monitor()
            peer.monitor.close(linger=0)
        peer.sock.close(linger=0)
