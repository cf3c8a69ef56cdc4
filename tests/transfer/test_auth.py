"""The KV plane's authentication and bounds: the handshake proves the secret both ways without sending it, every
header is MAC-checked and in sequence before it is decoded, ZeroMQ bounds every frame, a message cannot bring more
frames than a piece has, a lying header allocates nothing, and the pair groups' rendezvous store listens only where
it was told and admits no peer that cannot prove the session key."""

from __future__ import annotations

import math
import socket
import time

import msgpack
import msgspec
import psutil
import pytest
import torch
import zmq

from tests.helpers.kv import Cache, fingerprint, make_kv, poll_until
from tests.transfer.test_failures import FAST, RawPeer, _failed, _serves_next
from transfer import wire
from transfer.auth import NO_SESSION, OVERHEAD, handshake_key, pair_group_key, seal, split, verify
from transfer.base import make_receiver, make_sender
from transfer.config import TransferConfig
from transfer.errors import AuthError, PeerGone, ProtocolError
from transfer.pairgroup import PairLink, local_ip_towards, make_store_server
from transfer.state import TransferState
from transfer.wire import MAX_HEADER_BYTES, pack_header, unpack_header
from transfer.zap import ZapHandler, connect_plain, plane_keys, serve_plain

pytestmark = pytest.mark.timeout(60)
SECRET = "a-cluster-secret-0123456789abcdef"


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def sent(monkeypatch):
    """Every frame any ZeroMQ socket of this process sends, as (socket type, more-follows, bytes)."""
    frames: list[tuple[int, bool, bytes]] = []
    original = zmq.Socket.send

    def spy(self, data, flags=0, copy=True, track=False, **kw):
        raw = data.bytes if isinstance(data, zmq.Frame) else bytes(data)
        # recorded before the send: once the frame is out, the peer may act on it before this thread runs again
        entry = (self.type, bool(flags & zmq.SNDMORE), raw)
        frames.append(entry)
        try:
            return original(self, data, flags, copy=copy, track=track, **kw)
        except zmq.Again:  # not sent: not recorded
            frames.remove(entry)
            raise

    monkeypatch.setattr(zmq.Socket, "send", spy)
    return frames


def _messages(frames, socket_type) -> list[list[bytes]]:
    out, current = [], []
    for kind, more, raw in frames:
        if kind != socket_type:
            continue
        current.append(raw)
        if not more:
            out.append(current)
            current = []
    return out


def _transfer(r, s, fp, tid: str, dst: list[int], seed: int = 1) -> list:
    r.expect(tid, dst)
    s.begin(tid, r.address)
    for layer in range(fp.num_layers):
        s.send_layer(tid, layer, dst, *make_kv(fp, layer, len(dst), seed))
    s.finish(tid)
    return poll_until([r.poll, s.poll], lambda e: len(e) >= 2, 5)


def test_a_frame_is_tag_ident_seq_body_and_verifies_only_under_its_key() -> None:
    key = handshake_key(SECRET)
    frame = seal(key, b"s" * 16, 7, b"body")
    assert len(frame) == OVERHEAD + 4 and verify(key, frame) and not verify(handshake_key("other"), frame)
    tag, ident, seq, body = split(frame)
    assert (ident, seq, bytes(body)) == (b"s" * 16, 7, b"body") and bytes(tag) == frame[:32]
    assert not verify(key, frame[:-1] + b"B") and not verify(key, frame[: OVERHEAD - 1])
    with pytest.raises(AuthError, match="no MAC") as error:
        split(frame[: OVERHEAD - 1])
    assert error.value.reason is None and error.value.code == "unauthenticated"


