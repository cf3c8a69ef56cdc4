"""The OpenAI-compatible HTTP API over a ``Router``: completions and chat, streaming (SSE) and not.

Every refusal is an OpenAI-style error body with the right status (400 bad input, 401 no key, 404 unknown model,
413 body too large, 429 overloaded with Retry-After, 503 no workers); nothing reaches the client as a traceback.
A client that disconnects mid-stream cancels the response generator, and the router's cleanup aborts the request
on every worker that holds it. Each response carries ``usage`` and ``timing`` (where the time went, seconds).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from cluster.config import ClusterConfig
from cluster.detokenizer import Detokenizer
from cluster.openai_schema import APIError, ChatRequest, CompletionRequest, parse_body, sampling_params
from cluster.errors import RequestFailed
from cluster.router import Router


def create_app(router: Router, tokenizer, config: ClusterConfig, max_model_len: int) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, lifespan=lifespan)
    model_name = config.served_model_name

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}", err_type="server_error").body(), 500)

    def check_api_key(request: Request) -> None:
        if config.router.api_key is not None and request.headers.get("authorization") != f"Bearer {config.router.api_key}":
            raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)", err_type="authentication_error",
                           code="invalid_api_key")

    async def read_json(request: Request) -> dict:
        check_api_key(request)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.router.max_body_bytes:
            raise APIError(413, f"request body over {config.router.max_body_bytes} bytes")
        body = await request.body()
        if len(body) > config.router.max_body_bytes:
            raise APIError(413, f"request body over {config.router.max_body_bytes} bytes")
        try:
            return json.loads(body.decode("utf-8"))
        except UnicodeDecodeError:
            raise APIError(400, "the request body is not valid UTF-8") from None
        except json.JSONDecodeError as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc.msg}") from None

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{model_name}'", "model",
                           "model_not_found")

    def budget(prompt_ids: list[int], asked: int | None, default: int | None) -> int:
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", "prompt")
        room = max_model_len - len(prompt_ids)
        if room <= 0:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; max_model_len is {max_model_len}",
                           "prompt", "context_length_exceeded")
        if asked is None:
            return min(default, room) if default else room
        if asked <= 0:
            raise APIError(400, f"max_tokens must be at least 1, got {asked}", "max_tokens")
        if asked > room:
            raise APIError(400, f"max_tokens={asked} plus the prompt's {len(prompt_ids)} tokens exceeds max_model_len "
                           f"{max_model_len}", "max_tokens", "context_length_exceeded")
        return asked

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_body(CompletionRequest, await read_json(request))
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
            if any(t < 0 or t >= len(tokenizer) for t in prompt_ids):
                raise APIError(400, "prompt token ids must be in the vocabulary", "prompt")
        params = sampling_params(body, budget(prompt_ids, body.max_tokens, 16))
        return await respond(request, body, prompt_ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_body(ChatRequest, await read_json(request))
        check_model(body.model)
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in body.messages]
        try:
            prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # a template that rejects the conversation is the client's error
            raise APIError(400, f"the chat template rejected the messages: {exc}", "messages") from None
        if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(body, budget(list(prompt_ids), asked, None))
        return await respond(request, body, list(prompt_ids), params, chat=True)

    async def respond(request: Request, body, prompt_ids: list[int], params, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        detok = Detokenizer(tokenizer, params.stop)
        events = router.generate(prompt_ids, params, rid)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            first = await _first_event(events)  # errors before the first token are still a proper HTTP status
            return StreamingResponse(
                _sse(rid, created, chat, prompt_ids, detok, events, first, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        text, finish, completion_tokens = "", None, 0
        try:
            async for event in events:
                completion_tokens += len(event.token_ids)
                text += detok.add(event.token_ids, final=event.finish_reason is not None)
                if detok.stopped:
                    finish = "stop"
                    break
                finish = event.finish_reason
        except RequestFailed as exc:
            raise _http_error(exc) from None
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

    async def _sse(rid, created, chat, prompt_ids, detok, events, first, include_usage) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_text: str | None, finish: str | None, role: bool = False, extra: dict | None = None) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if delta_text is None else {"content": delta_text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
            payload = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            if extra:
                payload.update(extra)
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        completion_tokens = 0
        finish = None
        try:
            if chat:
                yield chunk(None, None, role=True)
            pending = [first] if first is not None else []
            async for event in _chain(pending, events):
                completion_tokens += len(event.token_ids)
                final = event.finish_reason is not None
                delta = detok.add(event.token_ids, final=final)
                if detok.stopped:
                    finish = "stop"
                elif final:
                    finish = event.finish_reason
                if delta:
                    yield chunk(delta, None)
                if finish is not None:
                    break
            yield chunk(None, _finish(finish), extra={"timing": router.last_timing.pop(rid, {})})
            if include_usage:
                usage_chunk = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [],
                               "usage": _usage(len(prompt_ids), completion_tokens)}
                yield f"data: {json.dumps(usage_chunk)}\n\n"
            yield "data: [DONE]\n\n"
        except RequestFailed as exc:
            yield f"data: {json.dumps(_http_error(exc).body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()

    @app.get("/v1/models")
    async def models(request: Request):
        check_api_key(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "pdserve",
                                             "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        status = router.status()
        roles = ("colocated",) if config.mode == "colocated" else ("prefill", "decode")
        ok = all(any(w["alive"] for w in status["workers"] if w["role"] == r) for r in roles)
        return JSONResponse({"status": "ok" if ok else "degraded", "mode": config.mode}, status_code=200 if ok else 503)

    @app.get("/status")
    async def status():
        return router.status()

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _first_event(events):
    """Wait for the first event so an error before any token becomes an HTTP error, not a broken stream."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None
    except RequestFailed as exc:
        await events.aclose()
        raise _http_error(exc) from None


async def _chain(first: list, rest):
    for event in first:
        yield event
        if event.finish_reason is not None:
            return
    async for event in rest:
        yield event


def _http_error(exc: RequestFailed) -> APIError:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None  # overloaded, or a worker restarting
    err_type = "server_error" if exc.status >= 500 else "rate_limit_error" if exc.status == 429 else "invalid_request_error"
    return APIError(exc.status, str(exc), code=exc.code, err_type=err_type, headers=headers)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finish(reason: str | None) -> str:
    return {"stop": "stop", "length": "length"}.get(reason or "", reason or "stop")
