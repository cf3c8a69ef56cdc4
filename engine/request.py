"""One object per request: the engine's whole view of a generation.

A request only tracks how many of its tokens have KV in the cache (``num_computed_tokens``) against how many tokens it
has (prompt plus generated). The scheduler needs nothing else to mix chunked prefill and decode in one step: a request
whose computed count lags by more than one token is still prefilling, one that lags by exactly one is decoding. Derived
values are properties, never stored copies, so they cannot go stale.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import torch

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by them overflows logits


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every status has exactly one way out to FINISHED, which frees its blocks."""

    WAITING = 0  # queued for KV blocks and a first prefill chunk
    WAITING_FOR_REMOTE_KV = 1  # blocks reserved, KV arriving from a prefill worker; not schedulable yet
    RUNNING = 2  # holds blocks, scheduled every step (prefill chunks, then one token per step)
    PREFILLED = 3  # prefill-only request done: blocks held for export until released
    FINISHED = 4  # blocks freed; finish_reason says why


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the caller (client gone, timeout, failed transfer)
    PREFILLED = "prefilled"  # prefill-only request whose KV was handed off
    ERROR = "error"  # this request's own fault (non-finite logits) or a failed forward step: ``error`` says which


@dataclass(slots=True)
class SamplingParams:
    """OpenAI-style sampling and stopping parameters. ``validate`` names the bad field in its ValueError."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(slots=True, eq=False)  # identity, not field-by-field comparison: `request in running` stays cheap
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float
    prefill_only: bool = False
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # the block table: logical block i -> physical block id
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, served from the prefix cache
    num_hashed_blocks: int = 0  # leading full blocks already registered in the prefix cache
    finish_reason: FinishReason | None = None
    output_text: str = ""  # detokenized output, cut at a stop string
    detokenizer: Any = None  # engine.detokenizer.IncrementalDetokenizer, made with the first token
    stop_token_set: frozenset[int] | None = None  # params.stop_token_ids as a set, made on first use
    generator: torch.Generator | None = None  # per-request RNG for seeded sampling
    scheduled_s: float | None = None  # first admitted into the running batch (queue time = scheduled - arrival)
    first_token_s: float | None = None
    finished_s: float | None = None
    error: str | None = None  # why it ended with FinishReason.ERROR

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, without building the concatenation (decode asks every step)."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: the tokens it gained, and how it ended if it did."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    text: str  # the whole output text, set once the request has finished ("" before)
    # the text safe to send now (engine.detokenizer's rules: half a UTF-8 character and the characters that could
    # still start a stop string are held back; everything at the finish; cut at a stop string). Joined over every
    # output of a request they make ``output_text``; a prefill-only request's is the first token's, as decoding would
    # send it, and ``complete_remote`` continues from there
    text_delta: str = ""
    error: str | None = None  # finish_reason ERROR: what went wrong, for the client
    error_code: str | None = None  # finish_reason ERROR: "sampling_error" (this request's logits) or "worker_error"


@dataclass(slots=True)
class CompletionResult:
    """What ``LLMEngine.generate`` returns for one prompt."""

    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None  # finish_reason "error": what went wrong
