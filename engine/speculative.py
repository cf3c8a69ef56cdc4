"""Speculative decoding's proposals: which tokens a decoding request guesses it will generate next
(docs/speculative.md).

Before each step the engine asks ``Speculator.propose_all`` for the running decoding requests; the scheduler packs each
request's last token and its proposal into one chunk, and the engine samples the verified rows one position at a
time (``LLMEngine._verify``). Proposers: n-gram prompt lookup (``ngram_proposal``: no model, so a request with no
match pays nothing) or a smaller ``DraftModel``. Each request's proposal length follows its own acceptance
(``SpecState``); a step verifies only the tokens that pay for their rows (``worth_verifying``).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.config import DRAFT_BLOCK_SIZE, EngineConfig, SpeculativeConfig
from engine.request import Request, SamplingParams

REACH_PROBABILITY = 0.1  # a proposed token is worth verifying while the chance it is reached and kept is this much
KEPT_DECAY = 0.5  # each verification's weight in a request's acceptance estimate, against the ones before
OBSERVED_WEIGHT = 0.1  # a decode step's weight in its row count's time (``StepTimes.observe``)
# the decode-step row counts warm-up times (``measure_step_times``); between and past them, time is taken as linear
PROFILED_ROWS = (1, 2, 4, 8, 16, 24, 32)
PAUSE_STEPS = 16  # a request whose next token is not worth proposing proposes nothing this many steps, then one


@dataclass(slots=True)
class SpecState:
    """One request's speculation: its acceptance so far and the length of its next proposal (the rule:
    docs/speculative.md, "Per-request length")."""

    num_tokens: int  # the next proposal's length bound (0: paused)
    kept: float = 2.0
    refused: float = 1.0
    paused_steps: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float:
        """The estimated chance that a proposed token is kept, given the ones before it were."""
        return self.kept / (self.kept + self.refused)

    def next_length(self) -> int:
        """The next proposal's length bound, counting down a pause."""
        if self.num_tokens == 0:
            self.paused_steps -= 1
            if self.paused_steps > 0:
                return 0
            self.num_tokens = 1
        return self.num_tokens

    def update(self, num_proposed: int, num_accepted: int, max_tokens: int) -> None:
        self.proposed += num_proposed
        self.accepted += num_accepted
        self.kept = self.kept * KEPT_DECAY + num_accepted
        self.refused = self.refused * KEPT_DECAY + (num_accepted < num_proposed)
        rate = self.rate
        reach = max_tokens if rate >= 1.0 else int(math.log(REACH_PROBABILITY) / math.log(rate)) if rate > 0 else 0
        self.num_tokens = min(max_tokens, reach)
        if self.num_tokens == 0:
            self.paused_steps = PAUSE_STEPS


@dataclass(slots=True)
class SpecTotals:
    """An engine's totals since it started (worker heartbeats: ``pdserve_worker_total``)."""

    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0  # request-steps that verified a proposal

    def since(self, earlier: SpecTotals) -> SpecTotals:
        """What was counted after ``earlier`` (a copy of these totals taken then)."""
        return SpecTotals(
            self.proposed_tokens - earlier.proposed_tokens,
            self.accepted_tokens - earlier.accepted_tokens,
            self.verify_steps - earlier.verify_steps,
        )

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying request gained per step: its accepted proposal plus the model's own next token."""
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0


