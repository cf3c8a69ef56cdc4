"""One request at the router: a ``Flow`` with its status, workers, wire id, timing and the text not yet sent.

QUEUED -> RESERVING -> PREFILLING -> DECODING -> DONE, or FAILED from any (``cluster/routing/core.py`` moves it);
DECODING <-> MIGRATING while it moves to another decode worker (``Move``, the same hand-off from a decoding source).
Each ``TokenItem`` is ``push``ed into one pending buffer that the response side empties at once (``take``): a slow
client gets fewer, larger events. An error follows the text before it; nothing after a finish or an error counts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from cluster.routing.errors import RequestFailed
from engine.request import SamplingParams, TokenLogprob
from worker.messages import Timing, TokenItem


class FlowStatus(enum.Enum):
    QUEUED = "queued"  # waiting for a decode worker with room (in the admission queue), or for its first ask
    RESERVING = "reserving"  # a decode worker is asked to reserve its KV (``Flow.asking``)
    PREFILLING = "prefilling"  # its prompt is being computed (prefill worker, or the decode/colocated worker)
    DECODING = "decoding"  # its first token came; the decode (or colocated) worker streams the rest
    MIGRATING = "migrating"  # moving from one decode worker to another (``Flow.move``)
    DONE = "done"  # its finish came
    FAILED = "failed"  # it ended with an error the client gets

    @property
    def ended(self) -> bool:
        return self in (FlowStatus.DONE, FlowStatus.FAILED)


class MovePhase(enum.Enum):
    """A move is a hand-off whose source is a decoding request: reserve on the target, stream the KV the source
    holds, join on "KV in + tokens in" (cluster/routing/core.py drives it; docs/request-lifecycle.md)."""

    RESERVING = "reserving"  # the target is asked to reserve the flow's context (``Reserve`` with context_tokens)
    EXPORTING = "exporting"  # the source ships its KV (``Export``) while it streams on, until it stops the request
    HANDING_OFF = "handing_off"  # stopped (``Frozen``); the target has its tokens (``Start``): the stream stands still


@dataclass(slots=True)
class Move:
    """A decoding flow on its way from ``source`` (which knows it as ``source_wire``) to ``target`` (as
    ``target_wire``); it ends when the target streams (moved), or is called off (it runs on at the source)."""

    source: str
    source_wire: str
    target: str
    target_wire: str
    started_s: float
    reason: str = "admin"  # what started it: admin, drain, rebalance
    phase: MovePhase = MovePhase.RESERVING
    phase_s: float = 0.0  # when the current phase began
    blocks_needed: int = 0  # what the target reserves for it
    precopy: bool = True  # the source ships its full blocks while it decodes on, before it stops the request
    frozen_s: float | None = None  # the source stopped it: the stream's standstill begins


@dataclass(slots=True)
class TokenEvent:
    """Everything a flow got since it was last taken from."""

    text: str  # the text to send, ready as it is
    num_tokens: int  # tokens the text covers (for usage)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # params.logprobs set: one per token of this event, in order
    # first token's event only: one per prompt token (entry 0 None); prompt tokens found in the prefix cache
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int | None = None


@dataclass(slots=True, eq=False)
class Flow:
    rid: str  # the client's id
    prompt: list[int]
    params: SamplingParams
    block_hashes: list[int]  # the prompt's full blocks (engine.blocks.prompt_block_hashes), for prefix matching
    started_s: float
    deadline_s: float
    affinity: str | None = None  # an earlier request whose workers this one prefers (``Placements``)
    blocks_needed: int = 0  # what a decode worker reserves for it (``Placer.blocks_needed``)
    status: FlowStatus = FlowStatus.QUEUED
    wire_id: str = ""  # the id workers know: a fresh one per reservation attempt and per retry
    attempts: int = 0  # wire ids made so far
    wire_used: bool = False  # a command went out under ``wire_id``: the next attempt gets a new one
    asking: str | None = None  # RESERVING: the decode worker asked
    asked_s: float = 0.0
    tried: list[str] = field(default_factory=list)  # decode workers that refused in this round
    queued: bool = False  # holds a place in the admission queue
    prefill: str | None = None  # its prefill worker (disaggregated, computed remotely)
    decode: str | None = None  # its decode worker, or its colocated one
    held_by: frozenset[str] = frozenset()  # the workers whose load it counts in now (``RouterCore._sync``)
    move: Move | None = None  # MIGRATING: the move under way
    migrations: int = 0  # moves that completed
    migration_s: float = 0.0  # time its stream stood still for them
    retries: int = 0  # dispatched again after a worker died before anything reached the client
    timing: Timing = field(default_factory=Timing)
    first_token_s: float | None = None  # when the router got its first token
    last_token_s: float | None = None  # ... its latest tokens (``pdserve_itl_seconds``)
    received_tokens: int = 0  # tokens its workers sent
    num_output_tokens: int = 0  # tokens taken (given to the client)
    finished: bool = False  # the finish was taken
    error: RequestFailed | None = None
    closed: bool = False  # a finish or an error was pushed: later items are dropped
    waiter: Any = None  # the live router's wake-up for the response side (an asyncio.Event); the core ignores it
    trace: str | None = None  # the live router's span for it, as a traceparent its commands carry (worker/tracing.py)
    pending_text: bytearray = field(default_factory=bytearray)
    pending_tokens: int = 0
    pending_finish: str | None = None
    pending_logprobs: list[TokenLogprob] | None = None  # None until an item brings some (most requests: never)
    pending_prompt_logprobs: list[TokenLogprob | None] | None = None
    pending_cached_tokens: int | None = None

    def holders(self) -> frozenset[str]:
        """The workers that count this flow as load: the one asked, prefill until the first token, decode from its
        reservation on."""
        status = self.status
        if status is FlowStatus.RESERVING:
            return frozenset(n for n in (self.asking, self.decode) if n)
        if status is FlowStatus.PREFILLING:
            return frozenset(n for n in (self.prefill, self.decode) if n)
        if status is FlowStatus.DECODING:
            return frozenset((self.decode,)) if self.decode else frozenset()
        if status is FlowStatus.MIGRATING and self.move is not None:
            return frozenset(n for n in (self.move.source, self.move.target) if n)
        return frozenset()

    def push(self, item: TokenItem, now: float) -> bool:
        """Append what one worker message brought; False if the flow takes no more (finished or failed)."""
        if type(item.text) is not str:
            raise TypeError(f"text must be a string, got {type(item.text).__name__}")
        if self.closed:
            return False
        if item.index is not None and item.index != self.received_tokens:
            if item.index < self.received_tokens:
                return False  # tokens it has (a message sent twice): nothing new
            lost = item.index - self.received_tokens  # a message lost on the way: the text would have a hole
            self.fail(RequestFailed(f"{lost} tokens from its worker were lost on the way", "worker_error"))
            return False
        num_tokens, logprobs = len(item.token_ids), item.logprobs
        if logprobs is not None:  # checked first: a wrong count leaves the pending state as it was
            if len(logprobs) != num_tokens:  # a worker's bug: an explicit error, never logprobs shifted
                self.fail(RequestFailed(f"{len(logprobs)} logprobs came for {num_tokens} tokens", "worker_error"))
                return False
            if self.pending_logprobs is None:
                self.pending_logprobs = list(logprobs)
            else:
                self.pending_logprobs += logprobs
        if item.timing is not None:
            self.timing.merge(item.timing)
        if num_tokens:
            self.last_token_s = now
        if num_tokens and self.first_token_s is None:
            self.first_token_s = now
            # the prompt's figures come with the first token only
            self.pending_prompt_logprobs, self.pending_cached_tokens = item.prompt_logprobs, item.cached_tokens
        self.pending_tokens += num_tokens
        self.received_tokens += num_tokens
        if item.text:
            self.pending_text += item.text.encode()
        if item.finish_reason is not None:
            self.pending_finish, self.closed = item.finish_reason.value, True
        return True

    def fail(self, error: RequestFailed) -> None:
        """End with an error, given to the client after any text already pending."""
        if not self.closed:
            self.error, self.closed = error, True

    def take(self) -> TokenEvent | None:
        """All pending text, tokens and finish as one event; None when there are none (``error`` may be set)."""
        if not self.pending_tokens and not self.pending_text and self.pending_finish is None:
            return None
        event = TokenEvent(self.pending_text.decode(), self.pending_tokens, self.pending_finish)
        self.pending_text = bytearray()
        self.pending_tokens, self.pending_finish = 0, None
        self.num_output_tokens += event.num_tokens
        self.finished = event.finish_reason is not None
        if self.pending_logprobs is not None:  # [] from now on: a later event without tokens has none, not None
            event.logprobs, self.pending_logprobs = self.pending_logprobs, []
        if self.pending_cached_tokens is not None or self.pending_prompt_logprobs is not None:
            event.prompt_logprobs, event.cached_tokens = self.pending_prompt_logprobs, self.pending_cached_tokens
            self.pending_prompt_logprobs = self.pending_cached_tokens = None
        return event

    def reset(self) -> None:
        """Forget the old dispatch's state before a new one (nothing of it was taken)."""
        self.pending_text, self.pending_tokens, self.pending_finish = bytearray(), 0, None
        self.pending_logprobs = self.pending_prompt_logprobs = self.pending_cached_tokens = None
        self.error, self.closed, self.received_tokens = None, False, 0
        self.first_token_s = self.last_token_s = None
        self.prefill = self.decode = self.asking = None
        self.tried.clear()
