"""Every failure is a typed error within its deadline, never a hang, and leaves no state on either side:
corrupted frame, truncated message, garbage, oversize frame, wrong fingerprint/secret, receiver that
never starts, sender or receiver killed mid-transfer, aborts, lost pieces, expired leases."""

from __future__ import annotations

import os
import signal
import time

import msgspec
import pytest
import torch
import zmq

from tests.helpers import transfer_peers as procs
from tests.helpers.kv import Cache, bits, fingerprint, make_kv, poll_until
from transfer.auth import NO_SESSION, NONCE_BYTES, handshake_key, seal, session_key, split
from transfer.base import make_receiver, make_sender
from transfer.config import TransferConfig
from transfer.errors import ChecksumError, FingerprintMismatch, FrameTooLarge, PeerGone, ProtocolError, TransferAborted
from transfer.state import TransferState
from transfer.wire import batch_layout, encode_piece, frame_view, pack_header, unpack_header
from transfer.zap import connect_plain, plane_keys

pytestmark = pytest.mark.timeout(60)
FAST = dict(deadline_s=2.0, lease_s=1.5, connect_timeout_s=1.0, send_timeout_s=1.0)


def _failed(events, tid):
    ev = [e for e in events if e.transfer_id == tid]
    assert len(ev) == 1 and ev[0].state == TransferState.FAILED, events
    return ev[0].error


@pytest.fixture
def rx(closing):
    """A zmq tcp receiver with short deadlines, and its cache."""
    fp = fingerprint("bfloat16")
    cache = Cache(fp)
    r = closing(make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", TransferConfig(max_frame_bytes=4096, **FAST)))
    return r, cache, fp


class RawPeer:
    """A hand-driven sender socket, to put exactly the bytes we want on the wire (headers sealed as the protocol
    wants, transfer/auth.py, so that what is tested is what comes after authentication)."""

    def __init__(self, address: str, fp, secret: str | None = None, transport: str = "zmq") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 3000)
        self.sock.setsockopt(zmq.SNDTIMEO, 3000)
        connect_plain(self.sock, plane_keys(secret))  # past ZeroMQ's handshake as its secret allows (transfer/zap.py)
        self.sock.connect(address)
        self.fp = fp
        self.hs_key, self.nonce, self.seq, self.key = handshake_key(secret), os.urandom(NONCE_BYTES), 0, b""
        hello = {"kind": "hello", "fp": msgspec.to_builtins(fp), "transport": transport, "nonce": self.nonce}
        self.sock.send(seal(self.hs_key, NO_SESSION, 0, pack_header(hello)))
        self.session = b""

    def welcome(self, r) -> None:
        end = time.monotonic() + 3
        while time.monotonic() < end and not self.session:
            r.poll()
            try:
                h = unpack_header(split(self.sock.recv(zmq.NOBLOCK))[3])
                self.session = h.session
                self.key = session_key(self.hs_key, self.nonce, h.rnonce, self.session)
            except zmq.Again:
                time.sleep(0.001)
        assert self.session

    def piece(self, tid: str, layer: int, dst: list[int]):
        k, v = make_kv(self.fp, layer, len(dst), seed=1)
        header, tensors = encode_piece(self.fp, tid, layer, dst, k, v, "raw", True)
        return msgspec.to_builtins(header), [bytes(frame_view(t)) for t in tensors]

    def send(self, fields: dict, frames: list[bytes], session: bytes | None = None) -> None:
        self.seq += 1
        header = seal(self.key, session or self.session, self.seq, pack_header(fields))
        self.sock.send_multipart([header, *frames])

    def replies(self) -> list:
        out = []
        while True:
            try:
                out.append(unpack_header(split(self.sock.recv(zmq.NOBLOCK))[3]))
            except zmq.Again:
                return out

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _serves_next(r, fp, cache) -> None:
    """After a bad message the receiver still completes a well-formed transfer."""
    s = make_sender("zmq", fp, TransferConfig(**FAST))
    try:
        r.expect("good", [4, 5])
        s.begin("good", r.address)
        for layer in range(fp.num_layers):
            s.send_layer("good", layer, [4, 5], *make_kv(fp, layer, 2, seed=9))
        s.finish("good")
        ev = poll_until([r.poll, s.poll], lambda e: len(e) >= 2, 5)
        assert [e.state for e in ev] == [TransferState.DONE] * 2
        cache.assert_holds([4, 5], seed=9)
    finally:
        s.close()


