"""The router against slow, lying, cut-off and broken workers: no request is resolved by another's reply, nothing
waits for what cannot come, a crashed background task comes back, a degraded worker is taken out of the pool.

In-process clusters (the real router, API, workers and transfer, as threads) so faults can be placed precisely."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.helpers.cluster import metric_value, wait_all_kv_free, wait_until, worker_named
from worker.messages import Start, Stats, WorkerCounters, WorkerLoad

pytestmark = pytest.mark.timeout(240)


def _complete(handle, prompt="hello there", max_tokens=8, timeout=60, **extra) -> httpx.Response:
    body = {
        "model": handle.config.served_model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=timeout)


def _delay_reservations(worker, delay_s: float) -> None:
    """The worker answers its next reservation ``delay_s`` late (its loop stalls first, as a slow worker's would)."""
    worker = worker.role  # the decode role answers reservations
    original = worker._reserve

    def slow_reserve(*args, **kwargs):
        worker._reserve = original
        time.sleep(delay_s)
        return original(*args, **kwargs)

    worker._reserve = slow_reserve


def test_a_late_reservation_reply_never_resolves_another_workers_reservation(serve):
    handle = serve(
        pools={"decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160}},
        router={"worker_timeout_s": 1.0, "decode_policy": "round_robin"},
    )
    expected = _complete(handle, prompt="the same prompt").json()["choices"][0]["text"]
    # the next request tries decode-a first; it answers 1.5 s late, while the router waits on decode-b, which
    # answers 2.5 s late: decode-a's late "ok" must not be taken for decode-b's
    first, second = [w.name for w in handle.router.core.placer.policies["decode"].order(handle.router.live("decode"))]
    _delay_reservations(worker_named(handle, first), 1.5)
    _delay_reservations(worker_named(handle, second), 2.5)
    response = _complete(handle, prompt="the same prompt")
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected
    # the reservation that came too late was undone on its worker
    try:
        wait_until(
            lambda: all(
                w.stats is not None and w.stats.load.requests == 0 and w.stats.load.awaiting_kv == 0
                for w in handle.router.members.workers.values()
            ),
            10,
        )
    except AssertionError:
        raise AssertionError([w.stats for w in handle.router.members.workers.values()]) from None


def test_a_reservation_pending_on_a_worker_marked_dead_moves_on_at_once(serve):
    handle = serve(
        pools={"decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160}}, router={"worker_timeout_s": 10.0}
    )
    expected = _complete(handle, prompt="the same prompt").json()["choices"][0]["text"]
    asked: list[str] = []
    for name in ("decode-0", "decode-1"):  # whichever is asked first answers 3 s late, and is then marked dead
        worker = worker_named(handle, name).role  # the decode role answers reservations
        original = worker._reserve

        def slow_reserve(*args, _worker=worker, _original=original, **kwargs):
            _worker._reserve = _original
            if not asked:
                asked.append(_worker.name)
                time.sleep(3.0)
            return _original(*args, **kwargs)

        worker._reserve = slow_reserve
    marker = threading.Thread(
        target=lambda: (
            wait_until(lambda: bool(asked), 5),
            time.sleep(0.3),
            handle.router.mark_dead_threadsafe(asked[0], "monitor: process gone"),
        )
    )
    marker.start()
    started = time.monotonic()
    response = _complete(handle, prompt="the same prompt")
    marker.join(10)
    assert asked and response.status_code == 200 and response.json()["choices"][0]["text"] == expected
    assert time.monotonic() - started < 2.5  # not the 10 s worker_timeout_s


def test_a_reservation_whose_start_never_comes_is_freed_and_the_client_told(serve):
    handle = serve(transfer={"deadline_s": 2, "lease_s": 20})
    router = handle.router
    original = router._send
    router._send = lambda name, message: True if isinstance(message, Start) else original(name, message)
    started = time.monotonic()
    response = _complete(handle, stream=True, timeout=30)
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    error = next(json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e))
    assert error["code"] == "reservation_expired" and events[-1] == "[DONE]"
    assert time.monotonic() - started < 2 + 3
    router._send = original
    status = wait_all_kv_free(handle.base_url)
    assert next(w for w in status["workers"] if w["role"] == "decode")["reservations_expired"] == 1


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_prompt_no_kv_cache_can_hold_is_refused_at_once(serve, mode):
    handle = serve(
        mode=mode,
        pools={
            "prefill": {"replicas": 1, "torch_threads": 1, "kv_blocks": 8},
            "decode": {"replicas": 1, "torch_threads": 1, "kv_blocks": 8},
        },
    )
    wait_until(lambda: all(w.stats is not None for w in handle.router.members.workers.values()), 5)
    started = time.monotonic()
    response = _complete(handle, prompt=" ".join(["word"] * 40), max_tokens=4)  # ~200 tokens > 8 blocks of 16
    assert time.monotonic() - started < 2
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert "KV cache" in response.json()["error"]["message"]
    assert _complete(handle).status_code == 200


def test_a_decode_worker_that_refuses_a_request_ends_it_at_once(serve):
    handle = serve(pools={"decode": {"replicas": 1, "torch_threads": 1, "kv_blocks": 8}})
    router = handle.router
    original = router.on_event

    def without_cache_size(event):  # the router does not know the cache size: the worker itself must refuse
        original(event)
        worker = router.members.get(event.worker)
        if isinstance(event, Stats) and worker is not None:  # heard from, its heartbeat forgotten (as before the first)
            worker.stats = None

    router.on_event = without_cache_size
    try:
        for worker in router.members.workers.values():
            worker.stats = None
        started = time.monotonic()
        response = _complete(handle, prompt=" ".join(["word"] * 40), max_tokens=4)
        assert time.monotonic() - started < 3  # not a queue until the request's timeout, then 429
        assert response.status_code == 400, response.text
        assert "KV cache" in response.json()["error"]["message"]
    finally:
        router.on_event = original


def test_a_heartbeat_from_another_incarnation_neither_refreshes_nor_revives(serve):
    handle = serve()
    router = handle.router
    decode = worker_named(handle, "decode-0")
    decode.kill()  # dead for good: only a stale heartbeat (an old or a restarted process's) could revive it
    wait_until(lambda: not router.members.workers["decode-0"].alive, 5)
    stale = Stats(
        worker="decode-0",
        role="decode",
        address="tcp://127.0.0.1:1",
        load=WorkerLoad(free_blocks=160, total_blocks=160),
        counters=WorkerCounters(),
        loop_age_s=0.0,
    )
    router.loop.call_soon_threadsafe(router.on_event, stale)
    time.sleep(0.3)
    assert not router.members.workers["decode-0"].alive
    kept = router.members.workers["decode-0"].stats  # the registered process's last heartbeat, if one came: not this
    assert kept is None or kept.address != "tcp://127.0.0.1:1"
    router.members.workers.pop("decode-0")  # the test killed it: nothing to wait for at teardown


def test_a_worker_marked_dead_by_mistake_is_revived_when_heard_from(serve):
    handle = serve()
    handle.router.mark_dead_threadsafe("decode-0", "monitor timed out")  # a false alarm: the worker is fine
    wait_until(lambda: not handle.router.members.workers["decode-0"].alive, 2)
    wait_until(lambda: handle.router.members.workers["decode-0"].alive, 3)  # its next heartbeat brings it back
    assert metric_value(handle.base_url, "pdserve_worker_revivals_total") == 1
    assert _complete(handle).status_code == 200


def test_a_crashed_background_task_is_restarted_and_counted(serve):
    handle = serve()
    router = handle.router
    original = router.on_event
    crashed = threading.Event()

    def crash_once(message):
        if not crashed.is_set():
            crashed.set()
            raise RuntimeError("injected crash in the event loop")
        return original(message)

    router.on_event = crash_once
    wait_until(crashed.is_set, 5)
    response = _complete(handle)  # events are still received
    assert response.status_code == 200
    assert metric_value(handle.base_url, "pdserve_router_task_restarts_total", task="receive_events") == 1


def test_a_worker_whose_loop_keeps_failing_is_degraded_and_gets_no_requests(serve):
    handle = serve(mode="colocated")
    broken = worker_named(handle, "prefill-0")

    def failing_tick():
        raise RuntimeError("injected: the device is gone")

    broken.role.tick = failing_tick
    wait_until(lambda: handle.router.members.workers["prefill-0"].degraded, 5)
    health = httpx.get(f"{handle.base_url}/health", timeout=5)
    assert health.status_code == 200  # the other worker still serves
    body = health.json()
    assert body["status"] == "degraded" and "device is gone" in body["unhealthy_workers"]["prefill-0"]
    status = httpx.get(f"{handle.base_url}/status", timeout=5).json()
    assert "device is gone" in next(w for w in status["workers"] if w["name"] == "prefill-0")["degraded"]
    assert metric_value(handle.base_url, "pdserve_worker_degraded", worker="prefill-0") == 1
    for _ in range(4):  # every request goes to the healthy worker
        assert _complete(handle, max_tokens=3).status_code == 200
    assert broken.engine.requests == {}
    del broken.role.tick  # repaired: the class's tick again
