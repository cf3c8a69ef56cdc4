"""Load shapes: when each request is sent, and when a run stops.

- Open loop (finite ``request_rate``, or inf without ``max_concurrency``): gamma gaps of shape ``burstiness`` (1:
  Poisson; below: burstier) and mean ``1 / rate``, the first at 0; inf sends all at once. A request due while
  ``max_concurrency`` are running waits, timed from its actual send (as vLLM; ``scheduled_s`` / ``sent_s``).
- Fixed schedule (``schedule``: a trace's send times): the open loop at those times instead of drawn ones.
- Closed loop (inf with ``max_concurrency`` N): N senders, each sending its next request when its last one ends.
- ``ramp_up_s``: open loop, the rate rises linearly from 0 (arrivals drawn in operational time); closed loop, sender
  i starts at ``ramp_up_s * i / N``.
- At the ``duration_s`` bound running requests are cancelled, and each has ``request_timeout_s``: a run always ends.
Time is read from a ``Clock`` (the wall's, or a test's fake one) and requests go through ``send`` (``send_request``).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx
import numpy as np

from bench.loadtest.client import RequestResult, RequestSettings, RequestSpec, send_request


@dataclass(slots=True)
class LoadShape:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_prompts: int | None = 100
    duration_s: float | None = None
    ramp_up_s: float = 0.0
    num_warmups: int = 0
    schedule: list[float] | None = None  # fixed send times (s from the start), e.g. a trace's: not drawn at a rate

    def validate(self) -> None:
        if self.schedule is not None:
            if not self.schedule or any(b < a for a, b in zip(self.schedule, self.schedule[1:])):
                raise ValueError("a fixed schedule needs at least one send time, in order")
            if self.schedule[0] < 0 or not math.isinf(self.request_rate) or self.ramp_up_s:
                raise ValueError("a fixed schedule starts at 0 or later and has no request rate or ramp-up")
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be positive (inf: all at once)")
        if not self.burstiness > 0:
            raise ValueError("--burstiness must be positive (1: Poisson)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("--duration must be positive")
        if self.ramp_up_s < 0 or self.num_warmups < 0:
            raise ValueError("--ramp-up-s and --num-warmups cannot be negative")
        if not self.num_prompts and self.duration_s is None:
            raise ValueError("a run needs a bound: --num-prompts or --duration")
        if not self.num_prompts and math.isinf(self.request_rate) and self.max_concurrency is None:
            raise ValueError("--request-rate inf with no --num-prompts needs --max-concurrency")

    @property
    def closed_loop(self) -> bool:
        return self.schedule is None and math.isinf(self.request_rate) and self.max_concurrency is not None

    @property
    def rate_label(self) -> float | str:
        """The run's rate: the request rate, or a schedule's mean (rows over its span, 4 decimals); "inf" for
        all at once."""
        if self.schedule is not None:
            span = self.schedule[-1] - self.schedule[0]
            return round(len(self.schedule) / span, 4) if span > 0 else "inf"
        return "inf" if math.isinf(self.request_rate) else self.request_rate


class Clock:
    """Seconds on a monotonic clock and sleeping on it: the wall's here; tests give a fake one."""

    def now(self) -> float:
        return time.perf_counter()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


WALL_CLOCK = Clock()
Send = Callable[[httpx.AsyncClient, RequestSpec, RequestSettings, RequestResult], Awaitable[RequestResult]]


class PhaseMonitor(Protocol):
    """Runs beside a measured phase from its start (``clock.now()`` then) until cancelled, e.g. sampling the
    server."""

    async def run(self, start: float) -> None: ...


