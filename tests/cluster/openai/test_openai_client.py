"""The fields real clients send, through HTTP with the official ``openai`` client, in both modes: null for every
optional field, chat template options (``chat_template_kwargs``, ``continue_final_message``, names, content parts,
tool calls and results in the history), ``usage.prompt_tokens_details.cached_tokens``,
``stream_options.continuous_usage_stats`` and ``system_fingerprint``.

The chat checks run on a copy of the tiny model whose template renders tools, names and ``enable_thinking`` (as
Qwen3's does): the prompt the server built must have exactly as many tokens as ``apply_chat_template`` gives.
"""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.helpers.openai_api import MODES, client, model_name

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=MODES)
def server(request, clusters, tool_model_folder):
    return clusters.get(tool_model_folder, request.param, model={"max_model_len": 1024})


@pytest.fixture(scope="module")
def tokenizer(tool_model_folder):
    return AutoTokenizer.from_pretrained(tool_model_folder)


def _template_len(tokenizer, messages, **kwargs) -> int:
    return len(tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)["input_ids"])


def _chat(handle, **kwargs):
    return client(handle).chat.completions.create(model=model_name(handle), **kwargs)


def _post(handle, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{handle.base_url}{path}", json={"model": model_name(handle), **body}, timeout=60)


# ---- null ------------------------------------------------------------------------------------------------------

COMMON_NULLS = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "n",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "stream",
    "stream_options",
    "user",
]
CHAT_NULLS = COMMON_NULLS + [
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "functions",
    "function_call",
    "store",
    "metadata",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "service_tier",
    "web_search_options",
    "verbosity",
    "moderation",
    "prompt_cache_retention",
    "prompt_cache_options",
    "safety_identifier",
    "prompt_cache_key",
]
COMPLETION_NULLS = COMMON_NULLS + ["best_of", "echo", "logprobs", "suffix"]


def test_null_is_accepted_for_every_optional_field_and_means_unset(server, tokenizer):
    greedy = {"temperature": 0, "max_tokens": 4}
    messages = [{"role": "user", "content": "nulls", "name": None}]
    base = _post(server, "/v1/chat/completions", {"messages": messages, **greedy}).json()
    nulls = {name: None for name in CHAT_NULLS if name not in greedy}
    response = _post(server, "/v1/chat/completions", {"messages": messages, **greedy, **nulls})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == base["choices"][0]["message"]["content"]
    for name in CHAT_NULLS:  # each alone, the required ones too where the spec makes them optional
        body = {"messages": messages, "max_tokens": 2, name: None}
        assert _post(server, "/v1/chat/completions", body).status_code == 200, name

    base = _post(server, "/v1/completions", {"prompt": "nulls", **greedy}).json()
    nulls = {name: None for name in COMPLETION_NULLS if name not in greedy}
    response = _post(server, "/v1/completions", {"prompt": "nulls", **greedy, **nulls})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == base["choices"][0]["text"]


# ---- the chat template -----------------------------------------------------------------------------------------


def test_chat_template_kwargs_reach_the_template(server, tokenizer):
    messages = [{"role": "user", "content": "think?"}]
    sizes = {}
    for thinking in (True, False):
        response = _chat(
            server, messages=messages, max_tokens=2, extra_body={"chat_template_kwargs": {"enable_thinking": thinking}}
        )
        sizes[thinking] = response.usage.prompt_tokens
        expected = _template_len(tokenizer, messages, add_generation_prompt=True, enable_thinking=thinking)
        assert sizes[thinking] == expected
    assert sizes[False] > sizes[True]  # the empty think block was rendered


def test_continue_final_message_continues_the_assistant_turn(server, tokenizer):
    messages = [{"role": "user", "content": "finish this"}, {"role": "assistant", "content": "The answer is"}]
    response = _chat(
        server,
        messages=messages,
        max_tokens=3,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    expected = _template_len(tokenizer, messages, continue_final_message=True, add_generation_prompt=False)
    assert response.usage.prompt_tokens == expected
    assert expected < _template_len(tokenizer, messages, add_generation_prompt=False)  # no <|im_end|> after it
    for add_generation_prompt in (True, None):  # its default is true, as in vLLM
        both = _post(
            server,
            "/v1/chat/completions",
            {"messages": messages, "continue_final_message": True, "add_generation_prompt": add_generation_prompt},
        )
        assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_history_with_names_parts_tool_calls_and_results_renders_as_the_template_does(server, tokenizer):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "the weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "developer", "content": "be brief"},
        {
            "role": "user",
            "name": "ann",
            "content": [{"type": "text", "text": "weather"}, {"type": "text", "text": "Oslo?"}],
        },
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    response = _chat(server, messages=messages, tools=tools, max_tokens=3, tool_choice="none")
    assert response.choices[0].message.tool_calls is None
    # what the server hands the template: system for developer, parts joined by "\n", "" for null content, the
    # arguments as a dict; tool_choice "none" offers no tools
    rendered = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "name": "ann", "content": "weather\nOslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**call, "function": {"name": "weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    assert response.usage.prompt_tokens == _template_len(tokenizer, rendered, add_generation_prompt=True)
    with_tools = _chat(server, messages=messages, tools=tools, max_tokens=3)  # auto: the tools are offered
    assert with_tools.usage.prompt_tokens == _template_len(tokenizer, rendered, tools=tools, add_generation_prompt=True)


# ---- usage and fingerprint -------------------------------------------------------------------------------------


def test_cached_tokens_count_the_prefix_cache(server):
    prompt = "a long shared document. " * 12  # 288 tokens: 18 blocks of 16
    # once per worker that may take it (the default policy spreads by load): one of them has it cached by then
    answers = [
        client(server).completions.create(model=model_name(server), prompt=prompt, max_tokens=2)
        for _ in range(server.num_workers + 1)
    ]
    assert answers[0].usage.prompt_tokens_details.cached_tokens == 0
    cached = max(a.usage.prompt_tokens_details.cached_tokens for a in answers)
    assert cached == len(prompt) - 16  # every full block but the last: its last token is computed for the logits

    streamed = []
    for _ in range(server.num_workers + 1):
        stream = client(server).completions.create(
            model=model_name(server), prompt=prompt, max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
        assert len(usage) == 1 and usage[0].prompt_tokens == len(prompt)
        streamed.append(usage[0].prompt_tokens_details.cached_tokens)
    assert max(streamed) == cached


def test_continuous_usage_stats_put_the_running_usage_in_every_chunk(server):
    stream = _chat(
        server,
        messages=[{"role": "user", "content": "usage"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 8
    assert len({chunk.usage.prompt_tokens for chunk in chunks}) == 1
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_system_fingerprint_is_on_every_response_and_chunk_and_stable(server):
    one = _chat(server, messages=[{"role": "user", "content": "a"}], max_tokens=2)
    two = client(server).completions.create(model=model_name(server), prompt="b", max_tokens=2)
    assert one.system_fingerprint and one.system_fingerprint == two.system_fingerprint
    assert one.system_fingerprint.startswith("pdserve-")
    stream = _chat(server, messages=[{"role": "user", "content": "a"}], max_tokens=3, stream=True)
    assert {chunk.system_fingerprint for chunk in stream} == {one.system_fingerprint}
