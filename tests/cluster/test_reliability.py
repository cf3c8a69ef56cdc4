"""Faults, overload, aborts and bad input: every request ends in a finish or an explicit error, and nothing leaks.

Most of these run the real workers as threads in this process (``in_process=True``: the same router, API, workers
and transfer backends, without Ray), so faults can be injected precisely; worker deaths need Ray (separate test)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from cluster.run.launch import start_serving
from tests.helpers.cluster import metric_value, tiny_cluster_config, wait_all_kv_free

pytestmark = pytest.mark.timeout(240)


def _worker(handle, role: str):
    return next(r.actor.worker for r in handle.workers if r.role == role)


def _complete(handle, prompt="hello there", max_tokens=8, **extra) -> httpx.Response:
    body = {
        "model": handle.config.served_model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60)


def _drop_layer(prefill, layer: int) -> None:
    """Lose every KV piece of one layer on its way to the decode worker."""
    original = prefill.role.sender.send_layer

    def send_layer(tid, lyr, dst, k, v):
        return True if lyr == layer else original(tid, lyr, dst, k, v)

    prefill.role.sender.send_layer = send_layer


def test_lost_transfer_fails_the_request_within_the_deadline(serve):
    handle = serve(transfer={"deadline_s": 3, "failure_policy": "fail"})
    _drop_layer(_worker(handle, "prefill"), layer=1)
    started = time.monotonic()
    response = _complete(handle, stream=True)
    elapsed = time.monotonic() - started
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and errors[0]["code"] == "kv_transfer_failed" and events[-1] == "[DONE]"
    assert elapsed < 3 + 1
    status = wait_all_kv_free(handle.base_url)
    decode = next(w for w in status["workers"] if w["role"] == "decode")
    assert decode["transfers_failed"] == 1
    time.sleep(0.3)  # one more heartbeat reaches the router's gauges
    assert metric_value(handle.base_url, "pdserve_worker_total", worker="decode-0", key="transfers_failed") == 1


def test_recompute_policy_serves_the_request_and_counts_it(serve, tiny_llama_path):
    handle = serve(transfer={"deadline_s": 3, "failure_policy": "recompute"})
    expected = _complete(handle, prompt="the same prompt", max_tokens=10).json()["choices"][0]["text"]
    _drop_layer(_worker(handle, "prefill"), layer=0)
    response = _complete(handle, prompt="the same prompt", max_tokens=10)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected, response.text
    assert response.json()["usage"]["completion_tokens"] == 10
    status = wait_all_kv_free(handle.base_url)
    decode = next(w for w in status["workers"] if w["role"] == "decode")
    assert decode.get("recomputes") == 1 and decode["transfers_failed"] == 1, json.dumps(status)
    time.sleep(0.3)
    assert metric_value(handle.base_url, "pdserve_worker_total", worker="decode-0", key="recomputes") == 1


def test_late_transfer_fails_cleanly(serve):
    handle = serve(transfer={"deadline_s": 1, "failure_policy": "fail"})
    prefill = _worker(handle, "prefill")

    def slow_hook(layer, batch):
        if layer == 1:
            time.sleep(1.5)  # the prefill stalls past the decode side's deadline

    prefill.engine.set_layer_hook(slow_hook)  # fault injection: runs inside the forward, after each layer's KV
    response = _complete(handle)
    assert response.status_code == 500 or "error" in response.text
    prefill.engine.set_layer_hook(None)
    assert _complete(handle).status_code == 200  # and the cluster serves normally afterwards


def test_overload_is_429_with_retry_after_and_recovers(serve):
    # decode holds 8 blocks: one 70-token request reserves 5, so the second waits and the rest are refused
    handle = serve(
        pools={"decode": {"replicas": 1, "torch_threads": 1, "kv_blocks": 8}}, router={"queue_size": 1, "port": 0}
    )

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": handle.config.served_model_name, "prompt": "x" * 70, "max_tokens": 40, "ignore_eos": True}
            return await asyncio.gather(
                *(client.post(f"{handle.base_url}/v1/completions", json=body) for _ in range(6))
            )

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) <= {200, 429}
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["retry-after"] and refused.json()["error"]["code"] == "overloaded"
    assert _complete(handle).status_code == 200
    assert "pdserve_errors_total" in httpx.get(f"{handle.base_url}/metrics").text


def test_client_disconnect_frees_blocks_on_both_workers_within_a_second(serve):
    handle = serve()
    body = {
        "model": handle.config.served_model_name,
        "prompt": "abc " * 30,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{handle.base_url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text": ""' not in line:
                break  # one token arrived; now the client goes away
    gone = time.monotonic()
    wait_all_kv_free(handle.base_url, timeout_s=1.0)
    assert time.monotonic() - gone < 1.0 + 0.3  # plus at most one heartbeat of reporting lag


def test_request_timeout_is_an_explicit_error_and_frees_blocks(serve):
    handle = serve(router={"request_timeout_s": 0.5, "port": 0})
    response = _complete(handle, max_tokens=400)
    assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"


def test_no_live_decode_worker_is_503(serve):
    handle = serve()
    _worker(handle, "decode").stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and handle.router.live("decode"):
        time.sleep(0.2)
    response = _complete(handle)
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_workers"
    assert httpx.get(f"{handle.base_url}/health").status_code == 503
    handle.pools.workers = [w for w in handle.workers if w.role != "decode"]  # already stopped


def test_api_key_guards_every_v1_route(serve):
    handle = serve(router={"api_key": "s3cret", "port": 0})
    assert _complete(handle).status_code == 401
    assert httpx.get(f"{handle.base_url}/v1/models").status_code == 401
    body = {"model": handle.config.served_model_name, "prompt": "hi", "max_tokens": 2}
    ok = httpx.post(f"{handle.base_url}/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200


BAD_BODIES = [
    (b"{not json", 400),
    (b"\xff\xfe\x00garbage", 400),
    (b"[1, 2, 3]", 400),
    (json.dumps({"model": "M", "prompt": 42}).encode(), 400),
    (json.dumps({"model": "M", "prompt": "x", "max_tokens": -1}).encode(), 400),
    (json.dumps({"model": "M", "prompt": "x", "max_tokens": 10**9}).encode(), 400),
    (json.dumps({"model": "M", "prompt": "x", "temperature": "hot"}).encode(), 400),
    (json.dumps({"model": "M", "prompt": "x", "top_k": -7}).encode(), 400),
    (json.dumps({"model": "M", "prompt": "x", "stop": [""]}).encode(), 400),
    (json.dumps({"model": "M", "prompt": "x", "logprobs": 6}).encode(), 400),  # completions allow 0..5
    (json.dumps({"model": "other", "prompt": "x"}).encode(), 404),
    (json.dumps({"model": "M", "prompt": "x" * 2_000_000}).encode(), 413),
]


def test_bad_bodies_get_the_right_status_and_an_openai_error(serve):
    handle = serve()
    for raw, status in BAD_BODIES:
        raw = raw.replace(b'"M"', json.dumps(handle.config.served_model_name).encode())
        response = httpx.post(
            f"{handle.base_url}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=30
        )
        assert response.status_code == status, (raw[:60], response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"]
    chat_cases = [
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user"}]},
        {"messages": "hello"},
        {},
    ]
    for case in chat_cases:
        response = httpx.post(
            f"{handle.base_url}/v1/chat/completions",
            json={"model": handle.config.served_model_name, **case},
            timeout=30,
        )
        assert response.status_code == 400 and response.json()["error"]["message"]
    assert _complete(handle).status_code == 200  # unharmed


def test_a_dead_router_strands_no_kv_on_the_workers(tiny_llama_path):
    config = tiny_cluster_config(tiny_llama_path, router={"orphan_timeout_s": 1.0, "port": 0})
    handle = start_serving(config, in_process=True)
    try:
        decode = _worker(handle, "decode").engine
        body = {
            "model": config.served_model_name,
            "prompt": "abc",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{handle.base_url}/v1/completions", json=body, timeout=60) as response:
            next(response.iter_lines())
            assert decode.requests  # mid-generation on the decode worker
            handle.server.should_exit = True  # the router's process goes away (server and router with it)
            handle.thread.join(10)
        gone = time.monotonic()
        engines = [r.actor.worker.engine for r in handle.workers]
        while time.monotonic() - gone < 5 and any(engine.requests for engine in engines):
            time.sleep(0.1)
        for engine in engines:
            assert not engine.requests and engine.num_free_blocks == engine.block_manager.num_blocks
        assert time.monotonic() - gone < 1.0 + 2.0  # the orphan timeout, plus the last ping's age and a loop turn
    finally:
        handle.pools.stop()


def test_a_step_longer_than_the_orphan_timeout_orphans_nothing(tiny_llama_path):
    """Pings that arrive while a step runs wait unread in the socket: the router is not silent, only unheard yet."""
    config = tiny_cluster_config(
        tiny_llama_path,
        mode="colocated",
        pools={"prefill": {"replicas": 0}},
        router={"orphan_timeout_s": 1.0, "port": 0},
    )
    handle = start_serving(config, in_process=True)
    try:
        engine = _worker(handle, "colocated").engine
        step, slow = engine.step, {"left": 2}

        def slow_step():
            if slow["left"] and engine.scheduler.has_work():
                slow["left"] -= 1
                time.sleep(1.6)  # longer than orphan_timeout_s, while the router keeps pinging
            return step()

        engine.step = slow_step
        response = _complete(handle, max_tokens=6)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 6 and slow["left"] == 0
        wait_all_kv_free(handle.base_url)
    finally:
        handle.stop()