def test_handshake_never_sends_the_secret(sent, closing) -> None:
    fp = fingerprint()
    cache = Cache(fp)
    r = closing(make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", TransferConfig(secret=SECRET, **FAST)))
    s = closing(make_sender("zmq", fp, TransferConfig(secret=SECRET, **FAST)))
    events = _transfer(r, s, fp, "t", [1, 2])
    assert [e.state for e in events] == [TransferState.DONE] * 2
    cache.assert_holds([1, 2], seed=1)
    hellos = [m for m in _messages(sent, zmq.DEALER) if split(m[0])[1] == NO_SESSION]
    assert len(hellos) == 1 and unpack_header(split(hellos[0][0])[3]).kind == "hello"
    assert "secret" not in msgpack.unpackb(split(hellos[0][0])[3])  # no such field, whatever its name
    wire_bytes = b"".join(raw for _, _, raw in sent)
    kv_bytes = fp.num_layers * 2 * 2 * math.prod(fp.block_shape) * fp.torch_dtype.itemsize  # 2 blocks, K and V
    assert len(wire_bytes) > kv_bytes and SECRET.encode() not in wire_bytes  # the capture saw the KV go by
    assert handshake_key(SECRET) not in wire_bytes  # nor the key derived from it
    assert r.pending_transfers() == [] and s.active_transfers() == []


@pytest.mark.parametrize("sender_secret, receiver_secret", [("guess", SECRET), (None, SECRET), (SECRET, None)])
def test_a_different_secret_is_refused_both_ways(sender_secret, receiver_secret, closing) -> None:
    fp = fingerprint()
    cache = Cache(fp)
    r = closing(
        make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", TransferConfig(secret=receiver_secret, **FAST))
    )
    s = closing(make_sender("zmq", fp, TransferConfig(secret=sender_secret, **FAST)))
    r.expect("t", [1])
    s.begin("t", r.address)
    s.send_layer("t", 0, [1], *make_kv(fp, 0, 1, seed=1))
    t0 = time.monotonic()
    error = _failed(poll_until([s.poll, lambda: [e for e in r.poll() if e.transfer_id != "t"]], lambda e: e, 3), "t")
    assert isinstance(error, AuthError) and "secret" in str(error) and time.monotonic() - t0 < 1.0
    # refused in ZeroMQ's handshake (transfer/zap.py): no session was ever opened, no byte of it read; the receiver's
    # ZAP thread counts the failure from the socket's events, which may come after the sender saw it
    end = time.monotonic() + 3
    while not r.handshake_refused and time.monotonic() < end:
        time.sleep(0.01)
    assert r._sessions == {} and r.handshake_refused >= 1 and cache.writes == 0
    r.abort("t")
    assert r.poll()[0].transfer_id == "t" and r.pending_transfers() == [] and s.active_transfers() == []


def test_a_receiver_that_cannot_prove_the_secret_gets_no_kv(zctx, closing) -> None:
    """An impostor at the receiver's address answers the hello with a welcome it cannot MAC: nothing is sent."""
    fp = fingerprint()
    fake = zctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.RCVTIMEO, 2000)
    serve_plain(fake)  # it sniffed the cluster's password (PLAIN is sent in the clear)
    impostor = ZapHandler(zctx, plane_keys(SECRET), "impostor")
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    s = closing(make_sender("zmq", fp, TransferConfig(secret=SECRET, **FAST)))
    s.begin("t", f"tcp://127.0.0.1:{port}")
    s.send_layer("t", 0, [1], *make_kv(fp, 0, 1, seed=1))
    identity, hello = fake.recv_multipart()
    h = unpack_header(split(hello)[3])
    welcome = {
        "kind": "welcome",
        "session": b"s" * 16,
        "nonce": h.nonce,
        "rnonce": b"r" * 16,
        "max_frame_bytes": 1 << 20,
    }
    fake.send_multipart([identity, seal(handshake_key("not-the-secret"), NO_SESSION, 0, pack_header(welcome))])
    assert isinstance(_failed(poll_until([s.poll], lambda e: e, 3), "t"), AuthError)
    time.sleep(0.1)
    with pytest.raises(zmq.Again):
        fake.recv_multipart(zmq.NOBLOCK)  # the piece never left
    assert s.active_transfers() == []
    impostor.close()  # its socket is on zctx's libzmq context, which the fixture terminates


