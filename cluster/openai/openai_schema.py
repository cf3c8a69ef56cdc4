"""OpenAI request bodies: what we accept, what we refuse by name, and the ``APIError`` body every refusal uses.

Checked at the edge, before anything is tokenized (docs/configuration.md, ``router.limits``; docs/api.md); ``param``
names the field as the client wrote it (``messages[3].content``). ``parse_json``: at most ``max_json_depth`` deep
(scanned before parsing, so a 100k-deep ``[[[[`` never reaches the recursive parser); ``parse_body``: the caps, then
the pydantic model (unknown fields refused, int64 integers, finite floats, real bools, null as unset). Known but
unsupported fields (``UNSUPPORTED``) are refused unless neutral. What depends on the model: request_params.py.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from cluster.config import LimitsSection

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_INT_DIGITS = 40  # longer integer literals fit no field (int64 has 19 digits) and cost quadratic time to convert
MAX_MESSAGE_CHARS = 300  # values quoted in an error message are cut to this


def _clean(text: str) -> str:
    """Strings echoed back must encode as UTF-8 (a lone surrogate in a field name would break the response)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def short(value: Any) -> str:
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
    """Stands in for a refused literal, so the walk afterwards can say which field held it."""

    def __init__(self, what: str) -> None:
        self.what = what


def _too_deep(text: str, max_depth: int) -> tuple[bool, str | None]:
    """(nested deeper than ``max_depth``?, the top-level key it happened under), without recursion; the regex
    skips each string literal whole, at C speed."""
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
    """The path of the first value (or dict key) that satisfies ``predicate``; iterative."""
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


def _error_path(data: Any, error: ErrorDetails) -> str | None:
    """The field a pydantic error is about, as the client wrote it (following the location through the data drops
    the union member names pydantic adds, like 'list[int]')."""
    path: list[str | int] = []
    node = data
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
    return isinstance(value, str) and _clean(value) != value  # only a lone surrogate changes


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
        where = _find(data, _not_utf8)
        if where is not None:
            raise APIError(
                400, f"{format_path(where)}: a lone UTF-16 surrogate (\\ud800-\\udfff) is not text", format_path(where)
            )
    return data


# ---- 2. the request models -------------------------------------------------------------------------------------

MAX_N = 128  # choices per prompt (``n``); router.limits.max_choices caps prompts x n
MAX_TOP_LOGPROBS = 20  # chat ``top_logprobs`` (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # completions ``logprobs`` (OpenAI's limit)

# OpenAI fields this server does not implement: accepted only at these neutral values, else a 400 naming them
UNSUPPORTED: dict[str, tuple] = {
    "suffix": (None, ""),
    "functions": (None,),
    "function_call": (None,),
    "store": (None, False),
    "metadata": (None, {}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"),
    "web_search_options": (None,),
    "verbosity": (None,),
    "moderation": (None,),
    "prompt_cache_retention": (None,),
    "prompt_cache_options": (None,),
}

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=1, le=INT64_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # OpenAI's range for presence/frequency penalties
Choices = Annotated[int, Field(ge=1, le=MAX_N)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = None  # a last chunk with the usage (choices [])
    continuous_usage_stats: StrictBool | None = None  # every chunk carries the usage so far (vLLM)
    include_obfuscation: StrictBool | None = None  # refused when true: no obfuscation padding here


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, allow_inf_nan=False)
    model: str
    max_tokens: Count | None = None
    # unset (or null): the model's generation_config.json, else OpenAI's default (cluster/openai/request_params.py)
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Int64 | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=INT64_MAX)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    seed: Int64 | None = None
    n: Choices | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: StrictBool | None = None
    speculative: StrictBool | None = None  # false: no proposed tokens for this request where the pool speculates
    skip_special_tokens: StrictBool | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user identifier: no effect on the output


class CompletionRequest(_Common):
    # a string, a list of strings, a list of token ids or a list of token-id lists (``prompts`` checks which)
    prompt: Any
    best_of: Choices | None = None  # only equal to n (no server-side ranking)
    echo: StrictBool | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    """Only text parts are served (``cluster/openai/chat_template.py`` refuses the others)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None  # null only where the spec allows it (chat_template.py checks)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    refusal: str | None = None  # assistant: only null (a refusal cannot be rendered by a template)
    function_call: Any = None  # deprecated: only null
    audio: Any = None  # only null


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # checked by cluster/openai/guided.py
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool | None = None  # default: true
    continue_final_message: StrictBool | None = None
    safety_identifier: str | None = None  # identifiers: no effect on the output
    prompt_cache_key: str | None = None
    # refused unless neutral (UNSUPPORTED)
    functions: list | None = None
    function_call: str | dict | None = None
    store: StrictBool | None = None
    metadata: dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    service_tier: str | None = None
    web_search_options: dict | None = None
    verbosity: str | None = None
    moderation: dict | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None


def _check_caps(data: dict, limits: LimitsSection) -> None:
    """On the raw data, before pydantic: a body at the cap costs no more to validate than a normal one."""

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
    n = data.get("n")
    prompt = data.get("prompt")
    if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= MAX_N:
        prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
        name = "prompt" if prompts > 1 else "n"
        cap(name, prompts * n, limits.max_choices, "choices (prompts x n)")


def parse_body(model: type[_Common], data: Any, limits: LimitsSection) -> Any:
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
    for name, neutral in UNSUPPORTED.items():
        value = getattr(request, name, None)
        if not any(value == ok and type(value) is type(ok) for ok in neutral):
            _unsupported(name, value)
    if request.stream_options is not None:
        if not request.stream:  # as OpenAI: options of a stream that is not one would be silently ignored
            raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
        if request.stream_options.include_obfuscation:
            _unsupported("stream_options.include_obfuscation", True)
    best_of = getattr(request, "best_of", None)
    if best_of is not None and best_of != (request.n or 1):
        raise APIError(400, f"best_of={best_of} must equal n={request.n or 1}: choices are not ranked here", "best_of")
    return request


def _unsupported(name: str, value: Any) -> None:
    raise APIError(400, f"'{name}' = {short(value)} is not supported by this server", name, "unsupported_parameter")


def check_token_ids(token_ids: list[int], vocab_size: int, field: str) -> None:
    for i, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise APIError(
                400, f"{field}[{i}]: token id {token} is not in the vocabulary [0, {vocab_size})", f"{field}[{i}]"
            )
