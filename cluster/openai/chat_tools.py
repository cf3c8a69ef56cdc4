"""A chat request's response_format / tools / tool_choice: the grammar, the tools the template offers, the reader.

``cluster/openai/guided.py`` makes the plan (its ``GuidedRequestError`` becomes the 400 here); the grammar is compiled
once at the edge with this server's tokenizer and the model's logits width, so a schema xgrammar cannot handle is
refused before any worker sees it. ``cluster/openai/tool_calls.py`` reads the text back into ``tool_calls``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cluster.openai.guided import GuidedPlan, GuidedRequestError, plan_chat
from cluster.openai.openai_schema import APIError, ChatRequest
from cluster.openai.tool_calls import ToolCallStreamParser, parse_output
from engine.request import GuidedDecoding
from engine.structured import compile_grammar


@dataclass(slots=True)
class ChatTools:
    guided: GuidedDecoding | None
    template_tools: list[dict] | None  # for apply_chat_template(tools=)
    reader: ToolCallReader | None  # set when the text is read for tool calls


def model_vocab_size(tokenizer) -> int:
    """The model's logits width (config.json ``vocab_size``, else the tokenizer's size): the grammar's bitmask
    covers exactly that many ids, which may be more than the tokenizer has."""
    folder = getattr(tokenizer, "name_or_path", None)
    try:
        config = json.loads((Path(folder) / "config.json").read_text()) if folder else {}
    except (OSError, ValueError):
        config = {}
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) and size >= len(tokenizer) else len(tokenizer)


def chat_tools(body: ChatRequest, tokenizer, vocab_size: int) -> ChatTools:
    """Blocking (it may compile a grammar): the API runs it in a thread."""
    try:
        plan = plan_chat(
            response_format=body.response_format,
            tools=body.tools,
            tool_choice=body.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
            compile_check=lambda guided: compile_grammar(tokenizer, vocab_size, guided),
        )
    except GuidedRequestError as exc:
        raise APIError(400, exc.message, exc.param) from None
    return ChatTools(plan.guided, plan.template_tools, ToolCallReader(plan) if plan.calls_tools else None)


class ToolCallReader:
    """The text read for tool calls, as ``cluster/openai/responses.py`` asks for it (one parser for both forms)."""

    def __init__(self, plan: GuidedPlan) -> None:
        self.plan = plan

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        parsed = parse_output(self.plan, text)
        return parsed.content, parsed.tool_calls

    def stream(self) -> ToolCallStreamParser:
        return ToolCallStreamParser(self.plan)
