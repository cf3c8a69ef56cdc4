"""OpenAI request bodies: what we accept, what we refuse by name, and the error body every refusal uses.

Unknown fields are refused (as OpenAI does: "Unrecognized request argument"), and fields we know but do not support
(``n`` > 1, ``logprobs``, penalties, tools...) are refused by name unless they carry their neutral value, so a client
never silently gets something other than what it asked for.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.request import SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 err_type: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, err_type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# fields we know and accept only at their neutral value
NEUTRAL = {
    "n": 1,
    "best_of": 1,
    "logprobs": None,
    "top_logprobs": None,
    "echo": False,
    "suffix": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "logit_bias": None,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "response_format": None,
    "parallel_tool_calls": None,
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # known, accepted only when neutral (checked in parse_body)
    n: int | None = 1
    best_of: int | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None


def parse_body(model: type[_Common], data: Any) -> _Common:
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            raise APIError(400, f"Unrecognized request argument supplied: {field}", field) from None
        if first["type"] == "missing":
            raise APIError(400, f"'{field}' is a required property", field) from None
        raise APIError(400, f"{field}: {first['msg']}", field) from None
    for name, neutral in NEUTRAL.items():
        value = getattr(request, name, None)
        if value is not None and value != neutral and not (neutral is None and value in (False, 0, {})):
            if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
                continue
            raise APIError(400, f"'{name}' = {value!r} is not supported by this server", name, "unsupported_parameter")
    return request


def sampling_params(request: _Common, max_tokens: int) -> SamplingParams:
    for name in ("temperature", "top_p"):
        value = getattr(request, name)
        if not math.isfinite(value):
            raise APIError(400, f"{name} must be a finite number", name)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        stop=[request.stop] if isinstance(request.stop, str) else list(request.stop or []),
        stop_token_ids=list(request.stop_token_ids or []),
        ignore_eos=request.ignore_eos,
    )
    try:
        params.validate()
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), field) from None
    return params