def arrival_offsets(rate: float, burstiness: float, ramp_up_s: float, rng: np.random.Generator) -> Iterator[float]:
    """Send times (s from the start) of an open-loop run, without end."""
    if math.isinf(rate):
        while True:
            yield 0.0
    s = 0.0  # operational time: expected arrivals so far
    ramp_arrivals = rate * ramp_up_s / 2.0  # arrivals expected during the ramp
    while True:
        if ramp_up_s > 0 and s < ramp_arrivals:
            yield math.sqrt(2.0 * ramp_up_s * s / rate)
        else:
            yield (ramp_up_s if ramp_up_s > 0 else 0.0) + (s - (ramp_arrivals if ramp_up_s > 0 else 0.0)) / rate
        s += rng.gamma(shape=burstiness, scale=1.0 / burstiness)


def make_client(settings: RequestSettings, connections: int | None = None) -> httpx.AsyncClient:
    # No environment proxies: a benchmark must reach the server directly.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(settings.request_timeout_s),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        trust_env=False,
    )


class LagMonitor:
    """How late the client's event loop wakes up: if this grows, the client itself is skewing the figures."""

    def __init__(self, period_s: float = 0.01) -> None:
        self.period_s = period_s
        self.lags: list[float] = []

    async def run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.period_s)
            self.lags.append(max(0.0, time.perf_counter() - before - self.period_s))

    def stats(self) -> dict:
        lags = np.asarray(self.lags or [0.0]) * 1000.0
        return {"loop_lag_ms_p99": float(np.percentile(lags, 99)), "loop_lag_ms_max": float(lags.max())}


async def run_phase(
    specs: Sequence[RequestSpec],
    shape: LoadShape,
    settings: RequestSettings,
    *,
    seed: int = 0,
    progress: bool = True,
    label: str = "",
    clock: Clock = WALL_CLOCK,
    send: Send = send_request,
    monitors: Sequence[PhaseMonitor] = (),
) -> tuple[list[RequestResult], float, dict]:
    """Warm up, then the measured phase, cycling ``specs``; ``monitors`` run beside the measured phase. Returns
    (all results, measured s, client stats)."""
    shape.validate()
    rate_label = shape.rate_label
    results: list[RequestResult] = []
    async with make_client(settings, shape.max_concurrency) as client:
        spec_iter = itertools.cycle(specs)
        if shape.num_warmups:
            warm = [RequestResult(index=-1 - i, warmup=True, rate=rate_label) for i in range(shape.num_warmups)]
            sem = asyncio.Semaphore(shape.max_concurrency or shape.num_warmups)

            async def warm_one(result: RequestResult, spec: RequestSpec) -> None:
                async with sem:
                    await send(client, spec, settings, result)

            await asyncio.gather(*(warm_one(r, next(spec_iter)) for r in warm))
            results.extend(warm)
        measured: list[RequestResult] = []
        bar = progress_bar(shape.num_prompts, progress, label)
        monitor = LagMonitor()
        lag_task = asyncio.create_task(monitor.run())
        start = clock.now()
        watching = [asyncio.create_task(m.run(start)) for m in monitors]
        try:
            phase = _Phase(client, settings, shape, start, rate_label, bar, clock, send)
            if shape.closed_loop:
                await _closed_loop(phase, spec_iter, measured)
            else:
                offsets = (
                    shape.schedule
                    if shape.schedule is not None
                    else arrival_offsets(
                        shape.request_rate, shape.burstiness, shape.ramp_up_s, np.random.default_rng(seed)
                    )
                )
                await _open_loop(phase, spec_iter, offsets, measured)
        finally:
            end = clock.now()
            for task in (lag_task, *watching):
                task.cancel()
            await asyncio.gather(lag_task, *watching, return_exceptions=True)
            if bar is not None:
                bar.close()
        results.extend(measured)
    return results, end - start, monitor.stats()


