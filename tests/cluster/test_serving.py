"""Through HTTP, in both modes: greedy output equals transformers, SSE framing is exact, usage is right, nothing leaks."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from cluster.run.launch import start_serving
from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free
from tests.helpers.engine import Reference, random_prompts

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def server(request, ray_local, tiny_llama_path):
    handle = start_serving(tiny_cluster_config(tiny_llama_path, request.param))
    yield handle
    handle.stop()


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "server" in request.fixturenames:
        wait_all_kv_free(request.getfixturevalue("server").base_url)


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    return Reference(tiny_llama_path)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_path)


def _model(server) -> str:
    return server.config.served_model_name


def _sse_events(text: str) -> list[str]:
    """Split an SSE body; every event must be exactly one 'data: ...' line followed by a blank line."""
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [e[len("data: ") :] for e in events]


def test_completions_match_transformers(server, reference, tokenizer):
    for prompt in random_prompts(3, 5, 120, seed=21):
        expected = reference.greedy(prompt, 10)
        body = {"model": _model(server), "prompt": prompt, "max_tokens": 10, "temperature": 0}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        data = response.json()
        assert data["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert data["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(expected),
            "total_tokens": len(prompt) + len(expected),
            "prompt_tokens_details": {"cached_tokens": data["usage"]["prompt_tokens_details"]["cached_tokens"]},
        }
        assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
        assert data["timing"]["ttft_s"] > 0


def test_streamed_chat_matches_transformers_and_is_framed_exactly(server, reference, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+2?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    expected = reference.greedy(prompt, 12)
    body = {
        "model": _model(server),
        "messages": messages,
        "max_completion_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == tokenizer.decode(expected, skip_special_tokens=True)
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] in ("stop", "length")
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(expected),
        "total_tokens": len(prompt) + len(expected),
        "prompt_tokens_details": {"cached_tokens": usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"]},
    }
    assert all(c["usage"] is None for c in chunks[:-1])


def test_streamed_completion_without_usage_option(server):
    body = {"model": _model(server), "prompt": "abc", "max_tokens": 5, "stream": True, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    events = _sse_events(response.text)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_32_concurrent_streams_complete_with_correct_usage(server):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, dict]:
        body = {
            "model": _model(server),
            "prompt": f"request number {i} " * (1 + i % 5),
            "max_tokens": 6 + i % 4,
            "temperature": 0.8,
            "seed": i,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            text = "".join([part async for part in response.aiter_text()])
        events = _sse_events(text)
        assert events[-1] == "[DONE]"
        return i, json.loads(events[-2])["usage"]

    async def run_all():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    for i, usage in asyncio.run(run_all()):
        assert usage["completion_tokens"] == 6 + i % 4


def test_models_health_metrics(server):
    models = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == _model(server)
    assert httpx.get(f"{server.base_url}/health", timeout=10).json()["status"] == "ok"
    httpx.post(
        f"{server.base_url}/v1/completions", json={"model": _model(server), "prompt": "x", "max_tokens": 2}, timeout=60
    )
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    for name in (
        "pdserve_ttft_seconds_bucket",
        "pdserve_e2e_seconds_count",
        "pdserve_router_queue_depth",
        'pdserve_worker{key="free_blocks"',
        "pdserve_requests_total",
    ):
        assert name.split("{")[0] in metrics
    if server.config.mode == "disaggregated":
        assert 'key="transfer_bytes"' in metrics


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": "x"}, 400, "model"),
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"prompt": "x", "n": 129}, 400, "n"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"prompt": "x", "frobnicate": True}, 400, "frobnicate"),
        ({"prompt": "y" * 600}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, param):
    body = {"model": _model(server), **body} if "model" not in body and param != "model" else body
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert error["param"] == param or param in error["message"]


def test_malformed_json_and_bad_chat_role(server):
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        content=b"{not json",
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    body = {"model": _model(server), "messages": [{"role": "wizard", "content": "hi"}]}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and "role" in response.json()["error"]["param"]
