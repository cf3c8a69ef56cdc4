"""From a checked request body to the engine's ``SamplingParams``: the checks that need the model.

Token ids (``stop_token_ids``, ``logit_bias`` keys) are checked against its vocabulary and ``top_k`` against its
size; sampling fields left unset take the model's ``generation_config.json`` defaults, as in vLLM. Choice j of a
seeded request draws with ``seed + j`` (``for_choice``): the choices differ, the response stays reproducible.
``prompts`` reads the four forms of a completions ``prompt``.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.openai.openai_schema import INT64_MAX, INT64_MIN, APIError, check_token_ids, short
from engine.request import GuidedDecoding, SamplingParams

logger = logging.getLogger(__name__)

MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]
# OpenAI's defaults for what neither the request nor the model's generation_config sets
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """The model's recommended sampling values (``generation_config.json``), for fields a request leaves unset."""

    values: dict[str, float | int] = field(default_factory=dict)

    @classmethod
    def from_model_dir(cls, folder: str | Path | None) -> GenerationDefaults:
        """The fields vLLM takes, with sane values; a missing or unreadable file means no defaults."""
        if not folder:
            return cls()
        path = Path(folder) / "generation_config.json"
        try:
            data = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError) as exc:
            logger.warning("ignoring %s: %s", path, exc)
            return cls()
        values: dict[str, float | int] = {}
        for name in OPENAI_DEFAULTS:
            value = data.get(name) if isinstance(data, dict) else None
            if name == "top_k" and isinstance(value, int) and not isinstance(value, bool) and value >= -1:
                values[name] = value
            elif name != "top_k" and isinstance(value, (int, float)) and not isinstance(value, bool):
                if math.isfinite(value) and _in_range(name, float(value)):
                    values[name] = float(value)
        return cls(values)

    def get(self, name: str, asked: Any) -> Any:
        return asked if asked is not None else self.values.get(name, OPENAI_DEFAULTS[name])


def _in_range(name: str, value: float) -> bool:
    if name == "temperature":
        return value >= 0
    if name == "top_p":
        return 0 < value <= 1
    if name == "min_p":
        return 0 <= value <= 1
    return value > 0  # repetition_penalty


def sampling_params(
    request: Any,
    max_tokens: int,
    vocab_size: int,
    defaults: GenerationDefaults,
    *,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    guided: GuidedDecoding | None = None,
) -> SamplingParams:
    """One choice's parameters (``for_choice`` derives the others)."""
    top_k = defaults.get("top_k", request.top_k)
    if top_k not in (-1, 0) and not 1 <= top_k <= vocab_size:
        raise APIError(400, f"top_k must be -1 or 0 (off) or in [1, {vocab_size}], got {top_k}", "top_k")
    stop_token_ids = list(request.stop_token_ids or [])
    check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
    min_tokens = request.min_tokens or 0
    if min_tokens > max_tokens:
        raise APIError(400, f"min_tokens={min_tokens} is more than max_tokens={max_tokens}", "min_tokens")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=defaults.get("temperature", request.temperature),
        top_p=defaults.get("top_p", request.top_p),
        top_k=top_k,
        min_p=defaults.get("min_p", request.min_p),
        repetition_penalty=defaults.get("repetition_penalty", request.repetition_penalty),
        min_tokens=min_tokens,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        logit_bias=logit_bias(request.logit_bias, vocab_size),
        seed=request.seed,
        stop=[request.stop] if isinstance(request.stop, str) else list(request.stop or []),
        stop_token_ids=stop_token_ids,
        ignore_eos=bool(request.ignore_eos),
        speculative=request.speculative is not False,
        skip_special_tokens=request.skip_special_tokens is not False,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        guided=guided,
    )
    try:
        params.validate()
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), name) from None
    return params


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's ``{"<token id>": bias}`` as ``{token id: bias}``; refusals name ``logit_bias.<key>``."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        name = f"logit_bias.{key}"
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 19 else -1
        if not 0 <= token < vocab_size:
            raise APIError(400, f"{name}: {key!r} is not a token id of this model [0, {vocab_size})", name)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise APIError(400, f"{name}: the bias must be in [-100, 100], got {value}", name)
        out[token] = float(value)
    return out


def for_choice(params: SamplingParams, j: int) -> SamplingParams:
    """Choice ``j``'s parameters: its own copy, and ``seed + j`` (wrapped into int64) when the request is seeded."""
    if j == 0:
        return params
    choice = params.copy()
    if params.seed is not None:
        choice.seed = (params.seed + j - INT64_MIN) % 2**64 + INT64_MIN
        assert INT64_MIN <= choice.seed <= INT64_MAX
    return choice


def prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completions request, each a string or token ids (the caller checks them against the
    vocabulary)."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise APIError(400, "prompt must be a string, a list of strings, or a (list of) list(s) of token ids", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(_is_int(t) for t in prompt):
        return [_token_ids(prompt, "prompt")]
    if all(isinstance(p, list) for p in prompt):
        return [_token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    kind = "str" if isinstance(prompt[0], str) else "list" if isinstance(prompt[0], list) else "int"
    bad = next(i for i, p in enumerate(prompt) if not _same_kind(p, kind))
    raise APIError(400, f"prompt[{bad}]: every element must be of the first one's kind ({kind})", f"prompt[{bad}]")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _same_kind(value: Any, kind: str) -> bool:
    return isinstance(value, str) if kind == "str" else isinstance(value, list) if kind == "list" else _is_int(value)


def _token_ids(ids: list, field: str) -> list[int]:
    for i, token in enumerate(ids):
        if not _is_int(token) or not INT64_MIN <= token <= INT64_MAX:
            raise APIError(400, f"{field}[{i}]: {short(token)} is not a token id", f"{field}[{i}]")
    return ids
