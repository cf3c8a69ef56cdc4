"""Continuous batching: which requests compute how many tokens in the next forward, within ``max_batch_tokens``.

1. Running requests first, in arrival order: a decode takes one token, a prefill the next prompt chunk that fits.
2. Then waiting requests, FIFO, while ``max_num_seqs`` allows and blocks for the whole prompt can be allocated now
   (prefix-cached blocks reused; never overcommitted). One whose prefix continues in a KV tier waits in LOADING,
   holding its blocks, until the tier's blocks are back; then it runs from there.
3. A running request that needs a block when none is free preempts the most recently admitted one (maybe itself),
   which goes back to the front of the queue with its tokens, to be prefilled again (recompute).
Decode side: a reservation (WAITING_FOR_REMOTE_KV, its ``KVImport`` moved by ``engine.kv_connector.KVImporter``) is
admitted by ``admit_remote`` once its KV and tokens are in, with no new blocks and whatever ``max_num_seqs`` (a cap
would only idle reserved memory); or ``prefill_here``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from engine.block_manager import BlockManager
from engine.request import ImportState, Request, RequestStatus


class TierIndex(Protocol):
    """The KV tiers below the device, as the scheduler asks them (``engine.kv_tiers.KVTiers``)."""

    def lookup(self, token_ids: list[int], first_block: int, max_blocks: int) -> list[int]: ...

    def start_load(
        self, request: Request, token_ids: list[int], first_block: int, hashes: list[int], counts_as_cached: bool
    ) -> object: ...


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    start: int  # first position computed in this step (== request.num_computed_tokens when scheduled)
    num_tokens: int  # proposed tokens included
    # speculative decoding: tokens proposed after the request's last one, computed in this chunk to be verified
    proposal: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk computes the request's last known token, so its logits give the next token."""
        return self.end - len(self.proposal) == self.request.num_tokens

    @property
    def num_sampled_rows(self) -> int:
        """Rows of this chunk whose logits are sampled: the last known token's and each proposed token's."""
        return 1 + len(self.proposal) if self.samples else 0

    def token_ids(self) -> list[int]:
        """The tokens this chunk computes: the request's, then its proposal."""
        known = self.request.token_slice(self.start, self.end - len(self.proposal))
        return known + self.proposal if self.proposal else known

    @property
    def prompt_score_positions(self) -> range:
        """Positions of this chunk whose logits score a prompt token (position p scores token p + 1) that the
        request's ``prompt_logprobs`` still lacks; empty unless it wants them."""
        request = self.request
        if not request.wants_prompt_logprobs:
            return range(0)
        have = len(request.prompt_logprobs) if request.prompt_logprobs is not None else 1  # entry 0 is None
        return range(max(self.start, have - 1), min(self.end, request.num_prompt_tokens - 1))


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_tokens: int, max_num_seqs: int) -> None:
        self.block_manager = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote_ready: deque[Request] = deque()  # remote KV and first token in: admitted at the next step
        self.loading: list[Request] = []  # LOADING: prefix blocks coming back from a KV tier
        self.tiers: TierIndex | None = None
        self.num_preemptions = 0
        # a model whose every layer has a sliding window of at most this many tokens: blocks behind it go back early
        self.release_window: int | None = None
        self.num_released_blocks = 0
        self.clock: Callable[[], float] = time.monotonic  # the requests' timing stamps (LLMEngine.set_clock)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def reserve_remote(self, request: Request, num_tokens: int, use_prefix_cache: bool) -> bool:
        """Hold blocks for ``num_tokens`` of a request whose KV comes from elsewhere (its ``kv_import`` set); with
        ``use_prefix_cache`` the leading full blocks held here are shared. False when the blocks are not free now."""
        allocation = self.block_manager.allocate(request.prompt_token_ids, num_tokens, use_prefix_cache)
        if allocation is None:
            return False
        request.block_ids, request.num_cached_tokens = allocation
        request.num_hashed_blocks = request.num_cached_tokens // self.block_manager.block_size  # shared: hashed
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        if use_prefix_cache:  # tier hits count as cached: the prefill worker sends only the blocks after them
            request.num_cached_tokens += self._start_tier_load(request, request.prompt_token_ids, True)
        return True

    def _start_tier_load(self, request: Request, token_ids: list[int], counts_as_cached: bool) -> int:
        """Start loading the blocks of ``token_ids`` that follow the request's computed prefix from a KV tier, as far
        as the reuse rule allows (one token is always computed); returns the tokens promised (0: none found)."""
        if self.tiers is None:
            return 0
        block_size = self.block_manager.block_size
        first_block = (request.num_cached_tokens if request.kv_import else request.num_computed_tokens) // block_size
        usable_blocks = (len(token_ids) - 1) // block_size
        found = self.tiers.lookup(token_ids, first_block, usable_blocks - first_block)
        if found:
            self.tiers.start_load(request, token_ids, first_block, found, counts_as_cached)
            request.num_loading_blocks = len(found)
        return len(found) * block_size

    def finish_load(self, request: Request, loaded_blocks: int, counts_as_cached: bool) -> None:
        """A LOADING request's tier blocks are in (``loaded_blocks`` of those promised): it runs from there."""
        self.loading.remove(request)
        request.num_loading_blocks = 0
        request.num_computed_tokens += loaded_blocks * self.block_manager.block_size
        if counts_as_cached:
            request.num_cached_tokens = request.num_computed_tokens
        self.register_full_blocks(request)
        self.add_running(request)

    def prefill_here(self, request: Request) -> None:
        """A reservation computed here instead (conditional disaggregation): it runs from its cached prefix on (after
        its tier blocks are in, if a load is under way)."""
        request.kv_import = None
        request.timing.scheduled_s = self.clock()  # admitted now: its queue time is the wait for the router
        if request.num_loading_blocks:
            request.num_computed_tokens = request.num_cached_tokens - request.num_loading_blocks * self.block_size
            request.status = RequestStatus.LOADING
            self.loading.append(request)
            return
        request.num_computed_tokens = request.num_cached_tokens
        self.add_running(request)

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    def register_full_blocks(self, request: Request) -> None:
        """Blocks that just filled up join the prefix cache (generated text too, so multi-turn chats reuse it)."""
        if request.num_computed_tokens // self.block_size > request.num_hashed_blocks:
            request.num_hashed_blocks = self.block_manager.register_full_blocks(
                request.block_ids,
                request.token_slice(0, request.num_computed_tokens),
                request.num_computed_tokens,
                request.num_hashed_blocks,
            )

    def release_behind_window(self, request: Request) -> None:
        """Hand back the blocks no layer's window reaches again: the next query (at ``num_computed_tokens``) and
        every later one attend keys from ``num_computed_tokens - window + 1`` on. The block the prefix-cache chain
        continues from is kept. A prefill-only request keeps all (its blocks are exported)."""
        window = self.release_window
        if window is None or request.prefill_only:
            return
        manager = self.block_manager
        first_needed = max(0, request.num_computed_tokens - window + 1) // manager.block_size
        if manager.enable_prefix_caching:
            first_needed = min(first_needed, request.num_hashed_blocks - 1)
        for index in range(request.num_released_blocks, first_needed):
            manager.release(request.block_ids, index)
            self.num_released_blocks += 1
        request.num_released_blocks = max(request.num_released_blocks, first_needed)

    def freeze(self, request: Request) -> None:
        """Take a running request out of the batch, blocks held (it moves to another worker, or resumes)."""
        self.running.remove(request)
        request.status = RequestStatus.FROZEN

    def add_running(self, request: Request) -> None:
        """A request on blocks it already holds joins between steps: KV imported, or a reservation prefilled here."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def remove(self, request: Request) -> None:
        for queue in (self.running, self.waiting, self.remote_ready, self.loading):
            if request in queue:
                queue.remove(request)
                return

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.remote_ready or self.loading)

    def import_progress(self, request: Request) -> None:
        """A reservation's KV or tokens came (or its transfer failed): once both are in (READY, or RECOMPUTE after a
        failure) and no KV-tier load is under way, it is queued for admission."""
        handoff = request.kv_import
        if handoff is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request.request_id!r} is not waiting for remote KV")
        joined = handoff.state in (ImportState.READY, ImportState.RECOMPUTE)
        if joined and handoff.ready_s is None and not request.num_loading_blocks:
            handoff.ready_s = self.clock()
            self.remote_ready.append(request)

    def admit_remote(self) -> list[Request]:
        """Take the joined reservations: READY -> RUNNING with its context computed (the KV of every token it brings
        but the last); RECOMPUTE -> WAITING, at the back. The caller appends each one's tokens."""
        admitted = list(self.remote_ready)
        self.remote_ready.clear()
        now = self.clock()
        for request in admitted:
            handoff = request.kv_import
            assert handoff is not None  # only import_progress queues, and it checks
            handoff.admitted_s = now
            if handoff.state is ImportState.RECOMPUTE:
                request.status = RequestStatus.WAITING
                self.waiting.append(request)
                continue
            computed = handoff.context_tokens(request.num_prompt_tokens)
            if handoff.valid_prompt_tokens is not None:  # a tier load fell short: the rest of the prompt is computed
                computed = min(computed, handoff.valid_prompt_tokens)
            request.num_computed_tokens = computed
            self.add_running(request)
        return admitted

    def rollback(self, request: Request) -> None:
        """After a verified proposal: the blocks grown for its rejected tokens go back (their KV is never read)."""
        self.block_manager.truncate(request.block_ids, request.num_tokens)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.block_manager.free(victim.block_ids)
        victim.num_computed_tokens = victim.num_hashed_blocks = victim.num_released_blocks = 0
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def _add_proposals(self, chunks: list[ScheduledChunk], proposals: Mapping[str, list[int]], budget: int) -> int:
        """Extend decode chunks by their requests' proposals, within the token budget, on blocks that are free after
        every running request has its own (a proposal never preempts); returns the budget left."""
        for chunk in chunks:
            proposal = proposals.get(chunk.request.request_id)
            if not proposal or chunk.num_tokens != 1 or not chunk.samples or budget <= 0:
                continue
            proposal = proposal[:budget]
            if self.block_manager.grow(chunk.request.block_ids, chunk.end + len(proposal)):
                chunk.proposal = proposal
                chunk.num_tokens += len(proposal)
                budget -= len(proposal)
        return budget

    def schedule(self, proposals: Mapping[str, list[int]] | None = None) -> list[ScheduledChunk]:
        """``proposals``: tokens proposed for decoding requests (speculative decoding), each verified in the chunk of
        the request's last token as far as the token budget allows."""
        budget = self.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[str] = set()
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.block_manager.grow(req.block_ids, req.num_computed_tokens + num_new):
                # req itself is never in ``scheduled`` yet, so a victim always exists
                victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
                self._preempt(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # req itself was preempted; the list shifted under index
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, num_new))
            scheduled.add(req.request_id)
            budget -= num_new
            index += 1
        if proposals:
            budget = self._add_proposals(chunks, proposals, budget)

        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
            req = self.waiting[0]
            tokens = req.all_token_ids
            # prompt logprobs need every prompt position computed: no prefix-cache hit for them (as in vLLM)
            use_cache = not req.wants_prompt_logprobs
            allocation = self.block_manager.allocate(tokens, len(tokens), use_prefix_cache=use_cache)
            if allocation is None:
                break
            self.waiting.popleft()
            req.block_ids, req.num_computed_tokens = allocation
            req.num_hashed_blocks = req.num_computed_tokens // self.block_manager.block_size
            first_admission = req.timing.scheduled_s is None
            if first_admission:
                req.timing.scheduled_s = self.clock()
                req.num_cached_tokens = req.num_computed_tokens
            if use_cache and self._start_tier_load(req, tokens, first_admission):
                req.status = RequestStatus.LOADING
                self.loading.append(req)
                continue
            self.add_running(req)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, num_new))
            scheduled.add(req.request_id)
            budget -= num_new
        return chunks