def test_corrupted_frame(rx, closing) -> None:
    r, cache, fp = rx
    raw = closing(RawPeer(r.address, fp))
    raw.welcome(r)
    r.expect("t", [1, 2])
    fields, frames = raw.piece("t", 0, [1, 2])
    frames[1] = frames[1][:10] + bytes([frames[1][10] ^ 1]) + frames[1][11:]
    raw.send(fields, frames)
    err = _failed(poll_until([r.poll], lambda e: e, 3), "t")
    assert isinstance(err, ChecksumError)
    assert r.pending_transfers() == [] and cache.writes == 0
    time.sleep(0.05)
    assert any(h.kind == "nack" and h.code == "checksum" for h in raw.replies())
    _serves_next(r, fp, cache)


@pytest.mark.parametrize("cut", ["missing_frame", "short_frame", "no_payload"])
def test_truncated_message(rx, closing, cut) -> None:
    r, cache, fp = rx
    raw = closing(RawPeer(r.address, fp))
    raw.welcome(r)
    r.expect("t", [1, 2])
    fields, frames = raw.piece("t", 0, [1, 2])
    frames = {"missing_frame": frames[:1], "short_frame": [frames[0], frames[1][:-3]], "no_payload": []}[cut]
    raw.send(fields, frames)
    assert isinstance(_failed(poll_until([r.poll], lambda e: e, 3), "t"), ProtocolError)
    assert r.pending_transfers() == [] and cache.writes == 0


def test_garbage_and_unknown_session_are_dropped(rx, closing) -> None:
    r, cache, fp = rx
    raw = closing(RawPeer(r.address, fp))
    raw.welcome(r)
    raw.sock.send_multipart([b"\xc1\xc1not msgpack", b"x"])
    raw.sock.send(b"")
    fields, frames = raw.piece("nobody", 0, [1])
    raw.send(fields, frames, session=b"forged" * 3)
    poll_until([r.poll], lambda e: False, 0.2)
    assert r.dropped >= 3
    _serves_next(r, fp, cache)


def test_oversize_frame_declared(rx, closing) -> None:
    r, cache, fp = rx
    raw = closing(RawPeer(r.address, fp))
    raw.welcome(r)
    dst = list(range(20))  # 20 blocks * 4*2*8 bf16 = 2560 B < 4096: fine; lie about it instead
    r.expect("t", dst)
    fields, frames = raw.piece("t", 0, dst)
    fields["frames"][0][2] = 1 << 40
    raw.send(fields, frames)
    assert isinstance(_failed(poll_until([r.poll], lambda e: e, 3), "t"), FrameTooLarge)


def test_oversize_frame_refused_by_sender(rx, closing) -> None:
    r, cache, fp = rx
    s = closing(make_sender("zmq", fp, TransferConfig(**FAST)))
    dst = list(range(32))  # 33 blocks * (4*2*8 bf16 = 128 B) = 4224 B > max_frame_bytes 4096
    r.expect("t", dst[:30] + [40, 41, 42])
    s.begin("t", r.address)
    s.send_layer("t", 0, dst[:30] + [40, 41, 42], *make_kv(fp, 0, 33, seed=1))
    ev = poll_until([r.poll, s.poll], lambda e: len(e) >= 2, 5)
    errs = sorted(type(e.error).__name__ for e in ev)
    assert errs == ["FrameTooLarge", "SenderAborted"], ev
    assert r.pending_transfers() == [] and s.active_transfers() == [] and cache.writes == 0


