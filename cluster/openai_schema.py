"""OpenAI request bodies: what we accept, what we refuse by name, and the error body every refusal uses.

Everything a client sends is checked here, at the edge, before it is tokenized or put on the wire to a worker:

1. ``parse_json``: the body is UTF-8 JSON nested at most ``max_json_depth`` deep (a cheap scan of the text before
   parsing, so a 100k-deep ``[[[[`` never reaches the recursive parser), with no ``NaN`` / ``Infinity`` literals,
   no integer literal longer than any field could hold, and no lone UTF-16 surrogate (which no tokenizer or
   msgpack can encode). A refusal names the field it found the problem in.
2. ``parse_body``: the caps of ``router.limits`` (stop strings, stop ids, logit_bias, messages, content parts), then
   the pydantic model: unknown fields are refused (as OpenAI does: "Unrecognized request argument"), integers that
   travel to workers are int64, floats are finite, bools are real bools. Fields we know but do not support
   (``n`` > 1, ``logprobs``, penalties, tools...) are refused by name unless they carry their neutral value, so a
   client never silently gets something other than what it asked for.
3. ``sampling_params``: what depends on the model (token ids and ``top_k`` against the vocabulary).

Every refusal is an ``APIError`` whose ``param`` names the field the way a client wrote it (``messages[3].content``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from cluster.config import LimitsSection
from engine.request import SamplingParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_INT_DIGITS = 40  # longer integer literals fit no field (int64 has 19 digits) and cost quadratic time to convert
MAX_MESSAGE_CHARS = 300  # values quoted in an error message are cut to this


def _clean(text: str) -> str:
    """Strings echoed back must encode as UTF-8 (a lone surrogate in a field name would break the response)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        err_type: str = "invalid_request_error",
        headers: dict | None = None,
    ) -> None:
        message, param = _clean(message), None if param is None else _clean(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, err_type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---- 1. the JSON text ------------------------------------------------------------------------------------------

_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.S)  # a whole string literal, or one bracket
_KEY_COLON = re.compile(r"\s*:")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


class _BadLiteral:
    """Stands in for a literal the parser met but we refuse, so the walk afterwards can say which field held it."""

    def __init__(self, what: str) -> None:
        self.what = what


def _too_deep(text: str, max_depth: int) -> tuple[bool, str | None]:
    """(nested deeper than ``max_depth``?, the top-level key it happened under), without recursion.

    Brackets inside string literals do not count; the regex skips each literal whole, at C speed."""
    if text.count("[") + text.count("{") <= max_depth:
        return False, None
    depth, key = 0, None
    for match in _TOKENS.finditer(text):
        char = text[match.start()]
        if char == '"':
            if depth == 1 and match.end() - match.start() <= 66 and _KEY_COLON.match(text, match.end()):
                try:
                    key = json.loads(match.group())
                except ValueError:  # a malformed escape: the parser would refuse the body anyway
                    key = None
        elif char in "[{":
            depth += 1
            if depth > max_depth:
                return True, key
        else:
            depth -= 1
    return False, None


def _find(data: Any, predicate) -> tuple | None:
    """The path of the first value (or dict key) that satisfies ``predicate``; iterative, any depth."""
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if predicate(value):
            return path
        if isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                if predicate(key):
                    return path + (key,)
                stack.append((path + (key,), item))
        elif isinstance(value, list):
            stack.extend((path + (i,), value[i]) for i in reversed(range(len(value))))
    return None


