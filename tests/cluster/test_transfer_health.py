"""The KV plane's health, as the operator sees it: a prefill worker whose KV sender I/O thread died is degraded in
/health, /status and /metrics and gets no new requests (the other prefill worker serves them), and KV-plane
messages that fail authentication are counted per decode worker in /metrics.

In-process clusters (the real router, API, workers and transfer, as threads) so the fault can be placed precisely."""

from __future__ import annotations

import time

import httpx
import pytest
import zmq

from tests.helpers.cluster import metric_value, wait_until, worker_named
from transfer.auth import NO_SESSION, handshake_key, seal
from transfer.wire import pack_header
from transfer.zap import connect_plain, plane_keys
from worker.rank_kv import frame_bound

pytestmark = pytest.mark.timeout(240)


def _complete(handle, prompt="hello there", max_tokens=6) -> httpx.Response:
    body = {
        "model": handle.config.served_model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60)


def test_a_prefill_worker_whose_kv_sender_thread_died_is_degraded_and_gets_no_requests(serve):
    handle = serve(
        pools={"prefill": {"replicas": 2, "torch_threads": 1, "kv_blocks": 96}},
        router={"prefill_policy": "round_robin"},
    )
    expected = _complete(handle).json()["choices"][0]["text"]
    broken, healthy = worker_named(handle, "prefill-1"), worker_named(handle, "prefill-0")

    def bug() -> None:
        raise RuntimeError("injected: a bug in the KV sender's loop")

    (sender,) = broken.role.sender.kv.endpoints()  # the one made for the decode worker's KV (its first hand-off)
    sender._check_timeouts = bug  # the sender's I/O thread dies at its next turn
    wait_until(lambda: handle.router.members.workers["prefill-1"].degraded, 5)

    health = httpx.get(f"{handle.base_url}/health", timeout=5)
    assert health.status_code == 200  # the cluster still serves
    body = health.json()
    assert body["status"] == "degraded" and list(body["unhealthy_workers"]) == ["prefill-1"]
    assert "kv-sender I/O thread died" in body["unhealthy_workers"]["prefill-1"]
    status = httpx.get(f"{handle.base_url}/status", timeout=5).json()
    assert "injected" in next(w for w in status["workers"] if w["name"] == "prefill-1")["degraded"]
    assert not next(w for w in status["workers"] if w["name"] == "prefill-0")["degraded"]
    assert metric_value(handle.base_url, "pdserve_worker_degraded", worker="prefill-1") == 1
    assert metric_value(handle.base_url, "pdserve_worker_degraded", worker="prefill-0") == 0

    served_before, broken_before = healthy.counters.transfers_ok, broken.counters.transfers_ok
    for _ in range(4):  # round robin would give every other request to prefill-1: they all go to prefill-0
        response = _complete(handle)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected
    wait_until(lambda: healthy.counters.transfers_ok == served_before + 4, 5)  # acks reach prefill as decode starts
    assert broken.counters.transfers_ok == broken_before and broken.engine.requests == {}


def test_kv_messages_that_fail_authentication_are_counted_per_decode_worker(serve):
    """A stranger (no password) is refused in ZeroMQ's handshake; a peer past it (the password, sniffed: PLAIN sends
    it in the clear) still fails the MACs. Both are counted per decode worker."""
    handle = serve()
    kv_address = handle.router.members.workers["decode-0"].kv_address

    def counted(key: str) -> float | None:
        return metric_value(handle.base_url, "pdserve_worker_total", worker="decode-0", key=key)

    wait_until(lambda: counted("kv_rejected") is not None, 5)  # the first heartbeat
    assert counted("kv_rejected") == 0 and counted("kv_handshake_refused") == 0
    ctx = zmq.Context()
    try:
        hello = {"kind": "hello", "fp": [], "transport": "zmq", "nonce": b"n" * 16}
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(kv_address.removeprefix("shm+"))  # the default (auto) receiver's zmq control socket
        stranger.send(b"\0" * 80, zmq.NOBLOCK)
        wait_until(lambda: (counted("kv_handshake_refused") or 0) >= 1, 5)
        insider = ctx.socket(zmq.DEALER)
        insider.setsockopt(zmq.LINGER, 0)
        connect_plain(insider, plane_keys(handle.config.transfer.secret))
        insider.connect(kv_address.removeprefix("shm+"))
        insider.send(b"\0" * 80)  # no valid MAC
        insider.send(seal(handshake_key("a guessed secret"), NO_SESSION, 0, pack_header(hello)))
        wait_until(lambda: counted("kv_rejected") == 2, 5)
    finally:
        ctx.destroy(linger=0)
    assert _complete(handle).status_code == 200  # the decode worker serves on


def test_a_decode_workers_frame_bound_is_its_largest_legitimate_frame_and_a_larger_one_drops_the_peer(serve):
    """Not the 1 GiB default: one layer of its KV cache (or a full batch of small pieces, whichever is more); ZeroMQ
    drops a peer past the handshake that sends more, before buffering it, and the worker serves on."""
    handle = serve()
    decode = worker_named(handle, "decode-0").role
    receiver = decode.receiver.kv.receiver
    bound = frame_bound(decode.engine.kv_cache, 1 << 30)
    assert receiver.cfg.max_frame_bytes == bound < 1 << 30
    assert bound >= max(t.nbytes for t in decode.engine.kv_cache.kv)
    ctx = zmq.Context()
    try:
        insider = ctx.socket(zmq.DEALER)
        insider.setsockopt(zmq.LINGER, 0)
        connect_plain(insider, plane_keys(handle.config.transfer.secret))
        insider.connect(receiver.address.removeprefix("shm+"))
        insider.send_multipart([b"\0" * 80, b"\0" * (bound + 1)])  # one frame past the bound
        time.sleep(0.5)
        assert receiver.rejected == 0 and receiver.dropped == 0  # never read: ZeroMQ dropped the connection
    finally:
        ctx.destroy(linger=0)
    assert _complete(handle).status_code == 200
