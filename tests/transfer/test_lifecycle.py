"""State machine edges: aborts from either side, lost pieces, unknown transfers, expired leases and
deadlines, receiver killed mid-transfer, close with work pending. Each ends with empty tables."""

from __future__ import annotations

import os
import signal
import time

import msgspec
import pytest
import torch

from tests.helpers import transfer_peers as procs
from tests.helpers.kv import Cache, fingerprint, make_kv, poll_until
from transfer.base import make_receiver, make_sender
from transfer.config import TransferConfig
from transfer.errors import PeerGone, ProtocolError, TransferAborted, TransferTimeout
from transfer.state import TransferState

pytestmark = pytest.mark.timeout(60)
FAST = TransferConfig(deadline_s=2.0, lease_s=1.0, connect_timeout_s=1.0, send_timeout_s=1.0)
BACKENDS = {"zmq": "tcp://127.0.0.1:0", "local": "local://life"}


def _pair(backend, closing, cfg=FAST):
    fp = fingerprint("float32")
    cache = Cache(fp)
    r = closing(make_receiver(backend, fp, cache.sink, BACKENDS[backend], cfg))
    s = closing(make_sender(backend, fp, cfg))
    return fp, cache, r, s


def _by_side(r, s, timeout=5.0):
    rev, sev = [], []
    poll_until(
        [lambda: rev.extend(r.poll()) or [], lambda: sev.extend(s.poll()) or []],
        lambda _: bool(rev) and bool(sev),
        timeout,
    )
    assert r.pending_transfers() == [] and s.active_transfers() == []
    return rev, sev


def _one_failure(events):
    assert len(events) == 1 and events[0].state == TransferState.FAILED, events
    return events[0].error


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_receiver_abort_releases_sender(backend, closing) -> None:
    fp, cache, r, s = _pair(backend, closing)
    r.expect("t", [1, 2])
    s.begin("t", r.address)
    s.send_layer("t", 0, [1, 2], *make_kv(fp, 0, 2, 1))
    poll_until([r.poll], lambda _: cache.writes == 1, 3)
    r.abort("t", "client went away")
    rev, sev = _by_side(r, s)
    assert isinstance(_one_failure(rev), TransferAborted)
    assert isinstance(_one_failure(sev), TransferAborted) and "client went away" in str(sev[0].error)
    assert s.send_layer("t", 1, [1, 2], *make_kv(fp, 1, 2, 1)) is False  # late pieces are dropped


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_sender_abort_fails_receiver(backend, closing) -> None:
    fp, cache, r, s = _pair(backend, closing)
    r.expect("t", [1, 2])
    s.begin("t", r.address)
    s.send_layer("t", 0, [1, 2], *make_kv(fp, 0, 2, 1))
    poll_until([r.poll], lambda _: cache.writes == 1, 3)
    s.abort("t", "prefill worker shutting down")
    rev, sev = _by_side(r, s)
    assert isinstance(_one_failure(rev), TransferAborted)
    assert isinstance(_one_failure(sev), TransferAborted)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_finish_with_missing_layers_fails_fast(backend, closing) -> None:
    fp, cache, r, s = _pair(backend, closing, TransferConfig(deadline_s=30, lease_s=30))
    r.expect("t", [1, 2])
    s.begin("t", r.address)
    for layer in range(fp.num_layers - 1):  # the last layer never comes
        s.send_layer("t", layer, [1, 2], *make_kv(fp, layer, 2, 1))
    s.finish("t")
    t0 = time.monotonic()
    rev, sev = _by_side(r, s)
    assert time.monotonic() - t0 < 2
    assert isinstance(_one_failure(rev), ProtocolError) and isinstance(_one_failure(sev), ProtocolError)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_unexpected_transfer_and_wrong_blocks(backend, closing) -> None:
    fp, cache, r, s = _pair(backend, closing)
    s.begin("ghost", r.address)  # the receiver never reserved blocks for it
    s.send_layer("ghost", 0, [1], *make_kv(fp, 0, 1, 1))
    sev = poll_until([r.poll, s.poll], lambda e: e, 3)
    assert isinstance(_one_failure(sev), ProtocolError)
    r.expect("t", [1, 2])
    s.begin("t", r.address)
    s.send_layer("t", 0, [1, 3], *make_kv(fp, 0, 2, 1))  # block 3 is not ours to write
    rev, sev = _by_side(r, s)
    assert isinstance(_one_failure(rev), ProtocolError) and cache.writes == 0


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_receiver_deadline(backend, closing) -> None:
    fp, cache, r, s = _pair(backend, closing)
    r.expect("t", [1], deadline_s=0.3)
    ev = poll_until([r.poll], lambda e: e, 3)
    assert isinstance(_one_failure(ev), TransferTimeout) and r.pending_transfers() == []