@dataclass(slots=True)
class StepTimes:
    """Seconds of a decode step by its number of rows, measured at warm-up (``LLMEngine.warm_up``) at a few counts,
    then followed by the decode steps that run (``observe``: longer contexts, other load). Between measured counts
    it is linear and never decreasing; past the last two, linear."""

    rows: list[int]  # ascending
    seconds: list[float]

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` rows took ``seconds``: the nearest measured count's time moves toward it."""
        index = min(range(len(self.rows)), key=lambda i: abs(self.rows[i] - rows))
        self.seconds[index] += OBSERVED_WEIGHT * (seconds - self.seconds[index])

    def at(self, rows: np.ndarray) -> np.ndarray:
        """The step seconds for each row count of ``rows``."""
        rising = np.maximum.accumulate(self.seconds)
        times = np.interp(rows, self.rows, rising)
        if len(self.rows) > 1:  # past the last count: the last two counts' slope
            slope = (rising[-1] - rising[-2]) / (self.rows[-1] - self.rows[-2])
            times = np.where(rows > self.rows[-1], rising[-1] + slope * (rows - self.rows[-1]), times)
        return times


def worth_verifying(num_decoding: int, wanted: dict[str, tuple[float, int]], times: StepTimes) -> dict[str, int]:
    """How many tokens of each request's proposal to verify, for ``wanted``: request id -> (chance a token is kept,
    proposal length). The j-th token adds ``rate ** j`` expected tokens and a row; taken in order of that chance, the
    prefix kept is the one with the most expected tokens per second of step (``num_decoding`` rows make one token
    each anyway), SmartSpec's goodput rule with our measured step times."""
    chances = sorted(
        ((rate**j, request_id) for request_id, (rate, length) in wanted.items() for j in range(1, length + 1)),
        reverse=True,
    )
    expected = num_decoding + np.cumsum([0.0, *(chance for chance, _ in chances)])  # for 0, 1, ... tokens taken
    rates = expected / times.at(num_decoding + np.arange(len(chances) + 1))
    best_count = int(np.argmax(rates))  # the first best: no token that adds nothing
    return Counter(request_id for _, request_id in chances[:best_count])


def measure_step_times(engine: Any) -> StepTimes | None:
    """Decode steps of ``PROFILED_ROWS`` rows (within the engine's batch and token bounds), timed on ``engine``
    (an ``engine.llm_engine.LLMEngine``, at warm-up): each count runs that many short greedy requests, and the
    median of its decode steps of that many rows is its time. None: no count could be timed (every proposal is then
    verified)."""
    scheduler = engine.scheduler
    most = min(PROFILED_ROWS[-1], scheduler.max_num_seqs, scheduler.max_batch_tokens)
    counts, seconds = [], []
    for count in sorted({*(rows for rows in PROFILED_ROWS if rows <= most), most}):
        engine.step_stats.clear()
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, speculative=False)
        results = engine.generate([[i % engine.vocab_size] * 8 for i in range(count)], params)
        if error := next((r.error for r in results if r.error is not None), None):
            raise RuntimeError(f"warm-up failed: {error}")
        steps = [s.duration_s for s in engine.step_stats if s.num_prefill_tokens == 0 and s.num_seqs == count]
        if steps:  # none when the requests could not all decode together (a small KV cache)
            counts.append(count)
            seconds.append(statistics.median(steps))
    engine.step_stats.clear()
    return StepTimes(counts, seconds) if counts else None


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


class DraftModel:
    """A smaller model's greedy proposals, from an engine of its own: each request's tokens so far go in as a prompt
    of a greedy request for the proposal's length, and the draft engine's prefix cache (blocks of
    ``DRAFT_BLOCK_SIZE`` tokens, content-hashed) keeps the KV of what it computed before, so a proposal computes at
    most a block's worth of tokens before its own and nothing is rolled back by hand (refused tokens are simply
    not in the next prompt). The decode worker computes the draft's prompt KV itself: it is a small model's, the
    KV hand-off stays one model's, and a moved or recomputed request needs nothing more."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine  # engine.llm_engine.LLMEngine

    @classmethod
    def build(
        cls,
        speculative: SpeculativeConfig,
        target: EngineConfig,
        vocab_size: int,
        max_model_len: int,
        new_engine: Callable[[EngineConfig], Any],
    ):
        """``new_engine``: the draft runs in an engine of its own (``LLMEngine``, handed in by the target's)."""
        assert speculative.draft_model is not None  # the config checks it
        engine = new_engine(
            EngineConfig(
                model=speculative.draft_model,
                dtype=target.dtype,
                device=target.device,
                block_size=DRAFT_BLOCK_SIZE,
                kv_cache_memory_bytes=speculative.draft_kv_memory_mb * 1024 * 1024,
                cuda_graphs=target.cuda_graphs,
                max_model_len=max_model_len,
                max_batch_tokens=target.max_batch_tokens,
                max_num_seqs=target.max_num_seqs,
            )
        )
        if engine.vocab_size != vocab_size or len(engine.tokenizer) > vocab_size:
            raise ValueError(
                f"speculative.draft_model {speculative.draft_model!r} has a vocabulary of {engine.vocab_size} tokens, "
                f"the model {vocab_size}: a draft must share the model's tokenizer"
            )
        return cls(engine)

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to n greedy tokens for each (request, n), all drafted together, one draft forward per token; a request
        the draft cannot take (its cache too small for it) gets none."""
        engine = self.engine
        drafted: dict[str, list[int]] = {}
        for request, num_tokens in wanted:
            params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, speculative=False)
            try:
                engine.add_request(request.token_slice(0, request.num_tokens), params, request.request_id)
            except ValueError:
                continue
            drafted[request.request_id] = []
        done: set[str] = set()
        # a prefill step, then one step per token; queueing for blocks may take a few more
        for _ in range(4 * (max((n for _, n in wanted), default=0) + 2)):
            if not engine.has_unfinished():
                break
            for output in engine.step():
                drafted[output.request_id] += output.new_token_ids
                if output.finished:
                    done.add(output.request_id)
                    if output.error is not None:
                        drafted[output.request_id] = []
        for request_id in set(drafted) - done:  # bounded: what is still drafting goes without a proposal
            engine.abort(request_id)
            drafted[request_id] = []
        return drafted


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None = None) -> None:
        self.config = config
        self.draft = draft
        self.totals = SpecTotals()
        self.step_times: StepTimes | None = None  # None: every proposal is verified (measured at warm-up)

    def state(self, request: Request) -> SpecState:
        state = request.spec
        if state is None:
            state = request.spec = SpecState(self.config.num_tokens)
        return state

    def propose_all(self, candidates: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Proposals for decoding requests, each at most its ``limit`` tokens (what its max_tokens and the model
        length leave after the token the step makes anyway) and its own adapted length, cut to what is worth a
        verified row (``worth_verifying``); tokens a request's grammar would refuse are cut off. Requests without a
        proposal are left out."""
        if self.draft is None:
            proposals = {request.request_id: self.propose(request, limit) for request, limit in candidates}
            lengths = self._worth_verifying(candidates, {rid: len(tokens) for rid, tokens in proposals.items()})
            return {rid: proposals[rid][:length] for rid, length in lengths.items() if length}
        wanted = {r.request_id: min(self.state(r).next_length(), limit) for r, limit in candidates}
        lengths = self._worth_verifying(candidates, wanted)
        drafted = self.draft.propose([(r, n) for r, _ in candidates if (n := lengths.get(r.request_id, 0)) > 0])
        proposals = {r.request_id: _grammar_cut(r, drafted.get(r.request_id, [])) for r, _ in candidates}
        return {request_id: proposal for request_id, proposal in proposals.items() if proposal}

    def _worth_verifying(self, candidates: list[tuple[Request, int]], lengths: dict[str, int]) -> dict[str, int]:
        if self.step_times is None:
            return lengths
        wanted = {r.request_id: (self.state(r).rate, lengths[r.request_id]) for r, _ in candidates}
        return worth_verifying(len(candidates), wanted, self.step_times)

    def propose(self, request: Request, limit: int) -> list[int]:
        """The n-gram proposal of one request (``propose_all``)."""
        num_tokens = min(self.state(request).next_length(), limit)
        if num_tokens <= 0:
            return []
        tokens = np.fromiter(request.token_slice(0, request.num_tokens), dtype=np.int64, count=request.num_tokens)
        return _grammar_cut(request, ngram_proposal(tokens, num_tokens, self.config.ngram_min, self.config.ngram_max))

    def verified(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """A proposal was checked: count it and adapt the request's next proposal length."""
        self.state(request).update(num_proposed, num_accepted, self.config.num_tokens)
        totals = self.totals
        totals.proposed_tokens += num_proposed
        totals.accepted_tokens += num_accepted
        totals.verify_steps += 1


def _grammar_cut(request: Request, proposal: list[int]) -> list[int]:
    """The proposal up to the first token the request's grammar would refuse."""
    if proposal and request.grammar is not None:
        return proposal[: request.grammar.valid_prefix(proposal)]
    return proposal


def build_speculator(
    config: EngineConfig, vocab_size: int, max_model_len: int, new_engine: Callable[[EngineConfig], Any]
) -> Speculator | None:
    """The engine's speculator (None: it does not speculate; a prefill-only engine samples one token a request);
    ``new_engine`` makes a draft model's engine."""
    speculative = config.speculative
    if speculative is None or config.prefill_only:
        return None
    draft = None
    if speculative.method == "draft":
        draft = DraftModel.build(speculative, config, vocab_size, max_model_len, new_engine)
    return Speculator(speculative, draft)
