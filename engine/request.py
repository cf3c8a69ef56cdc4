"""One object per request: the engine's whole view of a generation.

A request tracks only how many of its tokens have KV in the cache (``num_computed_tokens``) against how many it has
(prompt plus generated): lagging by more than one it is prefilling, by exactly one decoding, which is all the scheduler
needs to mix chunked prefill and decode in one step. Derived values are properties, so they cannot go stale.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by them overflows logits


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every status has exactly one way out to FINISHED, which frees its blocks."""

    WAITING = 0  # queued for KV blocks and a first prefill chunk
    # blocks reserved, its KV and tokens arriving from another worker (``Request.kv_import``)
    WAITING_FOR_REMOTE_KV = 1
    RUNNING = 2  # holds blocks, scheduled every step (prefill chunks, then one token per step)
    PREFILLED = 3  # prefill-only request done: blocks held for export until released
    FINISHED = 4  # blocks freed; finish_reason says why
    # holds blocks for its whole prompt; its prefix is being loaded back from a KV tier (engine/kv_tiers.py), then
    # RUNNING from the end of what was loaded
    LOADING = 5
    # stopped at a step boundary to move to another worker (``LLMEngine.freeze``): blocks held until released, or
    # RUNNING again when the move is called off (``resume``)
    FROZEN = 6


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the caller (client gone, timeout, failed transfer)
    PREFILLED = "prefilled"  # prefill-only request whose KV was handed off
    ERROR = "error"  # this request's own fault (non-finite logits) or a failed forward step: ``error`` says which


GuidedKind = Literal["json_object", "json_schema", "regex", "ebnf"]
GUIDED_KINDS: tuple[str, ...] = get_args(GuidedKind)
MAX_LOGPROBS = 20  # top logprobs per position (OpenAI's chat limit; vLLM's default max_logprobs is 20)


@dataclass(slots=True)
class GuidedDecoding:
    """A grammar every output token must keep the text inside (xgrammar, ``engine/structured.py``). It travels with
    the sampling parameters, so prefill and decode workers compile the same one; the decode side replays the tokens
    already sampled to reach the same state."""

    kind: GuidedKind
    spec: str = ""  # json_schema: the schema as JSON text; regex: the pattern; ebnf: the grammar; json_object: ""


