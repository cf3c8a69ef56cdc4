"""The OpenAI-compatible HTTP API over a ``Router``: completions and chat, streaming (SSE) and not.

Every refusal is an OpenAI-style error body with the right status (400 bad input, 401 no key, 404 unknown model
or route, 413 body too large, 429 overloaded with Retry-After, 503 no workers) whose ``param`` names the field;
nothing reaches the client as a traceback. What a body may hold is checked in ``cluster/openai_schema.py``; the
size limit is counted while reading, so it holds for chunked bodies too. The API key, when set, guards every route
but ``/health`` (load balancers probe it).

A client that disconnects cancels its request wherever it is: mid-stream (the response generator is cancelled),
while waiting for the first token, or while a non-streaming answer is being collected (a watcher on the ASGI
``http.disconnect`` message). Either way the router's generator is closed and its cleanup aborts the request on
every worker that holds it. Each response carries ``usage`` and ``timing`` (where the time went, seconds).

The text comes detokenized from the workers (cluster/streams.py); this module only frames it: one SSE chunk per
router event (everything that arrived since the last chunk was written), from per-request templates (``SSEChunks``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from json.encoder import encode_basestring  # what json.dumps(str, ensure_ascii=False) does, without the rest

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cluster.config import ClusterConfig
from cluster.errors import RequestFailed
from cluster.openai_schema import (
    APIError,
    ChatRequest,
    CompletionRequest,
    check_token_ids,
    parse_body,
    parse_json,
    sampling_params,
)
from cluster.router import Router


def create_app(router: Router, tokenizer, config: ClusterConfig, max_model_len: int) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, lifespan=lifespan)
    model_name = config.served_model_name
    limits = config.router.limits
    vocab_size = len(tokenizer)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)  # unknown route, wrong method: the same error body as the rest
    async def _http_error_body(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            APIError(exc.status_code, str(exc.detail), err_type=err_type).body(),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}", err_type="server_error").body(), 500)

    expected_auth = None if config.router.api_key is None else f"Bearer {config.router.api_key}".encode()

    def check_api_key(request: Request) -> None:
        if expected_auth is None:
            return
        given = request.headers.get("authorization", "").encode("latin-1")  # the raw bytes (ASGI decodes latin-1)
        if not hmac.compare_digest(given, expected_auth):
            raise APIError(
                401,
                "missing or wrong API key (Authorization: Bearer ...)",
                err_type="authentication_error",
                code="invalid_api_key",
            )

    async def read_json(request: Request):
        check_api_key(request)
        limit = config.router.max_body_bytes
        # the server discards the rest of the body (up to its keep-alive timeout) rather than closing at once: a
        # close with unread data resets the connection, and the client might never see this answer
        too_large = APIError(413, f"request body over {limit} bytes")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():  # counted as it arrives: chunked bodies have no Content-Length
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:
            raise APIError(400, "the client disconnected while sending the body") from None
        return parse_json(b"".join(chunks), limits)

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(
                404, f"The model '{name}' does not exist; this server serves '{model_name}'", "model", "model_not_found"
            )

    def budget(prompt_ids: list[int], asked: int | None, default: int | None, param: str = "max_tokens") -> int:
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", "prompt")
        room = max_model_len - len(prompt_ids)
        if room <= 0:
            raise APIError(
                400,
                f"the prompt has {len(prompt_ids)} tokens; max_model_len is {max_model_len}",
                "prompt",
                "context_length_exceeded",
            )
        if asked is None:
            return min(default, room) if default else room
        if asked <= 0:
            raise APIError(400, f"{param} must be at least 1, got {asked}", param)
        if asked > room:
            raise APIError(
                400,
                f"{param}={asked} plus the prompt's {len(prompt_ids)} tokens exceeds max_model_len {max_model_len}",
                param,
                "context_length_exceeded",
            )
        return asked

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_body(CompletionRequest, await read_json(request), limits)
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", "prompt", "unsupported_parameter")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = tokenizer(prompt, add_special_tokens=True).input_ids if prompt else []
        else:
            prompt_ids = list(prompt)
            check_token_ids(prompt_ids, vocab_size, "prompt")
        params = sampling_params(body, budget(prompt_ids, body.max_tokens, 16), vocab_size)
        return await respond(request, body, prompt_ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_body(ChatRequest, await read_json(request), limits)
        check_model(body.model)
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in body.messages]
        try:
            prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # a template that rejects the conversation is the client's error
            raise APIError(400, f"the chat template rejected the messages: {exc}", "messages") from None
        if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(body, budget(list(prompt_ids), asked, None, param), vocab_size)
        return await respond(request, body, list(prompt_ids), params, chat=True)

    async def respond(request: Request, body, prompt_ids: list[int], params, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        events = router.generate(prompt_ids, params, rid)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            try:  # errors before the first token are still a proper HTTP status
                first = await _unless_disconnected(request, _first_event(events))
            except _ClientGone:
                await events.aclose()
                return Response(status_code=499)
            return StreamingResponse(
                _sse(SSEChunks(rid, created, chat, model_name, include_usage), len(prompt_ids), events, first),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )

        async def collect() -> tuple[str, str | None, int]:
            parts, finish, completion_tokens = [], None, 0
            async for event in events:  # the workers' text, as it is: they detokenized it and cut stop strings
                completion_tokens += event.num_tokens
                parts.append(event.text)
                finish = event.finish_reason
            return "".join(parts), finish, completion_tokens

        try:
            text, finish, completion_tokens = await _unless_disconnected(request, collect())
        except RequestFailed as exc:
            raise _http_error(exc) from None
        except _ClientGone:  # nobody to answer; the router's cleanup has aborted the request on its workers
            return Response(status_code=499)
        finally:
            await events.aclose()
        usage = _usage(len(prompt_ids), completion_tokens)
        choice = {"index": 0, "finish_reason": _finish(finish), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model_name,
            "choices": [choice],
            "usage": usage,
            "timing": router.last_timing.pop(rid, {}),
        }

    async def _sse(chunks: SSEChunks, num_prompt_tokens: int, events, first) -> AsyncIterator[str]:
        """One chunk per event: an event holds everything that arrived since the last one was written, so a client
        that reads slowly (this generator waits on its socket) gets fewer, larger chunks."""
        completion_tokens = 0
        finish = None
        try:
            if chunks.chat:
                yield chunks.role()
            event = first
            if event is not None:
                completion_tokens += event.num_tokens
                if event.text:
                    yield chunks.text(event.text)
                finish = event.finish_reason
            if finish is None and first is not None:
                async for event in events:
                    completion_tokens += event.num_tokens
                    if event.text:
                        yield chunks.text(event.text)
                    if event.finish_reason is not None:
                        finish = event.finish_reason
                        break
            yield chunks.finish(_finish(finish), router.last_timing.pop(chunks.rid, {}))
            if chunks.include_usage:
                yield chunks.usage(_usage(num_prompt_tokens, completion_tokens))
            yield "data: [DONE]\n\n"
        except RequestFailed as exc:
            yield f"data: {json.dumps(_http_error(exc).body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()

    @app.get("/v1/models")
    async def models(request: Request):
        check_api_key(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "pdserve",
                    "max_model_len": max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health():
        """200 while every role has a worker that takes requests (503 otherwise, so a load balancer moves on);
        ``status`` is "degraded" as soon as any worker is dead or reports itself degraded, and says which."""
        roles = ("colocated",) if config.mode == "colocated" else ("prefill", "decode")
        serving = all(router.live(role) for role in roles)
        workers = router.members.workers.values()
        unhealthy = {w.name: w.degraded if w.alive else "dead" for w in workers if not w.alive or w.degraded}
        body = {
            "status": "ok" if serving and not unhealthy else "degraded",
            "mode": config.mode,
            "unhealthy_workers": unhealthy,
        }
        return JSONResponse(body, status_code=200 if serving else 503)

    @app.get("/status")
    async def status(request: Request):
        check_api_key(request)
        return router.status()

    @app.get("/metrics")
    async def metrics(request: Request):
        check_api_key(request)
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class SSEChunks:
    """The SSE events of one response, as ``json.dumps(payload, ensure_ascii=False)`` of the OpenAI chunk would give
    them, byte for byte. A text chunk is a prefix and a suffix made once per request around the JSON string of the
    delta (``encode_basestring``): per chunk, no dict is built and no generic encoder runs."""

    _MARK = "\x00pdserve-delta\x00"  # its JSON form, with its quotes, cannot occur elsewhere in the payload

    def __init__(self, rid: str, created: int, chat: bool, model: str, include_usage: bool) -> None:
        self.rid, self.chat, self.include_usage = rid, chat, include_usage
        self._head = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
        }
        prefix, mark, suffix = self._event(self._choice(self._MARK, None)).partition(encode_basestring(self._MARK))
        assert mark and encode_basestring(self._MARK) not in suffix
        self._prefix, self._suffix = prefix, suffix

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def _event(self, choice: dict, extra: dict | None = None) -> str:
        payload = {**self._head, "choices": [choice]}
        if self.include_usage:
            payload["usage"] = None
        if extra:
            payload.update(extra)
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def text(self, text: str) -> str:
        return self._prefix + encode_basestring(text) + self._suffix

    def role(self) -> str:
        return self._event(self._choice(None, None, role=True))

    def finish(self, reason: str, timing: dict) -> str:
        return self._event(self._choice(None, reason), {"timing": timing})

    def usage(self, usage: dict) -> str:
        return f"data: {json.dumps({**self._head, 'choices': [], 'usage': usage})}\n\n"


class _ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the ASGI server reports the client gone (only call once the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, awaitable):
    """Await ``awaitable``, unless the client disconnects first: then cancel it (so whatever it was iterating, the
    router's generator, is closed and aborts the request on every worker) and raise ``_ClientGone``."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done and watcher.exception() is not None:  # cannot tell: the client may be there, so wait
            await asyncio.wait({work})
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait({work})  # its cleanup (the abort) has run when this returns
    if work.cancelled():
        raise _ClientGone()
    return work.result()


async def _first_event(events):
    """Wait for the first event so an error before any token becomes an HTTP error, not a broken stream."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None
    except RequestFailed as exc:
        await events.aclose()
        raise _http_error(exc) from None


def _http_error(exc: RequestFailed) -> APIError:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None  # overloaded, or a worker restarting
    err_type = (
        "server_error" if exc.status >= 500 else "rate_limit_error" if exc.status == 429 else "invalid_request_error"
    )
    return APIError(exc.status, str(exc), code=exc.code, err_type=err_type, headers=headers)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _finish(reason: str | None) -> str:
    return {"stop": "stop", "length": "length"}.get(reason or "", reason or "stop")