def test_lease_expires_when_receiver_stops_polling(closing) -> None:
    fp, cache, r, s = _pair("zmq", closing)
    r.expect("t", [1])
    s.begin("t", r.address)
    s.send_layer("t", 0, [1], *make_kv(fp, 0, 1, 1))
    poll_until([r.poll], lambda _: cache.writes == 1, 3)  # then the decode side freezes
    t0 = time.monotonic()
    ev = poll_until([s.poll], lambda e: e, 5)
    assert isinstance(_one_failure(ev), TransferTimeout) and time.monotonic() - t0 < 2.5
    assert s.active_transfers() == []


def test_receiver_killed_mid_transfer(spawn, closing) -> None:
    fp = fingerprint("bfloat16")
    q = spawn.Queue()
    p = spawn.Process(
        target=procs.receiver_main, args=("zmq", "tcp://127.0.0.1:0", "bfloat16", "t", [1, 2], q), daemon=True
    )
    p.start()
    try:
        kind, address = q.get(timeout=30)
        s = closing(make_sender("zmq", fp, FAST))
        s.begin("t", address)
        s.send_layer("t", 0, [1, 2], *make_kv(fp, 0, 2, 1))
        time.sleep(0.3)
        os.kill(p.pid, signal.SIGKILL)
        p.join(5)
        for layer in range(1, fp.num_layers):
            s.send_layer("t", layer, [1, 2], *make_kv(fp, layer, 2, 1))
        s.finish("t")
        t0 = time.monotonic()
        ev = poll_until([s.poll], lambda e: e, 10)
        assert isinstance(_one_failure(ev), (TransferTimeout, PeerGone))
        assert time.monotonic() - t0 < 3 and s.active_transfers() == []
    finally:
        if p.is_alive():
            p.kill()


def test_close_reports_pending(closing) -> None:
    fp, cache, r, s = _pair("zmq", closing)
    r.expect("t", [1])
    s.begin("t", r.address)
    r.close()
    s.close()
    assert isinstance(_one_failure(r.poll()), PeerGone)
    assert isinstance(_one_failure(s.poll()), PeerGone)
    assert r.pending_transfers() == [] and s.active_transfers() == []


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_leading_run_ends_at_the_senders_finish_with_its_extent(backend, closing) -> None:
    """A running request's KV: the receiver reserved 4 blocks, the sender fills the first 3 in two parts (blocks it
    had, then the tail once the request stopped), and its finish ends the transfer; the event says 3."""
    fp, cache, r, s = _pair(backend, closing)
    r.expect("t", [5, 6, 7, 8], leading_run=True)
    s.begin("t", r.address)
    for layer in range(fp.num_layers):
        s.send_layer("t", layer, [5, 6], *make_kv(fp, layer, 2, 1))
    poll_until([r.poll], lambda _: cache.writes == fp.num_layers, 3)
    assert r.pending_transfers() == ["t"]  # every allowed block of no layer, and no finish: not done
    for layer in range(fp.num_layers):
        s.send_layer("t", layer, [7], *make_kv(fp, layer, 1, 2))
    s.finish("t")
    rev, sev = _by_side(r, s)
    assert [(e.state, e.num_blocks) for e in rev] == [(TransferState.DONE, 3)] and sev[0].ok
    cache.assert_holds([5, 6], seed=1)
    cache.assert_holds([7], seed=2)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("gap", ["layers differ", "not leading"])
