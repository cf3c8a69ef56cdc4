"""Nothing in the KV plane grows without bound or dies in silence: idle and unfinished sessions expire on both sides
(and a peer that comes back handshakes again), the receiver holds at most max_sessions, the sender's outboxes hold
at most max_outbox_bytes under a receiver that never reads (send_layer fails instead), and an I/O thread that dies
says so through io_problem() while its transfers fail."""

from __future__ import annotations

import time

import pytest

from tests.helpers.kv import Cache, fingerprint, make_kv, poll_until
from tests.transfer.test_failures import FAST, RawPeer, _failed
from transfer.base import make_receiver, make_sender
from transfer.config import TransferConfig
from transfer.errors import PeerGone, SessionLimit, TransferError, TransferTimeout
from transfer.outbox import HEADER_COST
from transfer.pairgroup import PairLink
from transfer.path import PeerState
from transfer.state import TransferState

pytestmark = pytest.mark.timeout(60)
SECRET = "bounds-secret-0123456789abcdef"


def _cfg(**kw) -> TransferConfig:
    return TransferConfig(**{**FAST, "secret": SECRET, "group_timeout_s": 10.0, **kw})


def _transfer(r, s, fp, cache, tid: str, dst: list[int], seed: int) -> None:
    """A whole transfer that must succeed on both sides."""
    r.expect(tid, dst)
    s.begin(tid, r.address)
    for layer in range(fp.num_layers):
        assert s.send_layer(tid, layer, dst, *make_kv(fp, layer, len(dst), seed))
    s.finish(tid)
    events = poll_until([r.poll, s.poll], lambda e: len(e) >= 2, 20)
    assert [(e.transfer_id, e.state) for e in events] == [(tid, TransferState.DONE)] * 2, events
    cache.assert_holds(dst, seed=seed)


def _until(predicate, timeout_s: float, poll=lambda: None) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        poll()
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


@pytest.mark.parametrize("backend", ["zmq", "gloo"])
def test_an_idle_session_expires_on_both_sides_and_the_peer_handshakes_again(backend, closing) -> None:
    fp = fingerprint()
    cache = Cache(fp)
    cfg = _cfg(idle_session_s=0.8)
    r = closing(make_receiver(backend, fp, cache.sink, "tcp://127.0.0.1:0", cfg))
    s = closing(make_sender(backend, fp, cfg))
    _transfer(r, s, fp, cache, "first", [1, 2], seed=1)
    [first] = r._sessions.values()
    links = [first.path.link, *(p.path.link for p in s._peers.values())] if backend == "gloo" else []
    # no transfer uses the session any more: the sender closes its side after idle/2, the receiver after idle
    assert _until(lambda: not s._peers, 3), "the sender kept an idle peer"
    assert _until(lambda: not r._sessions, 3, r.poll), "the receiver kept an idle session"
    assert r._sessions.expired == 1
    if backend == "gloo":  # the pair groups' threads end with their sessions
        assert _until(lambda: not any(link._thread.is_alive() for link in links), 5)
    _transfer(r, s, fp, cache, "second", [3, 4], seed=2)  # the peer comes back: a fresh handshake, a new session
    assert list(r._sessions) != [first.token] and len(r._sessions) == 1
    assert r.pending_transfers() == [] and s.active_transfers() == []


