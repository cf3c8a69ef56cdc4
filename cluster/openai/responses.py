"""A response from its choices' router events: the JSON body (``collect``) or the SSE stream (``stream``).

Events come from ``cluster/openai/choices.py``; each ``_Choice`` keeps its text, tokens, finish, cached tokens and
logprobs in its endpoint's shape (``cluster/openai/api_format.py``). An ``echo`` choice starts with its prompt's text
(and its entries); a chat choice offered tools reads its text for tool calls (``ToolReader``). Usage counts each
prompt once; ``cached_tokens`` counts only each prompt's first choice (the others hit what it computed).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.openai.api_format import (
    CompletionLogprobs,
    SSEChunks,
    TokenText,
    chat_logprobs,
    join_completion_logprobs,
    usage,
)
from cluster.openai.choices import ChoicePlan
from cluster.openai.openai_schema import APIError
from cluster.openai.tool_calls import tool_finish_reason
from cluster.routing.errors import RequestFailed
from cluster.routing.flow import TokenEvent
from cluster.routing.router import Router


class ToolStream(Protocol):
    def feed(self, text: str) -> list[dict]: ...  # chat delta dicts ({"content": ..} or {"tool_calls": [..]})

    def finish(self) -> list[dict]: ...

    num_calls: int  # tool calls emitted so far


class ToolReader(Protocol):
    def parse(self, text: str) -> tuple[str | None, list[dict]]: ...  # (content, tool_calls)

    def stream(self) -> ToolStream: ...


@dataclass(slots=True)
class ResponseShape:
    rid: str
    created: int
    chat: bool
    model: str
    fingerprint: str
    plans: list[ChoicePlan]
    prompt_tokens: int  # every prompt once
    token_text: TokenText
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    echo: list[str] | None = None  # completions echo: each prompt's text
    tools: ToolReader | None = None
    include_usage: bool = False
    continuous_usage: bool = False
    timing: dict = field(default_factory=dict)


class _Choice:
    def __init__(self, plan: ChoicePlan, shape: ResponseShape, streaming: bool) -> None:
        self.plan, self.shape = plan, shape
        self.tokens = 0
        self.finish: str | None = None
        self.cached: int | None = None
        self.started = False
        self.parts: list[str] = []
        self.logprob_pieces: list = []  # chat: entries; completions: blocks
        self.completion_logprobs = (
            CompletionLogprobs(shape.token_text) if not shape.chat and shape.logprobs is not None else None
        )
        self.tool_stream = shape.tools.stream() if streaming and shape.tools is not None else None

    def take(self, event: TokenEvent) -> tuple[str, Any]:
        """The text and the logprobs block this event adds (the echo first, on its first event)."""
        shape, text = self.shape, event.text
        block: list[dict] | dict | None = None
        echo_block = None
        if not self.started:
            self.started = True
            self.cached = event.cached_tokens
            if shape.echo is not None:
                text = shape.echo[self.plan.prompt_index] + text
                if self.completion_logprobs is not None:
                    prompt = self.plan.prompt
                    prompt_entries = event.prompt_logprobs or [None] * len(prompt)
                    echo_block = self.completion_logprobs.piece(prompt, list(prompt_entries))
        self.tokens += event.num_tokens
        if event.finish_reason is not None:
            self.finish = event.finish_reason
        if shape.logprobs is not None:
            entries = event.logprobs or []
            if self.completion_logprobs is None:
                block = chat_logprobs(entries, shape.logprobs, shape.token_text)
            else:
                piece = self.completion_logprobs.piece([e.token_id for e in entries], entries)
                block = piece if echo_block is None else join_completion_logprobs([echo_block, piece])
        return text, block

    def finish_reason(self, called: bool) -> str:
        return tool_finish_reason(self.finish or "stop", called)


def _cached(choices: dict[int, _Choice]) -> int:
    return sum(c.cached or 0 for c in choices.values() if c.plan.leader is None)


def _completion_tokens(choices: dict[int, _Choice]) -> int:
    return sum(c.tokens for c in choices.values())


async def collect(router: Router, shape: ResponseShape, events: AsyncGenerator[tuple[int, TokenEvent], None]) -> dict:
    """The whole answer as one body (the caller closes ``events``)."""
    choices = {plan.index: _Choice(plan, shape, streaming=False) for plan in shape.plans}
    async for index, event in events:  # the workers' text, as it is: they detokenized it and cut stop strings
        choice = choices[index]
        text, block = choice.take(event)
        choice.parts.append(text)
        if block is not None:
            choice.logprob_pieces.append(block)
    out = []
    for index, choice in sorted(choices.items()):
        text = "".join(choice.parts)
        entry: dict[str, Any] = {"index": index}
        if shape.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            calls: list[dict] = []
            if shape.tools is not None:
                message["content"], calls = shape.tools.parse(text)
                if calls:
                    message["tool_calls"] = calls
            entry["message"] = message
            logprobs = None
            if shape.logprobs is not None:
                logprobs = {"content": [e for piece in choice.logprob_pieces for e in piece]}
            entry.update(logprobs=logprobs, finish_reason=choice.finish_reason(bool(calls)))
        else:
            logprobs = join_completion_logprobs(choice.logprob_pieces) if shape.logprobs is not None else None
            entry.update(text=text, logprobs=logprobs, finish_reason=choice.finish_reason(False))
        out.append(entry)
    timings = [router.core.last_timing.pop(plan.request_id, {}) for plan in shape.plans]  # every choice's goes
    return {
        "id": shape.rid,
        "object": "chat.completion" if shape.chat else "text_completion",
        "created": shape.created,
        "model": shape.model,
        "system_fingerprint": shape.fingerprint,
        "choices": out,
        "usage": usage(shape.prompt_tokens, _completion_tokens(choices), _cached(choices)),
        "timing": timings[0],
    }


async def stream(
    router: Router, shape: ResponseShape, events: AsyncGenerator[tuple[int, TokenEvent], None], first
) -> AsyncIterator[str]:
    """The SSE events, one chunk per router event; ``first``: the first ``(index, event)``, already taken (so that an
    error before any token was an HTTP status), or None."""
    chunks = SSEChunks(
        shape.rid,
        shape.created,
        shape.chat,
        shape.model,
        shape.fingerprint,
        shape.include_usage,
        shape.continuous_usage,
    )
    choices = {plan.index: _Choice(plan, shape, streaming=True) for plan in shape.plans}
    continuous = shape.continuous_usage

    def running() -> dict | None:
        return usage(shape.prompt_tokens, _completion_tokens(choices)) if continuous else None

    def pieces(index: int, event: TokenEvent) -> list[str]:
        choice = choices[index]
        text, block = choice.take(event)
        out = _pieces(chunks, choice, text, block, running)
        if choice.finish is not None:
            called = choice.tool_stream is not None and choice.tool_stream.num_calls > 0
            held = {"content": choice.logprob_pieces} if choice.logprob_pieces else None
            timing = router.core.last_timing.pop(choice.plan.request_id, {})
            reason = choice.finish_reason(called)
            out.append(chunks.chunk(index, logprobs=held, finish=reason, usage=running(), extra={"timing": timing}))
        return out

    try:
        if shape.chat:
            for index in choices:
                yield chunks.role(index, running())
        if first is not None:
            for piece in pieces(*first):
                yield piece
            # the hot path: a text chunk from its template, nothing else per event
            plain = shape.logprobs is None and shape.tools is None and not continuous
            async for index, event in events:
                choice = choices[index]
                if plain and choice.started and event.finish_reason is None:
                    choice.tokens += event.num_tokens
                    if event.text:
                        yield chunks.text(index, event.text)
                    continue
                for piece in pieces(index, event):
                    yield piece
        if shape.include_usage:
            yield chunks.usage(usage(shape.prompt_tokens, _completion_tokens(choices), _cached(choices)))
        yield "data: [DONE]\n\n"
    except RequestFailed as exc:
        yield f"data: {json.dumps(http_error(exc).body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()


def _pieces(chunks: SSEChunks, choice: _Choice, text: str, block, running) -> list[str]:
    index = choice.plan.index
    if choice.tool_stream is None:
        if block is None and not chunks.continuous:
            return [chunks.text(index, text)] if text else []
        if not text and not block:
            return []
        logprobs = {"content": block} if chunks.chat and block is not None else block
        return [chunks.chunk(index, text, logprobs=logprobs, usage=running())]
    deltas = choice.tool_stream.feed(text) if text else []
    if choice.finish is not None:
        deltas += choice.tool_stream.finish()
    if block:
        choice.logprob_pieces.extend(block)  # held until a chunk goes out: a buffered tool call has no chunk yet
    out = []
    for delta in deltas:
        logprobs = {"content": choice.logprob_pieces} if choice.logprob_pieces else None
        out.append(chunks.chunk(index, delta=delta, logprobs=logprobs, usage=running()))
        choice.logprob_pieces = []
    return out


def http_error(exc: RequestFailed) -> APIError:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None  # overloaded, or a worker restarting
    err_type = (
        "server_error" if exc.status >= 500 else "rate_limit_error" if exc.status == 429 else "invalid_request_error"
    )
    return APIError(exc.status, str(exc), code=exc.code, err_type=err_type, headers=headers)
