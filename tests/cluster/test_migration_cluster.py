"""Moving running requests between decode workers in a served cluster (a tiny in-process cluster, two decode
workers), through HTTP: ``POST /admin/migrate`` moves a stream mid-way and the client gets exactly the text of an
undisturbed run, no token lost or repeated; draining a decode worker moves its streams instead of waiting for them;
/metrics and the response's timing count the moves; decode workers of degree 2 move a stream as exactly; nothing
leaks on either worker (the ``serve`` fixture).
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.helpers.cluster import metric_value, wait_until
from tests.helpers.engine import random_prompts

pytestmark = pytest.mark.timeout(300)

PROMPTS = random_prompts(4, 20, 40, seed=61)
MAX_TOKENS = 160


def _pools() -> dict:
    return {
        "prefill": {"replicas": 1, "torch_threads": 1, "kv_blocks": 96},
        "decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160},
    }


def _body(handle, prompt: list[int], stream: bool) -> dict:
    return {
        "model": handle.config.served_model_name,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def _reference(handle, prompt: list[int]) -> dict:
    response = httpx.post(f"{handle.base_url}/v1/completions", json=_body(handle, prompt, False), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _stream(handle, prompt: list[int], after_chunks: int, action) -> tuple[str, dict]:
    """Stream one completion; once ``after_chunks`` chunks came, run ``action`` (on another thread, as another
    client would). Returns the text and the final usage/timing chunk."""
    text, last, chunks = "", {}, 0
    body = {**_body(handle, prompt, True), "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{handle.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("choices"):
                text += chunk["choices"][0].get("text", "")
                chunks += 1
                if chunks == after_chunks:
                    threading.Thread(target=action, daemon=True).start()
            if chunk.get("usage"):
                last = {**last, "usage": chunk["usage"]}
            if chunk.get("timing"):
                last = {**last, "timing": chunk["timing"]}
    return text, last


def _total(url: str, key: str) -> float:
    """A worker counter summed over every worker."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text)
    return sum(
        sample.value
        for family in families
        for sample in family.samples
        if sample.name == "pdserve_worker_total" and sample.labels.get("key") == key
    )


def test_admin_migrate_moves_a_stream_and_the_client_sees_nothing_of_it(serve):
    handle = serve(pools=_pools())
    expected = _reference(handle, PROMPTS[0])
    moves: list[dict] = []

    def move() -> None:
        [flow] = list(dict.fromkeys(handle.router.core.flows.values()))
        response = httpx.post(
            f"{handle.base_url}/admin/migrate", json={"request_id": flow.rid}, headers=handle.admin_headers, timeout=10
        )
        moves.append({"status": response.status_code, "body": response.json(), "from": flow.decode})

    text, last = _stream(handle, PROMPTS[0], after_chunks=5, action=move)
    assert moves and moves[0]["status"] == 200 and list(moves[0]["body"]["moving"].values()) == ["moving"]
    assert text == expected["choices"][0]["text"]
    assert last["usage"]["completion_tokens"] == MAX_TOKENS
    assert last["timing"]["migrations"] == 1 and 0 < last["timing"]["migration_s"] < 10
    url = handle.base_url
    assert metric_value(url, "pdserve_migrations_total", reason="admin", result="moved") == 1
    wait_until(lambda: _total(url, "migrations_out") == 1, timeout_s=10)
    assert _total(url, "migrations_in") == 1 and _total(url, "migration_bytes") > 0


def test_admin_migrate_refuses_what_cannot_move(serve):
    handle = serve(pools=_pools())
    url, auth = f"{handle.base_url}/admin/migrate", handle.admin_headers
    assert httpx.post(url, json={"request_id": "nope"}, timeout=10).status_code == 401  # no credential
    assert httpx.post(url, json={"request_id": "nope"}, headers=auth, timeout=10).status_code == 404
    bad = httpx.post(url, json={"request_id": "a", "worker": "b"}, headers=auth, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"
    bad = httpx.post(url, json={"worker": "prefill-0"}, headers=auth, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "worker"
    bad = httpx.post(url, json={"worker": "decode-0", "speed": 1}, headers=auth, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speed"


def test_draining_a_decode_worker_moves_its_streams(serve):
    handle = serve(pools=_pools())
    expected = [_reference(handle, prompt)["choices"][0]["text"] for prompt in PROMPTS[:2]]
    drained: list[str] = []

    def drain() -> None:
        flows = list(dict.fromkeys(handle.router.core.flows.values()))
        name = flows[0].decode
        drained.append(name)
        handle.router.drain_worker_threadsafe(name, 60.0)

    results: list = [None, None]

    def other() -> None:
        results[1] = _stream(handle, PROMPTS[1], after_chunks=10**6, action=lambda: None)

    thread = threading.Thread(target=other)
    thread.start()
    results[0] = _stream(handle, PROMPTS[0], after_chunks=8, action=drain)
    thread.join(60)
    assert [r[0] for r in results] == expected
    url = handle.base_url
    moved = metric_value(url, "pdserve_migrations_total", reason="drain", result="moved")
    assert moved >= 1  # every stream on the drained worker moved (one or both, as the policy placed them)
    assert all(flow.decode != drained[0] for flow in handle.router.core.flows.values())


def test_a_stream_on_tensor_parallel_decode_workers_moves_exactly(serve):
    """Decode workers of degree 2 (rank threads): each source rank sends its KV heads to the target rank that holds
    them, between its steps; the client's text is the undisturbed run's."""
    pools = _pools()
    pools["decode"] |= {"tensor_parallel_size": 2, "kv_blocks": 96}
    handle = serve(pools=pools)
    expected = _reference(handle, PROMPTS[2])

    def move() -> None:
        [flow] = list(dict.fromkeys(handle.router.core.flows.values()))
        httpx.post(
            f"{handle.base_url}/admin/migrate", json={"request_id": flow.rid}, headers=handle.admin_headers, timeout=10
        )

    text, last = _stream(handle, PROMPTS[2], after_chunks=5, action=move)
    assert text == expected["choices"][0]["text"]
    assert last["timing"]["migrations"] == 1
    url = handle.base_url
    assert metric_value(url, "pdserve_migrations_total", reason="admin", result="moved") == 1
    wait_until(lambda: _total(url, "migrations_out") == 1, timeout_s=10)
    assert _total(url, "migrations_in") == 1