def progress_bar(total: int | None, enabled: bool, label: str):
    """A tqdm bar on stderr (``total`` None: unknown), or None when disabled."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total or None,
        desc=label or "requests",
        unit="req",
        file=sys.stderr,
        leave=False,
        dynamic_ncols=True,
    )


def remaining_s(start: float, shape: LoadShape, clock: Clock = WALL_CLOCK) -> float | None:
    return None if shape.duration_s is None else start + shape.duration_s - clock.now()


async def finish_within_bound(
    tasks: list[asyncio.Task], driver: asyncio.Task, start: float, shape: LoadShape, clock: Clock = WALL_CLOCK
) -> None:
    """Wait for ``driver`` (which creates ``tasks``) and every task, up to the duration bound; then cancel."""

    async def everything() -> None:
        await driver
        while True:  # the driver is done: ``tasks`` no longer grows
            pending = [t for t in tasks if not t.done()]
            if not pending:
                return
            await asyncio.wait(pending)

    waiter = asyncio.create_task(everything())
    try:
        await asyncio.wait({waiter}, timeout=remaining_s(start, shape, clock))
    finally:
        leftovers = [t for t in [waiter, driver, *tasks] if not t.done()]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(waiter, driver, *tasks, return_exceptions=True)


@dataclass(slots=True)
class _Phase:
    """What an open loop's requests share."""

    client: httpx.AsyncClient
    settings: RequestSettings
    shape: LoadShape
    start: float
    rate_label: float | str
    bar: object
    clock: Clock
    send: Send


async def _open_loop(
    phase: _Phase, spec_iter: Iterator[RequestSpec], offsets: Iterable[float], measured: list[RequestResult]
) -> None:
    """Each request at ``start + offset`` (never before), until the count or the duration bound."""
    shape, clock, start = phase.shape, phase.clock, phase.start
    sem = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
    tasks: list[asyncio.Task] = []

    async def one(result: RequestResult, spec: RequestSpec) -> None:
        try:
            if sem is None:
                result.sent_s = clock.now() - start
                await phase.send(phase.client, spec, phase.settings, result)
            else:
                async with sem:
                    result.sent_s = clock.now() - start
                    await phase.send(phase.client, spec, phase.settings, result)
        except asyncio.CancelledError:
            if result.error is None:
                result.error, result.error_detail = "cancelled", "due, but waiting for a concurrency slot at the bound"
            raise
        finally:
            if phase.bar is not None:
                phase.bar.update(1)  # type: ignore[attr-defined]

    async def dispatch() -> None:
        for seq, offset in enumerate(offsets):
            if shape.num_prompts and seq >= shape.num_prompts:
                return
            if shape.duration_s is not None and offset >= shape.duration_s:
                return
            while (delay := start + offset - clock.now()) > 0:
                await clock.sleep(delay)
            result = RequestResult(index=seq, rate=phase.rate_label, scheduled_s=offset)
            measured.append(result)
            tasks.append(asyncio.create_task(one(result, next(spec_iter))))

    await finish_within_bound(tasks, asyncio.create_task(dispatch()), start, shape, clock)


async def _closed_loop(phase: _Phase, spec_iter: Iterator[RequestSpec], measured: list[RequestResult]) -> None:
    shape, clock, start = phase.shape, phase.clock, phase.start
    counter = itertools.count()
    n = shape.max_concurrency
    assert n is not None  # a closed loop has a concurrency

    async def sender(i: int) -> None:
        if shape.ramp_up_s:
            await clock.sleep(shape.ramp_up_s * i / n)
        while True:
            seq = next(counter)
            if shape.num_prompts and seq >= shape.num_prompts:
                return
            remaining = remaining_s(start, shape, clock)
            if remaining is not None and remaining <= 0:
                return
            now = clock.now() - start
            result = RequestResult(index=seq, rate=phase.rate_label, scheduled_s=now, sent_s=now)
            measured.append(result)
            try:
                await phase.send(phase.client, next(spec_iter), phase.settings, result)
            finally:
                if phase.bar is not None:
                    phase.bar.update(1)  # type: ignore[attr-defined]

    senders = [asyncio.create_task(sender(i)) for i in range(n)]

    async def driver() -> None:
        await asyncio.gather(*senders)

    await finish_within_bound(senders, asyncio.create_task(driver()), start, shape, clock)
    measured.sort(key=lambda r: r.index)
