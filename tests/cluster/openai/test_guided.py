"""cluster/openai/guided.py: OpenAI response_format / tools / tool_choice -> a grammar, checked at the edge.

The grammars are compiled for real (the byte tokenizer and engine.structured), and the ones a client relies on are
sampled with random logits under their mask: what comes out must be what the client's own code accepts (pydantic's
model_validate_json for ``chat.completions.parse``, the tool's parameter schema for tool calls).
"""

from __future__ import annotations

import enum
import functools
import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
import torch
from openai.lib._parsing._completions import type_to_response_format_param

from cluster.openai.guided import GuidedPlan, GuidedRequestError, ToolMode, plan_chat, response_format_grammar
from cluster.openai.tool_calls import parse_output, tool_finish_reason
from engine.request import GuidedDecoding
from engine.structured import GrammarState, allocate_bitmask, apply_bitmask, compile_grammar
from engine.tiny_model import build_byte_tokenizer

VOCAB = 259


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def check(tokenizer):
    """What the API passes: a compile function bound to its tokenizer."""
    return functools.partial(compile_grammar, tokenizer, VOCAB)


def _sample(tokenizer, guided: GuidedDecoding, seed: int, max_steps: int = 4000) -> str:
    state = GrammarState(compile_grammar(tokenizer, VOCAB, guided))
    generator = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, VOCAB)
    tokens: list[int] = []
    while not state.is_terminated():
        assert len(tokens) < max_steps, "the grammar never let the text end"
        logits = torch.randn(1, VOCAB, generator=generator) * 4
        state.fill_bitmask(bitmask, 0)
        apply_bitmask(logits, bitmask, [0])
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=generator))
        assert state.accept(token)
        tokens.append(token)
    return tokenizer.decode(tokens[:-1])  # less the EOS that ended it


class Color(str, enum.Enum):
    RED = "red"
    GREEN = "green"


class Inner(pydantic.BaseModel):
    flag: bool
    size: Literal["s", "m", "l"]


class Answer(pydantic.BaseModel):
    ok: bool
    color: Color
    inner: Inner
    maybe: bool | None
    tags: list[Literal["a", "b"]]


def _tool(name: str, parameters: dict | None = None, **extra) -> dict:
    function: dict = {"name": name, **extra}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = _tool(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "metric": {"type": "boolean"}},
        "required": ["city", "metric"],
    },
    description="Current weather",
)
ALARM = _tool(
    "set_alarm",
    {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["hour"]},
)


def test_response_format_kinds(check):
    assert response_format_grammar(None) is None
    assert response_format_grammar({"type": "text"}, check) is None
    assert response_format_grammar({"type": "json_object"}, check) == GuidedDecoding("json_object", "")
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    guided = response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, check)
    assert guided == GuidedDecoding("json_schema", json.dumps(schema))
    no_schema = response_format_grammar({"type": "json_schema", "json_schema": {"name": "any", "strict": None}}, check)
    assert no_schema is not None and json.loads(no_schema.spec) == {"type": "object"}
    assert plan_chat(response_format={"type": "json_object"}, compile_check=check) == GuidedPlan(
        GuidedDecoding("json_object", "")
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_official_clients_parse_shape_round_trips(tokenizer, check, seed):
    """``client.chat.completions.parse(response_format=Answer)`` sends this; what the grammar lets out parses back."""
    response_format = type_to_response_format_param(Answer)
    assert response_format["json_schema"]["strict"] is True  # the shape under test: strict, $defs, no extra keys
    plan = plan_chat(response_format=response_format, compile_check=check)
    assert plan.tool_mode == ToolMode.NONE and plan.guided is not None
    text = _sample(tokenizer, plan.guided, seed)
    assert isinstance(Answer.model_validate_json(text), Answer)


def test_tool_choice_modes(check):
    tools = [WEATHER, ALARM]
    auto = plan_chat(tools=tools, compile_check=check)
    assert (auto.tool_mode, auto.guided, auto.template_tools) == (ToolMode.AUTO, None, tools)
    assert plan_chat(tools=tools, tool_choice="auto", compile_check=check) == auto
    none = plan_chat(tools=tools, tool_choice="none", response_format={"type": "json_object"}, compile_check=check)
    assert none.tool_mode == ToolMode.NONE and none.template_tools is None and none.guided.kind == "json_object"
    named = plan_chat(
        tools=tools, tool_choice={"type": "function", "function": {"name": "set_alarm"}}, compile_check=check
    )
    assert named.tool_mode == ToolMode.NAMED and named.function_name == "set_alarm"
    assert json.loads(named.guided.spec) == ALARM["function"]["parameters"]
    bare = plan_chat(tools=[_tool("ping")], tool_choice={"type": "function", "function": {"name": "ping"}})
    assert json.loads(bare.guided.spec) == {"type": "object"}, "no parameters: any JSON object"
    required = plan_chat(tools=tools, tool_choice="required", compile_check=check)
    schema = json.loads(required.guided.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [alt["properties"]["name"] for alt in schema["items"]["anyOf"]] == [
        {"const": "get_weather"},
        {"const": "set_alarm"},
    ]
    single = plan_chat(tools=tools, tool_choice="required", parallel_tool_calls=False, compile_check=check)
    assert json.loads(single.guided.spec)["maxItems"] == 1 and not single.parallel_tool_calls


@pytest.mark.parametrize("seed", [3, 4, 5, 6])
def test_required_and_named_outputs_are_valid_calls(tokenizer, check, seed):
    tools = [WEATHER, ALARM]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    required = plan_chat(tools=tools, tool_choice="required", compile_check=check)
    message = parse_output(required, _sample(tokenizer, required.guided, seed))
    assert (
        message.content is None
        and message.tool_calls
        and tool_finish_reason("stop", bool(message.tool_calls)) == "tool_calls"
    )
    for call in message.tool_calls:
        assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
        jsonschema.validate(json.loads(call["function"]["arguments"]), params[call["function"]["name"]])
    named = plan_chat(
        tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}, compile_check=check
    )
    (call,) = parse_output(named, _sample(tokenizer, named.guided, seed)).tool_calls
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), params["get_weather"])


