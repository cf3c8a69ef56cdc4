"""One streamed OpenAI request, timed at the client from just before sending (connection set-up included, as in
``vllm bench serve``).

TTFT is the read that delivered the first non-empty text (``text``, or ``delta.content``/``reasoning_content``); ITL
the gaps between reads that delivered text (a chunk may carry several tokens: ``content_chunks``); E2EL the read that
delivered ``[DONE]``. Token counts and ``cached_tokens`` come from the server's ``usage`` (without one the runner
counts the text: ``output_tokens_source``), stage timings from the last ``timing`` object. A failure has one reason:
``http_<status>``, ``timeout``, ``cancelled``, ``connect_error``, ``stream_cut`` (ended before ``[DONE]``),
``stream_error`` (an error event or object), ``bad_response`` (unparseable) or ``no_content``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import httpx

from bench.loadtest.sse import SSEParser

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
TIMING_FIELDS = (
    "router_queue_s",
    "prefill_queue_s",
    "prefill_compute_s",
    "first_token_delivery_s",
    "kv_transfer_s",
    "kv_after_prefill_s",
    "decode_queue_s",
    "ttft_s",
    "e2e_s",
)


@dataclass(slots=True)
class RequestSpec:
    """What to send. ``system`` is a chat system message, or for completions a text put before ``prompt``.
    ``messages`` (chat only), when given, is the whole conversation to send instead (a multi-turn chat's history)."""

    index: int
    prompt: str
    output_tokens: int  # sent as max_tokens
    input_tokens: int  # what our tokenizer counts for the prompt as sent (templated for chat)
    system: str | None = None
    group: int | None = None  # shared-prefix group
    messages: list[dict] | None = None
    trace_line: int | None = None  # a trace replay: the row's line in the trace file


@dataclass(slots=True)
class RequestSettings:
    base_url: str
    model: str
    endpoint_type: str = "completions"
    ignore_eos: bool = False
    temperature: float = 0.0
    api_key: str | None = None
    request_timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)


@dataclass(slots=True)
class RequestResult:
    index: int
    warmup: bool = False
    rate: float | str | None = None  # the phase's request rate ("inf": unlimited)
    scheduled_s: float | None = None  # planned send time, from the start of the run phase
    sent_s: float | None = None  # actual send time, from the start of the run phase
    success: bool = False
    error: str | None = None
    error_detail: str | None = None
    http_status: int | None = None
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    content_chunks: int = 0
    expected_input_tokens: int | None = None
    requested_output_tokens: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    output_tokens_source: str | None = None
    finish_reason: str | None = None
    server_timing: dict | None = None
    group: int | None = None
    conversation: int | None = None  # multi-turn: which conversation, and which turn of it (from 1)
    turn: int | None = None
    trace_line: int | None = None  # a trace replay: the row's line in the trace file
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    generated_text: str = ""  # kept for counting when usage is absent; not written out

    @property
    def tpot_s(self) -> float | None:
        """(e2el - ttft) / (output_tokens - 1); 0 for one token (as vLLM), None on failure."""
        if not self.success or self.ttft_s is None or self.e2el_s is None or not self.output_tokens:
            return None
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def to_record(self) -> dict:
        record = asdict(self)
        record.pop("generated_text")
        record["tpot_s"] = self.tpot_s
        return record


