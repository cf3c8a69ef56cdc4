"""The `shm` backend (and `auto`): KV payload through the receiver's shared-memory ring, control as on zmq.

Round trips are bit-exact for float32 / bfloat16 and several block counts, through a ring small enough to wrap; what
cannot use a ring goes inline (a piece larger than it, a sender on another node, no ring left). Checksums, aborts from
either side, deadlines, leases, a full ring, peers closing or killed mid-transfer and the authentication end as on zmq.
Every test ends with no pdserve segment left in /dev/shm (the autouse fixture), and the positions a sender puts in a
header are checked against the receiver's own ring before a byte is read.
"""

from __future__ import annotations

import os
import signal
import time

import msgspec
import pytest
import torch
import zmq

from tests.helpers import transfer_peers as procs
from tests.helpers.kv import Cache, fingerprint, make_kv, poll_until
from transfer import ring_path
from transfer.auth import NO_SESSION, NONCE_BYTES, handshake_key, seal, session_key, split
from transfer.base import make_receiver, make_sender
from transfer.config import TransferConfig
from transfer.errors import AuthError, ChecksumError, PeerGone, ProtocolError, TransferAborted, TransferTimeout
from transfer.handshake import Acceptor, Initiator
from transfer.receiver import Receiver
from transfer.ring_path import RingReceive, RingSend
from transfer.sender import Sender
from transfer.shm_ring import (
    MIN_RING_BYTES,
    PREFIX,
    SHM_DIR,
    STALE_AGE_S,
    RingOwner,
    RingWriter,
    ShmUnavailable,
    check_positions,
    node_id,
    place,
    sweep_stale,
)
from transfer.state import TransferState
from transfer.wire import encode_piece, pack_header, unpack_header, with_checksums
from transfer.zap import connect_plain, plane_keys

pytestmark = pytest.mark.timeout(60)
FAST = dict(deadline_s=2.0, lease_s=1.0, connect_timeout_s=1.0, send_timeout_s=1.0)
SECRET = "shm-secret-0123456789abcdef"


def _segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)}


@pytest.fixture(autouse=True)
def no_leftover_segments():
    """Runs its check after every endpoint of the test is closed (set up first, torn down last)."""
    before = _segments()
    yield
    assert _segments() - before == set(), "a pdserve shared-memory segment outlived its test"


def _cfg(**kw) -> TransferConfig:
    return TransferConfig(**{**FAST, "secret": SECRET, **kw})


def _pair(closing, dtype="float32", ring_bytes=MIN_RING_BYTES, max_rings=4, num_blocks=64, cfg=None):
    fp = fingerprint(dtype)
    cache = Cache(fp, num_blocks=num_blocks)
    cfg = cfg or _cfg()
    r = closing(
        Receiver(fp, cache.sink, "shm+tcp://127.0.0.1:0", cfg, "shm", ring_bytes=ring_bytes, max_rings=max_rings)
    )
    s = closing(Sender(fp, cfg, "shm"))
    return fp, cache, r, s


