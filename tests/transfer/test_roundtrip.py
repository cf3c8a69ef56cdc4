"""Bit-exact round trips on every backend (zmq tcp, zmq ipc, local in-process; gloo and zmq across two
processes), chunked pieces, int8 wire compression; both sides end with empty tables."""

from __future__ import annotations

import pytest

from tests.helpers import transfer_peers as procs
from tests.helpers.kv import DTYPES, Cache, fingerprint, make_kv, poll_until
from transfer.base import make_receiver, make_sender
from transfer.config import TransferConfig
from transfer.state import TransferState

pytestmark = pytest.mark.timeout(60)


def _address(kind: str, tmp_path) -> str:
    return {"tcp": "tcp://127.0.0.1:0", "ipc": f"ipc://{tmp_path}/kv.ipc", "local": "local://rt"}[kind]


def _run(kind, dtype, tmp_path, closing, cfg=None, chunks=1, seed=3):
    backend = "local" if kind == "local" else "zmq"
    fp = fingerprint(dtype)
    cache = Cache(fp)
    r = closing(make_receiver(backend, fp, cache.sink, _address(kind, tmp_path), cfg))
    s = closing(make_sender(backend, fp, cfg))
    dst = [7, 2, 11, 5, 30, 0]
    r.expect("req-1", dst)
    s.begin("req-1", r.address)
    per = len(dst) // chunks
    for c in range(chunks):  # chunked prefill: each chunk streams all layers for its blocks
        for layer in range(fp.num_layers):
            k, v = make_kv(fp, layer, len(dst), seed, specials=cfg is None or cfg.kv_wire_dtype == "raw")
            sl = slice(c * per, (c + 1) * per)
            assert s.send_layer("req-1", layer, dst[sl], k[sl], v[sl])
    s.finish("req-1")
    events = poll_until([r.poll, s.poll], lambda ev: len(ev) >= 2, 10.0)
    assert [e.state for e in events] == [TransferState.DONE] * 2, events
    assert r.pending_transfers() == [] and s.active_transfers() == []
    assert cache.writes == fp.num_layers * chunks
    return cache, dst, events


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", ["tcp", "ipc", "local"])
def test_bit_exact(kind: str, dtype: str, tmp_path, closing) -> None:
    cache, dst, events = _run(kind, dtype, tmp_path, closing)
    cache.assert_holds(dst, seed=3, exact=True)
    assert all(e.nbytes > 0 for e in events)  # a transfer really happened


@pytest.mark.parametrize("kind", ["tcp", "local"])
def test_chunked_pieces(kind: str, tmp_path, closing) -> None:
    cache, dst, _ = _run(kind, "bfloat16", tmp_path, closing, chunks=2)
    cache.assert_holds(dst, seed=3, exact=True)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_int8_wire(dtype: str, tmp_path, closing) -> None:
    cfg = TransferConfig(kv_wire_dtype="int8")
    cache, dst, events = _run("tcp", dtype, tmp_path, closing, cfg=cfg)
    cache.assert_holds(dst, seed=3, exact=False, atol=0.05)  # randn: |x| < ~5, step 5/127
    raw_bytes = fingerprint(dtype).num_layers * 2 * len(dst) * 4 * 2 * 8 * DTYPES[dtype].itemsize
    assert events[0].nbytes < raw_bytes


def test_two_processes_gloo_and_zmq(spawn, closing) -> None:
    """One spawned sender process; gloo pair groups for 3 dtypes, plus zmq tcp, into this process."""
    caches, receivers, jobs = [], [], []
    plan = [("gloo", "float32"), ("gloo", "bfloat16"), ("gloo", "float16"), ("zmq", "float16")]
    for i, (backend, dtype) in enumerate(plan):
        fp = fingerprint(dtype)
        cache = Cache(fp)
        r = closing(make_receiver(backend, fp, cache.sink, "tcp://127.0.0.1:0"))
        r.expect(f"t{i}", [3, 9, 1])
        caches.append(cache)
        receivers.append(r)
        jobs.append(dict(backend=backend, address=r.address, dtype=dtype, tid=f"t{i}", dst=[3, 9, 1], seed=i))
    q = spawn.Queue()
    p = spawn.Process(target=procs.sender_main, args=(jobs, q), daemon=True)
    p.start()
    try:
        events = poll_until([r.poll for r in receivers], lambda ev: len(ev) >= len(plan), 40.0)
        assert sorted((e.transfer_id, e.state) for e in events) == [
            (f"t{i}", TransferState.DONE) for i in range(len(plan))
        ]
        kind, sender_events, active = q.get(timeout=20)
        assert sorted(sender_events) == [(f"t{i}", "DONE", "None") for i in range(len(plan))]
        assert active == [[]] * len(plan)
        for i, cache in enumerate(caches):
            cache.assert_holds([3, 9, 1], seed=i, exact=True)
        assert all(r.pending_transfers() == [] for r in receivers)
        p.join(10)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()


@pytest.mark.parametrize("backend, path", [("zmq", "inline"), ("shm", "shm-ring")])
def test_the_sender_says_how_it_reaches_each_receiver(backend, path, closing) -> None:
    """What /status shows per worker (``kv_paths``): zmq frames inline, a same-node shm pair through a ring."""
    fp = fingerprint("float32")
    cache = Cache(fp)
    r = closing(make_receiver(backend, fp, cache.sink, "tcp://127.0.0.1:0"))
    s = closing(make_sender(backend, fp))
    assert s.paths() == {}
    r.expect("req-1", [3, 4])
    s.begin("req-1", r.address)
    for layer in range(fp.num_layers):
        k, v = make_kv(fp, layer, 2, 5)
        s.send_layer("req-1", layer, [3, 4], k, v)
    s.finish("req-1")
    events = poll_until([r.poll, s.poll], lambda ev: len(ev) >= 2, 10.0)
    assert [e.state for e in events] == [TransferState.DONE] * 2
    assert s.paths() == {r.address: path}
