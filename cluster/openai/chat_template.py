"""Chat messages to prompt tokens, through the model's own chat template (``tokenizer.apply_chat_template``).

The template sees what vLLM gives it: per message ``role``, ``content`` (text parts joined with "\\n", null as ""),
and ``name``, ``tool_calls`` (``arguments`` parsed into a dict) and ``tool_call_id`` when given; ``tools=``; and
``chat_template_kwargs`` as keyword arguments. ``continue_final_message`` leaves the last assistant message open.
What the template cannot take is refused by name before it runs; what it rejects itself is a 400 too.
"""

from __future__ import annotations

import json
from typing import Any

from cluster.openai.openai_schema import APIError, ChatMessage, ChatRequest

# apply_chat_template's own arguments: a chat_template_kwargs key may not override them
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
CONTENT_REQUIRED = ("system", "developer", "user", "tool")


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        for name in ("refusal", "function_call", "audio"):
            if getattr(message, name) is not None:
                raise APIError(400, f"{where}.{name} is not supported by this server", f"{where}.{name}")
        if message.tool_calls is not None and message.role != "assistant":
            raise APIError(400, f"{where}.tool_calls: only assistant messages make tool calls", f"{where}.tool_calls")
        if message.tool_call_id is not None and message.role != "tool":
            raise APIError(400, f"{where}.tool_call_id: only tool messages answer a call", f"{where}.tool_call_id")
        if message.role == "tool" and message.tool_call_id is None:
            raise APIError(400, f"'{where}.tool_call_id' is a required property", f"{where}.tool_call_id")
        if message.content is None and (message.role in CONTENT_REQUIRED or not message.tool_calls):
            raise APIError(400, f"'{where}.content' is required for this message", f"{where}.content")
        entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
        entry["content"] = _text(message, where)
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def _text(message: ChatMessage, where: str) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        if part.type != "text":
            name = f"{where}.content[{j}]"
            raise APIError(400, f"{name}: content parts of type {part.type!r} are not supported (text only)", name)
        if part.text is None:
            raise APIError(400, f"'{where}.content[{j}].text' is a required property", f"{where}.content[{j}].text")
        if part.model_extra:
            name = f"{where}.content[{j}].{next(iter(part.model_extra))}"
            raise APIError(400, f"Unrecognized request argument supplied: {name}", name)
        texts.append(part.text)
    return "\n".join(texts)  # vLLM's join for templates that take string content


def _arguments(text: str) -> Any:
    """Templates render ``arguments | tojson``: a dict, not the JSON string OpenAI sends (vLLM parses it too)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def template_kwargs(body: ChatRequest) -> tuple[bool, bool, dict[str, Any]]:
    """(add_generation_prompt, continue_final_message, the template's extra kwargs), each checked."""
    continue_final = bool(body.continue_final_message)
    add_prompt = body.add_generation_prompt is not False  # default true, as in vLLM
    if add_prompt and continue_final:
        raise APIError(
            400,
            "continue_final_message needs add_generation_prompt: false (its default is true): the last message is "
            "either continued or answered",
            "continue_final_message",
        )
    if continue_final and body.messages[-1].role != "assistant":
        raise APIError(
            400, "continue_final_message needs the last message to be the assistant's", "continue_final_message"
        )
    extra = dict(body.chat_template_kwargs or {})
    for key in extra:
        if key in RESERVED_KWARGS:
            name = f"chat_template_kwargs.{key}"
            raise APIError(400, f"{name}: set by the server (use the request field of that name if any)", name)
    return add_prompt, continue_final, extra


def render(tokenizer, body: ChatRequest, tools: list[dict] | None) -> list[int]:
    """The prompt's token ids, as ``tokenizer.apply_chat_template(..., tokenize=True)`` gives them."""
    messages = conversation(body.messages)
    add_prompt, continue_final, extra = template_kwargs(body)
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_prompt,
            continue_final_message=continue_final,
            tokenize=True,
            **extra,
        )
    except Exception as exc:  # a template that rejects the conversation is the client's error
        raise APIError(400, f"the chat template rejected the messages: {exc}", "messages") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