def build_body(spec: RequestSpec, settings: RequestSettings) -> dict:
    body: dict = {
        "model": settings.model,
        "max_tokens": spec.output_tokens,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.endpoint_type == "chat" and spec.messages is not None:
        body["messages"] = spec.messages
    elif settings.endpoint_type == "chat":
        messages = []
        if spec.system is not None:
            messages.append({"role": "system", "content": spec.system})
        messages.append({"role": "user", "content": spec.prompt})
        body["messages"] = messages
    else:
        body["prompt"] = (spec.system or "") + spec.prompt
    if settings.ignore_eos:
        body["ignore_eos"] = True
    body.update(settings.extra_body)
    return body


def _chunk_text(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or choice.get("message") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


class _StreamState:
    """Applies parsed chunks to a result; ``done`` once ``[DONE]`` arrived."""

    def __init__(self, result: RequestResult, start: float) -> None:
        self.result = result
        self.start = start
        self.last_content: float | None = None
        self.done = False
        self.text: list[str] = []

    def apply(self, obj: dict, now: float) -> None:
        result = self.result
        if obj.get("error"):
            raise _Failure("stream_error", json.dumps(obj["error"])[:500])
        usage = obj.get("usage")
        if usage:
            if usage.get("prompt_tokens") is not None:
                result.input_tokens = int(usage["prompt_tokens"])
            if usage.get("completion_tokens") is not None:
                result.output_tokens = int(usage["completion_tokens"])
                result.output_tokens_source = "usage"
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                result.cached_tokens = details["cached_tokens"]
        if isinstance(obj.get("timing"), dict):
            result.server_timing = obj["timing"]
        for choice in obj.get("choices") or []:
            text = _chunk_text(choice)
            if text:
                self.text.append(text)
                result.content_chunks += 1
                if self.last_content is None:
                    result.ttft_s = now - self.start
                else:
                    result.itl_s.append(now - self.last_content)
                self.last_content = now
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
            if isinstance(choice.get("timing"), dict):
                result.server_timing = choice["timing"]


class _Failure(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


async def _stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict, result: RequestResult) -> float:
    start = time.perf_counter()
    state = _StreamState(result, start)
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            result.http_status = response.status_code
            if response.status_code != 200:
                detail = (await response.aread())[:500].decode("utf-8", "replace")
                raise _Failure(f"http_{response.status_code}", detail)
            if "text/event-stream" not in response.headers.get("content-type", "text/event-stream"):
                raw = await response.aread()
                now = time.perf_counter()
                try:
                    obj = json.loads(raw)
                except ValueError:
                    raise _Failure("bad_response", raw[:200].decode("utf-8", "replace")) from None
                state.apply(obj, now)
                result.e2el_s = now - start
                state.done = True
            else:
                parser = SSEParser()
                async for chunk in response.aiter_bytes():
                    now = time.perf_counter()
                    _handle_events(state, parser.feed(chunk), now)
                    if state.done:
                        result.e2el_s = now - start
                        break
                if not state.done:
                    now = time.perf_counter()
                    _handle_events(state, parser.close(), now)
                    if state.done:
                        result.e2el_s = now - start
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        raise _Failure("stream_cut", f"{type(exc).__name__}: {exc}") from None
    if not state.done:
        raise _Failure("stream_cut", "the stream ended without [DONE]")
    result.generated_text = "".join(state.text)
    if result.ttft_s is None:
        raise _Failure("no_content", "the stream finished without any text")
    return start


def _handle_events(state: _StreamState, events: list[tuple[str | None, str]], now: float) -> None:
    for event, data in events:
        if state.done:
            return
        if data.strip() == "[DONE]":
            state.done = True
            continue
        if event == "error":
            raise _Failure("stream_error", data[:500])
        try:
            obj = json.loads(data)
        except ValueError:
            raise _Failure("bad_response", data[:200]) from None
        if isinstance(obj, dict):
            state.apply(obj, now)


async def send_request(
    client: httpx.AsyncClient, spec: RequestSpec, settings: RequestSettings, result: RequestResult
) -> RequestResult:
    """Send one request and fill ``result``; never raises except ``CancelledError`` (after marking it)."""
    url = settings.base_url.rstrip("/") + ENDPOINT_PATHS[settings.endpoint_type]
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    result.expected_input_tokens = spec.input_tokens
    result.requested_output_tokens = spec.output_tokens
    result.group = spec.group
    result.trace_line = spec.trace_line
    try:
        async with asyncio.timeout(settings.request_timeout_s):
            await _stream(client, url, build_body(spec, settings), headers, result)
        result.success = True
    except _Failure as exc:
        result.error, result.error_detail = exc.reason, exc.detail
    except (TimeoutError, httpx.TimeoutException) as exc:
        result.error, result.error_detail = (
            "timeout",
            f"no answer within {settings.request_timeout_s} s ({type(exc).__name__})",
        )
    except httpx.ConnectError as exc:
        result.error, result.error_detail = "connect_error", str(exc)
    except httpx.HTTPError as exc:
        result.error, result.error_detail = "stream_cut", f"{type(exc).__name__}: {exc}"
    except asyncio.CancelledError:
        result.error, result.error_detail = "cancelled", "still running when the run reached its bound"
        raise
    return result
