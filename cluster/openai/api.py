"""The OpenAI-compatible HTTP API over a ``Router``: completions and chat, streaming (SSE) and not.

1. ``authorized``: the API key (every route but ``/health``, which load balancers probe); ``read_json``: the size
   limit counted while reading (chunked bodies too), then ``openai_schema.py``'s checks;
2. ``request_params.py`` (what depends on the model), ``chat_template.py``, ``guided.py`` (response_format / tools);
3. one router request per choice (``choices.py``), the answer assembled in ``responses.py``.
Every refusal is an OpenAI error body with its status and the field in ``param``, never a traceback. A client that
disconnects (mid-stream, or seen by a watcher on ``http.disconnect``) aborts every choice on every worker.

The routes are module-level (``routes``); what they share (router, config, tokenizer, limits) is one ``Serving``,
built by ``create_app`` into ``app.state`` and handed to each route by the ``get_serving`` dependency.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cluster.admin_token import admin_credential
from cluster.config import ClusterConfig, LimitsSection, pool_layout
from cluster.openai.api_format import TokenText, system_fingerprint
from cluster.openai.chat_template import render
from cluster.openai.chat_tools import chat_tools, model_vocab_size
from cluster.openai.choices import ChoicePlan, choice_id, fan_out
from cluster.openai.openai_schema import (
    APIError,
    ChatRequest,
    CompletionRequest,
    check_token_ids,
    parse_body,
    parse_json,
)
from cluster.openai.request_params import GenerationDefaults, for_choice, prompts, sampling_params
from cluster.openai.responses import ResponseShape, collect, http_error, stream
from cluster.openai.tracing import TraceRequests
from cluster.routing.errors import RequestFailed, ScaleError
from cluster.routing.router import Router
from engine.blocks import DTYPE_BYTES, kv_bytes_per_token, kv_shape_from_config

logger = logging.getLogger(__name__)
routes = APIRouter()


@dataclass(slots=True)
class Serving:
    """What the routes share, built once per app by ``create_app`` and kept on ``app.state.serving``."""

    router: Router
    tokenizer: Any
    config: ClusterConfig
    max_model_len: int
    defaults: GenerationDefaults  # sampling values a request leaves unset
    model_name: str
    limits: LimitsSection
    vocab_size: int
    model_vocab: int  # the model's logits width (may exceed the tokenizer's)
    fingerprint: str
    token_text: TokenText
    kv_status: dict | None  # /status's ``kv``
    expected_auth: bytes | None  # b"Bearer <api_key>"; None: no key
    admin_auth: bytes  # /admin/*: the API key's, else b"Bearer <admin token>" (cluster/admin_token.py)

    def check_api_key(self, request: Request) -> None:
        if self.expected_auth is not None:
            _check_bearer(request, self.expected_auth, "missing or wrong API key (Authorization: Bearer ...)")

    def check_admin(self, request: Request) -> None:
        _check_bearer(
            request,
            self.admin_auth,
            "missing or wrong admin credential (Authorization: Bearer <router.api_key, or the admin token that "
            "pdserve serve wrote for this address; pdserve scale reads it>)",
        )

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            message = f"The model '{name}' does not exist; this server serves '{self.model_name}'"
            raise APIError(404, message, "model", "model_not_found")

    def budget(
        self,
        prompt_ids: list[int],
        asked: int | None,
        default: int | None,
        param: str = "max_tokens",
        prompt_field: str = "prompt",
    ) -> int:
        """The tokens a choice may generate: ``asked`` if the prompt leaves room for it, else ``default`` capped by
        the room; 400 naming ``param`` or ``prompt_field``."""
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", prompt_field)
        max_model_len = self.max_model_len
        room = max_model_len - len(prompt_ids)
        if room <= 0:
            raise APIError(
                400,
                f"the prompt has {len(prompt_ids)} tokens; max_model_len is {max_model_len}",
                prompt_field,
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

    def shape(self, body, prompt_ids: list[list[int]], params: list, chat: bool) -> ResponseShape:
        """Prompt p's choice j is index p * n + j, seeded seed + j, led by its choice 0."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        n = body.n or 1
        plans = []
        for p, (ids, base) in enumerate(zip(prompt_ids, params)):
            for j in range(n):
                index = p * n + j
                leader = None if j == 0 else p * n
                plans.append(ChoicePlan(index, p, ids, for_choice(base, j), choice_id(rid, index), leader))
        options = body.stream_options
        return ResponseShape(
            rid=rid,
            created=int(time.time()),
            chat=chat,
            model=self.model_name,
            fingerprint=self.fingerprint,
            plans=plans,
            prompt_tokens=sum(len(ids) for ids in prompt_ids),
            token_text=self.token_text,
            include_usage=bool(options and options.include_usage),
            continuous_usage=bool(options and options.continuous_usage_stats),
        )


