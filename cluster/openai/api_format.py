"""The OpenAI response pieces: log probabilities, usage, the system fingerprint, and the SSE chunks of a stream.

Workers' ``TokenLogprob`` get the shapes clients parse. Chat: ``{"content": [{token, logprob, bytes, top_logprobs}]}``.
Completions (the legacy shape lm-eval-harness reads): ``{tokens, token_logprobs, top_logprobs: [{token: logprob}],
text_offset}``; each top map also holds the chosen token (OpenAI: "up to logprobs + 1 elements") and an echoed
prompt's first token has None. A token's string is ``tokenizer.decode([id])``; a logprob that is not finite is
-9999.0, as in vLLM (JSON has no -Infinity). Plain text chunks are the router's hot path: ``SSEChunks`` wraps the
text's JSON string in a prefix and suffix made once per choice, with no dict and no generic encoder.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
from collections.abc import Sequence
from json.encoder import encode_basestring  # what json.dumps(str, ensure_ascii=False) does, without the rest

from engine.request import TokenLogprob

NO_PROBABILITY = -9999.0


def system_fingerprint(model_name: str, mode: str) -> str:
    """Stable for one server build and configuration."""
    try:
        version = importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        version = "dev"
    digest = hashlib.sha256(f"{model_name}\x00{mode}".encode()).hexdigest()[:10]
    return f"pdserve-{version}-{digest}"


class TokenText:
    """Token id -> its text, decoded once per id (a vocabulary is bounded)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NO_PROBABILITY


def chat_logprobs(entries: list[TokenLogprob], top_n: int, text: TokenText) -> list[dict]:
    out = []
    for entry in entries:
        token = text(entry.token_id)
        out.append(
            {
                "token": token,
                "logprob": _value(entry.logprob),
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": (alt := text(token_id)), "logprob": _value(lp), "bytes": list(alt.encode())}
                    for token_id, lp in entry.top[:top_n]
                ],
            }
        )
    return out


class CompletionLogprobs:
    """One choice's completions-style logprobs; ``text_offset`` runs on across a stream's chunks, echo included."""

    def __init__(self, text: TokenText) -> None:
        self._text = text
        self.offset = 0

    def piece(self, token_ids: list[int], entries: Sequence[TokenLogprob | None]) -> dict:
        """The block for ``token_ids`` (one entry each; None: a prompt's first token)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, entry in zip(token_ids, entries):
            token = self._text(token_id)
            tokens.append(token)
            offsets.append(self.offset)
            self.offset += len(token)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_value(entry.logprob))
            top: dict[str, float] = {}
            for alt, lp in entry.top:  # most likely first: where two tokens read the same ("\ufffd"), the likelier
                top.setdefault(self._text(alt), _value(lp))
            top.setdefault(token, _value(entry.logprob))
            top_logprobs.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }


def join_completion_logprobs(pieces: list[dict]) -> dict:
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for piece in pieces:
        for key, values in piece.items():
            out[key].extend(values)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """The usage block; with ``cached_tokens`` (the final one) also ``prompt_tokens_details``."""
    out: dict = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


class SSEChunks:
    """The SSE events of one response; with ``usage_key`` every chunk has a ``usage`` (null, or the running usage
    for ``continuous_usage_stats``)."""

    _MARK = "\x00pdserve-delta\x00"  # its JSON form, with its quotes, cannot occur elsewhere in the payload

    def __init__(
        self, rid: str, created: int, chat: bool, model: str, fingerprint: str, usage_key: bool, continuous: bool
    ) -> None:
        self.rid, self.chat, self.usage_key, self.continuous = rid, chat, usage_key or continuous, continuous
        self._head = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": fingerprint,
        }
        self._templates: dict[int, tuple[str, str]] = {}

    def _choice(self, index: int, text: str | None, delta: dict | None, logprobs, finish: str | None) -> dict:
        if self.chat:
            if delta is None:
                delta = {} if text is None else {"content": text}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def _event(self, choice: dict, usage: dict | None = None, extra: dict | None = None) -> str:
        payload: dict[str, object] = {**self._head, "choices": [choice]}
        if self.usage_key:
            payload["usage"] = usage
        if extra:
            payload.update(extra)
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def text(self, index: int, text: str) -> str:
        """A plain text chunk (no logprobs, no running usage), from its template."""
        template = self._templates.get(index)
        if template is None:
            event = self._event(self._choice(index, self._MARK, None, None, None))
            prefix, mark, suffix = event.partition(encode_basestring(self._MARK))
            assert mark and encode_basestring(self._MARK) not in suffix
            template = self._templates[index] = (prefix, suffix)
        return template[0] + encode_basestring(text) + template[1]

    def chunk(
        self,
        index: int,
        text: str | None = None,
        *,
        delta: dict | None = None,
        logprobs=None,
        finish: str | None = None,
        usage: dict | None = None,
        extra: dict | None = None,
    ) -> str:
        return self._event(self._choice(index, text, delta, logprobs, finish), usage, extra)

    def role(self, index: int, usage: dict | None = None) -> str:
        return self.chunk(index, delta={"role": "assistant", "content": ""}, usage=usage)

    def usage(self, usage: dict) -> str:
        return f"data: {json.dumps({**self._head, 'choices': [], 'usage': usage}, ensure_ascii=False)}\n\n"