def test_a_leading_run_with_a_gap_or_ragged_layers_fails(backend, gap, closing) -> None:
    fp, cache, r, s = _pair(backend, closing)
    r.expect("t", [5, 6, 7], leading_run=True)
    s.begin("t", r.address)
    for layer in range(fp.num_layers):
        blocks = [5, 6] if gap == "not leading" or layer else [5]
        if gap == "not leading":
            blocks = [5, 7]
        s.send_layer("t", layer, blocks, *make_kv(fp, layer, len(blocks), 1))
    s.finish("t")
    rev, sev = _by_side(r, s)
    assert isinstance(_one_failure(rev), ProtocolError) and isinstance(_one_failure(sev), ProtocolError)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_transfer_of_some_heads_writes_only_those(backend, closing) -> None:
    """A tensor-parallel sender's share of a receiver's heads: the receiver names the heads at expect, every piece
    carries exactly them, and the sink is told which; a piece of other heads fails the transfer."""
    whole = fingerprint("float32")
    fp = whole.slice(0, whole.num_kv_heads)  # a receiver holding every head of a 1-head model is its whole fp
    assert fp == whole
    writes: list = []

    def sink(tid, layer, blocks, k, v, heads=None):
        writes.append((layer, blocks, tuple(k.shape), heads))

    r = closing(make_receiver(backend, fp, sink, BACKENDS[backend], FAST))
    s = closing(make_sender(backend, fp, FAST))
    r.expect("t", [3, 4], heads=(0, fp.num_kv_heads))  # all of them, said explicitly: as a whole transfer
    s.begin("t", r.address)
    for layer in range(fp.num_layers):
        s.send_layer("t", layer, [3, 4], *make_kv(fp, layer, 2, 1))
    s.finish("t")
    rev, sev = _by_side(r, s)
    assert rev[0].ok and sev[0].ok and all(w[3] is None for w in writes)


def test_heads_of_a_fingerprint_slice_and_pieces_that_carry_them():
    from transfer.wire import check_piece, encode_piece

    whole = fingerprint("float32")
    wide = msgspec_replace(whole, num_kv_heads=4)
    rank = wide.slice(2, 2)  # a tensor-parallel rank holding heads 2 and 3 of 4
    assert (rank.head_start, rank.num_kv_heads, rank.model_kv_heads, rank.total_heads) == (2, 2, 4, 4)
    assert rank != wide
    with pytest.raises(ValueError, match="not within"):
        msgspec_replace(wide, head_start=3, num_kv_heads=2, model_kv_heads=4)
    k = torch.zeros(1, rank.block_size, 1, rank.head_dim)
    piece, _ = encode_piece(rank, "t", 0, [7], k, k, "raw", False, heads=(1, 1))
    check_piece(piece, rank, 1 << 30)  # one of the rank's two heads: its second
    bad, _ = encode_piece(rank, "t", 0, [7], k, k, "raw", False, heads=(2, 1))
    with pytest.raises(ProtocolError, match="heads"):
        check_piece(bad, rank, 1 << 30)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_piece_of_other_heads_than_expected_fails_the_transfer(backend, closing) -> None:
    whole = msgspec_replace(fingerprint("float32"), num_kv_heads=2)
    writes: list = []

    def sink(tid, layer, blocks, k, v, heads=None):
        writes.append(heads)

    r = closing(make_receiver(backend, whole, sink, BACKENDS[backend], FAST))
    s = closing(make_sender(backend, whole, FAST))
    r.expect("t", [1], heads=(1, 1))  # the second head only
    s.begin("t", r.address)
    one = torch.ones(1, whole.block_size, 1, whole.head_dim)
    s.send_layer("t", 0, [1], one, one, heads=(1, 1))
    poll_until([r.poll], lambda _: writes == [(1, 1)], 3)  # written with its heads named
    s.send_layer("t", 1, [1], one, one, heads=(0, 1))  # the first head: not this transfer's share
    rev, sev = _by_side(r, s)
    assert isinstance(_one_failure(rev), ProtocolError) and writes == [(1, 1)]


def msgspec_replace(fp, **fields):
    return msgspec.structs.replace(fp, **fields)
