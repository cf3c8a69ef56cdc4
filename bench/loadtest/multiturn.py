"""Plays multi-turn conversations against a chat server, and summarizes the run by turn.

Each conversation is one task sending its turns in order, each with the whole history, and waiting its think time
after each answer; a failed turn ends it (``failed``; later turns not sent). The load options apply to
conversations: a finite ``--request-rate`` starts them at gamma arrivals; ``--max-concurrency N`` bounds the open
ones (a slot is held through think times, like N users; at rate inf, N are open at all times). At the duration bound
open conversations are ``unfinished``: a turn in flight, or one still waiting for a slot, fails as ``cancelled``.
Our own input token count (``expected_input_tokens``) is made after the run, so tokenizing ever longer histories
never stalls the event loop that times the streams.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import httpx
import numpy as np

from bench.loadtest.client import RequestResult, RequestSettings, RequestSpec, send_request
from bench.loadtest.conversations import ConversationSpec, count_chat
from bench.loadtest.metrics import BASE_PERCENTILES, describe
from bench.loadtest.shapes import (
    LagMonitor,
    LoadShape,
    arrival_offsets,
    finish_within_bound,
    make_client,
    progress_bar,
)


class Outcome(StrEnum):
    COMPLETED = "completed"  # every turn answered
    FAILED = "failed"  # a turn failed on its own; the turns after it were not sent
    UNFINISHED = "unfinished"  # the duration bound cut it (thinking, waiting for a slot, or a turn in flight)


@dataclass(slots=True)
class ConversationRun:
    """One conversation as played: the server's answers so far and one result per turn created."""

    id: int  # the phase's dispatch order (warm-ups negative); the records' ``conversation``
    spec: ConversationSpec
    warmup: bool = False
    scheduled_s: float | None = None  # when it was due, from the start of the phase
    answers: list[str] = field(default_factory=list)
    results: list[RequestResult] = field(default_factory=list)
    outcome: Outcome = Outcome.UNFINISHED
    failure: str | None = None  # the failed turn's reason

    @property
    def turns_sent(self) -> int:
        return sum(r.sent_s is not None for r in self.results)