def _check_bearer(request: Request, expected: bytes, message: str) -> None:
    given = request.headers.get("authorization", "").encode("latin-1")  # the raw bytes (ASGI decodes latin-1)
    if not hmac.compare_digest(given, expected):
        raise APIError(401, message, err_type="authentication_error", code="invalid_api_key")


async def get_serving(request: Request) -> Serving:
    return request.app.state.serving


ServingDep = Annotated[Serving, Depends(get_serving)]


async def authorized(request: Request, serving: ServingDep) -> None:
    """Every route but ``/health`` (which load balancers probe) needs the API key, checked before the body is read."""
    serving.check_api_key(request)


AUTHORIZED = [Depends(authorized)]


async def admin_authorized(request: Request, serving: ServingDep) -> None:
    """``/admin/*`` needs a credential even on loopback, where any local process can connect."""
    serving.check_admin(request)


ADMIN_AUTHORIZED = [Depends(admin_authorized)]


def create_app(
    router: Router,
    tokenizer,
    config: ClusterConfig,
    max_model_len: int,
    generation_defaults: GenerationDefaults | None = None,
) -> FastAPI:
    """``generation_defaults``: for sampling values a request leaves unset (default: the tokenizer folder's
    generation_config.json)."""
    model_dir = getattr(tokenizer, "name_or_path", None)
    api_key = config.router.api_key
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, lifespan=_lifespan)
    app.state.serving = Serving(
        router=router,
        tokenizer=tokenizer,
        config=config,
        max_model_len=max_model_len,
        defaults=generation_defaults or GenerationDefaults.from_model_dir(model_dir),
        model_name=config.served_model_name,
        limits=config.router.limits,
        vocab_size=len(tokenizer),
        model_vocab=model_vocab_size(tokenizer),
        fingerprint=system_fingerprint(config.served_model_name, config.mode),
        token_text=TokenText(tokenizer),
        kv_status=model_kv_status(config, model_dir),  # config.json read once
        expected_auth=None if api_key is None else f"Bearer {api_key}".encode(),
        admin_auth=f"Bearer {admin_credential(config)}".encode(),
    )
    app.exception_handler(APIError)(_api_error)
    app.exception_handler(StarletteHTTPException)(_http_error_body)
    app.exception_handler(Exception)(_unexpected)
    app.include_router(routes)
    if router.tracing is not None:
        app.add_middleware(TraceRequests, tracing=router.tracing)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    router = app.state.serving.router
    await router.start()
    yield
    await router.close()