@pytest.mark.parametrize("backend", ["zmq", "local"])
def test_wrong_fingerprint(backend, closing) -> None:
    fp = fingerprint("bfloat16")
    wrong = fingerprint("bfloat16", head_dim=16)
    cache = Cache(fp)
    addr = "tcp://127.0.0.1:0" if backend == "zmq" else "local://fp-test"
    r = closing(make_receiver(backend, fp, cache.sink, addr, TransferConfig(**FAST)))
    s = closing(make_sender(backend, wrong, TransferConfig(**FAST)))
    r.expect("t", [1])
    s.begin("t", r.address)
    s.send_layer("t", 0, [1], *make_kv(wrong, 0, 1, seed=1))
    t0 = time.monotonic()
    rev: list = []
    ev = poll_until([lambda: rev.extend(r.poll()) or [], s.poll], lambda e: e, 3)
    assert isinstance(_failed(ev, "t"), FingerprintMismatch) and time.monotonic() - t0 < 1.5
    assert rev == [] and r.pending_transfers() == ["t"]  # nothing of the wrong model was accepted
    r.abort("t", "prefill refused")  # the decode worker frees its reservation
    assert isinstance(_failed(r.poll(), "t"), TransferAborted)
    assert r.pending_transfers() == [] and s.active_transfers() == []


def test_wrong_secret(closing) -> None:
    fp = fingerprint()
    r = closing(make_receiver("zmq", fp, Cache(fp).sink, "tcp://127.0.0.1:0", TransferConfig(secret="s3cret", **FAST)))
    s = closing(make_sender("zmq", fp, TransferConfig(secret="guess", **FAST)))
    s.begin("t", r.address)
    ev = poll_until([r.poll, s.poll], lambda e: e, 3)
    assert isinstance(_failed(ev, "t"), ProtocolError) and "secret" in str(ev[0].error)


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_receiver_never_starts(kind, tmp_path, closing) -> None:
    fp = fingerprint()
    if kind == "tcp":
        probe = zmq.Context().socket(zmq.ROUTER)
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.close(linger=0)
        address = f"tcp://127.0.0.1:{port}"
    else:
        address = f"ipc://{tmp_path}/nobody.ipc"
    s = closing(make_sender("zmq", fp, TransferConfig(**FAST)))
    t0 = time.monotonic()
    s.begin("t", address)
    for layer in range(fp.num_layers):
        s.send_layer("t", layer, [1], *make_kv(fp, layer, 1, seed=1))
    s.finish("t")
    ev = poll_until([s.poll], lambda e: e, 5)
    assert isinstance(_failed(ev, "t"), PeerGone) and time.monotonic() - t0 < 3
    assert s.active_transfers() == []


@pytest.mark.parametrize("backend", ["zmq", "gloo"])
def test_sender_killed_mid_transfer(backend, spawn, closing) -> None:
    fp = fingerprint("float16")
    cache = Cache(fp)
    r = closing(make_receiver(backend, fp, cache.sink, "tcp://127.0.0.1:0", TransferConfig(deadline_s=15, lease_s=1.5)))
    r.expect("t", [1, 2, 3], deadline_s=15)
    with procs.stalled_sender(spawn, backend, r.address, "t", [1, 2, 3]) as p:
        poll_until([r.poll], lambda e: cache.writes >= 2, 10)  # two layers arrived: mid-transfer
        assert cache.writes == 2 and r.pending_transfers() == ["t"]
        os.kill(p.pid, signal.SIGKILL)
        p.join(5)
        # nothing else to do: the sender's silence (lease_s) must free it, well before the deadline
        t0 = time.monotonic()
        ev = poll_until([r.poll], lambda e: e, 20)
        assert isinstance(_failed(ev, "t"), PeerGone), ev
        assert time.monotonic() - t0 < 4 and r.pending_transfers() == []


