"""Workers send text and the router only relays it: through HTTP, in both modes, the text a client gets (streamed or
not) is the engine's ``generate()`` text, multi-byte characters and stop strings across deltas included; a client
that reads slowly gets fewer, larger chunks while its stream holds one pending buffer; the router detokenizes
nothing.

In-process clusters (the real router, API, workers and transfer, as threads), so the router's stream objects can be
looked at while a request runs."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from cluster.routing.errors import RequestFailed
from cluster.routing.flow import Flow
from cluster.run.launch import start_serving
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import FinishReason, SamplingParams
from tests.helpers.cluster import metric_value, tiny_cluster_config, wait_all_kv_free
from worker.messages import TokenItem

pytestmark = pytest.mark.timeout(300)

# a long model name makes every SSE chunk ~3 KB, so a slow reader's socket buffers fill after a few dozen chunks
MODEL_NAME = "tiny-" + "m" * 3000
SLOW_TOKENS = 240


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def handle(request, tiny_llama_path):
    config = tiny_cluster_config(tiny_llama_path, request.param, router={"port": 0, "served_model_name": MODEL_NAME})
    handle = start_serving(config, in_process=True)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    return LLMEngine(EngineConfig(model=str(tiny_llama_path), kv_blocks=256))


def _reference(engine, prompt: list[int], max_tokens: int, stop: list[str] | None = None):
    [result] = engine.generate(
        [prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=list(stop or []))
    )
    return result


def _body(prompt: list[int], max_tokens: int, stop: list[str] | None = None, stream: bool = False) -> dict:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stop:
        body["stop"] = stop
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _sse(text: str) -> list[dict]:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text[: -len("data: [DONE]\n\n")].split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    return [json.loads(e[len("data: ") :]) for e in events]


def _streamed(handle, body: dict) -> tuple[str, str, int, int]:
    """(text, finish_reason, text chunks, completion_tokens) of a streamed completion."""
    response = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    chunks = _sse(response.text)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    [finish] = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return "".join(texts), finish, len(texts), chunks[-1]["usage"]["completion_tokens"]


def _whole(handle, body: dict) -> tuple[str, str, int]:
    response = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["text"], data["choices"][0]["finish_reason"], data["usage"]["completion_tokens"]


def _stop_in(text: str) -> str:
    """2 or 3 characters (so several tokens of the byte-level model), none a control character or U+FFFD, from the
    second half of ``text`` when it has them."""
    starts = list(range(len(text) // 2, len(text))) + list(range(len(text) // 2))
    for size in (3, 2):
        for start in starts:
            stop = text[start : start + size]
            if len(stop) == size and all(" " <= c != "\ufffd" for c in stop) and stop.strip() == stop:
                return stop
    raise AssertionError(f"no stop string candidate in {text!r}")


def test_streamed_and_whole_text_equal_the_engines(handle, engine):
    tokenizer = engine.tokenizer
    wide = 0
    for words in ("x", "hello there", "The quick brown fox"):
        prompt = tokenizer(words, add_special_tokens=True).input_ids
        expected = _reference(engine, prompt, 64)
        wide += sum(1 for c in expected.text if ord(c) > 127 and c != "\ufffd")  # characters over several tokens
        for stop in (None, [_stop_in(expected.text)]):
            want = _reference(engine, prompt, 64, stop) if stop else expected
            if stop:  # cut where the stop string starts, which spans tokens (and so deltas)
                assert want.finish_reason == "stop" and want.text == expected.text[: expected.text.find(stop[0])]
            streamed = _streamed(handle, _body(prompt, 64, stop, stream=True))
            assert streamed[:2] == (want.text, want.finish_reason)
            assert streamed[3] == len(want.token_ids)
            assert _whole(handle, _body(prompt, 64, stop)) == (want.text, want.finish_reason, len(want.token_ids))
    assert wide >= 2
    wait_all_kv_free(handle.base_url)
    assert metric_value(handle.base_url, "pdserve_router_detokenize_seconds_total") == 0.0


def _raw_request(base_url: str, body: dict) -> socket.socket:
    """An HTTP/1.0 POST on a socket with a small receive buffer (the body then ends when the server closes)."""
    url = urlsplit(base_url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    sock.connect((url.hostname, url.port))
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.0\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    return sock


def _body_of(raw: bytes) -> str:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0], head
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = bytearray(), body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            out += rest[:n]
            rest = rest[n + 2 :]
        body = bytes(out)
    return body.decode()


def test_a_slow_reader_gets_fewer_larger_chunks_and_its_stream_one_buffer(handle, engine):
    prompt = engine.tokenizer("hello there", add_special_tokens=True).input_ids
    expected = _reference(engine, prompt, SLOW_TOKENS)
    for server in handle.server.servers:  # accepted sockets inherit it: the server's kernel buffer stays small
        for listener in server.sockets:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock = _raw_request(handle.base_url, _body(prompt, SLOW_TOKENS, stream=True))
    try:
        raw = bytearray(sock.recv(1024))  # the response has started; now stop reading while the tokens come
        deadline = time.monotonic() + 120
        most_pending, stream = 0, None
        while time.monotonic() < deadline:
            streams = list(handle.router.flows.values())
            if streams:
                [stream] = streams
                assert isinstance(stream, Flow) and not hasattr(stream, "queue")
                assert type(stream.pending_text) is bytearray  # one buffer, whatever it holds
                assert len(stream.pending_text) <= len(expected.text.encode())
                most_pending = max(most_pending, stream.pending_tokens)
                if stream.closed:
                    break
            time.sleep(0.01)
        assert stream is not None and stream.closed and stream.pending_finish == "length"
        assert stream.pending_tokens > SLOW_TOKENS // 2  # most of the output waits in that one buffer
        while chunk := sock.recv(65536):  # now read everything
            raw += chunk
    finally:
        sock.close()
    chunks = _sse(_body_of(bytes(raw)))
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert "".join(texts) == expected.text
    assert len(texts) < SLOW_TOKENS // 2  # coalesced: far fewer chunks than tokens
    assert max(len(t) for t in texts) > SLOW_TOKENS // 4
    assert chunks[-1]["usage"]["completion_tokens"] == SLOW_TOKENS
    assert most_pending >= stream.pending_tokens
    wait_all_kv_free(handle.base_url)
    assert metric_value(handle.base_url, "pdserve_router_detokenize_seconds_total") == 0.0


def _flow(rid: str) -> Flow:
    return Flow(rid, [1, 2, 3], SamplingParams(), [], started_s=0.0, deadline_s=60.0)


def test_an_error_comes_after_the_text_before_it_and_ends_the_stream():
    flow = _flow("r")
    assert flow.push(TokenItem("r", [1], "héllo"), 0.1) and flow.push(TokenItem("r", [2, 3], " wörld"), 0.2)
    flow.fail(RequestFailed("worker died", "worker_died", 503))
    assert not flow.push(TokenItem("r", [4], "late"), 0.3)  # nothing after an error counts
    assert not flow.push(TokenItem("r", [], "", FinishReason.LENGTH), 0.3)
    event = flow.take()
    assert (event.text, event.num_tokens, event.finish_reason) == ("héllo wörld", 3, None)
    assert flow.take() is None and flow.error.code == "worker_died"
    finished = _flow("f")
    finished.push(TokenItem("f", [1], "a", FinishReason.STOP), 0.1)
    finished.fail(RequestFailed("too late", "worker_died", 503))  # a finish already came: it stands
    event = finished.take()
    assert (event.text, event.finish_reason) == ("a", "stop") and finished.error is None
