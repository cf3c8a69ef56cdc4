"""A worker's role: what it does with each typed command and each tick, apart from sockets, threads and routers.

A ``Role`` gets its engine, transfer endpoint and an ``emit`` callback, so tests hand it commands and read its events
(tests/prefill, tests/decode); the runtime (worker/runtime.py) adds the loop thread, heartbeat, sockets and request
ownership. A request's state is the engine's ``Request``; a role keeps no table of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import msgspec

from engine.llm_engine import LLMEngine
from engine.request import FinishReason, RequestOutput
from worker.messages import (
    Abort,
    Command,
    ErrorCode,
    ErrorEvent,
    Event,
    Timing,
    TokenItem,
    Tokens,
    WorkerCounters,
    WorkerLoad,
    kind,
)
from worker.spec import WorkerRole, WorkerSpec
from worker.tracing import RequestSpans

Emit = Callable[[Event], None]  # where a role's events go (the runtime's socket to the owning router, or a test)


class Role:
    """The request logic of one worker kind. Subclasses set ``kind`` and fill in ``handle`` and ``tick``."""

    kind: ClassVar[WorkerRole]

    def __init__(self, name: str, engine: LLMEngine, emit: Emit, counters: WorkerCounters | None = None) -> None:
        self.name = name
        self.engine = engine
        self.emit = emit
        self.counters = counters if counters is not None else WorkerCounters()  # the heartbeat's totals
        self.spans: RequestSpans | None = None  # the runtime's, when it traces requests (worker/tracing.py)

    @classmethod
    def from_spec(cls, spec: WorkerSpec, engine: LLMEngine, emit: Emit) -> Role:
        """The role as a worker process runs it, its transfer endpoint and options from the (resolved) spec."""
        return cls(spec.name, engine, emit)

    # ---- what each role fills in -------------------------------------------------------------------------------

    def handle(self, command: Command, arrival_s: float) -> None:
        """One command about a request (params already validated); ``arrival_s``: when it was sent, on this worker's
        monotonic clock. ValueError or KeyError answers the request with ``invalid_request``."""
        raise ValueError(f"{self.kind.value} worker does not take {kind(command)!r} commands")

    def tick(self) -> None:
        """One turn of the worker's loop: step the engine, poll the transfer layer, emit what came of it."""
        raise NotImplementedError

    def abort(self, rid: str) -> None:
        """Free whatever the request holds, in any state (the router aborted it, or it is being failed)."""
        self.engine.abort(rid)

    def has_work(self) -> bool:
        """Something to do before the next command: a step to run, or a request waiting on the transfer layer."""
        return self.engine.has_unfinished() or bool(self.engine.requests)

    def holds_requests(self) -> bool:
        """Anything a request still needs from this worker: engine requests (decode reservations included), steps
        or transfers in flight, exported KV a decode worker has not confirmed."""
        load = self.load()
        return self.has_work() or bool(load.requests or load.awaiting_kv or load.leased_transfers)

    def health_problem(self) -> str:
        """A role's own reason to be degraded ("" when none): a dead transfer I/O thread."""
        return ""

    def info(self) -> dict:
        """What the router needs to know about this role beyond the runtime's addresses (the KV address)."""
        return {}

    def close(self) -> None:
        """Close the transfer endpoint."""

    def take(self, command: Command, arrival_s: float) -> None:
        """A request command as every worker takes it (the runtime, the planner's and the fault simulations):
        ``Abort`` frees the request; a command the role refuses (ValueError, KeyError) is answered with an error."""
        rid = getattr(command, "rid", "")
        try:
            if isinstance(command, Abort):
                self.counters.aborts += 1
                self.abort(rid)
            else:
                self.handle(command, arrival_s)
        except (ValueError, KeyError) as exc:
            self.counters.errors += 1
            self.emit_error(rid, str(exc), ErrorCode.INVALID_REQUEST)

    # ---- shared ------------------------------------------------------------------------------------------------

    def fail_all(self, reason: str) -> None:
        """Fail every request this worker holds (its loop is broken): each is freed and gets an error event."""
        for rid in list(self.engine.requests):
            self.abort(rid)
            self.emit_error(rid, reason, ErrorCode.WORKER_ERROR)

    def emit_error(self, rid: str, message: str, code: ErrorCode) -> None:
        self.emit(ErrorEvent(rid=rid, worker=self.name, message=message, code=code))

    def emit_outputs(self, outputs: list[RequestOutput]) -> None:
        """One ``tokens`` event for a step's outputs; a failed request gets its own error event instead."""
        items = []
        for output in outputs:
            if output.error is not None:  # finish_reason ERROR (blocks already freed): an error for that request only
                self.counters.errors += 1
                self.emit_error(output.request_id, output.error, ErrorCode.from_engine(output.error_code))
            elif output.new_token_ids or output.text_delta or output.finished:
                items.append(token_item(output))
        if items:
            self.emit(Tokens(worker=self.name, items=items))

    def kv_paths(self) -> dict[str, str]:
        """How this worker's KV sender reaches each receiver (none: it sends no KV)."""
        return {}

    def load(self) -> WorkerLoad:
        """The gauges of the heartbeat (a fresh object: never changed once sent)."""
        engine = self.engine
        return WorkerLoad(
            waiting=len(engine.scheduler.waiting),
            running=len(engine.scheduler.running),
            requests=len(engine.requests),
            max_requests=engine.config.max_num_seqs,
            free_blocks=engine.num_free_blocks,
            total_blocks=engine.block_manager.num_blocks,
        )

    def totals(self) -> WorkerCounters:
        """The counters of the heartbeat (a copy), with those the engine keeps itself."""
        engine = self.engine
        fields: dict[str, float] = {
            "preemptions": engine.scheduler.num_preemptions,
            "prefix_hit_tokens": engine.block_manager.prefix_hit_tokens,
            "recomputes": engine.num_recomputes,
        }
        if engine.speculator is not None:
            spec = engine.speculator.totals
            fields["spec_proposed_tokens"] = spec.proposed_tokens
            fields["spec_accepted_tokens"] = spec.accepted_tokens
            fields["spec_verify_steps"] = spec.verify_steps
        graphs = engine.runner.decode_graphs
        if graphs is not None:
            fields["static_decode_steps"] = sum(graphs.steps.values())
            fields["decode_compile_seconds"] = sum(graphs.compile_s.values())
        traffic = engine.expert_traffic
        if traffic is not None and traffic.layer_forwards:
            fields["expert_tokens"] = traffic.tokens
            fields["expert_pairs_busiest_rank"] = max(traffic.pairs_per_rank)
            fields["expert_pairs_mean_rank"] = sum(traffic.pairs_per_rank) // traffic.size
            fields["expert_bytes_sent"] = traffic.bytes_sent
        if engine.kv_tiers is not None:
            stats = engine.kv_tiers.stats
            for tier in ("host", "disk"):
                fields[f"{tier}_hit_tokens"] = stats.hit_tokens[tier]
                fields[f"{tier}_saved_bytes"] = stats.saved_bytes[tier]
                fields[f"{tier}_loaded_bytes"] = stats.loaded_bytes[tier]
            fields["tier_loads"] = stats.loads
            fields["tier_load_seconds"] = stats.load_seconds
        return msgspec.structs.replace(self.counters, **fields)