def _batch(raw, pieces: list[tuple[str, int, list[int]]]) -> tuple[dict, bytes]:
    """A `kvs` message as a sender builds it: the pieces' headers, their frames laid out in one payload frame."""
    headers, frames = [], []
    for tid, layer, dst in pieces:
        fields, fr = raw.piece(tid, layer, dst)
        headers.append({k: v for k, v in fields.items() if k != "kind"} | {"kind": "kv"})
        frames += fr
    offsets, total = batch_layout([len(f) for f in frames])
    payload = bytearray(total)
    for at, f in zip(offsets, frames):
        payload[at : at + len(f)] = f
    return {"kind": "kvs", "pieces": headers}, bytes(payload)


def test_a_batch_takes_each_piece_on_its_own(rx, closing) -> None:
    """Pieces of two transfers in one message: both land; one piece for a transfer nobody expects is nacked alone."""
    r, cache, fp = rx
    raw = closing(RawPeer(r.address, fp))
    raw.welcome(r)
    r.expect("a", [1, 2], num_layers=1)
    r.expect("b", [3], num_layers=1)
    header, payload = _batch(raw, [("a", 0, [1, 2]), ("ghost", 0, [5]), ("b", 0, [3])])
    raw.send(header, [payload])
    events = poll_until([r.poll], lambda e: len(e) >= 2, 3)
    assert sorted((e.transfer_id, e.state) for e in events) == [("a", TransferState.DONE), ("b", TransferState.DONE)]
    k, v = make_kv(fp, 0, 2, seed=1)
    assert torch.equal(bits(cache.k[0][torch.tensor([1, 2])]), bits(k))
    time.sleep(0.05)
    replies = [(h.kind, h.tid) for h in raw.replies()]
    assert ("nack", "ghost") in replies and ("ack", "a") in replies and ("ack", "b") in replies


@pytest.mark.parametrize("lie", ["size", "short_payload", "two_payloads"])
def test_a_batch_whose_payload_cannot_be_laid_out_is_refused_whole(rx, closing, lie) -> None:
    """One piece's declared size, or a payload of the wrong length, would shift every later piece's bytes: none is
    taken, even with checksums off (what makes the layout trustworthy is the receiver's own fingerprint)."""
    r, cache, fp = rx
    raw = closing(RawPeer(r.address, fp))
    raw.welcome(r)
    r.expect("a", [1], num_layers=1)
    r.expect("b", [2], num_layers=1)
    header, payload = _batch(raw, [("a", 0, [1]), ("b", 0, [2])])
    frames = [payload]
    if lie == "size":
        header["pieces"][0]["frames"][0][2] += 64  # "nbytes"
        header["pieces"][0]["frames"][0][3] = None  # no checksum to catch it
    elif lie == "short_payload":
        frames = [payload[:-1]]
    else:
        frames = [payload, payload]
    raw.send(header, frames)
    events = poll_until([r.poll], lambda e: len(e) >= 2, 3)
    assert sorted(e.transfer_id for e in events) == ["a", "b"]
    assert all(e.state == TransferState.FAILED and isinstance(e.error, ProtocolError) for e in events)
    assert cache.writes == 0
    _serves_next(r, fp, cache)


def test_batches_stay_within_the_receivers_frame_bound(closing) -> None:
    """Pieces that each fit the receiver's max_frame_bytes are not batched past it: one payload frame of several
    pieces larger than ZeroMQ's message bound would cost the whole session."""
    fp = fingerprint("float32", layers=4, heads=4, head_dim=64, block_size=16)  # 96 KiB frames for 6 blocks
    cache = Cache(fp, num_blocks=16)
    cfg = TransferConfig(max_frame_bytes=100 << 10, **FAST)
    r = closing(make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", cfg))
    s = closing(make_sender("zmq", fp, cfg))
    dst = list(range(6))
    r.expect("t", dst)
    s.begin("t", r.address)
    for layer in range(fp.num_layers):
        s.send_layer("t", layer, dst, *make_kv(fp, layer, len(dst), seed=4))
    s.finish("t")
    events = poll_until([r.poll, s.poll], lambda e: len(e) >= 2, 10)
    assert [e.state for e in events] == [TransferState.DONE] * 2
    cache.assert_holds(dst, seed=4)
