"""One response stream at the router: what its workers sent that the client has not been given yet, coalesced.

Why: the router used to queue one event object per worker message per stream, and the API wrote one SSE chunk per
event. A client that reads slower than the workers generate then let that queue grow by one object per step, and
every token cost a socket write. Now a stream holds one pending state (the text in a single UTF-8 buffer, a token
count, the finish reason, the first error) that the router's event loop appends to (``push``, ``fail``) and the
response side empties all at once (``take``): a slow client gets fewer, larger chunks, and its stream holds no more
than the text it has not been sent yet. The text comes detokenized from the workers; the router only relays it.

Order is kept: an error is given only after the text that came before it, and nothing that comes after a finish or
an error counts.

Log probabilities (issue 14) ride the same state: a list of pending per-token entries, extended by each push that
brings some (one per token, so a taken event's ``logprobs`` cover exactly its ``num_tokens``), and the prompt's
logprobs and prefix-cache hit, set once with the first token and given with the first event taken after it. A request
that asked for none pays two ``is None`` checks per push.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from cluster.routing.errors import RequestFailed
from engine.request import TokenLogprob


@dataclass(slots=True)
class TokenEvent:
    """Everything a stream got since it was last taken from."""

    text: str  # the text to send, ready as it is (held-back characters come in a later event; stop strings cut)
    num_tokens: int  # tokens the text covers (for usage)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # params.logprobs set: one per token of this event, in order
    # with the event that brings the first token only: per prompt token (entry 0 None), and the prompt tokens the
    # worker that computed the prompt found in its prefix cache
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int | None = None


@dataclass(slots=True)
class Stream:
    rid: str  # the client-facing id
    num_prompt_tokens: int
    wire_rid: str = ""  # the id workers know; a new one per dispatch, so a retried request ignores stale events
    prefill: str | None = None
    decode: str | None = None
    started_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None  # when the router got the first token
    num_output_tokens: int = 0  # tokens taken (given to the client)
    finished: bool = False  # the finish was taken
    timing: dict = field(default_factory=dict)
    # the pending state: one buffer, however many events it gathered
    pending_text: bytearray = field(default_factory=bytearray)
    pending_tokens: int = 0
    pending_finish: str | None = None
    pending_logprobs: list[TokenLogprob] | None = None  # None until a push brings some (most requests: never)
    pending_prompt_logprobs: list[TokenLogprob | None] | None = None
    pending_cached_tokens: int | None = None
    error: RequestFailed | None = None
    closed: bool = False  # a finish or an error was pushed: later events are dropped
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set when something was pushed

    def push(
        self,
        num_tokens: int,
        text: str,
        finish_reason: str | None,
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
        cached_tokens: int | None = None,
    ) -> bool:
        """Append what one worker message brought; False if the stream takes no more (finished or failed).

        ``logprobs``: one per token (for requests that asked; a count that does not match fails the stream);
        ``prompt_logprobs`` and ``cached_tokens``: kept from the push that brings the stream's first token only."""
        if type(text) is not str:
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        if self.closed:
            return False
        if logprobs is not None:  # first: a count that does not match leaves the pending state as it was
            if len(logprobs) != num_tokens:  # a worker's bug: an explicit error, never logprobs shifted
                self.fail(RequestFailed(f"{len(logprobs)} logprobs came for {num_tokens} tokens", "worker_error"))
                return False
            if self.pending_logprobs is None:
                self.pending_logprobs = list(logprobs)
            else:
                self.pending_logprobs += logprobs
        if num_tokens and self.first_token_s is None:
            self.first_token_s = time.monotonic()
            # the prompt's figures come with the first token; any other push's are not this dispatch's first
            self.pending_prompt_logprobs, self.pending_cached_tokens = prompt_logprobs, cached_tokens
        self.pending_tokens += num_tokens
        if text:
            self.pending_text += text.encode()
        if finish_reason is not None:
            self.pending_finish, self.closed = finish_reason, True
        self.ready.set()
        return True

    def fail(self, error: RequestFailed) -> None:
        """The request ended with an error: given to the client after any text already pending."""
        if not self.closed:
            self.error, self.closed = error, True
            self.ready.set()

    def take(self) -> TokenEvent | None:
        """All pending text, tokens and finish as one event; None when there are none (``error`` may be set)."""
        self.ready.clear()
        if not self.pending_tokens and not self.pending_text and self.pending_finish is None:
            return None
        event = TokenEvent(self.pending_text.decode(), self.pending_tokens, self.pending_finish)
        self.pending_text = bytearray()
        self.pending_tokens, self.pending_finish = 0, None
        self.num_output_tokens += event.num_tokens
        if self.pending_logprobs is not None:  # [] from now on: a later event without tokens has none, not None
            event.logprobs, self.pending_logprobs = self.pending_logprobs, []
        if self.pending_cached_tokens is not None or self.pending_prompt_logprobs is not None:
            event.prompt_logprobs, event.cached_tokens = self.pending_prompt_logprobs, self.pending_cached_tokens
            self.pending_prompt_logprobs = self.pending_cached_tokens = None
        return event

    def reset(self) -> None:
        """A new dispatch of a request nothing of which was taken: forget what the old one left."""
        self.pending_text, self.pending_tokens, self.pending_finish = bytearray(), 0, None
        self.pending_logprobs = self.pending_prompt_logprobs = self.pending_cached_tokens = None
        self.error, self.closed, self.first_token_s = None, False, None
        self.ready.clear()
