"""One simulated worker's engine: the real scheduler's rules (engine/scheduler.py) stepped in simulated time.

Every role runs the engine's one scheduler, so the simulator has one too: each step has a token budget
(``max_batch_tokens``); running requests go first (a decoding one takes one token, one still prefilling the next
chunk that fits); then waiting requests are admitted FIFO while budget and ``max_num_seqs`` allow, each only if the
KV blocks for its whole prompt are free (a cached prefix's blocks are shared). A running request that needs a block
when none is free preempts the most recently admitted one (recompute: it goes back to the front of the queue). A
step lasts ``profile.mixed_step_s`` of its prefill tokens and its decodes, so a prefill worker's steps cost
``prefill_s``, a decode worker's ``decode_step_s`` and a colocated worker's the mix (``_step_s``).

What differs by role is only where requests come from and where they end:

- prefill: a request ends at its first token, and its blocks stay held (leased) until its KV transfer is done;
- decode: a request's blocks are reserved at the router's ask (``reserve``), and it joins the running batch, past
  the scheduler's ``max_num_seqs``, once both its KV and its first token are in (``remote_ready``), like
  ``admit_remote``;
- colocated: a request is prefilled and decoded here.

Simplifications, said once: the prefix cache keeps every prefix it computed (no eviction; prefixes are few and
short in the workloads it serves), and a decode worker does not look up its own prefix cache for a reservation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import simpy

from engine.blocks import blocks_for_tokens, reusable_prefix_tokens
from planner.profile_model import Profile
from planner.trace import TraceRequest


@dataclass(slots=True, eq=False)
class SimRequest:
    index: int
    trace: TraceRequest
    num_tokens: int  # tokens whose KV it must hold to produce its next token: prompt + tokens generated
    computed: int = 0
    generated: int = 0
    blocks: int = 0  # its own blocks (a shared cached prefix not counted)
    shared_blocks: int = 0  # cached prefix blocks it uses
    first_token_s: float | None = None  # on the worker (the router sees it a hop later)
    last_token_s: float | None = None
    done: bool = False
    rejected: bool = False
    kv_in: bool = False  # decode: its KV arrived
    token_in: bool = False  # decode: its first token arrived (the router's Start)
    flight: Any = None  # the simulator's record of the request at the router (planner/simulator.py)


Hook = Callable[[SimRequest, float], None]


class SimEngine:
    def __init__(
        self,
        env: simpy.Environment,
        profile: Profile,
        role: str,
        total_blocks: int,
        block_size: int,
        max_batch_tokens: int,
        max_num_seqs: int,
        prefix_caching: bool,
        on_first_token: Hook,
        on_finished: Hook,
        on_capacity: Callable[[], None],
        on_prefix_cached: Callable[[int, int], None] | None = None,
    ) -> None:
        self.env, self.profile, self.role = env, profile, role
        self.total_blocks, self.block_size = total_blocks, block_size
        self.max_batch_tokens, self.max_num_seqs = max_batch_tokens, max_num_seqs
        self.prefix_caching = prefix_caching
        self._on_first_token, self._on_finished, self._on_capacity = on_first_token, on_finished, on_capacity
        self._on_prefix_cached = on_prefix_cached  # the worker's KV event for the router's prefix index
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.awaiting: list[SimRequest] = []  # decode: reserved, waiting for KV and first token
        self.leased = 0  # prefill: finished requests whose blocks wait for their transfer
        self.used_blocks = 0
        self.cached: dict[int, int] = {}  # prefix id -> blocks held by the prefix cache
        self._wake: simpy.Event | None = None
        self.steps = 0
        env.process(self._loop())

    # ---- what the router sees ----------------------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks - sum(self.cached.values())

    def cached_tokens(self, trace: TraceRequest) -> int:
        """Prompt tokens this worker's prefix cache spares (the engine's rule: at least one token is computed)."""
        if not self.prefix_caching or trace.prefix_id is None or trace.prefix_id not in self.cached:
            return 0
        return reusable_prefix_tokens(self.cached[trace.prefix_id], trace.input_tokens, self.block_size)

    # ---- requests in -------------------------------------------------------------------------------------------------

    def add(self, req: SimRequest) -> None:
        """A prompt to compute here (prefill, colocated)."""
        self.waiting.append(req)
        self.notify()

    def reserve(self, req: SimRequest, blocks: int) -> bool:
        """Decode: hold ``blocks`` for a request whose KV will come from a prefill worker."""
        if blocks > self.free_blocks:
            return False
        self.used_blocks += blocks
        req.blocks = blocks
        self.awaiting.append(req)
        return True

    def remote_progress(self, req: SimRequest) -> None:
        """Decode: its KV or its first token came; both in, it joins the batch at the next step."""
        self.notify()

    def transfer_done(self, req: SimRequest) -> None:
        """Prefill: a finished request's KV reached its decode worker; its lease ends."""
        self.leased -= 1
        self.release(req)

    def release(self, req: SimRequest) -> None:
        """Free a request's own blocks (its end, a reservation given up, or a prefill worker's lease over)."""
        self.used_blocks -= req.blocks
        req.blocks = 0
        self._on_capacity()
        self.notify()

    def notify(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    # ---- the loop ----------------------------------------------------------------------------------------------------

    def _loop(self):
        while True:
            self._admit_remote()
            chunks = self._schedule()
            if not chunks:
                self._wake = self.env.event()
                yield self._wake
                self._wake = None
                continue
            yield self.env.timeout(self._step_s(chunks))
            self.steps += 1
            self._apply(chunks)

    def _admit_remote(self) -> None:
        ready = [r for r in self.awaiting if r.kv_in and r.token_in]
        for req in ready:
            self.awaiting.remove(req)
            req.computed = req.trace.input_tokens  # its prompt's KV arrived whole; its first token is next
            self.running.append(req)

    def _schedule(self) -> list[tuple[SimRequest, int, int]]:
        budget, chunks, scheduled = self.max_batch_tokens, [], set()
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            num_new = min(req.num_tokens - req.computed, budget)
            need = blocks_for_tokens(req.computed + num_new, self.block_size) - req.shared_blocks - req.blocks
            preempted_self = False
            while need > self.free_blocks:
                victim = next(r for r in reversed(self.running) if r.index not in scheduled)
                self._preempt(victim)
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                continue
            if need > 0:
                self.used_blocks += need
                req.blocks += need
            chunks.append((req, req.computed, num_new))
            scheduled.add(req.index)
            budget -= num_new
            index += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached = self.cached_tokens(req.trace)
            shared = cached // self.block_size
            need = blocks_for_tokens(req.num_tokens, self.block_size) - shared
            if need > self.free_blocks:
                break
            self.waiting.popleft()
            self.used_blocks += need
            req.blocks, req.shared_blocks, req.computed = need, shared, cached
            self.running.append(req)
            num_new = min(req.num_tokens - req.computed, budget)
            chunks.append((req, req.computed, num_new))
            scheduled.add(req.index)
            budget -= num_new
        return chunks

    def _preempt(self, victim: SimRequest) -> None:
        self.running.remove(victim)
        self.used_blocks -= victim.blocks
        victim.blocks = victim.shared_blocks = victim.computed = 0
        self.waiting.appendleft(victim)

    def _step_s(self, chunks: list[tuple[SimRequest, int, int]]) -> float:
        """One forward's time. Prompt chunks of several requests cost each its own ``prefill_s`` (attention is per
        sequence: the fit's quadratic terms must not see their sum as one prompt) less the fixed cost of every
        forward but one; decodes add ``decode_step_s`` less its fixed cost (``Profile.mixed_step_s``'s rule)."""
        profile = self.profile
        prefill, num_chunks, batch, decode_context = 0.0, 0, 0, 0
        for req, start, num_new in chunks:
            if num_new == 1 and start >= req.trace.input_tokens:  # generating
                batch += 1
                decode_context += start + 1
            else:
                prefill += profile.prefill_s(num_new, start)
                num_chunks += 1
        if num_chunks == 0:
            return profile.decode_step_s(batch, decode_context)
        prefill -= (num_chunks - 1) * profile.prefill_s(0, 0)
        if batch == 0:
            return prefill
        return prefill + profile.decode_step_s(batch, decode_context) - profile.decode_step_s(0, 0)

    def _apply(self, chunks: list[tuple[SimRequest, int, int]]) -> None:
        now = self.env.now
        for req, _start, num_new in chunks:
            req.computed += num_new
            self._maybe_cache_prefix(req)
            if req.computed < req.num_tokens:
                continue  # a prompt chunk that is not the last
            req.generated += 1
            req.last_token_s = now
            if req.generated == 1:
                req.first_token_s = now
                self._on_first_token(req, now)
            if self.role == "prefill" or req.generated >= req.trace.output_tokens:
                self.running.remove(req)
                if self.role == "prefill":
                    self.leased += 1  # its blocks stay until the transfer ends (``release``)
                else:
                    req.done = True
                    self.release(req)
                self._on_finished(req, now)
            else:
                req.num_tokens += 1

    def _maybe_cache_prefix(self, req: SimRequest) -> None:
        """Once a prefix is computed, its full blocks belong to the cache (shared by later requests with it)."""
        trace = req.trace
        if not self.prefix_caching or trace.prefix_id is None or req.shared_blocks or trace.prefix_id in self.cached:
            return
        blocks = trace.prefix_tokens // self.block_size
        if blocks and req.computed >= blocks * self.block_size and req.blocks >= blocks:
            self.cached[trace.prefix_id] = blocks
            req.blocks -= blocks
            self.used_blocks -= blocks
            req.shared_blocks = blocks
            if self._on_prefix_cached is not None:
                self._on_prefix_cached(trace.prefix_id, blocks)