class _Player:
    """Plays conversations on one client; ``indices`` numbers the turn results in the order they are created."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        settings: RequestSettings,
        start: float,
        rate_label,
        bar,
        indices: Iterable[int],
    ) -> None:
        self.client, self.settings, self.start = client, settings, start
        self.rate_label, self.bar, self.indices = rate_label, bar, iter(indices)

    def _now(self) -> float:
        return time.perf_counter() - self.start

    def _result(self, run: ConversationRun, turn: int, scheduled_s: float | None) -> RequestResult:
        result = RequestResult(
            index=next(self.indices),
            warmup=run.warmup,
            rate=self.rate_label,
            scheduled_s=scheduled_s,
            conversation=run.id,
            turn=turn + 1,
            requested_output_tokens=run.spec.output_tokens[turn],
        )
        run.results.append(result)
        return result

    async def play(self, run: ConversationRun, slot: asyncio.Semaphore | None) -> None:
        try:
            if slot is None:
                await self._turns(run)
            else:
                async with slot:
                    await self._turns(run)
        except asyncio.CancelledError:
            if not run.results:
                result = self._result(run, 0, run.scheduled_s)
                result.error, result.error_detail = "cancelled", "due, but waiting for a concurrency slot at the bound"
            raise

    async def _turns(self, run: ConversationRun) -> None:
        spec = run.spec
        for k in range(spec.turns):
            scheduled = run.scheduled_s
            if k:
                think = spec.think_s[k - 1] if k - 1 < len(spec.think_s) else 0.0
                scheduled = self._now() + think
                if think > 0:
                    await asyncio.sleep(think)
            result = self._result(run, k, scheduled)
            request = RequestSpec(
                index=result.index,
                prompt=spec.user_turns[k],
                output_tokens=spec.output_tokens[k],
                input_tokens=0,  # counted after the run (fill_expected_input_tokens)
                messages=spec.messages(run.answers),
            )
            result.sent_s = self._now()
            try:
                await send_request(self.client, request, self.settings, result)
            finally:
                if self.bar is not None:
                    self.bar.update(1)
            if not result.success:
                run.outcome, run.failure = Outcome.FAILED, result.error
                return
            run.answers.append(result.generated_text)
        run.outcome = Outcome.COMPLETED


async def run_conversations(
    conversations: Sequence[ConversationSpec],
    shape: LoadShape,
    settings: RequestSettings,
    *,
    seed: int = 0,
    progress: bool = True,
    label: str = "",
) -> tuple[list[ConversationRun], float, dict]:
    """Warm-ups, then the measured phase (``shape.num_prompts`` counts conversations). Returns (all conversations,
    warm-ups first; measured s; client stats)."""
    shape.validate()
    if settings.endpoint_type != "chat":
        raise ValueError("multi-turn conversations go to the chat endpoint (--endpoint-type chat)")
    rate_label = "inf" if math.isinf(shape.request_rate) else shape.request_rate
    pool = itertools.cycle(conversations)
    runs: list[ConversationRun] = []
    async with make_client(settings, shape.max_concurrency) as client:
        if shape.num_warmups:
            warm = [ConversationRun(-1 - i, next(pool), warmup=True) for i in range(shape.num_warmups)]
            player = _Player(client, settings, time.perf_counter(), rate_label, None, itertools.count(-1, -1))
            slot = asyncio.Semaphore(shape.max_concurrency or shape.num_warmups)
            await asyncio.gather(*(player.play(run, slot) for run in warm))
            runs.extend(warm)
        measured: list[ConversationRun] = []
        total = sum(c.turns for c in itertools.islice(itertools.cycle(conversations), shape.num_prompts or 0))
        bar = progress_bar(total, progress, label)
        monitor = LagMonitor()
        lag_task = asyncio.create_task(monitor.run())
        start = time.perf_counter()
        try:
            await _measured(
                _Player(client, settings, start, rate_label, bar, itertools.count()), pool, shape, measured, seed
            )
        finally:
            end = time.perf_counter()
            lag_task.cancel()
            await asyncio.gather(lag_task, return_exceptions=True)
            if bar is not None:
                bar.close()
        runs.extend(measured)
    return runs, end - start, monitor.stats()


async def _measured(player: _Player, pool, shape: LoadShape, measured: list[ConversationRun], seed: int) -> None:
    rng = np.random.default_rng(seed)
    closed = shape.closed_loop
    slot = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
    tasks: list[asyncio.Task] = []
    start = player.start

    async def dispatch() -> None:
        for seq, offset in enumerate(arrival_offsets(shape.request_rate, shape.burstiness, shape.ramp_up_s, rng)):
            if shape.num_prompts and seq >= shape.num_prompts:
                return
            if closed:
                assert slot is not None and shape.max_concurrency
                if shape.ramp_up_s and seq < shape.max_concurrency:
                    offset = shape.ramp_up_s * seq / shape.max_concurrency
                else:
                    offset = 0.0
            if shape.duration_s is not None and offset >= shape.duration_s:
                return
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if closed:
                assert slot is not None
                await slot.acquire()
                offset = time.perf_counter() - start
            run = ConversationRun(seq, next(pool), scheduled_s=offset)
            measured.append(run)
            task = asyncio.create_task(player.play(run, None if closed else slot))
            if closed:
                assert slot is not None
                task.add_done_callback(lambda _t: slot.release())
            tasks.append(task)

    await finish_within_bound(tasks, asyncio.create_task(dispatch()), start, shape)


def turn_results(runs: Sequence[ConversationRun]) -> list[RequestResult]:
    """Every turn's result, in the order the turns were created (warm-ups first)."""
    warm = sorted((r for run in runs if run.warmup for r in run.results), key=lambda r: -r.index)
    measured = sorted((r for run in runs if not run.warmup for r in run.results), key=lambda r: r.index)
    return warm + measured


