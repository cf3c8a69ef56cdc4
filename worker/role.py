"""A worker's role: what it does with each typed command and each tick, apart from sockets, threads and routers.

Why split from the runtime (worker/runtime.py): the role is where the request logic lives (which command does what
to the engine and the transfer layer, which events come out), and it is testable only if it can be driven without a
socket. A ``Role`` takes its engine, its transfer endpoint (a sender, a receiver, or none) and an ``emit`` callback
for the events it produces; tests hand it typed commands and read the typed events it emits (tests/prefill,
tests/decode), the way vLLM tests its scheduler with hand-built outputs. The runtime owns one role and adds the rest:
the loop thread, the heartbeat, the sockets and which router owns each request.

A role keeps no request table of its own: a request's state is the engine's ``Request`` (its status, its
``RequestTiming``, its KV export or import). What a role does keep is named where it is (the prefill role's set of
transfers the router already knows have ended; the decode role's map of the router's reservation attempts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import msgspec

from engine.llm_engine import LLMEngine
from engine.request import RequestOutput, RequestTiming
from worker.messages import (
    Command,
    ErrorCode,
    ErrorEvent,
    Event,
    PrefillTiming,
    TokenItem,
    WorkerCounters,
    WorkerLoad,
    kind,
)
from worker.spec import WorkerRole, WorkerSpec

Emit = Callable[[Event], None]  # where a role's events go (the runtime's socket to the owning router, or a test)


class Role:
    """The request logic of one worker kind. Subclasses set ``kind`` and fill in ``handle`` and ``tick``."""

    kind: ClassVar[WorkerRole]

    def __init__(self, name: str, engine: LLMEngine, emit: Emit, counters: WorkerCounters | None = None) -> None:
        self.name = name
        self.engine = engine
        self.emit = emit
        self.counters = counters if counters is not None else WorkerCounters()  # the heartbeat's totals

    @classmethod
    def from_spec(cls, spec: WorkerSpec, engine: LLMEngine, emit: Emit) -> Role:
        """The role as a worker process runs it: its transfer endpoint and options taken from the (resolved) spec."""
        return cls(spec.name, engine, emit)

    # ---- what each role fills in -------------------------------------------------------------------------------

    def handle(self, command: Command, arrival_s: float) -> None:
        """One command about a request (its params already validated); ``arrival_s``: when it was sent, on this
        worker's monotonic clock. Raising ValueError or KeyError answers the request with ``invalid_request``."""
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

    def health_problem(self) -> str:
        """A role's own reason to be degraded ("" when none): a dead transfer I/O thread."""
        return ""

    def info(self) -> dict:
        """What the router needs to know about this role beyond the runtime's addresses (the KV address)."""
        return {}

    def close(self) -> None:
        """Close the transfer endpoint."""

    # ---- shared ------------------------------------------------------------------------------------------------

    def fail_all(self, reason: str) -> None:
        """Fail every request this worker holds (its loop is broken): each is freed and gets an error event."""
        for rid in list(self.engine.requests):
            self.abort(rid)
            self.emit_error(rid, reason, ErrorCode.WORKER_ERROR)

    def emit_error(self, rid: str, message: str, code: ErrorCode) -> None:
        self.emit(ErrorEvent(rid=rid, worker=self.name, message=message, code=code))

    def load(self) -> WorkerLoad:
        """The gauges of the heartbeat (a fresh object: never changed once sent)."""
        engine = self.engine
        return WorkerLoad(
            waiting=len(engine.scheduler.waiting),
            running=len(engine.scheduler.running),
            requests=len(engine.requests),
            free_blocks=engine.num_free_blocks,
            total_blocks=engine.block_manager.num_blocks,
        )

    def totals(self) -> WorkerCounters:
        """The counters of the heartbeat (a copy), with those the engine keeps itself."""
        engine = self.engine
        return msgspec.structs.replace(
            self.counters,
            preemptions=engine.scheduler.num_preemptions,
            prefix_hit_tokens=engine.block_manager.prefix_hit_tokens,
            recomputes=engine.num_recomputes,
        )


def prefill_timing(timing: RequestTiming | None) -> PrefillTiming:
    """Where a request's prefill time went in this worker (seconds; None: not reached), from the engine's record."""
    if timing is None:
        return PrefillTiming()
    return PrefillTiming(queue_s=timing.queue_s, compute_s=timing.compute_s)


def computed_here_item(output: RequestOutput) -> TokenItem:
    """A request's share of a step on the worker that computed its prompt and samples its first token (colocated, or
    the decode worker's ``prefill_here``): the prefill's timing (the router names it prefill_*) with the first token
    and the last; the tokens' logprobs when the request asked for them; and with the first sampled token only, the
    prompt's logprobs and how many prompt tokens the prefix cache held (the response's ``cached_tokens``)."""
    first = output.num_output_tokens == 1 and bool(output.new_token_ids)
    return TokenItem(
        output.request_id,
        output.new_token_ids,
        output.text_delta,
        output.finish_reason,
        prefill_timing(output.timing) if output.num_output_tokens == 1 or output.finished else None,
        output.logprobs,
        output.prompt_logprobs if first else None,
        output.num_cached_tokens if first else None,
    )