def test_required_moves_each_tools_defs_to_the_root(tokenizer, check):
    """pydantic_function_tool parameters reference "#/$defs/..."; inside the array those must resolve at the root."""
    tools = [openai.pydantic_function_tool(Answer), openai.pydantic_function_tool(Inner, name="inner_tool")]
    plan = plan_chat(tools=tools, tool_choice="required", compile_check=check)
    schema = json.loads(plan.guided.spec)
    assert set(schema["$defs"]) == {"Color", "Inner"}
    for seed in (7, 8):
        for call in parse_output(plan, _sample(tokenizer, plan.guided, seed)).tool_calls:
            model = Answer if call["function"]["name"] == "Answer" else Inner
            assert isinstance(model.model_validate_json(call["function"]["arguments"]), model)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
            "response_format.json_schema.strict",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "extra": 1}}},
            "response_format.json_schema.extra",
        ),
        ({"tools": []}, "tools"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [WEATHER, "x"]}, "tools[1]"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [WEATHER, ALARM, _tool("bad", ["x"])]}, "tools[2].function.parameters"),
        ({"tools": [_tool("f", {}, strict=1)]}, "tools[0].function.strict"),
        ({"tools": [_tool("f", {}, examples=[])]}, "tools[0].function.examples"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": 3}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        (
            {
                "tools": [WEATHER, _tool("f", {"type": "wat"})],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tools[1].function.parameters",
        ),
        (
            {"tools": [WEATHER, ALARM, _tool("f", {"type": "wat"})], "tool_choice": "required"},
            "tools[2].function.parameters",
        ),
    ],
)
def test_refusals_name_the_field(check, kwargs, param):
    with pytest.raises(GuidedRequestError) as info:
        plan_chat(compile_check=check, **kwargs)
    assert info.value.param == param
    assert isinstance(info.value, ValueError) and info.value.message == str(info.value) and str(info.value)
    assert ".cc:" not in str(info.value)


def test_conflicting_defs_between_tools_are_refused():
    one = _tool("a", {"$defs": {"X": {"type": "integer"}}, "properties": {"x": {"$ref": "#/$defs/X"}}})
    two = _tool("b", {"$defs": {"X": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/X"}}})
    with pytest.raises(GuidedRequestError) as info:
        plan_chat(tools=[one, two], tool_choice="required")
    assert info.value.param == "tools[1].function.parameters"


def test_template_tools_are_the_clients_own_and_copied():
    tools = [WEATHER]
    plan = plan_chat(tools=tools)
    assert plan.template_tools == tools and plan.template_tools[0] is not tools[0]
    assert plan_chat().template_tools is None and not plan_chat().calls_tools
