"""cluster/openai/tool_calls.py: generated text -> OpenAI tool_calls, whole and streamed.

The streamed deltas, however the text was cut into pieces, must add up to the non-streaming message: every text
here is fed split at every position, character by character and in random chunks.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from cluster.openai.guided import GuidedPlan, ToolMode, plan_chat
from cluster.openai.tool_calls import ParsedOutput, ToolCallStreamParser, join_deltas, parse_output, tool_finish_reason

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add"}},
]
AUTO = plan_chat(tools=TOOLS)
AUTO_SINGLE = plan_chat(tools=TOOLS, parallel_tool_calls=False)
REQUIRED = plan_chat(tools=TOOLS, tool_choice="required")
NAMED = plan_chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})

HERMES_TWO = (
    "Let me check. <tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Pa}ris </tool", "when": {"day": [1, 2]}}}\n'
    '</tool_call>\n<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call> done'
)


def _ids():
    counter = itertools.count()
    return lambda: f"chatcmpl-tool-{next(counter):032x}"


def _call(n: int, name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{n:032x}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _stream(plan: GuidedPlan, pieces: list[str]) -> list[dict]:
    parser = ToolCallStreamParser(plan, _ids())
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
    _check_delta_shapes(deltas)
    return deltas


def _check_delta_shapes(deltas: list[dict]) -> None:
    """vLLM's shape: a call's first delta has index, id, type and name with empty arguments; later ones only index
    and an argument fragment. Nothing is sent empty."""
    seen: set[int] = set()
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"}), delta
        if "content" in delta:
            assert delta["content"]
            continue
        (item,) = delta["tool_calls"]
        if item["index"] not in seen:
            assert item["index"] == len(seen) and item["type"] == "function" and item["id"].startswith("chatcmpl-tool-")
            assert item["function"]["arguments"] == "" and item["function"]["name"]
            seen.add(item["index"])
        else:
            assert set(item) == {"index", "function"} and set(item["function"]) == {"arguments"}
            assert item["function"]["arguments"]


def _assert_split_invariant(plan: GuidedPlan, text: str) -> ParsedOutput:
    whole = parse_output(plan, text, _ids())
    for i in range(len(text) + 1):
        assert join_deltas(_stream(plan, [text[:i], text[i:]])) == whole, f"split at {i}: {text[:i]!r}|{text[i:]!r}"
    assert join_deltas(_stream(plan, list(text))) == whole
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(6, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert join_deltas(_stream(plan, pieces)) == whole
    return whole


def test_auto_hermes_blocks():
    message = _assert_split_invariant(AUTO, HERMES_TWO)
    assert message.content == "Let me check. \n done"
    assert message.tool_calls == [
        _call(0, "get_weather", '{"city": "Pa}ris </tool", "when": {"day": [1, 2]}}'),
        _call(1, "add", '{"a": 1}'),
    ]
    called = bool(message.tool_calls)
    assert tool_finish_reason("stop", called) == "tool_calls" and tool_finish_reason("length", called) == "length"
    for call in message.tool_calls:
        json.loads(call["function"]["arguments"])


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Just words, <tool and all.", "Just words, <tool and all.", []),
        ("", None, []),
        ('\n <tool_call>{"name": "add", "arguments": {}}</tool_call>\n\n', None, [_call(0, "add", "{}")]),
        (  # not a call: the block stays in the content as written
            "a <tool_call>oops</tool_call> b",
            "a <tool_call>oops</tool_call> b",
            [],
        ),
        (  # cut by max_tokens inside a call: the call and its arguments so far
            'x<tool_call>{"name": "add", "arguments": {"a": [1, 2',
            "x",
            [_call(0, "add", '{"a": [1, 2')],
        ),
        ("x<tool_call>", "x<tool_call>", []),
        ("x<tool_ca", "x<tool_ca", []),
        (  # unicode and escapes in the arguments are the model's own text; an escaped name is decoded
            '<tool_call>{"name": "get_\\u0077eather", "parameters": {"q": "caf\u00e9 \\"x\\" \\u00e9"} }</tool_call>',
            None,
            [_call(0, "get_weather", '{"q": "caf\u00e9 \\"x\\" \\u00e9"}')],
        ),
    ],
)
def test_auto_edge_cases(text, content, calls):
    message = _assert_split_invariant(AUTO, text)
    assert (message.content, message.tool_calls) == (content, calls)


def test_auto_without_parallel_calls_keeps_the_first():
    message = _assert_split_invariant(AUTO_SINGLE, HERMES_TWO)
    assert [c["function"]["name"] for c in message.tool_calls] == ["get_weather"]
    assert message.content == "Let me check. \n done"


def test_required_array():
    text = '[{"name": "add", "parameters": {"a": [1, {"b": "}]"}]}}, {"name": "get_weather", "parameters": {}}]'
    message = _assert_split_invariant(REQUIRED, text)
    assert message.content is None
    assert message.tool_calls == [_call(0, "add", '{"a": [1, {"b": "}]"}]}'), _call(1, "get_weather", "{}")]


def test_named_text_is_the_arguments():
    message = _assert_split_invariant(NAMED, '{"a": 1, "b": "x"}')
    assert message == ParsedOutput(None, [_call(0, "add", '{"a": 1, "b": "x"}')])
    assert _assert_split_invariant(NAMED, "").tool_calls == [_call(0, "add", "")]
    deltas = _stream(NAMED, ['{"a": ', "1}"])
    assert [d["tool_calls"][0]["function"]["arguments"] for d in deltas] == ["", '{"a": ', "1}"]


def test_no_tools_passes_text_through():
    plan = GuidedPlan()
    assert parse_output(plan, ' <tool_call>{"name": "add", "arguments": {}}</tool_call>') == ParsedOutput(
        ' <tool_call>{"name": "add", "arguments": {}}</tool_call>'
    )
    assert _stream(plan, ["a", "", "b"]) == [{"content": "a"}, {"content": "b"}]
    assert plan.tool_mode == ToolMode.NONE


def test_streaming_sends_the_name_early_and_arguments_incrementally():
    parser = ToolCallStreamParser(AUTO, _ids())
    assert parser.feed("Hi <tool_") == [{"content": "Hi "}]  # the partial tag is held back
    assert parser.feed('call>{"name": "get_weather", "arguments": ') == []  # the head needs what follows it
    head = parser.feed('{"city"')
    assert head[0] == {
        "tool_calls": [
            {
                "index": 0,
                "id": _call(0, "", "")["id"],
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ]
    }
    assert head[1:] == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}]
    assert parser.feed(': "Oslo"}') == [{"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"'}}]}]
    # only the last brace may be the call's own close: the one before it is now surely the arguments'
    assert parser.feed("}") == [{"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}]
    assert parser.feed(" </tool_call> bye") == [{"content": " bye"}]
    assert parser.finish() == [] and parser.num_calls == 1