def _send_all(s, fp, tid, dst, seed, chunks=1):
    per = -(-len(dst) // chunks)
    for c in range(chunks):
        sl = slice(c * per, (c + 1) * per)
        for layer in range(fp.num_layers):
            k, v = make_kv(fp, layer, len(dst), seed)
            assert s.send_layer(tid, layer, dst[sl], k[sl], v[sl])
    s.finish(tid)


def _transfer(r, s, fp, cache, tid, dst, seed, chunks=1):
    r.expect(tid, dst)
    s.begin(tid, r.address)
    _send_all(s, fp, tid, dst, seed, chunks)
    events = poll_until([r.poll, s.poll], lambda e: len(e) >= 2, 10)
    assert [(e.transfer_id, e.state) for e in events] == [(tid, TransferState.DONE)] * 2, events
    cache.assert_holds(dst, seed=seed)
    assert r.pending_transfers() == [] and s.active_transfers() == []


def _by_side(r, s, timeout=5.0):
    rev, sev = [], []
    poll_until(
        [lambda: rev.extend(r.poll()) or [], lambda: sev.extend(s.poll()) or []],
        lambda _: bool(rev) and bool(sev),
        timeout,
    )
    assert r.pending_transfers() == [] and s.active_transfers() == []
    return rev, sev


def _until(predicate, timeout_s: float, poll) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not predicate():
        poll()
        time.sleep(0.005)
    return predicate()


def _one_failure(events):
    assert len(events) == 1 and events[0].state == TransferState.FAILED, events
    return events[0].error


# ---------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("n", [1, 6, 48])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bit_exact_through_a_ring_that_wraps(dtype, n, closing) -> None:
    """Three transfers in a row through a 64 KiB ring: with 48 blocks each crosses the ring's end more than once."""
    fp, cache, r, s = _pair(closing, dtype)
    before = _segments()
    dst = list(range(63, 63 - n, -1))  # not contiguous in the order sent: the sink scatters
    for i in range(3):
        _transfer(r, s, fp, cache, f"t{i}", dst, seed=i + 1)
    assert r.shm_pieces == s.shm_pieces == 3 * fp.num_layers  # every piece went through the ring
    assert r.rings() == 1  # one ring for the session, reused
    assert _segments() - before == set()  # its name is gone as soon as the sender mapped it


def test_the_sink_reads_the_ring_in_place_and_the_region_is_freed_when_it_returns(closing) -> None:
    """The receiver copies nothing: the sink's k and v lie inside the session's ring (its copy into the KV cache is the
    only one on this side), the region stays the sink's until it returns (the tail has not passed it), and once the
    transfer is done every region is released (the receiver's tail is the sender's head)."""
    fp, cache, r, s = _pair(closing, "float32")
    seen: list[tuple[int, int, int, int]] = []  # (k ptr, v ptr, ring tail during the call, layer)

    def sink(tid, layer, blocks, k, v):
        ring = next(sess.path.ring for sess in r._sessions.values() if isinstance(sess.path, RingReceive))
        seen.append((k.data_ptr(), v.data_ptr(), ring.tail, layer))
        cache.sink(tid, layer, blocks, k, v)

    r._sink.sink = sink
    dst = list(range(56, 8, -1))  # 48 blocks, 6 KiB frames, 48 KiB per transfer: the 64 KiB ring wraps
    for i in range(2):
        _transfer(r, s, fp, cache, f"t{i}", dst, seed=i + 3)
    ring = next(sess.path.ring for sess in r._sessions.values() if isinstance(sess.path, RingReceive))
    base = torch.frombuffer(ring._data, dtype=torch.uint8).data_ptr()  # the view is dropped at once
    frame = len(dst) * fp.block_size * fp.num_kv_heads * fp.head_dim * 4
    assert len(seen) == 2 * fp.num_layers
    for kp, vp, _, _ in seen:
        assert base <= kp and kp + frame <= base + ring.size and base <= vp and vp + frame <= base + ring.size
    tails = [t for _, _, t, _ in seen]
    assert tails == sorted(tails) and len(set(tails)) == len(tails)  # each piece released before the next one
    writer = next(p.path.ring for p in s._peers.values() if isinstance(p.path, RingSend))
    assert ring.tail == writer.head > ring.size  # all released, after more than one lap
    assert r.shm_pieces == s.shm_pieces == 2 * fp.num_layers


def test_chunked_pieces_and_auto_backend(tmp_path, closing) -> None:
    fp = fingerprint("bfloat16")
    cache = Cache(fp)
    r = closing(make_receiver("auto", fp, cache.sink, f"shm+ipc://{tmp_path}/kv.sock", _cfg()))
    s = closing(make_sender("auto", fp, _cfg()))
    assert r.address.startswith("shm+ipc://")
    _transfer(r, s, fp, cache, "t", [3, 9, 1, 12, 7, 0], seed=5, chunks=2)
    assert r.shm_pieces == 2 * fp.num_layers


def test_a_piece_larger_than_the_ring_goes_inline(closing) -> None:
    """Frames of 160 float32 blocks are 80 KiB each: more than the 64 KiB ring, so they travel as zmq frames; the
    small pieces of the same transfer still use the ring."""
    fp, cache, r, s = _pair(closing, "float32", num_blocks=200)
    dst = list(range(170))
    r.expect("t", dst)
    s.begin("t", r.address)
    for layer in range(fp.num_layers):
        k, v = make_kv(fp, layer, len(dst), seed=4)
        assert s.send_layer("t", layer, dst[:160], k[:160], v[:160])  # inline
        assert s.send_layer("t", layer, dst[160:], k[160:], v[160:])  # through the ring
    s.finish("t")
    events = poll_until([r.poll, s.poll], lambda e: len(e) >= 2, 10)
    assert [e.state for e in events] == [TransferState.DONE] * 2, events
    cache.assert_holds(dst, seed=4)
    assert r.shm_pieces == s.shm_pieces == fp.num_layers


@pytest.mark.parametrize("why", ["another node", "no ring left"])
def test_without_a_ring_the_kv_goes_inline(why, closing, monkeypatch) -> None:
    created = []
    opened = Acceptor.open

    def spy(self, *a):
        sess, welcome = opened(self, *a)
        created.append(welcome.shm is not None)
        return sess, welcome

    monkeypatch.setattr(Acceptor, "open", spy)
    if why == "another node":  # a sender that says it runs on another node
        hello = Initiator.hello
        monkeypatch.setattr(Initiator, "hello", lambda self, peer: msgspec.structs.replace(hello(self, peer), node="x"))
    fp, cache, r, s = _pair(closing, "bfloat16", max_rings=0 if why == "no ring left" else 4)
    _transfer(r, s, fp, cache, "t", [5, 1, 2], seed=6)
    assert created == [False] and r.rings() == 0
    assert r.shm_pieces == s.shm_pieces == 0


def test_a_shm_sender_speaks_zmq_to_a_zmq_receiver(closing) -> None:
    fp = fingerprint("float32")
    cache = Cache(fp)
    r = closing(make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", _cfg()))
    s = closing(make_sender("shm", fp, _cfg()))
    _transfer(r, s, fp, cache, "t", [2, 4], seed=7)
    assert s.shm_pieces == 0


# ---------------------------------------------------------------------------------------- failures


def test_a_checksum_mismatch_fails_the_transfer_and_frees_the_region(closing, monkeypatch) -> None:
    fp, cache, r, s = _pair(closing, "bfloat16")
    hashed = []

    def corrupt(piece, copies):  # the bytes change in the ring after the sender hashed its copy there
        header = with_checksums(piece, copies)
        hashed.append(copies[0])
        copies[0][0] ^= 0xFF
        return header

    monkeypatch.setattr(ring_path, "with_checksums", corrupt)
    r.expect("t", [1, 2])
    s.begin("t", r.address)
    _send_all(s, fp, "t", [1, 2], seed=1)
    rev, sev = _by_side(r, s)
    assert isinstance(_one_failure(rev), ChecksumError) and isinstance(_one_failure(sev), ChecksumError)
    assert cache.writes == 0 and hashed  # the checksum was taken over the ring's copy, and it caught the change
    monkeypatch.setattr(ring_path, "with_checksums", with_checksums)
    _transfer(r, s, fp, cache, "next", [1, 2], seed=2)  # the session and its ring still serve


@pytest.mark.parametrize("side", ["receiver", "sender"])
def test_abort_from_either_side(side, closing) -> None:
    fp, cache, r, s = _pair(closing)
    r.expect("t", [1, 2])
    s.begin("t", r.address)
    assert s.send_layer("t", 0, [1, 2], *make_kv(fp, 0, 2, 1))
    poll_until([r.poll], lambda _: cache.writes == 1, 3)
    (r if side == "receiver" else s).abort("t", "client went away")
    rev, sev = _by_side(r, s)
    assert isinstance(_one_failure(rev), TransferAborted) and isinstance(_one_failure(sev), TransferAborted)
    assert s.send_layer("t", 1, [1, 2], *make_kv(fp, 1, 2, 1)) is False
    _transfer(r, s, fp, cache, "next", [3, 4], seed=3)


def test_receiver_deadline(closing) -> None:
    fp, cache, r, s = _pair(closing)
    r.expect("t", [1], deadline_s=0.3)
    assert isinstance(_one_failure(poll_until([r.poll], lambda e: e, 3)), TransferTimeout)


def test_the_lease_expires_when_the_receiver_stops_polling(closing) -> None:
    fp, cache, r, s = _pair(closing)
    r.expect("t", [1])
    s.begin("t", r.address)
    s.send_layer("t", 0, [1], *make_kv(fp, 0, 1, 1))
    poll_until([r.poll], lambda _: cache.writes == 1, 3)  # then the decode side freezes
    t0 = time.monotonic()
    ev = poll_until([s.poll], lambda e: e, 5)
    assert isinstance(_one_failure(ev), TransferTimeout) and time.monotonic() - t0 < 2.5


def test_a_full_ring_under_a_receiver_that_stops_reading_fails_in_bounded_time(closing) -> None:
    """Pieces of 24 KiB into a 64 KiB ring nobody frees: the sender cannot place the third one and gives up after
    send_timeout_s (or its lease), as with a full high-water mark on zmq."""
    fp, cache, r, s = _pair(closing, "float32", cfg=_cfg(lease_s=5.0, deadline_s=10.0))
    dst = list(range(48))
    r.expect("t", dst)
    s.begin("t", r.address)
    poll_until([r.poll], lambda _: r.rings() == 1, 3)  # handshake done; from now on nobody reads
    _send_all(s, fp, "t", dst, seed=1)
    t0 = time.monotonic()
    ev = poll_until([s.poll], lambda e: e, 8)
    assert isinstance(_one_failure(ev), PeerGone) and time.monotonic() - t0 < 3
    assert s.shm_pieces == 2 and s.active_transfers() == []


def test_closing_either_side_mid_transfer(closing) -> None:
    fp, cache, r, s = _pair(closing)
    r.expect("a", [1, 2])
    s.begin("a", r.address)
    s.send_layer("a", 0, [1, 2], *make_kv(fp, 0, 2, 1))
    poll_until([r.poll], lambda _: cache.writes == 1, 3)
    s.close()  # the prefill side goes away: its silence frees the decode blocks within lease_s
    t0 = time.monotonic()
    assert isinstance(_one_failure(poll_until([r.poll], lambda e: e, 5)), PeerGone)
    assert time.monotonic() - t0 < 2.5 and r.pending_transfers() == []

    s2 = closing(Sender(fp, _cfg(), "shm"))
    r.expect("b", [3])
    s2.begin("b", r.address)
    s2.send_layer("b", 0, [3], *make_kv(fp, 0, 1, 1))
    poll_until([r.poll], lambda _: cache.writes == 2, 3)
    r.close()  # the decode side goes away
    assert isinstance(_one_failure(r.poll()), PeerGone)
    for layer in range(1, fp.num_layers):
        s2.send_layer("b", layer, [3], *make_kv(fp, layer, 1, 1))
    s2.finish("b")
    ev = poll_until([s2.poll], lambda e: e, 5)
    assert isinstance(_one_failure(ev), (PeerGone, TransferTimeout)) and s2.active_transfers() == []


def test_a_killed_sender_frees_the_transfer_and_its_ring(spawn, closing) -> None:
    fp = fingerprint("float16")
    cache = Cache(fp)
    cfg = TransferConfig(deadline_s=15, lease_s=1.5, idle_session_s=1.0)
    r = closing(make_receiver("shm", fp, cache.sink, "shm+tcp://127.0.0.1:0", cfg))
    r.expect("t", [1, 2, 3])
    with procs.stalled_sender(spawn, "shm", r.address, "t", [1, 2, 3]) as p:
        poll_until([r.poll], lambda e: cache.writes >= 2, 10)
        assert cache.writes == 2 and r.shm_pieces == 2 and r.rings() == 1
        os.kill(p.pid, signal.SIGKILL)
        p.join(5)
        t0 = time.monotonic()
        ev = poll_until([r.poll], lambda e: e, 10)
        assert isinstance(_one_failure(ev), PeerGone) and time.monotonic() - t0 < 4
        assert _until(lambda: r.rings() == 0, 5, r.poll)  # the idle session expires with its ring


def test_a_killed_receiver_fails_the_sender(spawn, closing) -> None:
    fp = fingerprint("bfloat16")
    q = spawn.Queue()
    p = spawn.Process(
        target=procs.receiver_main, args=("shm", "shm+tcp://127.0.0.1:0", "bfloat16", "t", [1, 2], q), daemon=True
    )
    p.start()
    try:
        _, address = q.get(timeout=30)
        s = closing(make_sender("shm", fp, TransferConfig(**FAST)))
        s.begin("t", address)
        s.send_layer("t", 0, [1, 2], *make_kv(fp, 0, 2, 1))
        poll_until([s.poll], lambda _: s.shm_pieces == 1, 3)
        time.sleep(0.2)
        os.kill(p.pid, signal.SIGKILL)
        p.join(5)
        for layer in range(1, fp.num_layers):
            s.send_layer("t", layer, [1, 2], *make_kv(fp, layer, 2, 1))
        s.finish("t")
        ev = poll_until([s.poll], lambda e: e, 10)
        assert isinstance(_one_failure(ev), (TransferTimeout, PeerGone)) and s.active_transfers() == []
    finally:
        if p.is_alive():
            p.kill()


# ---------------------------------------------------------------------------------------- authentication, positions


def test_a_wrong_secret_is_refused_and_gets_no_ring(closing) -> None:
    fp = fingerprint()
    r = closing(Receiver(fp, Cache(fp).sink, "shm+tcp://127.0.0.1:0", _cfg(secret="s3cret"), "shm"))
    s = closing(Sender(fp, _cfg(secret="guess"), "shm"))
    s.begin("t", r.address)
    ev = poll_until([r.poll, s.poll], lambda e: e, 3)
    assert isinstance(_one_failure(ev), AuthError) and "secret" in str(ev[0].error)
    end = time.monotonic() + 3  # the receiver's ZAP thread counts it from the socket's events, maybe a little later
    while not r.handshake_refused and time.monotonic() < end:
        time.sleep(0.01)
    assert r.handshake_refused >= 1 and r.rings() == 0 and len(r._sessions) == 0  # dropped in ZeroMQ's handshake


class HandPeer:
    """A hand-driven sender: hello with this node's id, then exactly the messages a test wants (sealed or not)."""

    def __init__(self, address: str, fp, secret: str = SECRET) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        connect_plain(self.sock, plane_keys(secret))  # past ZeroMQ's handshake as its secret allows (transfer/zap.py)
        self.sock.connect(address.removeprefix("shm+"))
        self.fp, self.hs_key, self.nonce = fp, handshake_key(secret), os.urandom(NONCE_BYTES)
        self.seq, self.key, self.session, self.welcome = 0, b"", b"", None
        hello = {
            "kind": "hello",
            "fp": msgspec.to_builtins(fp),
            "transport": "shm",
            "nonce": self.nonce,
            "node": node_id(),
        }
        self.sock.send(seal(self.hs_key, NO_SESSION, 0, pack_header(hello)))

    def handshake(self, r) -> None:
        end = time.monotonic() + 3
        while time.monotonic() < end and not self.session:
            r.poll()
            try:
                self.welcome = unpack_header(split(self.sock.recv(zmq.NOBLOCK))[3])
                self.session = self.welcome.session
                self.key = session_key(self.hs_key, self.nonce, self.welcome.rnonce, self.session)
            except zmq.Again:
                time.sleep(0.001)
        assert self.session

    def seal(self, fields: dict, key: bytes | None = None) -> bytes:
        self.seq += 1
        return seal(key or self.key, self.session, self.seq, pack_header(fields))

    def piece(self, ring: RingWriter, tid: str, layer: int, dst: list[int], where=None) -> dict:
        k, v = make_kv(self.fp, layer, len(dst), seed=1)
        header, tensors = encode_piece(self.fp, tid, layer, dst, k, v, "raw", True)
        placed = ring.reserve([f.nbytes for f in header.frames])
        for pos, t in zip(placed, tensors):
            ring.write(pos, t)
        ring.commit(placed[-1])
        return {**msgspec.to_builtins(header), "shm": placed if where is None else where}

    def replies(self) -> list:
        out = []
        while True:
            try:
                out.append(unpack_header(split(self.sock.recv(zmq.NOBLOCK))[3]))
            except zmq.Again:
                return out

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def test_forged_replayed_and_lying_pieces_are_refused(closing) -> None:
    fp = fingerprint("float32")
    cache = Cache(fp)
    r = closing(Receiver(fp, cache.sink, "shm+tcp://127.0.0.1:0", _cfg(), "shm", ring_bytes=MIN_RING_BYTES))
    peer = closing(HandPeer(r.address, fp))
    peer.handshake(r)
    ring = closing(RingWriter.open(peer.welcome.shm))
    r.expect("t", [1, 2])

    forged = peer.seal(peer.piece(ring, "t", 0, [1, 2]), key=b"k" * 32)  # not the session key
    peer.sock.send(forged)
    good = peer.seal(peer.piece(ring, "t", 0, [1, 2]))
    peer.sock.send(good)
    poll_until([r.poll], lambda _: cache.writes == 1, 3)
    assert r.rejected == 1 and cache.writes == 1 and r.pending_transfers() == ["t"]
    peer.sock.send(good)  # replayed: dropped before it is decoded
    assert _until(lambda: r.rejected == 2, 3, r.poll) and cache.writes == 1

    # a header naming a segment instead of positions, and one pointing past the ring: the transfer fails
    peer.sock.send(peer.seal(peer.piece(ring, "t", 1, [1, 2], where=["/dev/shm/elsewhere", 0, 0])))
    ev = poll_until([r.poll], lambda e: e, 3)
    assert isinstance(_one_failure(ev), ProtocolError) and "shm positions" in str(ev[0].error)
    r.expect("u", [3])
    peer.sock.send(peer.seal(peer.piece(ring, "u", 0, [3], where=[0, 1 << 20, (1 << 20) + 256])))
    ev = poll_until([r.poll], lambda e: e, 3)
    assert isinstance(_one_failure(ev), ProtocolError) and cache.writes == 1
    nacks: list = []
    assert _until(lambda: len(nacks) >= 2, 3, lambda: nacks.extend(h for h in peer.replies() if h.kind == "nack"))
    assert [h.tid for h in nacks] == ["t", "u"] and {h.code for h in nacks} == {"protocol"}


def test_the_sender_waits_for_room_by_the_receivers_tail_alone() -> None:
    """What the sender's wait for room reads: has_room flips when the receiver releases, and a ring closed meanwhile
    (its peer dropped) never holds the I/O thread."""
    owner = RingOwner(MIN_RING_BYTES)
    writer = RingWriter.open(owner.announce())
    try:
        half = [MIN_RING_BYTES // 2 - 64]
        ends = []
        for _ in range(2):
            where = writer.reserve(half)
            assert where is not None
            writer.commit(where[-1])
            ends.append(where[-1])
        assert writer.reserve(half) is None  # full: the receiver has released nothing
        end = writer.end_of(half)
        assert end == MIN_RING_BYTES + half[0] and not writer.has_room(end)  # the next lap's start, then its size
        owner.release(ends[0] - 64)  # not quite the first piece
        assert not writer.has_room(end)
        owner.release(ends[0])  # the first piece is copied out
        assert writer.has_room(end) and writer.reserve(half) == [MIN_RING_BYTES, end]
    finally:
        writer.close()
        owner.close()
    assert writer.has_room(end + MIN_RING_BYTES)


def test_positions_are_checked_against_the_ring() -> None:
    size = 1 << 16
    assert check_positions(place(100, [256, 256], size), [256, 256], 0, size) == [128, 384]
    wrapped = place(size - 100, [256], size)  # would cross the end: starts at the next lap
    assert wrapped == [size, size + 256] and check_positions(wrapped, [256], size - 100, size) == [0]
    bad = [
        "abc",
        [0, 256],  # one frame, no end
        [0, 256, True],
        [-64, 256, 512],
        [0, 0, 512],  # overlapping frames
        [size - 128, size + 128, size + 384],  # a frame across the ring's end
        [0, 512, 300],  # a frame past the end
        [size, size + 256, size + 512],  # more than a lap past the tail (0)
        [0, 256, 1 << 63],
    ]
    for where in bad:
        with pytest.raises(ProtocolError):
            check_positions(where, [256, 256], 0, size)
    with pytest.raises(ProtocolError):  # behind the released tail
        check_positions([0, 256, 512], [256, 256], 64, size)


def test_a_ring_announcement_is_checked_before_and_after_opening(closing) -> None:
    fp = fingerprint()
    r = closing(Receiver(fp, Cache(fp).sink, "shm+tcp://127.0.0.1:0", _cfg(), "shm", ring_bytes=MIN_RING_BYTES))
    peer = closing(HandPeer(r.address, fp))
    peer.handshake(r)
    name, size, token = peer.welcome.shm
    assert name in _segments()  # not mapped by anyone yet
    for announced in (
        ["../../etc/passwd", size, token],
        [f"{PREFIX}1-{'0' * 32}", size, token],  # a name of the pattern that is not there
        [name, size * 2, token],  # the size differs from the file's
        [name, size, b"x" * 16],  # the token differs
        [name, size],
    ):
        with pytest.raises(ShmUnavailable):
            RingWriter.open(announced)
    assert name in _segments()  # a refused announcement unlinks nothing
    closing(RingWriter.open([name, size, token]))
    assert name not in _segments()  # mapped: the name is gone at once


def test_a_ring_nobody_mapped_is_unlinked_when_its_session_ends(closing) -> None:
    fp = fingerprint()
    r = closing(
        Receiver(
            fp, Cache(fp).sink, "shm+tcp://127.0.0.1:0", _cfg(idle_session_s=0.5), "shm", ring_bytes=MIN_RING_BYTES
        )
    )
    first = closing(HandPeer(r.address, fp))
    first.handshake(r)
    assert first.welcome.shm[0] in _segments()
    assert _until(lambda: r.rings() == 0, 5, r.poll)  # the unfinished handshake expires with its ring
    assert first.welcome.shm[0] not in _segments()
    second = closing(HandPeer(r.address, fp))
    second.handshake(r)
    assert second.welcome.shm[0] in _segments()
    r.close()
    assert second.welcome.shm[0] not in _segments()


def test_stale_rings_of_dead_receivers_are_swept(spawn) -> None:
    p = spawn.Process(target=time.sleep, args=(0,))
    p.start()
    p.join(10)
    old = time.time() - 2 * STALE_AGE_S
    names = {
        "dead": f"{PREFIX}{p.pid}-{os.urandom(16).hex()}",
        "alive": f"{PREFIX}{os.getpid()}-{os.urandom(16).hex()}",
        "young": f"{PREFIX}{p.pid}-{os.urandom(16).hex()}",
    }
    try:
        for what, name in names.items():
            path = os.path.join(SHM_DIR, name)
            with open(path, "wb"):
                pass
            if what != "young":
                os.utime(path, (old, old))
        assert sweep_stale() >= 1
        assert names["dead"] not in _segments()
        assert {names["alive"], names["young"]} <= _segments()
    finally:
        for name in names.values():
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass


def test_the_decode_worker_chooses_the_address_and_auto_uses_the_ring(closing) -> None:
    """``auto``: the decode worker listens on TCP and marks its address ``shm+``; a sender on this node reads the
    scheme and moves the KV through the ring. ``shm``: a Unix socket (one node). ``zmq``: unchanged."""
    from engine.config import EngineConfig
    from worker.rank_kv import receiver_address
    from worker.spec import RuntimeOptions, WorkerSpec

    def spec(backend: str, transport: str = "tcp") -> WorkerSpec:
        runtime = RuntimeOptions(["tcp://127.0.0.1:1"], host="127.0.0.1", secret=SECRET)
        engine = EngineConfig(model="/nowhere")
        return WorkerSpec("decode-3", "decode", engine, runtime, transfer_backend=backend, zmq_transport=transport)

    assert receiver_address(spec("auto")) == "shm+tcp://127.0.0.1:0"
    assert receiver_address(spec("auto", "ipc")) == "shm+tcp://127.0.0.1:0"  # other nodes must reach it
    assert receiver_address(spec("shm")).startswith("shm+ipc://")
    assert receiver_address(spec("zmq")) == "tcp://127.0.0.1:0"
    assert receiver_address(spec("zmq", "ipc")).startswith("ipc://")
    fp = fingerprint("bfloat16")
    cache = Cache(fp)
    decode = spec("auto")
    r = closing(make_receiver("auto", fp, cache.sink, receiver_address(decode), decode.transfer))
    s = closing(make_sender("auto", fp, spec("auto").transfer))
    assert r.address.startswith("shm+tcp://127.0.0.1:")
    _transfer(r, s, fp, cache, "t", [6, 2, 8], seed=8)
    assert r.shm_pieces == s.shm_pieces == fp.num_layers