@dataclass(slots=True)
class TokenLogprob:
    """The chosen token's logprob and the ``top`` (token id, logprob), most likely first: the model's own
    distribution (``log_softmax`` of the raw logits, before temperature, penalties, bias or grammar), as OpenAI's."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


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
    min_p: float = 0.0  # drop tokens whose probability is below min_p times the most likely one's (0: off)
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens were generated
    presence_penalty: float = 0.0  # OpenAI: subtracted once from a token that occurs in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # CTRL / transformers: tokens of the prompt and output, logit / p if > 0 else * p
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # per generated token: its logprob and this many top ones (0: its own only)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (computed on prefill)
    skip_special_tokens: bool = True  # drop special tokens from the text (the ids still count and still stop)
    guided: GuidedDecoding | None = None  # structured output: the grammar the text must match
    speculative: bool = True  # False: this request takes no proposed tokens where the engine speculates

    def copy(self) -> SamplingParams:
        """An independent copy (its lists too): each request owns its parameters, as each worker's decoded ones do."""
        return dataclasses.replace(
            self, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids), logit_bias=dict(self.logit_bias)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def validate(self, prefill_only: bool = False) -> None:
        """Raise ValueError naming the first bad field (its first word). ``prefill_only``: the prefill worker's copy,
        whose max_tokens is 1 by construction while min_tokens is the whole request's (it still masks EOS there)."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not prefill_only and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not (
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0
        ):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a map of token ids to numbers, got {self.logit_bias!r}")
        for token_id, bias in self.logit_bias.items():
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token_id}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or null, got {value!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a boolean, got {self.skip_special_tokens!r}")
        guided = self.guided
        if guided is not None:
            if not isinstance(guided, GuidedDecoding) or guided.kind not in GUIDED_KINDS:
                kind = getattr(guided, "kind", guided)
                raise ValueError(f"guided kind must be one of {list(GUIDED_KINDS)}, got {kind!r}")
            if not isinstance(guided.spec, str) or (guided.kind != "json_object" and not guided.spec):
                raise ValueError(f"guided spec must be a non-empty string for kind {guided.kind!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(slots=True)
class KVExport:
    """Prefill side: where a request's KV goes and how many of its logical blocks were reported (every layer).
    ``first_block``: the receiver already holds the blocks before it, so reporting starts there."""

    sink: Callable[[Any], None]  # engine.kv_connector.KVSink: what the KV of each finished block goes to
    stream: bool
    first_block: int = 0
    num_blocks_reported: int = 0

    def __post_init__(self) -> None:
        if self.first_block < 0:
            raise ValueError(f"first_block must be >= 0, got {self.first_block}")
        self.num_blocks_reported = max(self.num_blocks_reported, self.first_block)


class ImportState(enum.Enum):
    """Where a decode-side hand-off stands: its KV and its tokens come from another worker, in either order (the
    join). ``engine.kv_connector.KVImporter`` moves it; the scheduler admits READY and RECOMPUTE."""

    RESERVED = "reserved"  # blocks held; the KV and the tokens are to come
    KV_IN = "kv_in"  # every block's KV arrived; the tokens are to come
    TOKENS_IN = "tokens_in"  # the tokens came; the KV is to come
    KV_FAILED = "kv_failed"  # the transfer failed (its blocks were freed): computed here once the tokens come
    READY = "ready"  # KV and tokens in: queued to join the running batch from its next token
    RECOMPUTE = "recompute"  # tokens in after a failed transfer: queued to be computed here, prompt and tokens

    @property
    def awaits_kv(self) -> bool:
        return self in (ImportState.RESERVED, ImportState.TOKENS_IN)

    @property
    def awaits_tokens(self) -> bool:
        return self in (ImportState.RESERVED, ImportState.KV_IN, ImportState.KV_FAILED)


@dataclass(slots=True)
class KVImport:
    """Decode side: a request whose KV and tokens come from another worker, the same hand-off whether the source
    prefilled it (``tokens``: the first token it sampled) or decoded it (``moved``: a running request; ``tokens``:
    every one it generated). Its KV holds every token but the last; stamps are ``time.monotonic`` seconds."""

    expected_s: float  # blocks reserved; the KV is expected from now on
    moved: bool = False  # a running request from another decode worker: its KV fills a leading run of its blocks
    state: ImportState = ImportState.RESERVED
    tokens: list[int] = field(default_factory=list)  # brought by the router (``Start``), appended at admission
    tokens_in_s: float | None = None
    kv_done_s: float | None = None  # the transfer layer wrote every layer of every block
    kv_blocks: int = 0  # the blocks the KV filled (a moved request's: as many as its context needs)
    kv_failed_s: float | None = None  # the transfer failed (the reserved blocks were freed then)
    # a KV-tier load behind the reservation fell short: the prompt's KV is good up to here only; the rest (and the
    # first token's) is computed at admission
    valid_prompt_tokens: int | None = None
    ready_s: float | None = None  # the join: queued for admission
    admitted_s: float | None = None  # the scheduler took it: into the running batch (or, to recompute, the queue)
    first_decode_s: float | None = None  # end of the first step that computed a token for it here

    def context_tokens(self, num_prompt_tokens: int) -> int:
        """The tokens whose KV the hand-off brings: the prompt and every token but the last (once the tokens came)."""
        return num_prompt_tokens + max(0, len(self.tokens) - 1)

    # ---- what the worker reports (``worker.role.wire_timing``) ------------------------------------------------------
    @property
    def kv_transfer_s(self) -> float | None:
        """Reservation (KV expected) to KV complete: spans the prefill."""
        return None if self.kv_done_s is None else self.kv_done_s - self.expected_s

    @property
    def kv_wait_after_first_token_s(self) -> float | None:
        """How long the KV lagged behind the first token (0 when it was here first)."""
        if self.kv_done_s is None or self.tokens_in_s is None:
            return None
        return max(0.0, self.kv_done_s - self.tokens_in_s)

    @property
    def decode_queue_s(self) -> float | None:
        """From the join (KV or its recompute decision, and the tokens) to the end of the first step computing a token
        here (or to admission, if it finished there): what the next token waits for beyond the KV."""
        if self.ready_s is None:
            return None
        end = self.first_decode_s if self.first_decode_s is not None else self.admitted_s
        return None if end is None else end - self.ready_s

    @property
    def recomputed(self) -> bool:
        """The KV transfer failed and the request was computed here instead."""
        return self.kv_failed_s is not None


@dataclass(slots=True)
class RequestTiming:
    """When things happened to one request (``time.monotonic`` seconds), and the figures workers report from them
    (None where they do not apply yet). Every ``RequestOutput`` references this object, so workers keep no table."""

    arrival_s: float  # reached the worker (backdated by the caller to when its message arrived)
    scheduled_s: float | None = None  # first admitted into the running batch from the waiting queue
    first_token_s: float | None = None  # its first token was sampled here, or (decode side) appended at admission
    finished_s: float | None = None

    @property
    def queue_s(self) -> float | None:
        """Arrival to admission into the running batch."""
        return None if self.scheduled_s is None else self.scheduled_s - self.arrival_s

    @property
    def compute_s(self) -> float | None:
        """Admission to the first token (the prefill, chunks and preemptions included)."""
        if self.scheduled_s is None or self.first_token_s is None:
            return None
        return self.first_token_s - self.scheduled_s


@dataclass(slots=True, eq=False)  # identity, not field-by-field comparison: `request in running` stays cheap
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    timing: RequestTiming
    prefill_only: bool = False
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # the block table: logical block i -> physical block id
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, served from the prefix cache
    num_hashed_blocks: int = 0  # leading full blocks already registered in the prefix cache
    # leading blocks handed back because no layer's sliding window reaches them again (Scheduler.release_behind_window)
    num_released_blocks: int = 0
    # blocks after the computed (or device-cached) ones being loaded back from a KV tier now (engine/kv_tiers.py)
    num_loading_blocks: int = 0
    finish_reason: FinishReason | None = None
    output_text: str = ""  # detokenized output, cut at a stop string
    detokenizer: Any = None  # engine.detokenizer.IncrementalDetokenizer, made with the first token
    stop_token_set: frozenset[int] | None = None  # params.stop_token_ids as a set, made on first use
    grammar: Any = None  # engine.structured.GrammarState of params.guided: what the next token may be
    # entry j scores prompt token j (entry 0 None), filled as the prompt is computed, sent with the first token
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # why it ended with FinishReason.ERROR
    kv_export: KVExport | None = None  # prefill side: where its KV goes, and how many blocks were reported
    kv_import: KVImport | None = None  # decode side: the hand-off bringing its KV and tokens (None: computed here)
    spec: Any = None  # engine.speculative.SpecState: its proposals, where the engine speculates

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
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute here: asked for, and no token yet (a decode-side request's first token
        comes from the prefill worker, which computed them; a recompute has output tokens)."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids


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
    # the text safe to send now (engine.detokenizer's rules); joined over a request's outputs it is ``output_text``.
    # A prefill-only request's is the first token's, as decoding would send it; the decode side continues from there
    text_delta: str = ""
    error: str | None = None  # finish_reason ERROR: what went wrong, for the client
    error_code: str | None = None  # finish_reason ERROR: "sampling_error" (this request's logits) or "worker_error"
    timing: RequestTiming | None = None  # the request's stamps (the live object, not a copy)
    kv_import: KVImport | None = None  # decode side: its hand-off's record (the live object), for its figures
    # params.logprobs set: one entry per token of new_token_ids (an admission's output, which has none, has none)
    logprobs: list[TokenLogprob] | None = None
    # params.prompt_logprobs set: with the request's first token, one entry per prompt token (None for the first)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from this engine's prefix cache (not computed)


@dataclass(slots=True)
class CompletionResult:
    """What ``LLMEngine.generate`` returns for one prompt."""

    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None  # finish_reason "error": what went wrong
