"""Validation at the edge: every bad body is a 400/413 with an OpenAI error naming the field, never a 500.

One in-process cluster (the real router, API and workers as threads) takes a table of hostile or merely odd
requests; after all of them the same greedy request still answers exactly as before and no KV is held. Then the
network-exposure rules (no non-loopback bind without an API key; /metrics and /status behind the key), and a
non-streaming request whose client goes away is aborted on every worker.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import yaml

from cli.main import main as cli_main
from cluster.config import ConfigError, parse_config
from cluster.network_exposure import check_network_exposure
from cluster.run.launch import start_serving
from tests.helpers.cluster import metric_value, tiny_cluster_config, wait_all_kv_free

pytestmark = pytest.mark.timeout(240)

GREEDY = {"prompt": "the edge holds", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    handle = start_serving(tiny_cluster_config(tiny_llama_path), in_process=True)
    handle.vocab = len(_tokenizer(tiny_llama_path))
    handle.baseline = _post(handle, "/v1/completions", GREEDY).json()["choices"][0]["text"]
    try:
        yield handle
        wait_all_kv_free(handle.base_url)
    finally:
        handle.stop()


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _post(handle, path: str, body: dict | bytes, **kwargs) -> httpx.Response:
    if isinstance(body, dict):
        body = json.dumps({"model": handle.config.served_model_name, **body}).encode()
    kwargs.setdefault("timeout", 60)
    return httpx.post(
        f"{handle.base_url}{path}",
        content=body,
        headers={"content-type": "application/json", **kwargs.pop("headers", {})},
        **kwargs,
    )


def _raw(text: str) -> callable:
    """A body that json.dumps cannot write (NaN literals, huge integers); MODEL becomes the served name."""
    return lambda handle: text.replace("MODEL", json.dumps(handle.config.served_model_name)).encode()


def _deep(depth: int, key: str | None) -> callable:
    nest = "[" * depth + "]" * depth
    if key is None:
        return lambda handle: nest.encode()
    return lambda handle: f'{{"model": "m", "prompt": "x", "{key}": {nest}}}'.encode()


def _chat(messages) -> dict:
    return {"messages": messages, "max_tokens": 2}


def _parts(count: int, text: str = "a") -> list[dict]:
    return [{"type": "text", "text": text} for _ in range(count)]


USER = [{"role": "user", "content": "x"}]


C, CHAT = "/v1/completions", "/v1/chat/completions"
# id, route, body (dict merged with the model; or handle -> dict/bytes), status, the error's `param`
CASES = [
    ("seed-2**64", C, {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("seed-below-int64", C, {"prompt": "x", "seed": -(2**63) - 1}, 400, "seed"),
    ("max_tokens-1e30", C, {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    (
        "max_tokens-5000-digits",
        C,
        _raw('{"model": MODEL, "prompt": "x", "max_tokens": %s}' % ("9" * 5000)),
        400,
        "max_tokens",
    ),
    ("max_tokens-0", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (
        "max_completion_tokens-2**64",
        CHAT,
        {**_chat([{"role": "user", "content": "x"}]), "max_completion_tokens": 2**64},
        400,
        "max_completion_tokens",
    ),
    ("NaN-literal", C, _raw('{"model": MODEL, "prompt": "x", "temperature": NaN}'), 400, "temperature"),
    ("Infinity-literal", C, _raw('{"model": MODEL, "prompt": "x", "top_p": Infinity}'), 400, "top_p"),
    (
        "-Infinity-literal",
        C,
        _raw('{"model": MODEL, "prompt": "x", "presence_penalty": -Infinity}'),
        400,
        "presence_penalty",
    ),
    ("NaN-in-a-list", C, _raw('{"model": MODEL, "prompt": "x", "stop_token_ids": [1, NaN]}'), 400, "stop_token_ids[1]"),
    ("temperature-1e309", C, _raw('{"model": MODEL, "prompt": "x", "temperature": 1e309}'), 400, "temperature"),
    ("temperature-negative", C, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("stop_token_id-vocab", C, lambda h: {"prompt": "x", "stop_token_ids": [1, h.vocab]}, 400, "stop_token_ids[1]"),
    ("stop_token_id-negative", C, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids[0]"),
    ("stop_token_ids-too-many", C, {"prompt": "x", "stop_token_ids": list(range(65))}, 400, "stop_token_ids"),
    ("prompt-id-vocab", C, lambda h: {"prompt": [5, h.vocab]}, 400, "prompt[1]"),
    ("prompt-id-2**64", C, {"prompt": [5, 2**64]}, 400, "prompt[1]"),
    ("top_k-huge", C, {"prompt": "x", "top_k": 10**12}, 400, "top_k"),
    ("top_k-vocab+1", C, lambda h: {"prompt": "x", "top_k": h.vocab + 1}, 400, "top_k"),
    ("top_k--2", C, {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("n-huge", C, {"prompt": "x", "n": 10**30}, 400, "n"),
    ("stop-too-many", C, {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("stop-too-long", C, {"prompt": "x", "stop": ["ok", "z" * 257]}, 400, "stop[1]"),
    ("stop-string-too-long", C, {"prompt": "x", "stop": "z" * 257}, 400, "stop"),
    ("logit_bias-too-many", C, {"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    ("messages-too-many", CHAT, _chat([{"role": "user", "content": "x"}] * 1025), 400, "messages"),
    (
        "content-parts-too-many",
        CHAT,
        _chat([{"role": "user", "content": "x"}] * 3 + [{"role": "user", "content": _parts(257)}]),
        400,
        "messages[3].content",
    ),
    ("deep-nesting-100k", C, _deep(100_000, None), 400, None),
    ("deep-nesting-in-a-field", C, _deep(100_000, "logprobs"), 400, "logprobs"),
    ("stream-as-string", C, {"prompt": "x", "stream": "true"}, 400, "stream"),
    ("ignore_eos-as-string", C, {"prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("echo-as-int", C, {"prompt": "x", "echo": 0}, 400, "echo"),
    (
        "include_usage-as-int",
        C,
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
        400,
        "stream_options.include_usage",
    ),
    ("prompt-lone-surrogate", C, _raw('{"model": MODEL, "prompt": "a\\ud800b"}'), 400, "prompt"),
    ("stop-lone-surrogate", C, _raw('{"model": MODEL, "prompt": "x", "stop": ["\\udfff"]}'), 400, "stop[0]"),
    (
        "chat-content-lone-surrogate",
        CHAT,
        _raw('{"model": MODEL, "messages": [{"role": "user", "content": "\\ud800"}]}'),
        400,
        "messages[0].content",
    ),
    (
        "huge-int-in-any-field",
        C,
        _raw('{"model": MODEL, "prompt": "x", "logprobs": %s}' % ("7" * 5000)),
        400,
        "logprobs",
    ),
    (
        "bad-field-in-a-message",
        CHAT,
        _chat([{"role": "user", "content": "x"}, {"role": "user", "content": 5}]),
        400,
        "messages[1].content",
    ),
    # supported fields, out of their range or against the model
    ("logit_bias-not-a-token-id", C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias.abc"),
    ("logit_bias-value-over-100", C, {"prompt": "x", "logit_bias": {"5": 100.5}}, 400, "logit_bias.5"),
    ("top_logprobs-21", CHAT, {**_chat(USER), "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("top_logprobs-without-logprobs", CHAT, {**_chat(USER), "top_logprobs": 2}, 400, "top_logprobs"),
    ("logprobs-as-int-in-chat", CHAT, {**_chat(USER), "logprobs": 1}, 400, "logprobs"),
    ("completion-logprobs-6", C, {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("best_of-not-n", C, {"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of"),
    ("n-0", C, {"prompt": "x", "n": 0}, 400, "n"),
    ("choices-over-the-cap", C, {"prompt": ["a"] * 3, "n": 100}, 400, "prompt"),
    ("prompt-list-mixed", C, {"prompt": ["a", [1, 2]]}, 400, "prompt[1]"),
    ("prompt-list-empty-item", C, {"prompt": ["a", ""]}, 400, "prompt[1]"),
    ("prompt-ids-in-a-list-past-the-vocab", C, lambda h: {"prompt": [[1], [2, h.vocab]]}, 400, "prompt[1][1]"),
    ("min_tokens-over-max_tokens", C, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ("min_p-over-1", C, {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("presence_penalty-over-2", C, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("repetition_penalty-0", C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (
        "image-part",
        CHAT,
        _chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]),
        400,
        "messages[0].content[0]",
    ),
    ("tool-message-without-call-id", CHAT, _chat([{"role": "tool", "content": "r"}]), 400, "messages[0].tool_call_id"),
    ("user-without-content", CHAT, _chat([{"role": "user", "content": None}]), 400, "messages[0].content"),
    (
        "assistant-refusal",
        CHAT,
        _chat(USER + [{"role": "assistant", "content": "a", "refusal": "no"}]),
        400,
        "messages[1].refusal",
    ),
    (
        "continue-and-generation-prompt",
        CHAT,
        {
            **_chat(USER + [{"role": "assistant", "content": "a"}]),
            "continue_final_message": True,
            "add_generation_prompt": True,
        },
        400,
        "continue_final_message",
    ),
    ("continue-a-user-message", CHAT, {**_chat(USER), "continue_final_message": True}, 400, "continue_final_message"),
    (
        "chat_template_kwargs-tokenize",
        CHAT,
        {**_chat(USER), "chat_template_kwargs": {"tokenize": False}},
        400,
        "chat_template_kwargs.tokenize",
    ),
    (
        "response_format-bad-type",
        CHAT,
        {**_chat(USER), "response_format": {"type": "yaml"}},
        400,
        "response_format.type",
    ),
    (
        "tool_choice-unknown-function",
        CHAT,
        {
            **_chat(USER),
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice.function.name",
    ),
    # fields of the OpenAI API this server refuses unless neutral
    ("functions", CHAT, {**_chat(USER), "functions": [{"name": "f"}]}, 400, "functions"),
    ("function_call", CHAT, {**_chat(USER), "function_call": "auto"}, 400, "function_call"),
    ("store-true", CHAT, {**_chat(USER), "store": True}, 400, "store"),
    ("audio", CHAT, {**_chat(USER), "audio": {"voice": "alloy"}}, 400, "audio"),
    ("modalities-audio", CHAT, {**_chat(USER), "modalities": ["text", "audio"]}, 400, "modalities"),
    ("suffix", C, {"prompt": "x", "suffix": "end"}, 400, "suffix"),
    (
        "include_obfuscation",
        C,
        {"prompt": "x", "stream": True, "stream_options": {"include_obfuscation": True}},
        400,
        "stream_options.include_obfuscation",
    ),
    ("echo-in-chat", CHAT, {**_chat(USER), "echo": True}, 400, "echo"),
    ("chat_template-field", CHAT, {**_chat(USER), "chat_template": "{{ x }}"}, 400, "chat_template"),
]


@pytest.mark.parametrize("route, body, status, param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_an_openai_error_naming_the_field(server, route, body, status, param):
    if callable(body):
        body = body(server)
    counted = metric_value(server.base_url, "pdserve_http_errors_total", status=str(status)) or 0
    response = _post(server, route, body)
    assert response.status_code == status, response.text[:300]
    # counted by status and type, for the dashboard's "errors by code"
    assert metric_value(server.base_url, "pdserve_http_errors_total", status=str(status)) == counted + 1
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"] and len(error["message"]) < 1000


def test_a_chunked_body_over_the_limit_is_413_before_it_even_ends(server):
    """No Content-Length: only counting while reading can refuse this body, which never ends."""
    limit = server.config.router.max_body_bytes
    url = httpx.URL(server.base_url)
    with socket.create_connection((url.host, url.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        piece, sent = b"x" * 65536, 0
        while sent <= limit + len(piece):
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
        reply = b""
        while b"\r\n\r\n" not in reply:  # the answer comes while the body is still "arriving"
            chunk = sock.recv(65536)
            assert chunk, reply
            reply += chunk
        head, body = reply.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        length = int(next(line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 413")
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and str(limit) in error["message"]
    assert _post(server, C, GREEDY).status_code == 200  # and the server goes on as usual


def test_nesting_is_capped_at_the_configured_depth(server):
    depth = server.config.router.limits.max_json_depth
    at_cap = _deep(depth - 1, "logprobs")(server)  # the object itself is one level
    over = _deep(depth, "logprobs")(server)
    assert "nest" not in _post(server, C, at_cap).json()["error"]["message"]  # refused for what it says, not depth
    error = _post(server, C, over).json()["error"]
    assert "nest" in error["message"] and error["param"] == "logprobs"


def test_extremes_that_are_valid_are_served(server):
    for extra in (
        {"seed": 2**63 - 1, "temperature": 0.7},
        {"seed": -(2**63), "temperature": 0.7},
        {"top_k": server.vocab, "temperature": 0.7},
        {"top_k": -1},
        {"stop_token_ids": [server.vocab - 1]},
        {"stop": [f"q{i}" for i in range(16)]},
        {"stop": "z" * 256},
        {"n": 2, "best_of": 2, "temperature": 0.7},
        {"logit_bias": {"0": -100, str(server.vocab - 1): 100}},
        {"suffix": "", "echo": False, "best_of": 1},
    ):
        response = _post(server, C, {"prompt": "x", "max_tokens": 3, **extra})
        assert response.status_code == 200, (extra, response.text[:300])
    parts = _chat([{"role": "user", "content": _parts(256, "")}])  # joined by "\n": 255 tokens
    assert _post(server, CHAT, parts).status_code == 200
    neutral = {**_chat(USER), "store": False, "metadata": {}, "service_tier": "auto", "modalities": ["text"]}
    assert _post(server, CHAT, neutral).status_code == 200


def test_a_logit_bias_key_past_the_vocabulary_is_refused_by_its_name(server):
    key = str(server.vocab)
    response = _post(server, C, {"prompt": "x", "logit_bias": {"1": 2, key: 1}})
    assert response.status_code == 400 and response.json()["error"]["param"] == f"logit_bias.{key}"


def test_unknown_routes_and_methods_get_an_openai_error(server):
    for response, status in (
        (httpx.get(f"{server.base_url}/v1/nope"), 404),
        (httpx.get(f"{server.base_url}/v1/completions"), 405),
    ):
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_non_streaming_request_is_cancelled_when_its_client_goes_away(server):
    decode = next(r.actor.worker for r in server.workers if r.role == "decode")
    engine = decode.engine
    step = engine.step
    steps = []

    def slow_step():
        steps.append(time.monotonic())
        time.sleep(0.02)  # 400 tokens take ~8 s: the client leaves long before
        return step()

    engine.step = slow_step
    try:
        before = metric_value(server.base_url, "pdserve_errors_total", reason="client_disconnected") or 0
        body = {"prompt": "abc " * 20, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            _post(server, C, body, timeout=httpx.Timeout(10, read=1.5))
        gone = time.monotonic()
        assert len(steps) > 10  # the decode worker was generating when the client left
        wait_all_kv_free(server.base_url, timeout_s=1.5)
        assert time.monotonic() - gone < 1.5 and not server.router.flows
        assert metric_value(server.base_url, "pdserve_errors_total", reason="client_disconnected") == before + 1
        assert len(steps) < 200  # it stopped: nowhere near the 400 steps the request asked for
    finally:
        del engine.step


def test_a_streaming_request_whose_client_leaves_before_the_first_token_is_aborted(server):
    prefill = next(r.actor.worker for r in server.workers if r.role == "prefill")
    engine = prefill.engine
    step = engine.step

    def slow_step():
        time.sleep(2.0)  # the first token is far away when the client gives up
        return step()

    engine.step = slow_step
    try:
        body = {"prompt": "abc " * 20, "max_tokens": 50, "temperature": 0, "stream": True}
        with pytest.raises(httpx.ReadTimeout):
            _post(server, C, body, timeout=httpx.Timeout(10, read=0.5))
        gone = time.monotonic()
        while server.router.flows and time.monotonic() - gone < 1.0:
            time.sleep(0.02)
        assert not server.router.flows  # the router let go at once, without waiting for a token
    finally:
        del engine.step
    wait_all_kv_free(server.base_url, timeout_s=5)  # and both workers freed it (prefill after its slow step)


def test_after_every_refusal_the_same_greedy_request_answers_the_same(server):
    response = _post(server, C, GREEDY)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == server.baseline
    wait_all_kv_free(server.base_url)


# ---- exposure: binds and the API key -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "router, ray, field",
    [
        ({"host": "0.0.0.0"}, {}, "router.host"),
        ({"host": "::"}, {}, "router.host"),
        ({"host": "10.1.2.3"}, {}, "router.host"),
        ({"host": "example.com"}, {}, "router.host"),
        ({}, {"worker_host": "auto"}, "ray.worker_host"),
        ({}, {"worker_host": "0.0.0.0"}, "ray.worker_host"),
        ({"host": "127.0.0.1"}, {}, None),
        ({"host": "localhost"}, {"worker_host": "::1"}, None),
        ({"host": "0.0.0.0", "api_key": "k"}, {"worker_host": "auto"}, None),
        ({"host": "0.0.0.0", "allow_unauthenticated": True}, {"worker_host": "auto"}, None),
    ],
)
def test_a_non_loopback_bind_needs_an_api_key(router, ray, field):
    config = parse_config({"router": router, "ray": ray})
    if field is None:
        check_network_exposure(config)
        return
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as info:
        check_network_exposure(config)
    assert "api_key" in str(info.value) and "allow_unauthenticated" in str(info.value)


def test_start_serving_refuses_an_exposed_bind_before_starting_anything(tiny_llama_path):
    with pytest.raises(ConfigError, match=r"router\.host"):
        start_serving(tiny_cluster_config(tiny_llama_path, router={"host": "0.0.0.0"}), in_process=True)
    with pytest.raises(ConfigError, match=r"router\.host"):
        start_serving(tiny_cluster_config(tiny_llama_path), host="0.0.0.0", in_process=True)
    with pytest.raises(ConfigError, match=r"ray\.worker_host"):
        start_serving(tiny_cluster_config(tiny_llama_path, ray={"worker_host": "0.0.0.0"}), in_process=True)


def test_serve_host_flag_is_checked_on_the_final_config(tmp_path, tiny_llama_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": str(tiny_llama_path)}}))
    assert cli_main(["serve", "--config", str(path), "--host", "0.0.0.0"]) == 2
    assert "router.host" in capsys.readouterr().err


@pytest.fixture
def keyed_server(tiny_llama_path):
    handle = start_serving(tiny_cluster_config(tiny_llama_path, router={"api_key": "s3cret"}), in_process=True)
    try:
        yield handle
        wait_all_kv_free(handle.base_url, api_key="s3cret")
    finally:
        handle.stop()


def test_metrics_and_status_follow_the_api_key_and_health_stays_open(keyed_server, capsys, monkeypatch):
    url = keyed_server.base_url
    for path in ("/metrics", "/status"):
        refused = httpx.get(f"{url}{path}", timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(f"{url}{path}", headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.status_code == 401
        assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer s3cret"}, timeout=10).status_code == 200
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert cli_main(["status", "--url", url]) == 2
    assert "401" in capsys.readouterr().err
    assert cli_main(["status", "--url", url, "--api-key", "s3cret"]) == 0
    assert "decode-0" in capsys.readouterr().out
    monkeypatch.setenv("PDSERVE_API_KEY", "s3cret")
    assert cli_main(["status", "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == "disaggregated"


def test_loopback_only_by_default(tiny_llama_path):
    """The default config serves loopback only, so it starts without a key (and nothing else can reach it)."""
    config = tiny_cluster_config(tiny_llama_path)
    check_network_exposure(config)
    assert config.router.host == "127.0.0.1" and not config.router.allow_unauthenticated
