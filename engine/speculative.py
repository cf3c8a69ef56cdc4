"""Speculative decoding's proposals: which tokens a decoding request guesses it will generate next.

Before each step the engine asks ``Speculator.propose`` for the running decoding requests; the scheduler packs each
request's last token and its proposal into one chunk, and the engine samples the verified rows one position at a
time (``LLMEngine._verify``), keeping the proposal up to the first token the model would not have produced. The
proposer here is n-gram prompt lookup: the request's last n tokens are searched for, latest first, in its prompt and
output, and the tokens after that occurrence are the proposal. It costs no model, so a request with no match pays
nothing. Each request's length adapts as transformers' assisted generation does: +2 after a fully accepted proposal,
-1 after a rejection, within [1, ``num_tokens``].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.config import SpeculativeConfig
from engine.request import Request


@dataclass(slots=True)
class SpecState:
    """One request's speculation: its current proposal length and what became of its proposals."""

    num_tokens: int  # the next proposal's length bound
    proposed: int = 0
    accepted: int = 0


@dataclass(slots=True)
class SpecTotals:
    """An engine's totals since it started (worker heartbeats: ``pdserve_worker_total``)."""

    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0  # request-steps that verified a proposal

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying request gained per step: its accepted proposal plus the model's own next token."""
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0


def ngram_proposal(token_ids: np.ndarray, num_tokens: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to ``num_tokens`` tokens that followed the latest earlier occurrence of the sequence's last n tokens (the
    latest followed by ``num_tokens`` tokens, if one is), for the longest n in [ngram_min, ngram_max] that occurs;
    [] when none does."""
    length = len(token_ids)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        # windows starting at 0 .. length - n - 1: every occurrence but the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(token_ids[: length - 1], n)
        hits = np.flatnonzero((windows == token_ids[length - n :]).all(axis=1))
        if hits.size:
            full = hits[hits + n + num_tokens <= length]  # those followed by a whole proposal, if any
            start = int(full[-1] if full.size else hits[-1]) + n
            return token_ids[start : start + num_tokens].tolist()
    return []


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.totals = SpecTotals()

    def state(self, request: Request) -> SpecState:
        state = request.spec
        if state is None:
            state = request.spec = SpecState(self.config.num_tokens)
        return state

    def propose(self, request: Request, limit: int) -> list[int]:
        """A proposal for a decoding request, at most ``limit`` tokens (what its max_tokens and the model length leave
        after the token the step makes anyway); tokens the request's grammar would refuse are cut off."""
        num_tokens = min(self.state(request).num_tokens, limit)
        if num_tokens <= 0:
            return []
        tokens = np.fromiter(request.token_slice(0, request.num_tokens), dtype=np.int64, count=request.num_tokens)
        proposal = ngram_proposal(tokens, num_tokens, self.config.ngram_min, self.config.ngram_max)
        if proposal and request.grammar is not None:
            proposal = proposal[: request.grammar.valid_prefix(proposal)]
        return proposal

    def verified(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """A proposal was checked: count it and adapt the request's next proposal length."""
        state = self.state(request)
        state.proposed += num_proposed
        state.accepted += num_accepted
        if num_accepted == num_proposed:
            state.num_tokens = min(self.config.num_tokens, state.num_tokens + 2)
        else:
            state.num_tokens = max(1, state.num_tokens - 1)
        totals = self.totals
        totals.proposed_tokens += num_proposed
        totals.accepted_tokens += num_accepted
        totals.verify_steps += 1
