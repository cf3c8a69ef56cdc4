"""Continuous batching: which requests compute how many tokens in the next forward.

Every step has a token budget (``max_batch_tokens``). Running requests go first, in arrival order: a decoding request
takes one token, a request still prefilling takes the next chunk of its prompt that fits. Then waiting requests are
admitted in FIFO order while budget and ``max_num_seqs`` allow, each only if the KV blocks for its whole prompt can be
allocated now (reusing prefix-cached blocks). A request that cannot get blocks waits; memory is never overcommitted.

Preemption (recompute): when a running request needs a new block for its next token and none is free, the most
recently admitted running request is preempted: its blocks are freed, its computed count is reset and it goes back to
the front of the waiting queue, keeping the tokens it generated. When it is admitted again its prompt plus those
tokens are prefilled again (full blocks are usually still in the prefix cache), and generation continues where it
stopped. If the request itself is the only one left, it is preempted and waits for blocks.
"""

from __future__ import annotations

import time
from collections import deque

from engine.block_manager import BlockManager
from engine.model_runner import ScheduledChunk
from engine.request import Request, RequestStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_tokens: int, max_num_seqs: int) -> None:
        self.block_manager = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A request whose KV is already complete (imported from a prefill worker) joins between steps."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.block_manager.free(victim.block_ids)
        victim.num_computed_tokens = 0
        victim.num_hashed_blocks = 0
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[str] = set()
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.block_manager.grow(req.block_ids, req.num_computed_tokens + num_new):
                victim = next((r for r in reversed(self.running) if r.request_id not in scheduled), None)
                self._preempt(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # req itself was preempted; the list shifted under index
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, num_new))
            scheduled.add(req.request_id)
            budget -= num_new
            index += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            tokens = req.all_token_ids
            allocation = self.block_manager.allocate(tokens, len(tokens))
            if allocation is None:
                break
            self.waiting.popleft()
            req.block_ids, req.num_computed_tokens = allocation
            req.num_hashed_blocks = req.num_computed_tokens // self.block_manager.block_size
            if req.scheduled_s is None:
                req.scheduled_s = time.monotonic()
                req.num_cached_tokens = req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, num_new))
            scheduled.add(req.request_id)
            budget -= num_new
        return chunks
