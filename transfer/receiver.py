"""The KV receiver of every socket backend (zmq, shm, auto, nccl, gloo): the decode side of a transfer.

All in the thread that calls `poll()`, never blocking:
    ROUTER <- [identity, sealed header, frames...], at most MAX_FRAMES, each bounded by MAXMSGSIZE; MAC checked first
    hello  -> transfer/handshake.py Acceptor -> welcome (session token and the session's payload path: inline frames,
              a shm ring, the engine's cache (direct) or a torch.distributed pair) or reject
    kv     -> InboundTable.admit (checks, claims blocks) -> the session's path (transfer/path.py) -> sink
    finish -> lost pieces fail now; abort -> FAILED; replies: ack (DONE), nack (FAILED, with the error's code), renew
A malformed message fails only the transfer it names; sessions are bounded (transfer/sessions.py).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import zmq

from transfer.auth import NO_SESSION, OVERHEAD, seal, split, verify
from transfer.base import KVReceiver
from transfer.config import TransferConfig
from transfer.errors import (
    AuthError,
    PeerGone,
    ProtocolError,
    SenderAborted,
    SessionLimit,
    TransferAborted,
    TransferError,
)
from transfer.handshake import Acceptor, handshake_frame, reject
from transfer.inbound import InboundTable, Sink
from transfer.kv_segment import KVSegment
from transfer.path import ReceivePath, Session
from transfer.ring_path import DEFAULT_MAX_RINGS, DEFAULT_RING_BYTES, SCHEME, RingReceive, control_address
from transfer.sessions import SessionTable
from transfer.shm_ring import MAX_RING_BYTES, MIN_RING_BYTES, sweep_stale
from transfer.sockets import bind_address, configure
from transfer.staging import SideStreamSink
from transfer.state import Inbound, TransferEvent
from transfer.wire import (
    MAX_HEADER_BYTES,
    Abort,
    Ack,
    Finish,
    Header,
    Hello,
    ModelFingerprint,
    Nack,
    Named,
    PieceHeader,
    Pieces,
    Reject,
    Renew,
    Welcome,
    batch_layout,
    declared_sizes_match,
    named,
    pack_header,
    unpack_header,
)
from transfer.zap import ZapHandler, plane_keys, serve_plain

log = logging.getLogger(__name__)
MAX_FRAMES = 2 + 4  # identity, header, at most 4 payload frames (int8: k, k scales, v, v scales); a batch has 1
TIMERS_EVERY_S = 0.005  # how often poll() looks at deadlines, silent senders, idle sessions and renewals


class Receiver(KVReceiver):
    """Not thread-safe: one thread calls expect/poll/abort. `transport` is what hellos must say: "zmq", "shm" (its
    address is "shm+" and the control address) or "dist" (nccl/gloo)."""

    def __init__(
        self,
        fingerprint: ModelFingerprint,
        sink: Sink,
        address: str,
        config: TransferConfig | None = None,
        transport: str = "zmq",
        *,
        ring_bytes: int = DEFAULT_RING_BYTES,
        max_rings: int = DEFAULT_MAX_RINGS,
        segment: KVSegment | None = None,
    ) -> None:
        """``segment``: the engine's KV cache in shared memory (shm and auto) or its GPU cache's IPC handles (dist),
        written in place by same-node senders; closed with the receiver."""
        if not MIN_RING_BYTES <= ring_bytes <= MAX_RING_BYTES or max_rings < 0:
            raise ValueError(f"ring_bytes must be in [{MIN_RING_BYTES}, {MAX_RING_BYTES}] and max_rings >= 0")
        self.fp = fingerprint
        self.cfg = config or TransferConfig()
        self.transport = transport
        self.ring_bytes, self.max_rings = ring_bytes, max_rings
        self.pieces_by_path: Counter[str] = Counter()  # pieces a ring or the sender itself (direct) carried
        self._segment = segment if transport in ("shm", "dist") else None
        self._held: list[TransferEvent] = []  # failed transfers whose blocks a writer may still be copying into
        if transport != "zmq":
            swept = sweep_stale()
            if swept:
                log.info("unlinked %d shared-memory rings of dead receivers", swept)
        # a KV cache on a GPU is written on a side stream, fenced into the consumer's stream when a transfer is DONE
        self._sink = SideStreamSink(sink, self.cfg.kv_device, self.cfg.staging_bytes)
        self._table = InboundTable(fingerprint, self._sink, self.cfg.max_frame_bytes, self.cfg.deadline_s)
        self._sessions = SessionTable(self.cfg.max_sessions, self.cfg.idle_session_s)
        self._seq_out = 0
        self._ctx = zmq.Context()
        self._zap = ZapHandler(self._ctx, plane_keys(self.cfg.secret), "kv-receiver")
        # no frame larger than a payload frame or a sealed header is ever buffered (ZeroMQ drops the peer)
        self._sock = configure(
            self._ctx.socket(zmq.ROUTER),
            self.cfg,
            max_msg_bytes=max(self.cfg.max_frame_bytes, MAX_HEADER_BYTES + OVERHEAD),
        )
        serve_plain(self._sock)  # a stranger is dropped in ZeroMQ's handshake (transfer/zap.py)
        self._zap.watch(self._sock)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # replies to vanished peers error, not vanish
        self._sock.bind(bind_address(control_address(address)))
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if transport == "shm":
            self.address = SCHEME + self.address  # senders see that a ring is on offer
        self.dropped = 0  # messages refused before they could be attributed to a transfer
        self.rejected = 0  # of which: bad or missing MAC, replayed, or too many frames
        self._io_problem = ""  # dist: a pair-link thread died of a bug (see io_problem)
        self._retired: list[ReceivePath] = []  # paths of dropped sessions whose link thread has not ended yet
        self._handshake = Acceptor(
            fingerprint, self.cfg, transport, self.address, self._segment, ring_bytes, max_rings, self._note_link_crash
        )
        self._closed = False
        self._next_timers = 0.0

    # ------------------------------------------------------------------ API

    def expect(
        self,
        transfer_id: str,
        dst_block_ids: Sequence[int],
        *,
        num_layers: int | None = None,
        deadline_s: float | None = None,
        leading_run: bool = False,
        heads: tuple[int, int] | None = None,
    ) -> None:
        self._table.expect(transfer_id, dst_block_ids, num_layers, deadline_s, leading_run, heads)
        if self._segment is not None:
            self._segment.claim(transfer_id, dst_block_ids)

    def poll(self, max_messages: int = 256) -> list[TransferEvent]:
        if not self._closed:
            for _ in range(max_messages):
                try:
                    frames = self._recv_message()
                except zmq.Again:
                    break
                if frames is not None:
                    self._handle(frames)
            for sess in list(self._sessions.values()):
                sess.path.poll(self, sess)  # payloads that completed off the socket (pair links)
            now = time.monotonic()
            if now >= self._next_timers:  # deadlines and leases are seconds: not every message's business
                self._next_timers = now + TIMERS_EVERY_S
                self._renew_and_expire()
        events = self._released(self._held + self._table.drain())
        if any(ev.ok for ev in events):
            self._sink.fence()  # what the engine admits next is ordered after the side stream's writes
        return events

    def _released(self, events: list[TransferEvent]) -> list[TransferEvent]:
        """The ended transfers whose blocks no sender can write any more (all, without a segment); the others are
        held for the next poll."""
        if self._segment is None:
            return events
        done: list[TransferEvent] = []
        self._held = []
        for ev in events:
            (done if self._segment.release(ev.transfer_id, writer_may_run=not ev.ok) else self._held).append(ev)
        return done

    def wait(self, timeout_s: float) -> bool:
        if self._closed:
            return False
        if self.transport == "dist":  # payloads complete in link threads, not on the socket
            timeout_s = min(timeout_s, 0.001)
        return bool(self._sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN))

    def rings(self) -> int:
        """Sessions that hold a ring now."""
        return sum(1 for s in self._sessions.values() if isinstance(s.path, RingReceive))

    @property
    def shm_pieces(self) -> int:
        """Pieces read from a ring."""
        return self.pieces_by_path["shm-ring"]

    @property
    def direct_pieces(self) -> int:
        """Pieces a sender wrote into the segment itself."""
        return self.pieces_by_path["shm-direct"] + self.pieces_by_path["cuda-ipc"]

    @property
    def same_gpu_sessions(self) -> int:
        """dist: sender sessions from this GPU (ring or inline, no pair group)."""
        return self._handshake.same_gpu_sessions

    def abort(self, transfer_id: str, reason: str = "aborted by receiver") -> None:
        rec = self._table.fail(transfer_id, TransferAborted(reason))
        if rec is not None:
            self._nack(rec, "aborted", reason)
            if self._segment is not None:  # now: the caller may expect its blocks for another transfer at once
                self._segment.release(transfer_id, writer_may_run=True)

    def io_problem(self) -> str:
        """A pair-link thread that died of something other than its peer (all other I/O is in poll(), the caller's)."""
        return self._io_problem

    def _note_link_crash(self, what: str) -> None:
        """Called from a pair-link thread whose top level caught an unexpected exception (transfer/pairgroup.py)."""
        self._io_problem = self._io_problem or f"kv-receiver pair-link thread died: {what}"[:500]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for tid in self._table.ids():
            self._table.fail(tid, PeerGone("receiver closed"))
        end = time.monotonic() + 2.0  # a pair group alive at interpreter exit aborts the process: let them end
        for path in [s.path for s in self._sessions.values()] + self._retired:
            path.close(join_s=max(0.0, end - time.monotonic()))
        self._sock.close(linger=0)
        self._zap.close()
        self._ctx.destroy(linger=0)
        if self._segment is not None:
            self._segment.close()

    @property
    def handshake_refused(self) -> int:
        """Peers without the cluster's password, dropped at connect (the ZAP handler counts)."""
        return self._zap.refused

    # ------------------------------------------------------------------ messages

    def _recv_message(self) -> list[Any] | None:
        """One message (raises zmq.Again when none is waiting): identity and header as bytes (small: a copy costs less
        than a zero-copy frame), payload frames as views of ZeroMQ's buffers. None if it had too many frames: those
        are dropped as they are read, never collected."""
        sock = self._sock
        parts: list[Any] = [sock.recv(zmq.NOBLOCK)]
        while sock.getsockopt(zmq.RCVMORE):
            if len(parts) >= MAX_FRAMES:
                while sock.getsockopt(zmq.RCVMORE):
                    sock.recv(zmq.NOBLOCK, copy=False)
                self._reject_frame(f"a message of more than {MAX_FRAMES} frames")
                return None
            parts.append(sock.recv(zmq.NOBLOCK) if len(parts) == 1 else sock.recv(zmq.NOBLOCK, copy=False).buffer)
        return parts

    def _reject_frame(self, reason: str) -> None:
        self.dropped += 1
        self.rejected += 1
        if self.rejected & (self.rejected - 1) == 0:  # 1st, 2nd, 4th, ...: a flood cannot flood the log
            log.warning("dropped an unauthenticated message (%d so far): %s", self.rejected, reason)

    def _handle(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            self.dropped += 1
            return
        identity, raw = frames[0], frames[1]
        try:
            _, session, seq, body = split(raw)
        except AuthError as e:
            self._reject_frame(str(e))
            return
        if session == NO_SESSION:  # a hello: MAC under the handshake key
            if not verify(self._handshake.key, raw):
                self._reject_frame("handshake not authenticated (a different cluster secret?)")
                self._send_hs(identity, reject(AuthError("handshake not authenticated: a different cluster secret?")))
                return
            try:
                h = unpack_header(body)
            except TransferError as e:  # authenticated, so a bug of its sender: say so if it was a hello
                self.dropped += 1
                log.warning("dropped undecodable handshake: %s", e)
                if named(body).kind == "hello":
                    self._send_hs(identity, reject(e))
                return
            if isinstance(h, Hello) and len(frames) == 2:
                self._on_hello(identity, h)
            else:
                self.dropped += 1
            return
        sess = self._sessions.get(session)
        if sess is None:
            self.dropped += 1
            self._send_hs(identity, reject(PeerGone("unknown session (receiver restarted?): handshake again")))
            return
        if not verify(sess.key, raw):
            self._reject_frame("MAC does not match the session key")
            return
        if seq <= sess.seq_in:
            self._reject_frame(f"replayed message (sequence {seq} <= {sess.seq_in})")
            return
        sess.seq_in = seq
        self._sessions.touch(sess)
        sess.identity = identity  # a reconnected DEALER may come back under a new routing id
        try:
            h = unpack_header(body)
        except TransferError as e:
            self._refuse(sess, session, named(body), e)
            return
        if isinstance(h, Pieces):
            self._on_pieces(sess, session, h, frames[2:])
            return
        if isinstance(h, PieceHeader):
            self._take_piece(sess, session, h, frames[2:])
            return
        tid = getattr(h, "tid", None)
        if tid is None:
            self.dropped += 1
            return
        rec = self._table.get(tid)
        try:
            if isinstance(h, Finish):
                self._table.on_finish(session, tid, h.pieces)
            elif isinstance(h, Renew):
                self._table.heard(tid, session)
                return
            elif isinstance(h, Abort) and rec is not None and rec.session in (None, session):
                self._table.fail(tid, SenderAborted(f"sender aborted: {h.reason[:200]}"))
                return
            else:
                self.dropped += 1
        except TransferError as e:
            self._refuse(sess, session, h, e)
            return
        if rec is not None and self._table.get(tid) is None:
            self._reply(sess, Ack(tid))

    def _on_pieces(self, sess: Session, session: bytes, batch: Pieces, bufs: list[Any]) -> None:
        """A batch: each piece taken or refused on its own, its frames sliced out of the one payload frame. Sizes
        that are not our fingerprint's, or a payload of another length than they add up to, refuse every piece: the
        slices of the others would be wrong."""
        inline = [p for p in batch.pieces if not p.direct]
        offsets, total = batch_layout([f.nbytes for p in inline for f in p.frames])
        payload = memoryview(bufs[0]) if len(bufs) == 1 else None
        fits = payload.nbytes == total if payload is not None else not bufs and not inline
        if not fits or not all(declared_sizes_match(p, self.fp) for p in inline):
            for p in batch.pieces:
                self._refuse(sess, session, p, ProtocolError("a batch whose payload does not match its pieces"))
            return
        i = 0
        for p in batch.pieces:
            views: list[Any] = []
            if not p.direct:
                assert payload is not None
                views = [payload[at : at + f.nbytes] for at, f in zip(offsets[i : i + len(p.frames)], p.frames)]
                i += len(p.frames)
            self._take_piece(sess, session, p, views)

    def _take_piece(self, sess: Session, session: bytes, h: PieceHeader, bufs: list[Any]) -> None:
        rec = self._table.get(h.transfer_id)
        try:
            self._on_piece(sess, self._table.admit(session, h), bufs)
        except TransferError as e:
            self._refuse(sess, session, h, e)
            return
        if rec is not None and self._table.get(h.transfer_id) is None:
            self._reply(sess, Ack(h.transfer_id))

    def _refuse(self, sess: Session, session: bytes, h: Header | Named, error: TransferError) -> None:
        """A message that cannot be taken fails the transfer it names, if that is one of this session's; one for a
        transfer that is not ours is nacked, so its sender frees it now."""
        tid = h.transfer_id if isinstance(h, PieceHeader) else getattr(h, "tid", None)
        rec = self._table.get(tid) if isinstance(tid, str) else None
        if isinstance(h, PieceHeader | Named) and h.kind == "kv":
            sess.path.on_bad_piece(self, sess, h, error)
        if rec is not None and rec.session in (None, session):
            self._fail(rec.transfer_id, error)
            return
        self.dropped += 1
        log.warning("dropped message for transfer %r: %s", tid, error)
        if isinstance(tid, str) and rec is None:  # not ours (never expected, or already ended): free the sender now
            self._reply(sess, Nack(tid, error.code, str(error)[:1000]))

    def _on_hello(self, identity: bytes, h: Hello) -> None:
        try:
            self._handshake.check(h)
            if self._sessions.full():
                self._expire_sessions(force=True)
            if self._sessions.full():  # never evict a session that may be in use: refuse the newcomer
                raise SessionLimit(
                    f"receiver holds its maximum of {self._sessions.max_sessions} sender sessions "
                    f"(none idle for {self._sessions.idle_s:g} s); try again later"
                )
            sess, welcome = self._handshake.open(identity, h, self.rings())
        except TransferError as e:
            self.rejected += isinstance(e, AuthError)  # a replayed hello
            log.warning("refused handshake: %s", e)
            self._send_hs(identity, reject(e))
            return
        self._sessions.add(sess)
        self._send_hs(identity, welcome)

    def _on_piece(self, sess: Session, piece: PieceHeader, bufs: list[Any]) -> None:
        sess.path.on_piece(self, sess, piece, bufs)

    # ------------------------------------------------------------------ what its payload paths may ask (ReceiveHost)

    def complete(self, piece: PieceHeader, frames: Sequence[Any]) -> None:
        self._table.complete(piece, frames)

    def land(self, piece: PieceHeader) -> None:
        self._table.landed(piece)

    def arrived(
        self, sess: Session, piece: PieceHeader, tensors: list[torch.Tensor], error: TransferError | None
    ) -> None:
        tid = piece.transfer_id
        known = self._table.get(tid) is not None
        try:
            if error is not None:
                raise error
            self._table.complete_tensors(piece, tensors)
        except TransferError as e:
            self._fail(tid, e)
            return
        if known and self._table.get(tid) is None:
            self._reply(sess, Ack(tid))

    def drop_session(self, sess: Session, error: TransferError) -> None:
        if self._sessions.pop(sess.token, None) is not None:
            self._close_session(sess)  # never waits for a link thread still forming its group
        for rec in self._table.items():
            if rec.session == sess.token:
                self._table.fail(rec.transfer_id, error)

    def count_pieces(self, path: str, pieces: int) -> None:
        self.pieces_by_path[path] += pieces

    # ------------------------------------------------------------------ replies, timers

    def _fail(self, tid: str, error: TransferError) -> None:
        rec = self._table.fail(tid, error)
        if rec is not None:
            self._nack(rec, error.code, str(error))

    def _nack(self, rec: Inbound, code: str, reason: str) -> None:
        sess = self._sessions.get(rec.session) if rec.session else None
        if sess is not None:
            self._reply(sess, Nack(rec.transfer_id, code, reason[:1000]))

    def _reply(self, sess: Session, header: Header) -> None:
        """A reply within a session: sealed with its key."""
        self._seq_out += 1
        self._send(sess.identity, seal(sess.key, sess.token, self._seq_out, pack_header(header)))

    def _send_hs(self, identity: bytes, header: Welcome | Reject) -> None:
        """A handshake reply: sealed with the handshake key."""
        self._send(identity, handshake_frame(self._handshake.key, header))

    def _send(self, identity: bytes, frame: bytes) -> None:
        try:
            self._sock.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # peer gone or not reading: its lease expiry covers it

    def _expire_sessions(self, force: bool = False) -> None:
        """Drop sessions no transfer is bound to that have been silent for idle_session_s (transfer/sessions.py)."""

        def bound() -> Iterator[bytes]:  # the sessions a transfer is bound to
            return (rec.session for rec in self._table.items() if rec.session is not None)

        for sess in self._sessions.idle(bound, force):
            log.info("dropped a sender session idle for %g s", self._sessions.idle_s)
            self._close_session(sess)

    def _close_session(self, sess: Session) -> None:
        sess.path.close(join_s=0.0)  # from poll(): never wait for a link thread; close() joins what is left
        self._retired = [path for path in self._retired if path.alive()]
        if sess.path.alive():
            self._retired.append(sess.path)

    def _renew_and_expire(self) -> None:
        self._expire_sessions()
        for rec in self._table.expire(silence_s=self.cfg.lease_s):
            self._nack(rec, "timeout", "receiver deadline passed or sender silent")
        now = time.monotonic()
        every = self.cfg.lease_s / 3
        for rec in self._table.items():
            if rec.session is not None and now - rec.last_renew >= every:
                rec.last_renew = now
                sess = self._sessions.get(rec.session)
                if sess is not None:
                    self._reply(sess, Renew(rec.transfer_id))
