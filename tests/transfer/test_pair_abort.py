"""A pair whose peer stops in the middle of a piece: the survivor's op times out, the pair group is aborted (gloo here,
the same code path as NCCL's `ProcessGroupNCCL.abort()`), only that pair's transfers fail, within the group timeout,
and the survivor goes on serving: the next transfer, with a fresh peer, forms a new pair and arrives bit-exact.
Nothing is left behind: no transfer, no session or peer, no pair-link thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.helpers import transfer_peers as procs
from tests.helpers.kv import Cache, fingerprint, make_kv, poll_until
from tests.transfer import pair_peers
from transfer.base import make_receiver, make_sender
from transfer.config import TransferConfig
from transfer.errors import PeerGone
from transfer.pairgroup import ABORTS, LinkJob, PairLink, make_store_server
from transfer.state import TransferState

pytestmark = pytest.mark.timeout(120)
GROUP_TIMEOUT_S = 2.0


def _pair_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kv-pair-") and t.is_alive()]


def _wait_no_pair_threads(timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while _pair_threads() and time.monotonic() < end:
        time.sleep(0.02)
    assert _pair_threads() == [], "a pair-link thread outlived its endpoint"


def _only(events, tid):
    mine = [e for e in events if e.transfer_id == tid]
    assert len(mine) == 1, events
    return mine[0]


def test_link_aborts_its_group_when_the_peer_never_receives() -> None:
    """The unit: a send whose peer never posts the receive fails after the timeout and aborts the group; a new pair
    on the same store works."""
    store = make_store_server("127.0.0.1", 10)
    key = b"k" * 32

    def pair(name: str) -> tuple[PairLink, PairLink]:
        common = dict(backend="gloo", key=name, store_host="127.0.0.1", store_port=store.port, auth_key=key)
        r = PairLink(rank=0, local_host="127.0.0.1", timeout_s=GROUP_TIMEOUT_S, store=store, **common)
        s = PairLink(rank=1, local_host="127.0.0.1", timeout_s=GROUP_TIMEOUT_S, **common)
        assert r.ready.wait(10) and s.ready.wait(10)
        return r, s

    aborts = ABORTS["count"]
    r, s = pair("first")
    t0 = time.monotonic()
    s.submit(LinkJob("t", [torch.ones(1000)], (0,)))
    while s.broken is None and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    took = time.monotonic() - t0
    assert isinstance(s.broken, PeerGone) and "timed out" in str(s.broken).lower()
    assert GROUP_TIMEOUT_S * 0.9 <= took < GROUP_TIMEOUT_S + 2, took
    assert s.aborted and ABORTS["count"] == aborts + 1
    (job, err), *_ = s.pop_done()
    assert job.transfer_id == "t" and err is s.broken
    s.submit(LinkJob("late", [torch.ones(4)], (1,)))  # a broken link fails new work at once
    assert s.pop_done()[0][1] is s.broken
    r.close()
    s.close()

    r2, s2 = pair("second")
    got = torch.zeros(1000)
    r2.submit(LinkJob("u", [got], (0,)))
    s2.submit(LinkJob("u", [torch.arange(1000, dtype=torch.float32)], (0,)))
    end = time.monotonic() + 10
    done: list = []
    while not done and time.monotonic() < end:
        done = r2.pop_done()
        time.sleep(0.01)
    assert done and done[0][1] is None and torch.equal(got, torch.arange(1000, dtype=torch.float32))
    assert not r2.aborted and not s2.aborted
    r2.close()
    s2.close()
    _wait_no_pair_threads()


def test_receiver_survives_a_sender_that_stops_mid_piece(spawn, closing) -> None:
    fp = fingerprint("float32")
    cache = Cache(fp)
    cfg = TransferConfig(group_timeout_s=GROUP_TIMEOUT_S, deadline_s=60.0, lease_s=30.0)
    r = closing(make_receiver("gloo", fp, cache.sink, "tcp://127.0.0.1:0", cfg))
    r.expect("stuck", [1, 2], deadline_s=60.0)
    q = spawn.Queue()
    p = spawn.Process(target=pair_peers.stalling_sender_main, args=(r.address, "stuck", [1, 2], q), daemon=True)
    p.start()
    try:
        assert q.get(timeout=60) == "sent"
        t0 = time.monotonic()
        events = poll_until([r.poll], lambda e: e, 30)
        took = time.monotonic() - t0
        ev = _only(events, "stuck")
        assert ev.state == TransferState.FAILED and isinstance(ev.error, PeerGone), ev
        assert "timed out" in str(ev.error).lower()
        assert took < GROUP_TIMEOUT_S + 3, took  # the group timeout, not the 60 s deadline nor the 30 s lease
        assert cache.writes == 1  # layer 0 arrived; nothing of the stuck piece was written
        assert r.pending_transfers() == [] and len(r._sessions) == 0  # the pair's session is gone
    finally:
        p.kill()
        p.join(5)

    # the survivor serves a fresh sender, through a new pair group, bit-exact
    r.expect("next", [3, 4, 5])
    q2 = spawn.Queue()
    job = dict(backend="gloo", address=r.address, dtype="float32", tid="next", dst=[3, 4, 5], seed=8)
    p2 = spawn.Process(target=procs.sender_main, args=([job], q2), daemon=True)
    p2.start()
    try:
        events = poll_until([r.poll], lambda e: e, 60)
        assert _only(events, "next").state == TransferState.DONE
        cache.assert_holds([3, 4, 5], seed=8)
        kind, sender_events, active = q2.get(timeout=30)
        assert kind == "events" and sender_events[0][1] == "DONE" and active == [[]]
    finally:
        p2.join(10)
        if p2.is_alive():
            p2.kill()
    assert r.pending_transfers() == []
    r.close()
    _wait_no_pair_threads()


def test_sender_survives_a_receiver_that_stops_mid_piece(spawn, closing) -> None:
    fp = fingerprint("float32")
    cfg = TransferConfig(group_timeout_s=GROUP_TIMEOUT_S, lease_s=30.0, send_timeout_s=30.0)
    s = closing(make_sender("gloo", fp, cfg))
    q = spawn.Queue()
    p = spawn.Process(target=pair_peers.stalling_receiver_main, args=("stuck", [1, 2], q), daemon=True)
    p.start()
    try:
        address = q.get(timeout=60)
        s.begin("stuck", address)
        t0 = time.monotonic()
        for layer in range(fp.num_layers):
            assert s.send_layer("stuck", layer, [1, 2], *make_kv(fp, layer, 2, seed=5))
        s.finish("stuck")
        events = poll_until([s.poll], lambda e: e, 60)
        took = time.monotonic() - t0
        ev = _only(events, "stuck")
        assert ev.state == TransferState.FAILED and isinstance(ev.error, PeerGone), ev
        # pair formation (about 1 s here) plus the group timeout, far below the 30 s lease and send timeout
        assert took < GROUP_TIMEOUT_S + 10, took
        assert s.active_transfers() == [] and s._peers == {}  # the peer and its aborted group are dropped
        assert s.io_problem() == ""  # a dead peer is not a broken sender
    finally:
        p.kill()
        p.join(5)

    # a fresh receiver: the same sender pairs anew and delivers
    cache = Cache(fp)
    r = closing(make_receiver("gloo", fp, cache.sink, "tcp://127.0.0.1:0", TransferConfig(group_timeout_s=10.0)))
    r.expect("next", [6, 7])
    s.begin("next", r.address)
    for layer in range(fp.num_layers):
        assert s.send_layer("next", layer, [6, 7], *make_kv(fp, layer, 2, seed=3))
    s.finish("next")
    events = poll_until([r.poll, s.poll], lambda e: len(e) >= 2, 30)
    assert [e.state for e in events] == [TransferState.DONE] * 2
    cache.assert_holds([6, 7], seed=3)
    assert s.active_transfers() == [] and r.pending_transfers() == []
    s.close()
    r.close()
    _wait_no_pair_threads()
