"""Structured outputs and tool calls through HTTP with the official ``openai`` client, in both modes.

The tiny random model writes whatever the grammar lets it, so the schemas here are booleans and enums (which it
always finishes) and the checks are the client's: ``chat.completions.parse`` returns a parsed object, a named or
required tool choice comes back as ``tool_calls`` with ``finish_reason: "tool_calls"``, the tool's result goes back
in the history and gets an answer, and streamed tool-call deltas join to the non-streamed answer.
"""

from __future__ import annotations

import json
from enum import Enum

import pytest
from pydantic import BaseModel

from tests.helpers.openai_api import MODES, client, model_name

pytestmark = pytest.mark.timeout(300)


class Colour(str, Enum):
    RED = "red"
    GREEN = "green"


class Verdict(BaseModel):
    ok: bool
    colour: Colour
    sure: bool


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}, "metric": {"type": "boolean"}},
    "required": ["city", "metric"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "the weather", "parameters": CITY}},
    {
        "type": "function",
        "function": {
            "name": "time_in",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["utc", "local"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
WEATHER = {"type": "function", "function": {"name": "weather"}}


@pytest.fixture(scope="module", params=MODES)
def server(request, clusters, tool_model_folder):
    return clusters.get(tool_model_folder, request.param, model={"max_model_len": 1024})


def _chat(handle, **kwargs):
    return client(handle).chat.completions.create(model=model_name(handle), **kwargs)


def test_parse_with_a_pydantic_model_returns_the_parsed_object(server):
    for seed in range(3):
        completion = client(server).chat.completions.parse(
            model=model_name(server),
            messages=[{"role": "user", "content": "judge"}],
            response_format=Verdict,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Verdict)
        assert Verdict.model_validate_json(message.content) == message.parsed


def test_json_object_gives_a_json_object(server):
    """A random model may write one string forever inside the object: max_tokens cuts those; every answer that
    ends by itself is a JSON object, and some do."""
    finished = []
    for seed in range(6):
        response = _chat(
            server,
            messages=[{"role": "user", "content": "json"}],
            response_format={"type": "json_object"},
            max_tokens=40,
            temperature=1.0,
            seed=seed,
        )
        text = response.choices[0].message.content
        assert text.startswith("{")
        if response.choices[0].finish_reason == "stop":
            finished.append(json.loads(text))
    assert finished and all(isinstance(value, dict) for value in finished)


def test_a_tool_call_round_trip(server):
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    response = _chat(server, messages=messages, tools=TOOLS, tool_choice=WEATHER, max_tokens=60, temperature=1.0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("chatcmpl-tool-")
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Oslo", "Lima") and isinstance(arguments["metric"], bool)

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
    ]
    answer = _chat(server, messages=messages, tools=TOOLS, max_tokens=8)  # auto: the model may answer or call
    assert answer.choices[0].message.tool_calls is None  # this tiny model writes no <tool_call> block
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > response.usage.prompt_tokens  # the call and its result are in the prompt


def test_tool_choice_required_gives_calls_to_known_tools(server):
    response = _chat(
        server,
        messages=[{"role": "user", "content": "anything"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=1.0,
        seed=5,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name in ("weather", "time_in")
    assert isinstance(json.loads(call.function.arguments), dict)


def test_streamed_tool_call_deltas_join_to_the_whole_answer(server):
    args = {
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": TOOLS,
        "tool_choice": WEATHER,
        "max_tokens": 60,
        "temperature": 0,
        "n": 2,
    }
    whole = _chat(server, **args)
    calls: dict[int, dict] = {0: {}, 1: {}}
    finishes = {}
    first_deltas = {}
    for chunk in _chat(server, stream=True, **args):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls[choice.index].setdefault(delta.index, {"name": None, "arguments": "", "id": None})
                if delta.id is not None:
                    first_deltas.setdefault(choice.index, delta)
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
            assert not choice.delta.content
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    for index in (0, 1):
        expected = whole.choices[index].message.tool_calls[0]
        assert first_deltas[index].type == "function" and first_deltas[index].function.arguments == ""
        assert calls[index][0]["name"] == "weather" and calls[index][0]["id"].startswith("chatcmpl-tool-")
        assert calls[index][0]["arguments"] == expected.function.arguments


def test_auto_tool_choice_without_a_call_is_plain_content(server):
    response = _chat(server, messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=6, temperature=0)
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str) and "<tool_call>" not in choice.message.content


def test_a_bad_schema_is_a_400_naming_it(server):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        _chat(
            server,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        )
    assert info.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as info:
        _chat(
            server,
            messages=[{"role": "user", "content": "x"}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert info.value.body["param"] == "tool_choice.function.name"
