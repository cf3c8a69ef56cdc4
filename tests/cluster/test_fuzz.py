"""Property-based fuzzing of the OpenAI API: no body, however odd or hostile, hurts the server or the next request.

Hypothesis builds bodies from the real OpenAI fields with odd values (ints past int64, 1e-40, -0.0, NaN and Infinity
literals, wrong types, unicode junk, huge lists, nested junk, unknown fields, odd roles and content parts) and raw
invalid bodies (truncated JSON, bytes that are not UTF-8, deep nesting, a chunked body over the size limit). Each
answer must be a well-formed 200 (JSON with choices and usage, or an SSE stream ending in ``[DONE]`` with no error
event) or a 4xx with an OpenAI error body; never a 5xx, never a hang. A body built only from valid values must be
served (200), and a 400 caused by one odd field must name that field. After every generated request a fixed greedy
request must return exactly the text it returned at the start, so a request that poisons the workers (issue 9: one
``temperature: 1e-40`` broke every later request) fails the very example that did it. At the end nothing is held.

Deterministic (``derandomize``), no example database, no shrinking: a failing example is reported as generated
(shrinking would replay variants against a cluster the example may already have broken).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from cluster.run.launch import start_serving
from engine.model_loader import load_tokenizer
from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free

pytestmark = pytest.mark.timeout(300)

CLIENT_TIMEOUT_S = 30.0  # no answer in this long is a hang
FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
REFERENCE = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


class Raw(str):
    """A literal written into the JSON text as is (NaN, Infinity, 1e400, a 5000-digit integer...)."""


@dataclass(frozen=True)
class Case:
    endpoint: str  # "completions" | "chat/completions"
    body: bytes
    expect: str  # "ok": must be 200; "error": must be 4xx; "any": 200 or 4xx
    field: str | None = None  # the one odd field: a 400 must name it
    chunked: bool = False

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        shown = self.body if len(self.body) < 600 else self.body[:300] + b"..." + self.body[-100:]
        return f"Case({self.endpoint}, expect={self.expect}, field={self.field}, {len(self.body)} bytes: {shown!r})"


def encode(body: object, ascii_only: bool = True) -> bytes:
    """JSON text of ``body`` with ``Raw`` values spliced in as literals; non-ASCII text may go out as raw bytes
    (lone surrogates then become bytes that are not UTF-8)."""
    raws: list[str] = []

    def mark(value: object) -> object:
        if isinstance(value, Raw):
            raws.append(str(value))
            return f"RAW-LITERAL-{len(raws) - 1}-END"
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    text = json.dumps(mark(body), ensure_ascii=ascii_only)
    for index, literal in enumerate(raws):
        text = text.replace(f'"RAW-LITERAL-{index}-END"', literal, 1)
    return text.encode("utf-8", "surrogatepass")


def has_raw(value: object) -> bool:
    """A literal or a non-finite float: a server may refuse it while parsing, before it knows the field."""
    if isinstance(value, Raw) or (isinstance(value, float) and not math.isfinite(value)):
        return True
    if isinstance(value, dict):
        return any(has_raw(v) for v in value.values())
    return isinstance(value, list) and any(has_raw(v) for v in value)


# ---- values ------------------------------------------------------------------------------------------------------

INT_EDGES = [
    0,
    -1,
    -2,
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    2**64 + 1,
    -(2**63),
    -(2**63) - 1,
    10**30,
    -(10**30),
]
NUMBER_LITERALS = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "-1e400",
    "1e-400",
    "-0",
    "-0.0",
    "0e0",
    "1E-40",
    "5e-324",
    "1.7976931348623157e308",
    "1" * 5000,
    "-" + "9" * 4400,
]
TEXT_EDGES = [
    "",
    " ",
    "\x00",
    "\ud800",
    "\udfff\ud800x",
    "\u202e\u202d",
    "\ufeff",
    "\U0001f4a5" * 8,
    "\r\n\r\n",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>user\n",
    "data: [DONE]\n\n",
    "{}",
    "null",
    "\\u0000",
    "é" * 40,
]

odd_ints = st.one_of(
    st.sampled_from(INT_EDGES),
    st.integers(),
    st.integers(min_value=2**64, max_value=2**256),
    st.integers(max_value=-(2**63) - 1, min_value=-(2**256)),
)
odd_floats = st.one_of(
    st.floats(),
    st.sampled_from([1e-40, -0.0, 5e-324, 1e308, -1e308, 1e-5, 1e-6, -1e-40]),
    st.sampled_from(NUMBER_LITERALS).map(Raw),
)
any_text = st.one_of(
    st.text(max_size=24), st.text(st.characters(exclude_categories=()), max_size=12), st.sampled_from(TEXT_EDGES)
)
scalars = st.one_of(st.none(), st.booleans(), odd_ints, odd_floats, any_text)
junk = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4), max_leaves=10
)
deep_list = st.integers(min_value=20, max_value=200).map(lambda n: json.loads("[" * n + "1" + "]" * n))


def wrong(*extra: st.SearchStrategy) -> st.SearchStrategy:
    """Any value at all, biased towards the edges; ``extra`` adds field-specific odd values."""
    return st.one_of(*extra, scalars, junk, st.lists(junk, max_size=3))


def huge_list(item: object, n: int = 100_000) -> st.SearchStrategy:
    return st.just([item] * n)


def field_strategies(model: str, vocab: int, chat: bool) -> dict[str, tuple[st.SearchStrategy, st.SearchStrategy]]:
    """Field name -> (valid values, odd values). Valid means any OpenAI server must serve it."""
    ok_tokens = st.integers(1, 6)
    text = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=24)
    stop_text = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=8)
    fields = {
        "model": (st.just(model), wrong(st.just(model.upper()), st.just(model + " "), st.just(""))),
        "max_tokens": (ok_tokens, wrong(st.sampled_from([0, -1, 10**6, 513, 2**31 - 1, 6.0, 6.5, "6"]))),
        "temperature": (
            st.one_of(st.sampled_from([0, 1e-40, 5e-324, 1e-6, 1e-5, 2]), st.floats(0, 2)),
            wrong(st.floats(max_value=-1e-300), st.floats(min_value=2.01), st.just("hot")),
        ),
        "top_p": (
            st.one_of(st.sampled_from([1, 0.05, 1 - 1e-9]), st.floats(0.05, 1.0)),
            wrong(st.sampled_from([0, 1e-40, 1.0000001, -0.5, 100])),
        ),
        "top_k": (
            st.one_of(st.sampled_from([-1, 0]), st.integers(1, 50)),
            wrong(st.sampled_from([vocab, vocab + 1, -2, 2**63, 3.5])),
        ),
        "seed": (
            st.one_of(st.sampled_from([0, 2**32, 2**63 - 1]), st.integers(0, 2**63 - 1)),
            wrong(st.floats(), st.integers(min_value=2**63)),
        ),
        "stop": (
            st.one_of(stop_text, st.lists(stop_text, min_size=1, max_size=4)),
            wrong(
                st.sampled_from(["", [""], [], ["x" * 100_000]]),
                huge_list("ab", 20_000),
                st.lists(any_text, max_size=6),
            ),
        ),
        "stop_token_ids": (
            st.lists(st.integers(0, vocab - 1), max_size=4),
            wrong(st.lists(odd_ints, min_size=1, max_size=4), st.sampled_from([[vocab], [-1]]), huge_list(3)),
        ),
        "ignore_eos": (st.booleans(), wrong(st.sampled_from(["true", "no", 2]))),
        "stream": (st.booleans(), wrong(st.sampled_from(["yes", 1, 0, "false"]))),
        "stream_options": (
            st.fixed_dictionaries({"include_usage": st.booleans()}),
            wrong(st.just({"include_usage": True, "extra": 1})),
        ),
        "user": (text, wrong()),
        "n": (st.just(1), wrong(st.sampled_from([2, 0, -1, 2**64]))),
        "logprobs": (st.none(), wrong(st.sampled_from([True, 5, 2**70]))),
        "presence_penalty": (st.just(0), wrong(st.sampled_from([0.5, -2.5, math.inf]))),
        "logit_bias": (
            st.none(),
            wrong(
                st.dictionaries(st.sampled_from(["1", "-1", "99999999999", "x"]), odd_floats, min_size=1, max_size=3)
            ),
        ),
    }
    if chat:
        part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=16)})
        content = st.one_of(
            st.text(st.characters(exclude_categories=("Cs",)), max_size=24), st.lists(part, min_size=1, max_size=3)
        )
        message = st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": content}
        )
        odd_part = wrong(
            st.just({"type": "image_url", "image_url": {"url": "http://x"}}),
            st.just({"type": "text"}),
            st.fixed_dictionaries({"type": st.just("text"), "text": wrong()}),
        )
        odd_message = st.fixed_dictionaries(
            {
                "role": wrong(st.sampled_from(["tool", "function", "robot", "", "USER", "assistant\x00"])),
                "content": wrong(st.lists(odd_part, max_size=3), st.just("x" * 300_000), any_text),
            },
            optional={"name": wrong(), "tool_calls": wrong()},
        )
        fields["messages"] = (
            st.lists(message, min_size=1, max_size=3),
            wrong(
                st.lists(st.one_of(message, odd_message), min_size=1, max_size=4),
                st.lists(odd_message, min_size=1, max_size=3),
                st.just([]),
                huge_list({"role": "user", "content": "hi"}, 5000),
                deep_list,
            ),
        )
        fields["max_completion_tokens"] = fields["max_tokens"]
    else:
        token_ids = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20)
        fields["prompt"] = (
            st.one_of(text, token_ids, text.map(lambda t: [t])),
            wrong(
                st.sampled_from(["", [], [""], [[1, 2]], [1.5], "x" * 600, "x" * 2_000_000]),
                st.lists(odd_ints, min_size=1, max_size=5),
                st.lists(text, min_size=2, max_size=4),
                huge_list(vocab - 1, 60_000),
                deep_list,
            ),
        )
        fields["echo"] = (st.just(False), wrong(st.just(True)))
        fields["suffix"] = (st.none(), wrong(text))
    return fields


@st.composite
def api_cases(draw, endpoint: str, model: str, vocab: int) -> Case:
    fields = field_strategies(model, vocab, chat=endpoint == "chat/completions")
    main = "messages" if endpoint == "chat/completions" else "prompt"
    budget = st.sampled_from(["max_tokens", "max_completion_tokens"]) if main == "messages" else st.just("max_tokens")
    body = {
        "model": model,
        main: draw(fields[main][0]),
        draw(budget): draw(fields["max_tokens"][0]),
        "stream": draw(fields["stream"][0]),
    }
    optional = sorted(set(fields) - {"model", main, "max_tokens", "max_completion_tokens", "stream"})
    for name in draw(st.lists(st.sampled_from(optional), max_size=8, unique=True)):
        body[name] = draw(fields[name][0])
    if "stream_options" in body:
        body["stream"] = True  # as OpenAI, stream_options without a stream is refused
    # valid bodies reach the workers with edge values; one odd field reaches the validation of that field alone
    num_odd = draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3]))
    odd = draw(
        st.lists(st.sampled_from(sorted(fields) + ["<unknown>"]), min_size=num_odd, max_size=num_odd, unique=True)
    )
    named = None
    for name in odd:
        if name == "<unknown>":
            name = draw(
                st.one_of(st.sampled_from(["tools_x", "Model", "prompt ", "__proto__", "functions_"]), any_text).filter(
                    lambda k: k not in fields
                )
            )
            body[name] = draw(junk)
        else:
            body[name] = draw(fields[name][1])
        named = name
    ascii_only = draw(st.booleans())
    data = encode(body, ascii_only)
    clean_json = not has_raw(body)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        clean_json = False
    expect = "ok" if not odd else "any"
    return Case(endpoint, data, expect, named if len(odd) == 1 and clean_json else None)


@st.composite
def raw_cases(draw, model: str) -> Case:
    endpoint = draw(st.sampled_from(["completions", "chat/completions"]))
    good = {"model": model, "max_tokens": 3}
    if endpoint == "chat/completions":
        good["messages"] = [{"role": "user", "content": "hi"}]
    else:
        good["prompt"] = "hi"
    valid = encode(good)
    kind = draw(st.sampled_from(["truncated", "not_utf8", "deep", "literal", "misc", "chunked_huge"]))
    if kind == "truncated":
        return Case(endpoint, valid[: draw(st.integers(0, len(valid) - 1))], "error")
    if kind == "not_utf8":
        bad = draw(
            st.sampled_from([b"\xff", b"\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xfe\xfe"])
        )
        at = draw(st.integers(0, len(valid)))
        return Case(endpoint, valid[:at] + bad + valid[at:], "error")
    if kind == "deep":
        depth = draw(st.sampled_from([1000, 5000, 100_000]))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        inner = opener * depth + b"1" + closer * depth
        return Case(endpoint, draw(st.sampled_from([inner, valid[:-1] + b', "user": ' + inner + b"}"])), "error")
    if kind == "literal":
        literal = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1" * 5000, "1" * 100_000, "1e999999"]))
        return Case(endpoint, valid[:-1] + f', "temperature": {literal}}}'.encode(), "error")
    if kind == "chunked_huge":
        return Case(endpoint, valid[:-1] + b', "user": "' + b"x" * (2 << 20) + b'"}', "error", chunked=True)
    misc = draw(
        st.sampled_from(
            [
                (b"", "error"),
                (b"null", "error"),
                (b"[]", "error"),
                (b'"x"', "error"),
                (b"\xef\xbb\xbf" + valid, "any"),
                (valid[:-1] + b', "model": "other"}', "error"),
                (valid + b"  \n", "ok"),
                (valid + b"{}", "error"),
            ]
        )
    )
    return Case(endpoint, *misc)


# ---- the cluster and the checks ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_llama_path):
    handle = start_serving(tiny_cluster_config(tiny_llama_path), in_process=True)
    client = httpx.Client(base_url=handle.base_url, timeout=CLIENT_TIMEOUT_S)
    reference = complete_reference(client, handle.config.served_model_name)
    vocab = len(load_tokenizer(str(tiny_llama_path)))
    try:
        yield handle, client, reference, vocab
    finally:
        client.close()
        handle.stop()


def complete_reference(client: httpx.Client, model: str) -> tuple[str, int]:
    response = client.post("/v1/completions", json={"model": model, **REFERENCE})
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


def send(client: httpx.Client, case: Case) -> tuple[int, dict, bytes]:
    content = case.body
    if case.chunked:  # no Content-Length: the size limit must hold while reading
        content = (case.body[i : i + 65536] for i in range(0, len(case.body), 65536))
    try:
        with client.stream(
            "POST", f"/v1/{case.endpoint}", content=content, headers={"content-type": "application/json"}
        ) as response:
            return response.status_code, dict(response.headers), response.read()
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {CLIENT_TIMEOUT_S} s (a hang) for {case!r}")


def check_error_body(raw: bytes, case: Case, status: int) -> None:
    error = json.loads(raw)["error"]
    assert isinstance(error["message"], str) and error["message"], raw
    assert isinstance(error["type"], str) and error["type"], raw
    assert "param" in error and "code" in error, raw
    if status == 400 and case.field is not None:  # one odd field: the refusal names it
        named = re.split(r"[.\[]", error["param"] or "")[0]
        assert named == case.field or case.field in error["message"], (case.field, error)


def check_completion(raw: bytes, headers: dict, chat: bool) -> None:
    if headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in raw.decode("utf-8").split("\n") if line.strip()]
        assert all(line.startswith("data: ") for line in lines), lines[:5]
        assert lines and lines[-1] == "data: [DONE]", lines[-3:]
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert not [c for c in chunks if "error" in c], chunks[-2:]  # an error event is a 5xx in disguise
        finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
        assert finishes and finishes[-1] in ("stop", "length"), chunks[-2:]
        for c in chunks:
            for choice in c["choices"]:
                assert isinstance(choice["delta"] if chat else choice["text"], dict if chat else str)
        return
    body = json.loads(raw)
    (choice,) = body["choices"]
    text = choice["message"]["content"] if chat else choice["text"]
    assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length"), body
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and usage["prompt_tokens"] > 0


def check_case(cluster, case: Case) -> None:
    handle, client, reference, _ = cluster
    status, headers, raw = send(client, case)
    assert status < 500, f"{status} {raw[:300]!r} for {case!r}"
    if case.expect == "ok":
        assert status == 200, f"a valid body was refused: {status} {raw[:300]!r} for {case!r}"
    elif case.expect == "error":
        assert 400 <= status < 500, f"{status} {raw[:300]!r} for {case!r}"
    if status == 200:
        check_completion(raw, headers, chat=case.endpoint == "chat/completions")
    else:
        assert 400 <= status < 500, status
        check_error_body(raw, case, status)
    after = complete_reference(client, handle.config.served_model_name)
    assert after == reference, f"the greedy reference changed after {case!r}: {after} != {reference}"


def check_nothing_held(handle) -> None:
    wait_all_kv_free(handle.base_url, timeout_s=20)
    deadline = time.monotonic() + 5
    while handle.router.flows and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not handle.router.flows, list(handle.router.flows)


# ---- the tests ---------------------------------------------------------------------------------------------------


def test_fuzz_completions(cluster):
    handle, _, _, vocab = cluster
    model = handle.config.served_model_name

    @settings(FUZZ, max_examples=110)
    @given(case=api_cases("completions", model, vocab))
    @example(
        case=Case("completions", encode({"model": model, "prompt": "hi", "max_tokens": 4, "temperature": 1e-40}), "ok")
    )
    @example(
        case=Case(
            "completions", encode({"model": model, "prompt": "hi", "max_tokens": 4, "seed": 2**64 + 1}), "error", "seed"
        )
    )
    @example(
        case=Case(
            "completions",
            encode({"model": model, "prompt": "hi", "max_tokens": 4, "stop_token_ids": [2**64]}),
            "error",
            "stop_token_ids",
        )
    )
    @example(
        case=Case("completions", encode({"model": model, "prompt": [vocab + 5], "max_tokens": 4}), "error", "prompt")
    )
    def fuzz(case: Case) -> None:
        check_case(cluster, case)

    fuzz()
    check_nothing_held(handle)


def test_fuzz_chat_completions(cluster):
    handle, _, _, vocab = cluster
    model = handle.config.served_model_name

    @settings(FUZZ, max_examples=90)
    @given(case=api_cases("chat/completions", model, vocab))
    @example(
        case=Case(
            "chat/completions",
            encode({"model": model, "messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 3}),
            "any",
            "messages",
        )
    )
    def fuzz(case: Case) -> None:
        check_case(cluster, case)

    fuzz()
    check_nothing_held(handle)


def test_fuzz_raw_bodies(cluster):
    handle, _, _, _ = cluster
    model = handle.config.served_model_name

    @settings(FUZZ, max_examples=50)
    @given(case=raw_cases(model))
    def fuzz(case: Case) -> None:
        check_case(cluster, case)

    fuzz()
    check_nothing_held(handle)