def format_path(path: tuple | list) -> str | None:
    """('messages', 3, 'content') -> 'messages[3].content'."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text or None


def _error_path(data: Any, error: dict) -> str | None:
    """The field a pydantic error is about, as the client wrote it: the location is followed through the data itself,
    which drops the names pydantic adds for the member of a union it tried ('str', 'list[int]')."""
    path, node = [], data
    for i, part in enumerate(error["loc"]):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            path.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(part)
            node = node[part]
        elif error["type"] == "missing" and i == len(error["loc"]) - 1:
            path.append(part)
    return format_path(path)


def _not_utf8(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_json(body: bytes, limits: LimitsSection) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8") from None
    deep, key = _too_deep(text, limits.max_json_depth)
    if deep:
        raise APIError(400, f"the request body is nested more than {limits.max_json_depth} levels deep", key)
    refused: list[_BadLiteral] = []

    def constant(name: str) -> _BadLiteral:
        refused.append(_BadLiteral(f"{name} is not valid JSON (numbers must be finite)"))
        return refused[-1]

    def integer(digits: str) -> int | _BadLiteral:
        if len(digits) - digits.startswith("-") > MAX_INT_DIGITS:
            refused.append(_BadLiteral(f"an integer of {len(digits)} digits is out of range"))
            return refused[-1]
        return int(digits)

    try:
        data = json.loads(text, parse_constant=constant, parse_int=integer)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} (char {exc.pos})") from None
    except (RecursionError, ValueError) as exc:  # the depth scan should make these impossible; still never a 500
        raise APIError(400, f"the request body is not valid JSON: {type(exc).__name__}") from None
    if refused:
        path = format_path(_find(data, lambda v: isinstance(v, _BadLiteral)) or ())
        what = next(r.what for r in refused)
        raise APIError(400, f"{path}: {what}" if path else what, path)
    if _SURROGATE_ESCAPE.search(text):
        path = _find(data, _not_utf8)
        if path is not None:
            raise APIError(
                400, f"{format_path(path)}: a lone UTF-16 surrogate (\\ud800-\\udfff) is not text", format_path(path)
            )
    return data


# ---- 2. the request models -------------------------------------------------------------------------------------

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

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=1, le=INT64_MAX)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, allow_inf_nan=False)
    model: str
    max_tokens: Count | None = None
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: Int64 = 0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # known, accepted only when neutral (checked in parse_body)
    n: Annotated[int, Field(ge=1, le=128)] | None = 1
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: StrictBool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]  # token ids are checked against the vocabulary by the API
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
    max_completion_tokens: Count | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None


def _check_caps(data: dict, limits: LimitsSection) -> None:
    """Counts and lengths, on the raw data: a body at the cap costs nothing more to validate than a normal one."""

    def cap(name: str, count: int, limit: int, what: str) -> None:
        if count > limit:
            raise APIError(400, f"{name}: {count} {what}; at most {limit} are allowed (router.limits)", name)

    stop = data.get("stop")
    if isinstance(stop, list):
        cap("stop", len(stop), limits.max_stop_strings, "stop strings")
    for i, text in enumerate(stop if isinstance(stop, list) else [stop]):
        if isinstance(text, str) and len(text) > limits.max_stop_string_chars:
            name = f"stop[{i}]" if isinstance(stop, list) else "stop"
            raise APIError(
                400,
                f"{name}: a stop string of {len(text)} characters; at most "
                f"{limits.max_stop_string_chars} are allowed (router.limits)",
                name,
            )
    if isinstance(data.get("stop_token_ids"), list):
        cap("stop_token_ids", len(data["stop_token_ids"]), limits.max_stop_token_ids, "stop token ids")
    if isinstance(data.get("logit_bias"), dict):
        cap("logit_bias", len(data["logit_bias"]), limits.max_logit_bias_entries, "entries")
    messages = data.get("messages")
    if isinstance(messages, list):
        cap("messages", len(messages), limits.max_messages, "messages")
        for i, message in enumerate(messages):
            if isinstance(message, dict) and isinstance(message.get("content"), list):
                cap(f"messages[{i}].content", len(message["content"]), limits.max_content_parts, "content parts")


def parse_body(model: type[_Common], data: Any, limits: LimitsSection) -> _Common:
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_caps(data, limits)
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        # the most specific location: for a union (str | list[ContentPart]) the member that got furthest
        first = max(exc.errors(), key=lambda e: len(_error_path(data, e) or ""))
        field = _error_path(data, first)
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
            raise APIError(
                400, f"'{name}' = {_short(value)} is not supported by this server", name, "unsupported_parameter"
            )
    return request


# ---- 3. what depends on the model ------------------------------------------------------------------------------


def check_token_ids(token_ids: list[int], vocab_size: int, field: str) -> None:
    for i, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise APIError(
                400, f"{field}[{i}]: token id {token} is not in the vocabulary [0, {vocab_size})", f"{field}[{i}]"
            )


def sampling_params(request: _Common, max_tokens: int, vocab_size: int) -> SamplingParams:
    for name in ("temperature", "top_p"):  # the model already refuses these; kept as the contract of this function
        if not math.isfinite(getattr(request, name)):
            raise APIError(400, f"{name} must be a finite number", name)
    if request.top_k not in (-1, 0) and not 1 <= request.top_k <= vocab_size:
        raise APIError(400, f"top_k must be -1 or 0 (off) or in [1, {vocab_size}], got {request.top_k}", "top_k")
    stop_token_ids = list(request.stop_token_ids or [])
    check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        stop=[request.stop] if isinstance(request.stop, str) else list(request.stop or []),
        stop_token_ids=stop_token_ids,
        ignore_eos=request.ignore_eos,
    )
    try:
        params.validate()
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), field) from None
    return params
