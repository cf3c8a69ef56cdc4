"""Structured output through the engine: every token of a guided request keeps its text inside the grammar, from the
first token (sampled by the prefill engine) to the last (the decode engine), and the request stops when the grammar is
complete. A random model writes valid JSON only because the grammar makes it."""

from __future__ import annotations

import json
import re

import pytest

from engine.request import GuidedDecoding, SamplingParams
from engine.structured import GrammarError
from tests.helpers.engine import handoff

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"enum": ["S", "M", "L"]},
    },
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}
GUIDED = GuidedDecoding("json_schema", json.dumps(SCHEMA))


def _valid(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == {"ok", "color", "size"}
        and isinstance(value["ok"], bool)
        and value["color"] in SCHEMA["properties"]["color"]["enum"]
        and value["size"] in SCHEMA["properties"]["size"]["enum"]
    )


def _params(seed: int | None, **changes) -> SamplingParams:
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=seed, guided=GUIDED)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


def test_json_schema_output_parses_and_validates(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    [free] = engine.generate(["Answer in JSON:"], SamplingParams(max_tokens=40, temperature=1.0, seed=0))
    assert not free.text.startswith('{"ok": ')  # unguided, the random model writes noise
    params = [_params(seed) for seed in range(6)] + [_params(None, temperature=0.0)]
    results = engine.generate(["Answer in JSON:"] * len(params), params)
    for result in results:
        assert result.finish_reason == "stop" and _valid(result.text), result.text
        assert result.token_ids[-1] in engine.eos_token_ids  # finished by the grammar's own end
    assert len({r.text for r in results}) > 2  # sampled within the grammar, not one forced string
    engine.check_no_leaks()


def test_regex_json_object_and_plain_requests_share_a_batch(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    regex = GuidedDecoding("regex", r"(yes|no), [0-9]{3}!")
    params = [
        SamplingParams(max_tokens=30, temperature=1.0, seed=1, guided=regex),
        SamplingParams(max_tokens=30, temperature=0.8, seed=2),  # no grammar: untouched by the masks
        SamplingParams(max_tokens=60, temperature=0.0, guided=GuidedDecoding("json_object")),
        SamplingParams(max_tokens=30, temperature=1.0, seed=3, guided=regex, logprobs=2, presence_penalty=1.0),
    ]
    [alone] = engine.generate(["free text"], params[1])
    results = engine.generate(["a", "free text", "an object:", "b"], params)
    assert re.fullmatch(r"(yes|no), [0-9]{3}!", results[0].text) and results[0].finish_reason == "stop"
    assert re.fullmatch(r"(yes|no), [0-9]{3}!", results[3].text) and results[3].finish_reason == "stop"
    assert results[1].token_ids == alone.token_ids
    obj = results[2]
    if obj.finish_reason == "stop":  # greedy may keep adding keys until max_tokens: then the text is a prefix
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")
    engine.check_no_leaks()


def test_the_grammar_crosses_the_handoff(tiny_llama_path, make_engine):
    single = make_engine(tiny_llama_path)
    prefill = make_engine(tiny_llama_path)
    decode = make_engine(tiny_llama_path)
    for seed in range(4):
        params = _params(seed)
        [expected] = single.generate(["Answer in JSON:"], params)
        outputs = handoff(prefill, decode, single.tokenize("Answer in JSON:"), params, f"g{seed}")
        text = "".join(o.text_delta for o in outputs)
        assert [t for o in outputs for t in o.new_token_ids] == expected.token_ids
        assert text == expected.text and _valid(text) and outputs[-1].finish_reason.value == "stop"
    for engine in (single, prefill, decode):
        engine.check_no_leaks()


def test_a_recomputed_handoff_replays_the_first_token_into_the_grammar(tiny_llama_path, make_engine):
    single = make_engine(tiny_llama_path)
    prefill = make_engine(tiny_llama_path)
    decode = make_engine(tiny_llama_path)
    prompt = single.tokenize("Answer in JSON:")
    params = _params(11)
    [expected] = single.generate([prompt], params)
    assert decode.kv_importer.reserve(prompt, params.copy(), "r") is not None
    first_params = params.copy()
    first_params.max_tokens = 1
    prefill.add_request(prompt, first_params, "r", prefill_only=True, kv_sink=lambda ready: None)
    [first] = [o for _ in range(5) for o in prefill.step()]
    prefill.release("r")
    assert decode.kv_importer.kv_failed("r", recompute=True)  # the KV never came: decode computes the prompt itself
    decode.kv_importer.tokens_in("r", [first.new_token_ids[0]])
    outputs = [first]
    while decode.has_unfinished():
        outputs += decode.step()
    assert [t for o in outputs for t in o.new_token_ids] == expected.token_ids
    assert _valid("".join(o.text_delta for o in outputs)) and decode.num_recomputes == 1
    for engine in (single, prefill, decode):
        engine.check_no_leaks()


@pytest.mark.parametrize(
    "guided",
    [
        GuidedDecoding("json_schema", "{not json"),
        GuidedDecoding("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nonsense"}}})),
        GuidedDecoding("regex", "(unclosed"),
        GuidedDecoding("ebnf", "root ::= undefined_rule"),
    ],
    ids=["not-json", "bad-type", "bad-regex", "bad-ebnf"],
)
def test_a_grammar_that_does_not_compile_is_that_requests_error(tiny_llama_path, make_engine, guided):
    engine = make_engine(tiny_llama_path)
    params = SamplingParams(max_tokens=5, guided=guided)
    with pytest.raises(GrammarError):
        engine.add_request("x", params)
    with pytest.raises(ValueError):  # what the workers catch: an invalid request, not a worker fault
        engine.kv_importer.reserve("x", params, "r")
    assert not engine.requests
    assert engine.generate(["still serving"], SamplingParams(max_tokens=2))[0].token_ids
    engine.check_no_leaks()