def _error_response(request: Request, error: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """Every error body the API answers with, counted (``pdserve_http_errors_total{status, type}``)."""
    request.app.state.serving.router.metrics.http_errors.labels(str(error.status), error.type).inc()
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return _error_response(request, exc, exc.headers)


async def _http_error_body(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """An unknown route or a wrong method: the same error body as the rest."""
    err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error_response(request, APIError(exc.status_code, str(exc.detail), err_type=err_type), exc.headers)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    return _error_response(request, APIError(500, f"internal error: {type(exc).__name__}", err_type="server_error"))


async def read_json(request: Request, serving: Serving):
    """The body as JSON, within ``router.max_body_bytes`` (413 past it) and the request limits."""
    limit = serving.config.router.max_body_bytes
    # the server discards the rest of the body rather than closing at once: a close with unread data resets the
    # connection, and the client might never see this answer
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
    return parse_json(b"".join(chunks), serving.limits)


# ---- generation ---------------------------------------------------------------------------------------------------


@routes.post("/v1/completions", dependencies=AUTHORIZED)
async def completions(request: Request, serving: ServingDep):
    body = parse_body(CompletionRequest, await read_json(request, serving), serving.limits)
    serving.check_model(body.model)
    tokenizer, vocab_size, defaults = serving.tokenizer, serving.vocab_size, serving.defaults
    items = prompts(body.prompt)
    logprobs = body.logprobs
    prompt_logprobs = logprobs if body.echo else None
    prompt_ids, echo, params = [], [], []
    for i, prompt in enumerate(items):
        field = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=True).input_ids if prompt else []
            echo.append(prompt)
        else:
            ids = list(prompt)
            check_token_ids(ids, vocab_size, field)
            echo.append(tokenizer.decode(ids) if body.echo else "")
        max_tokens = serving.budget(ids, body.max_tokens, 16, prompt_field=field)
        prompt_ids.append(ids)
        params.append(
            sampling_params(body, max_tokens, vocab_size, defaults, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        )
    shape = serving.shape(body, prompt_ids, params, chat=False)
    shape.logprobs, shape.echo = logprobs, echo if body.echo else None
    return await respond(request, serving.router, body, shape)


@routes.post("/v1/chat/completions", dependencies=AUTHORIZED)
async def chat_completions(request: Request, serving: ServingDep):
    body = parse_body(ChatRequest, await read_json(request, serving), serving.limits)
    serving.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    tokenizer = serving.tokenizer
    tools = None
    if body.tools is not None or body.response_format is not None or body.tool_choice is not None:
        tools = await asyncio.to_thread(chat_tools, body, tokenizer, serving.model_vocab)  # may compile: off the loop
    prompt_ids = render(tokenizer, body, tools.template_tools if tools else None)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(
        body,
        serving.budget(prompt_ids, asked, None, param),
        serving.vocab_size,
        serving.defaults,
        logprobs=logprobs,
        guided=tools.guided if tools else None,
    )
    shape = serving.shape(body, [prompt_ids], [params], chat=True)
    shape.logprobs, shape.tools = logprobs, tools.reader if tools else None
    return await respond(request, serving.router, body, shape)


async def respond(request: Request, router: Router, body, shape: ResponseShape):
    """Stream or collect the choices' events; a client gone before the answer is a 499 (its choices aborted)."""
    events = fan_out(router, shape.plans)
    if body.stream:
        try:  # errors before the first token are still a proper HTTP status
            first = await _unless_disconnected(request, _first_event(events))
        except _ClientGone:
            await events.aclose()
            return Response(status_code=499)
        return StreamingResponse(
            stream(router, shape, events, first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        return await _unless_disconnected(request, collect(router, shape, events))
    except RequestFailed as exc:
        raise http_error(exc) from None
    except _ClientGone:  # nobody to answer; the router's cleanup has aborted every choice on its workers
        return Response(status_code=499)
    finally:
        await events.aclose()


# ---- the server ---------------------------------------------------------------------------------------------------


@routes.get("/v1/models", dependencies=AUTHORIZED)
async def models(serving: ServingDep):
    return {
        "object": "list",
        "data": [
            {
                "id": serving.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "pdserve",
                "max_model_len": serving.max_model_len,
            }
        ],
    }


@routes.get("/health")
async def health(serving: ServingDep):
    """200 while every role has a worker that takes requests, else 503 (a load balancer moves on); ``status`` is
    "degraded" while any worker is dead or degraded."""
    config, router = serving.config, serving.router
    roles = ("colocated",) if config.mode == "colocated" else ("prefill", "decode")
    live = all(router.live(role) for role in roles)
    workers = router.members.workers.values()
    unhealthy = {w.name: w.degraded if w.alive else "dead" for w in workers if not w.alive or w.degraded}
    body = {
        "status": "ok" if live and not unhealthy else "degraded",
        "mode": config.mode,
        "unhealthy_workers": unhealthy,
    }
    return JSONResponse(body, status_code=200 if live else 503)


@routes.get("/status", dependencies=AUTHORIZED)
async def status(serving: ServingDep):
    return {**serving.router.status(), "kv": serving.kv_status}


async def admin_body(request: Request, serving: Serving, fields: set[str]) -> dict:
    """An admin call's JSON object; 400 naming an unknown field."""
    body = await read_json(request, serving)
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r}", unknown[0])
    return body


@routes.post("/admin/scale", dependencies=ADMIN_AUTHORIZED)
async def admin_scale(request: Request, serving: ServingDep):
    """``{"pool": "decode", "replicas": N, "drain_timeout_s": S}`` -> the pools once the new workers serve
    (cluster/run/scaling.py)."""
    body = await admin_body(request, serving, {"pool", "replicas", "drain_timeout_s"})
    scaler = serving.router.scaler
    if scaler is None:
        raise APIError(503, "this router cannot resize its pools", err_type="server_error")
    try:
        return await scaler.scale_async(body.get("pool"), body.get("replicas"), body.get("drain_timeout_s"))
    except ScaleError as exc:
        raise APIError(400, str(exc), exc.param) from None


@routes.post("/admin/role", dependencies=ADMIN_AUTHORIZED)
async def admin_role(request: Request, serving: ServingDep):
    """``{"worker": NAME, "to": "prefill" | "decode", "drain_timeout_s": S, "wait": bool}`` -> the switch's record
    and the pools (cluster/run/role_switch.py); with ``wait``, once the switch has ended."""
    body = await admin_body(request, serving, {"worker", "to", "drain_timeout_s", "wait"})
    scaler = serving.router.scaler
    if scaler is None:
        raise APIError(503, "this router cannot switch workers' roles", err_type="server_error")
    try:
        return await scaler.switch_role_async(
            body.get("worker"), body.get("to"), body.get("drain_timeout_s"), body.get("wait", False)
        )
    except ScaleError as exc:
        raise APIError(400, str(exc), exc.param) from None


@routes.post("/admin/migrate", dependencies=ADMIN_AUTHORIZED)
async def admin_migrate(request: Request, serving: ServingDep):
    """``{"request_id": ID}`` or ``{"worker": NAME}``, optionally ``"to": NAME``: move that running request, or
    every one the decode worker runs, to another decode worker -> ``{"moving": {id: "moving" | why not}}``. Each
    router process moves the requests it holds (a worker's all: ``pdserve scale`` or a drain)."""
    body = await admin_body(request, serving, {"request_id", "worker", "to"})
    for field in ("request_id", "worker", "to"):
        if body.get(field) is not None and not isinstance(body[field], str):
            raise APIError(400, f"{field} must be a string", field)
    if (body.get("request_id") is None) == (body.get("worker") is None):
        raise APIError(400, "give exactly one of request_id and worker", "request_id")
    router = serving.router
    worker, target = body.get("worker"), body.get("to")
    known = router.members.workers
    for field, name in (("worker", worker), ("to", target)):
        if name is not None and (name not in known or known[name].role != "decode"):
            raise APIError(400, f"{field}: {name!r} is not a decode worker", field)
    moving = router.migrate(body.get("request_id"), worker, target)
    if body.get("request_id") is not None and not moving:
        raise APIError(404, f"no request {body['request_id']!r} in flight here", "request_id")
    return {"moving": moving}


@routes.get("/metrics", dependencies=AUTHORIZED)
async def metrics(serving: ServingDep):
    return Response(serving.router.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def model_kv_status(config: ClusterConfig, model_dir: str | None) -> dict | None:
    """/status's ``kv``: the model's KV bytes per token and, per pool, what each replica's cache holds (the engine's
    own rule). None when config.json is unreadable (a tokenizer not loaded from a model folder)."""
    path = Path(model_dir or "") / "config.json"
    try:
        layers, kv_heads, head_dim = kv_shape_from_config(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        logger.warning("no KV sizing in /status: %s: %s", path, exc)
        return None
    per_token = kv_bytes_per_token(layers, kv_heads, head_dim, DTYPE_BYTES[config.served_dtype])
    block_size = config.transfer.block_size
    pools = {}
    for name, role, pool in pool_layout(config):
        blocks = config.pool_kv_blocks(pool, per_token * block_size, kv_heads)
        pools[name] = {
            "role": role.value,
            "replicas": pool.replicas,
            "tensor_parallel_size": pool.tensor_parallel_size,
            "expert_parallel_size": pool.expert_parallel_size,
            "kv_memory_mb": pool.kv_memory_mb,
            "kv_blocks": pool.kv_blocks,
            # per replica; None: a GPU pool sizes its cache from measured free memory at start (gpu_memory_utilization)
            "blocks": blocks,
            "tokens": None if blocks is None else blocks * block_size,
            "kv_bytes": None if blocks is None else blocks * block_size * per_token,
        }
    return {
        "dtype": config.served_dtype,
        "bytes_per_token": per_token,
        "tokens_per_gib": (1 << 30) // per_token,
        "block_size": block_size,
        "pools": pools,
    }


class _ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    """Only call once the body has been read."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, awaitable):
    """Await ``awaitable``, unless the client disconnects first: then cancel it (closing the router's generator,
    which aborts the request on every worker) and raise ``_ClientGone``."""
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
    """The first event, so that an error before any token is an HTTP error, not a broken stream."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None
    except RequestFailed as exc:
        await events.aclose()
        raise http_error(exc) from None