def wire_timing(output: RequestOutput) -> Timing:
    """Where a request's time went here: the prefill's figures if the prompt was computed here, else the KV import's
    (none for a request moved here while running: the router times the move, and its first import's figures stand)."""
    timing, handoff = output.timing, output.kv_import
    if handoff is not None and handoff.moved:
        return Timing()
    if handoff is None:
        assert timing is not None  # the caller reports only outputs that carry their request's stamps
        return Timing(
            prefill_queue_s=timing.queue_s, prefill_compute_s=timing.compute_s, prefill_end_mono=timing.first_token_s
        )
    return Timing(
        kv_done_mono=handoff.kv_done_s,
        kv_transfer_s=handoff.kv_transfer_s,
        kv_wait_after_first_token_s=handoff.kv_wait_after_first_token_s,
        decode_queue_s=handoff.decode_queue_s,
        recomputed=handoff.recomputed,
    )


def token_item(output: RequestOutput) -> TokenItem:
    """A request's share of a step: tokens, text, logprobs; its timing with its first token here (its first decoded
    one, if the KV was imported) and its last; prompt logprobs and prefix-cache hit with the first token sampled
    where the prompt was computed. A prefill worker's finish (PREFILLED) is not a finish for the client."""
    imported = output.kv_import is not None
    # a step may bring several tokens (speculative decoding): which of them is the request's n-th
    before = output.num_output_tokens - len(output.new_token_ids)
    first_here = before == 0 and bool(output.new_token_ids) and not imported
    reports = output.finished or before < (2 if imported else 1) <= output.num_output_tokens
    finish = None if output.finish_reason is FinishReason.PREFILLED else output.finish_reason
    return TokenItem(
        output.request_id,
        output.new_token_ids,
        output.text_delta,
        finish,
        wire_timing(output) if reports and output.timing is not None else None,
        output.logprobs if output.new_token_ids else None,
        output.prompt_logprobs if first_here else None,
        output.num_cached_tokens if first_here else None,
        before,
    )