def fill_expected_input_tokens(runs: Sequence[ConversationRun], tokenizer) -> None:
    """Our count of each sent turn's prompt: the templated history with the answers the server gave."""
    for run in runs:
        for k, result in enumerate(run.results):
            if result.sent_s is not None and k <= len(run.answers):
                result.expected_input_tokens = count_chat(tokenizer, run.spec.messages(run.answers[:k]))


def _ttft(results: Sequence[RequestResult], percentiles: Iterable[float]) -> dict:
    d = describe([r.ttft_s for r in results if r.ttft_s is not None], percentiles, scale=1000.0)
    return {k: v for k, v in d.items() if k not in ("std", "min", "max")}


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def _cached(results: Sequence[RequestResult]) -> dict | None:
    """Prompt tokens the server reports it served from its prefix cache; None when it reports nothing."""
    reporting = [r for r in results if r.cached_tokens is not None]
    if not reporting:
        return None

    def rate(rs: list[RequestResult]) -> float | None:
        prompt = sum(r.input_tokens or 0 for r in rs)
        return sum(r.cached_tokens or 0 for r in rs) / prompt if prompt else None

    return {
        "requests_reporting": len(reporting),
        "cached_tokens": sum(r.cached_tokens or 0 for r in reporting),
        "prompt_tokens": sum(r.input_tokens or 0 for r in reporting),
        "hit_rate": rate(reporting),
        "first_turn_hit_rate": rate([r for r in reporting if r.turn == 1]),
        "later_turns_hit_rate": rate([r for r in reporting if (r.turn or 0) > 1]),
    }


def summarize_conversations(runs: Sequence[ConversationRun], percentiles: Iterable[float] = BASE_PERCENTILES) -> dict:
    """The run's ``multi_turn`` section: outcomes, TTFT of turn 1 against later turns (where reuse of the history's
    prefix shows), input tokens by turn, and the server's cached tokens."""
    percentiles = sorted(set(BASE_PERCENTILES) | {float(p) for p in percentiles})
    measured = [r for r in runs if not r.warmup]
    results = [x for run in measured for x in run.results]
    ok = [x for x in results if x.success]
    outcomes = Counter(run.outcome for run in measured)
    first = _ttft([x for x in ok if x.turn == 1], percentiles)
    later = _ttft([x for x in ok if (x.turn or 0) > 1], percentiles)
    by_turn = {}
    for k in sorted({x.turn for x in results if x.turn is not None}):
        mine = [x for x in results if x.turn == k]
        good = [x for x in mine if x.success]
        by_turn[str(k)] = {
            "requests": len(mine),
            "completed": len(good),
            "ttft_ms": _ttft(good, (50.0, 90.0)),
            "input_tokens_mean": _mean([x.input_tokens for x in good if x.input_tokens is not None]),
            "cached_tokens_mean": _mean([x.cached_tokens for x in good if x.cached_tokens is not None]),
        }
    planned = sum(run.spec.turns for run in measured)
    sent = sum(run.turns_sent for run in measured)
    ratio = None
    if first.get("median") and later.get("median") is not None:
        ratio = later["median"] / first["median"]
    return {
        "conversations": len(measured),
        "completed": outcomes[Outcome.COMPLETED],
        "failed": outcomes[Outcome.FAILED],
        "unfinished": outcomes[Outcome.UNFINISHED],
        "failed_by_reason": dict(
            sorted(Counter(run.failure or "unknown" for run in measured if run.outcome == Outcome.FAILED).items())
        ),
        "turns_planned": planned,
        "turns_sent": sent,
        "turns_not_sent": planned - sent,
        "turns_per_conversation_mean": planned / len(measured) if measured else None,
        "ttft_ms_first_turn": first,
        "ttft_ms_later_turns": later,
        "later_over_first_ttft_p50": ratio,
        "by_turn": by_turn,
        "cached_tokens": _cached(ok),
    }
