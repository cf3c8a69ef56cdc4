"""What the simulator is asked to serve: requests with an arrival time, a prompt length and an output length.

A ``Workload`` holds unit-rate arrivals (one request per second on average); ``at_rate(r)`` divides them by ``r``,
so every rate the goodput search probes is the same sequence compressed and attainment falls with the rate instead
of jumping with each random draw. Sources: Poisson arrivals (``poisson_workload``), or a JSONL trace
(``load_jsonl``) whose arrival pattern, bursts included, is only scaled in time.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(slots=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    prefix_id: int | None = None  # requests with one prefix_id share their first prefix_tokens prompt tokens
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"a request needs at least 1 input and 1 output token, got {self}")
        if not 0 <= self.prefix_tokens <= self.input_tokens:
            raise ValueError(f"prefix_tokens must be within the prompt, got {self}")


@dataclass(slots=True)
class Workload:
    name: str  # how tables and plots describe it
    shapes: list[TraceRequest]  # arrival_s: unit-rate arrival time (mean gap 1 s)

    def at_rate(self, rate: float, min_duration_s: float = 0.0) -> list[TraceRequest]:
        """The requests arriving at ``rate`` per second on average.

        ``min_duration_s``: repeat the workload until it spans that long, so a fast cluster is measured in steady
        state, not on a burst it absorbs; the first ``len(shapes)`` requests stay the same, keeping results monotone."""
        if rate <= 0:
            raise ValueError(f"a request rate must be positive, got {rate}")
        shapes, period = self.shapes, self.shapes[-1].arrival_s + 1.0
        copies = max(1, math.ceil(min_duration_s * rate / period)) if min_duration_s > 0 else 1
        return [replace(s, arrival_s=(c * period + s.arrival_s) / rate) for c in range(copies) for s in shapes]

    @property
    def mean_input(self) -> float:
        return sum(s.input_tokens for s in self.shapes) / len(self.shapes)

    @property
    def mean_output(self) -> float:
        return sum(s.output_tokens for s in self.shapes) / len(self.shapes)


def poisson_workload(name: str, shapes: Sequence[TraceRequest], seed: int = 0) -> Workload:
    """``shapes`` (their ``arrival_s`` ignored) with Poisson arrivals at rate 1, the first at 0."""
    if not shapes:
        raise ValueError("a workload needs at least one request")
    rng = random.Random(seed)
    clock, out = 0.0, []
    for index, shape in enumerate(shapes):
        if index:
            clock += rng.expovariate(1.0)
        out.append(replace(shape, arrival_s=clock))
    return Workload(name, out)


def load_jsonl(path: str | Path, limit: int | None = None) -> Workload:
    """A trace of ``{"arrival_s", "input_tokens", "output_tokens"}`` lines, shifted to start at 0, at unit rate."""
    path = Path(path)
    rows: list[TraceRequest] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append(TraceRequest(float(row["arrival_s"]), int(row["input_tokens"]), int(row["output_tokens"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f'{path}:{number}: expected {{"arrival_s": float, "input_tokens": int, "output_tokens": int}} ({exc})'
            ) from None
        if limit is not None and len(rows) >= limit:
            break
    if len(rows) < 2:
        raise ValueError(f"{path}: a trace needs at least two requests (their spacing sets the rate)")
    rows.sort(key=lambda r: r.arrival_s)
    start, span = rows[0].arrival_s, rows[-1].arrival_s - rows[0].arrival_s
    if span <= 0:
        raise ValueError(f"{path}: every request arrives at the same time; the trace has no rate to scale")
    scale = (len(rows) - 1) / span
    return Workload(path.name, [replace(r, arrival_s=(r.arrival_s - start) * scale) for r in rows])