def test_a_session_a_transfer_is_bound_to_is_kept_however_quiet(closing) -> None:
    """Idleness drops only sessions that carry no transfer: a bound one lives until its transfer ends (here: the
    sender's silence, after lease_s), then expires."""
    fp = fingerprint()
    cache = Cache(fp)
    r = closing(make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", _cfg(idle_session_s=0.2, lease_s=1.5)))
    raw = closing(RawPeer(r.address, fp, secret=SECRET))
    raw.welcome(r)
    r.expect("t", [1, 2])
    raw.send(*raw.piece("t", 0, [1, 2]))  # binds "t" to this session, then the sender goes quiet
    assert _until(lambda: cache.writes == 1, 3, r.poll)
    events = []
    assert not _until(lambda: not r._sessions, 0.8, lambda: events.extend(r.poll()))  # 4 x idle: still there
    assert events == [] and r.pending_transfers() == ["t"]
    assert isinstance(_failed(poll_until([r.poll], lambda e: e, 3), "t"), PeerGone)  # silent for lease_s
    assert _until(lambda: not r._sessions, 2, r.poll)


@pytest.mark.parametrize("transport", ["zmq", "dist"])
def test_a_handshake_never_followed_by_a_message_expires(transport, closing) -> None:
    fp = fingerprint()
    cache = Cache(fp)
    backend = "zmq" if transport == "zmq" else "gloo"
    cfg = _cfg(idle_session_s=0.5, group_timeout_s=2.0)
    r = closing(make_receiver(backend, fp, cache.sink, "tcp://127.0.0.1:0", cfg))
    peers = [closing(RawPeer(r.address, fp, secret=SECRET, transport=transport)) for _ in range(3)]
    for raw in peers:
        raw.welcome(r)  # welcomed (for dist: a pair link starts forming), then silence
    assert len(r._sessions) == 3
    links = [sess.path.link for sess in r._sessions.values()] if transport == "dist" else []
    assert _until(lambda: not r._sessions, 3, r.poll)
    assert r._sessions.expired == 3
    if transport == "dist":  # their pair links were told to stop (a link forming its group ends within its timeout)
        assert all(link._stop.is_set() for link in links)
    # a stranger who knows nothing (no secret) cannot open one at all: ZeroMQ's handshake drops it (transfer/zap.py)
    stranger = closing(RawPeer(r.address, fp, secret="not-the-secret", transport=transport))
    replies: list[dict] = []
    assert _until(lambda: r.handshake_refused, 2, lambda: (r.poll(), replies.extend(stranger.replies())))
    assert replies == [] and r.rejected == 0 and not r._sessions


def test_the_session_cap_refuses_new_hellos_until_sessions_expire(closing) -> None:
    fp = fingerprint()
    cache = Cache(fp)
    cfg = _cfg(idle_session_s=1.0, max_sessions=2)
    r = closing(make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", cfg))
    held = [closing(RawPeer(r.address, fp, secret=SECRET)) for _ in range(2)]
    for raw in held:
        raw.welcome(r)
    tokens = set(r._sessions)
    # a third sender is refused with a clear reason, and no held session is evicted for it
    s = closing(make_sender("zmq", fp, cfg))
    r.expect("refused", [1])
    s.begin("refused", r.address)
    error = _failed(_poll_sender(s, r), "refused")
    assert isinstance(error, SessionLimit) and "maximum of 2" in str(error)
    assert set(r._sessions) == tokens
    r.abort("refused")
    r.poll()
    # the held sessions never carry anything: once they expire, the same sender is welcomed
    assert _until(lambda: not r._sessions, 3, r.poll)
    _transfer(r, s, fp, cache, "welcome", [2, 3], seed=5)


def _poll_sender(s, r) -> list:
    """Sender events while the receiver is polled too (it answers the hello)."""
    return poll_until([s.poll, lambda: [e for e in r.poll() if e.transfer_id != "refused"]], lambda e: e, 3)


def test_hellos_past_the_cap_from_many_senders_get_rejects_not_sessions(closing) -> None:
    fp = fingerprint()
    cache = Cache(fp)
    r = closing(make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", _cfg(max_sessions=3, idle_session_s=30)))
    peers = [closing(RawPeer(r.address, fp, secret=SECRET)) for _ in range(10)]
    replies: list[dict] = []
    assert _until(lambda: len(replies) == 10, 3, lambda: (r.poll(), [replies.extend(p.replies()) for p in peers]))
    assert sorted(h.kind for h in replies) == ["reject"] * 7 + ["welcome"] * 3
    assert {h.code for h in replies if h.kind == "reject"} == {SessionLimit.code}
    assert len(r._sessions) == 3


def test_the_outbox_stays_bounded_under_a_receiver_that_never_reads(closing) -> None:
    """The receiver handshakes, then stops reading. Pieces pile up in the sender; at max_outbox_bytes the I/O thread
    takes no more commands, send_layer waits enqueue_timeout_s and fails the transfer, and memory stays bounded."""
    fp = fingerprint(heads=8, head_dim=64, block_size=16)  # 16 KiB per block and tensor
    cache = Cache(fp, num_blocks=16)
    limit = 1 << 20
    cfg = _cfg(
        max_outbox_bytes=limit,
        queue_size=2,
        enqueue_timeout_s=0.5,
        hwm=2,
        connect_timeout_s=30,
        send_timeout_s=30,
        lease_s=30,
        deadline_s=30,
    )
    stalled = closing(make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", cfg))
    s = closing(make_sender("zmq", fp, cfg))
    dst = list(range(8))
    stalled.expect("t", dst)
    s.begin("t", stalled.address)
    assert _until(lambda: any(p.state is PeerState.READY for p in s._peers.values()), 3, stalled.poll)
    k, v = make_kv(fp, 0, len(dst), seed=1)
    piece = k.numel() * k.element_size() * 2 + HEADER_COST
    started, ok, peak = time.monotonic(), True, 0
    for i in range(400):  # 400 x 256 KiB = 100 MiB if nothing pushed back
        t0 = time.monotonic()
        ok = s.send_layer("t", i % fp.num_layers, dst, k.clone(), v.clone())
        peak = max(peak, s.outbox_bytes)
        if not ok:
            assert time.monotonic() - t0 < cfg.enqueue_timeout_s + 1.0  # waited for room, then gave up
            break
    assert not ok, "send_layer never pushed back"
    assert time.monotonic() - started < 30
    assert s.outbox_peak <= limit + piece and peak <= limit + piece
    error = _failed(poll_until([s.poll], lambda e: e, 2), "t")
    assert isinstance(error, TransferTimeout) and "queue" in str(error)
    # the ended transfer's queued pieces are dropped, so the sender serves another receiver at once
    assert _until(lambda: s.outbox_bytes < limit, 2)
    other_cache = Cache(fingerprint(heads=8, head_dim=64, block_size=16), num_blocks=16)
    other = closing(make_receiver("zmq", fp, other_cache.sink, "tcp://127.0.0.1:0", cfg))
    _transfer(other, s, fp, other_cache, "next", [1, 2], seed=3)
    stalled.abort("t")
    assert [e.transfer_id for e in stalled.poll()] == ["t"]


def test_a_sender_io_thread_that_dies_says_so_and_fails_its_transfers(closing) -> None:
    fp = fingerprint()
    cache = Cache(fp)
    r = closing(make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", _cfg()))
    s = closing(make_sender("zmq", fp, _cfg(enqueue_timeout_s=5)))
    _transfer(r, s, fp, cache, "before", [1], seed=1)
    assert s.io_problem() == "" and r.io_problem() == ""
    r.expect("t", [2, 3])
    s.begin("t", r.address)
    assert s.send_layer("t", 0, [2, 3], *make_kv(fp, 0, 2, seed=2))
    assert _until(lambda: cache.writes == fp.num_layers + 1, 3, r.poll)

    def broken() -> None:
        raise RuntimeError("injected: the I/O loop hit a bug")

    s._check_timeouts = broken  # the thread's next turn raises
    error = _failed(poll_until([s.poll], lambda e: e, 3), "t")
    assert isinstance(error, TransferError) and "injected" in str(error)
    assert "kv-sender I/O thread died" in s.io_problem() and "injected" in s.io_problem()
    # later transfers fail at once, through poll(), instead of waiting on a thread that is gone
    t0 = time.monotonic()
    s.begin("later", r.address)
    assert s.send_layer("later", 0, [4], *make_kv(fp, 0, 1, seed=3)) is False
    assert "injected" in str(_failed(s.poll(), "later")) and time.monotonic() - t0 < 1.0
    assert s.active_transfers() == [] and r.io_problem() == ""
    r.abort("t")
    assert [e.transfer_id for e in r.poll()] == ["t"]


def test_a_pair_link_thread_that_dies_says_so_on_both_sides(monkeypatch, closing) -> None:
    fp = fingerprint()
    cache = Cache(fp)

    def broken(self) -> None:
        raise RuntimeError("injected: a pair-link bug")

    monkeypatch.setattr(PairLink, "_serve", broken)
    r = closing(make_receiver("gloo", fp, cache.sink, "tcp://127.0.0.1:0", _cfg()))
    s = closing(make_sender("gloo", fp, _cfg()))
    r.expect("t", [1, 2])
    s.begin("t", r.address)
    s.send_layer("t", 0, [1, 2], *make_kv(fp, 0, 2, seed=1))
    events = poll_until([r.poll, s.poll], lambda e: len(e) >= 2, 10)
    assert sorted(e.state for e in events) == [TransferState.FAILED] * 2, events
    assert "pair-link thread died" in s.io_problem() and "injected" in s.io_problem()
    assert "pair-link thread died" in r.io_problem() and "injected" in r.io_problem()
    assert r.pending_transfers() == [] and s.active_transfers() == []


def test_the_local_backend_has_no_io_thread_to_lose(closing) -> None:
    fp = fingerprint()
    cache = Cache(fp)
    r = closing(make_receiver("local", fp, cache.sink, "local://bounds", _cfg()))
    s = closing(make_sender("local", fp, _cfg()))
    _transfer(r, s, fp, cache, "t", [1], seed=1)
    assert r.io_problem() == "" and s.io_problem() == "" and r.rejected == 0


@pytest.mark.parametrize("field", ["idle_session_s", "max_sessions", "max_outbox_bytes"])
def test_bounds_must_be_positive(field) -> None:
    with pytest.raises(ValueError, match=field):
        TransferConfig(**{field: 0})