def test_replayed_hello_and_pieces_are_dropped(sent, zctx, closing) -> None:
    """A replayed piece would duplicate blocks and fail the transfer; it is dropped as a replay instead."""
    fp = fingerprint()
    cache = Cache(fp)
    r = closing(make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", TransferConfig(secret=SECRET, **FAST)))
    s = closing(make_sender("zmq", fp, TransferConfig(secret=SECRET, **FAST)))
    r.expect("t", [1, 2])
    s.begin("t", r.address)
    s.send_layer("t", 0, [1, 2], *make_kv(fp, 0, 2, seed=4))
    poll_until([r.poll, s.poll], lambda e: cache.writes == 1, 3)
    assert cache.writes == 1
    captured = _messages(sent, zmq.DEALER)  # the hello and the first piece, as they went on the wire
    assert len(captured) == 2 and len(captured[1]) == 3
    attacker = zctx.socket(zmq.DEALER)
    connect_plain(attacker, plane_keys(SECRET))  # past ZeroMQ's handshake (a sniffed password): the MACs must hold
    attacker.connect(r.address)
    for message in captured:
        attacker.send_multipart(message)
    poll_until([r.poll], lambda e: r.rejected >= 2, 3)
    assert r.rejected == 2 and len(r._sessions) == 1 and cache.writes == 1
    for layer in range(1, fp.num_layers):
        s.send_layer("t", layer, [1, 2], *make_kv(fp, layer, 2, seed=4))
    s.finish("t")
    events = poll_until([r.poll, s.poll], lambda e: len(e) >= 2, 5)
    assert [e.state for e in events] == [TransferState.DONE] * 2
    cache.assert_holds([1, 2], seed=4)
    assert r.pending_transfers() == [] and s.active_transfers() == []


def test_a_sniffed_session_token_is_not_enough(closing) -> None:
    fp = fingerprint()
    cache = Cache(fp)
    r = closing(make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", TransferConfig(secret=SECRET, **FAST)))
    raw = closing(RawPeer(r.address, fp, secret=SECRET))
    raw.welcome(r)
    r.expect("t", [1])
    fields, frames = raw.piece("t", 0, [1])
    forged = seal(b"k" * 32, raw.session, 99, pack_header(fields))  # the right session, not its key
    raw.sock.send_multipart([forged, *frames])
    raw.sock.send_multipart([forged[: OVERHEAD - 1], *frames])  # too short to carry a MAC
    poll_until([r.poll], lambda e: r.rejected >= 2, 3)
    assert r.rejected == 2 and cache.writes == 0 and r.pending_transfers() == ["t"]
    raw.send(fields, frames)  # the same piece, sealed with the session key, is accepted
    poll_until([r.poll], lambda e: cache.writes == 1, 3)
    assert cache.writes == 1
    r.abort("t")
    r.poll()
    assert r.pending_transfers() == []


def test_maxmsgsize_on_every_socket_and_an_oversize_frame_is_never_buffered(sent, closing) -> None:
    fp = fingerprint()
    cache = Cache(fp)
    cfg = TransferConfig(max_frame_bytes=4096, **FAST)
    r = closing(make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", cfg))
    assert r._sock.getsockopt(zmq.MAXMSGSIZE) == max(4096, MAX_HEADER_BYTES + OVERHEAD)
    s = closing(make_sender("zmq", fp, cfg))
    _transfer(r, s, fp, "first", [1])
    assert [p.sock.getsockopt(zmq.MAXMSGSIZE) for p in s._peers.values()] == [MAX_HEADER_BYTES + OVERHEAD]
    raw = closing(RawPeer(r.address, fp))
    raw.welcome(r)
    r.expect("t", [3])
    fields, frames = raw.piece("t", 0, [3])
    raw.send(fields, [frames[0], frames[1] + bytes(1 << 20)])  # a 1 MiB frame to a 4 KiB receiver
    events = poll_until([r.poll], lambda e: e, 0.5)
    assert events == [] and cache.writes == fp.num_layers  # the first transfer's: the big frame was dropped unread
    assert r.pending_transfers() == ["t"]
    r.abort("t")
    r.poll()
    _serves_next(r, fp, cache)
    assert r.pending_transfers() == []


def test_a_message_with_too_many_frames_is_dropped_unread(closing) -> None:
    fp = fingerprint()
    cache = Cache(fp)
    r = closing(make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", TransferConfig(**FAST)))
    raw = closing(RawPeer(r.address, fp))
    raw.welcome(r)
    r.expect("t", [1])
    fields, frames = raw.piece("t", 0, [1])
    raw.send(fields, frames + [b"x"] * 500)
    raw.send(fields, frames)  # the next message is read from its own first frame on
    poll_until([r.poll], lambda e: cache.writes == 1, 3)
    assert r.rejected == 1 and cache.writes == 1
    r.abort("t")
    r.poll()
    _serves_next(r, fp, cache)
    assert r.pending_transfers() == []


LIES = {
    "negative_shape": lambda f: f.__setitem__(1, [-2, *f[1][1:]]),
    "bool_shape": lambda f: f.__setitem__(1, [True, *f[1][1:]]),
    "negative_nbytes": lambda f: f.__setitem__(2, -f[2]),
    "lying_nbytes": lambda f: f.__setitem__(2, f[2] // 2),
    "shape_not_ours": lambda f: (f.__setitem__(1, [f[1][0] * 2, *f[1][1:]]), f.__setitem__(2, f[2] * 2)),
}


@pytest.fixture
def allocations(monkeypatch):
    """Sizes of every torch.empty and tensor_over (view over received bytes) call."""
    calls: list = []
    empty, over = torch.empty, wire.tensor_over
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: calls.append(("empty", a)) or empty(*a, **kw))
    monkeypatch.setattr(
        wire, "tensor_over", lambda buf, dt, shape: calls.append(("view", shape)) or over(buf, dt, shape)
    )
    return calls


@pytest.mark.parametrize("lie", list(LIES))
def test_a_lying_header_is_refused_before_anything_is_allocated(lie, allocations, closing) -> None:
    fp = fingerprint()
    cache = Cache(fp)
    r = closing(make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", TransferConfig(**FAST)))
    raw = closing(RawPeer(r.address, fp))
    raw.welcome(r)
    r.expect("t", [1, 2])
    fields, frames = raw.piece("t", 0, [1, 2])
    LIES[lie](fields["frames"][0])
    allocations.clear()
    raw.send(fields, frames)
    assert isinstance(_failed(poll_until([r.poll], lambda e: e, 3), "t"), ProtocolError)
    assert allocations == [] and cache.writes == 0 and r.pending_transfers() == []


@pytest.mark.parametrize("lie", ["negative_nbytes", "lying_nbytes"])
def test_a_lying_dist_header_sizes_no_scratch_buffer(lie, allocations, closing) -> None:
    """nccl/gloo: a refused piece's tensors are received into scratch, sized from the header only once it adds up."""
    fp = fingerprint()
    cache = Cache(fp)
    r = closing(make_receiver("gloo", fp, cache.sink, "tcp://127.0.0.1:0", TransferConfig(group_timeout_s=2, **FAST)))
    raw = closing(RawPeer(r.address, fp, transport="dist"))
    raw.welcome(r)
    r.expect("t", [1, 2])
    fields, _ = raw.piece("t", 0, [1, 2])
    fields["tags"] = [0, 1]
    LIES[lie](fields["frames"][0])
    allocations.clear()
    raw.send(fields, [])
    error = _failed(poll_until([r.poll], lambda e: e, 3), "t")
    assert isinstance(error, (ProtocolError, PeerGone)) and ("nbytes" in str(error) or "malformed" in str(error))
    assert allocations == [] and r._sessions == {}  # the pair stream is unrecoverable: the session is dropped
    assert r.pending_transfers() == [] and cache.writes == 0


def test_the_pair_group_store_listens_only_on_its_host() -> None:
    outside = local_ip_towards("192.0.2.1")  # the address this machine would use towards another one
    if outside.startswith("127."):  # no route out (tools/loopback-only): any address of this host but loopback
        outside = next(
            (
                a.address
                for addrs in psutil.net_if_addrs().values()
                for a in addrs
                if a.family == socket.AF_INET and not a.address.startswith("127.")
            ),
            outside,
        )
    if outside.startswith("127."):
        pytest.skip("no non-loopback interface to try the store's port from")
    store = make_store_server("127.0.0.1", 5)
    try:
        with socket.socket() as probe:
            probe.settimeout(2)
            assert probe.connect_ex(("127.0.0.1", store.port)) == 0
        with socket.socket() as probe:
            probe.settimeout(2)
            assert probe.connect_ex((outside, store.port)) != 0  # torch's own server would accept this
    finally:
        del store


@pytest.mark.parametrize("same_key", [True, False])
def test_a_pair_group_peer_must_prove_the_session_key(same_key) -> None:
    """Anyone who reaches the store can list its keys and race to join a pair: the proof exchange stops them."""
    store = make_store_server("127.0.0.1", 5)
    key = b"k" * 32
    links = [
        PairLink(
            backend="gloo",
            rank=rank,
            key=pair_group_key(key),
            store_host="127.0.0.1",
            store_port=store.port,
            local_host="127.0.0.1",
            timeout_s=5,
            auth_key=key if same_key or rank == 0 else b"x" * 32,
            store=store if rank == 0 else None,
        )
        for rank in (0, 1)
    ]
    try:
        end = time.monotonic() + 10
        while time.monotonic() < end and not all(link.ready.is_set() or link.broken for link in links):
            time.sleep(0.01)
        if same_key:
            assert all(link.ready.is_set() and link.broken is None for link in links)
        else:
            assert not any(link.ready.is_set() for link in links)
            assert all(isinstance(link.broken, (AuthError, PeerGone)) for link in links)
            assert any(isinstance(link.broken, AuthError) for link in links)
    finally:
        for link in links:
            link.close()


def test_an_authenticated_but_malformed_hello_gets_a_reject_naming_why(zctx, closing) -> None:
    """A sender with the secret but a bug (here: no nonce) learns at once why, instead of waiting for its timeout."""
    fp = fingerprint()
    r = closing(make_receiver("zmq", fp, Cache(fp).sink, "tcp://127.0.0.1:0", TransferConfig(secret=SECRET, **FAST)))
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    connect_plain(sock, plane_keys(SECRET))
    sock.connect(r.address)
    hello = {"kind": "hello", "fp": msgspec.to_builtins(fp), "transport": "zmq"}
    sock.send(seal(handshake_key(SECRET), NO_SESSION, 0, pack_header(hello)))
    replies: list = []
    end = time.monotonic() + 3
    while not replies and time.monotonic() < end:
        r.poll()
        try:
            replies.append(unpack_header(split(sock.recv(zmq.NOBLOCK))[3]))
        except zmq.Again:
            time.sleep(0.005)
    assert [(h.kind, h.code) for h in replies] == [("reject", "protocol")] and "nonce" in replies[0].reason
    assert r._sessions == {} and r.dropped == 1
