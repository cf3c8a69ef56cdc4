"""What the simulator is asked to serve: requests with an arrival time, a prompt length, an output length and what
their prompts share (a group's prefix, or a trace's hash ids: one per block of ``hash_block_tokens``, equal ids equal
blocks).

A ``Workload`` holds unit-rate arrivals (one request per second on average); ``at_rate(r)`` divides them by ``r``,
so every rate the goodput search probes is the same sequence compressed and attainment falls with the rate instead
of jumping with each random draw. Sources: Poisson arrivals (``poisson_workload``), or a trace's own arrival times
(``trace_workload``: its bursts and lulls kept, only its clock scaled; the CLI reads the file).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(slots=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    prefix_id: int | None = None  # requests with one prefix_id share their first prefix_tokens prompt tokens
    prefix_tokens: int = 0
    hash_ids: tuple[int, ...] | None = None  # the prompt's blocks from its start: equal ids, equal blocks
    hash_block_tokens: int = 0  # the tokens of one hash block (the last one may be cut by the prompt's end)

    def __post_init__(self) -> None:
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"a request needs at least 1 input and 1 output token, got {self}")
        if not 0 <= self.prefix_tokens <= self.input_tokens:
            raise ValueError(f"prefix_tokens must be within the prompt, got {self}")
        if self.hash_ids is not None and (self.hash_block_tokens < 1 or self.prefix_id is not None):
            raise ValueError(f"hash_ids need a hash_block_tokens >= 1 and no prefix_id, got {self}")


@dataclass(slots=True)
class Workload:
    name: str  # how tables and plots describe it
    shapes: list[TraceRequest]  # arrival_s: unit-rate arrival time (mean gap 1 s)
    native_rate: float | None = None  # a trace's own mean rate, requests/s (None: a synthetic workload)

    def at_rate(self, rate: float, min_duration_s: float = 0.0) -> list[TraceRequest]:
        """The requests arriving at ``rate`` per second on average.

        ``min_duration_s``: repeat the workload until it spans that long, so a fast cluster is measured in steady
        state, not on a burst it absorbs; the first ``len(shapes)`` requests stay the same, keeping results monotone.
        A repeat shares no hash block with the copies before it (its ids are shifted past theirs)."""
        if rate <= 0:
            raise ValueError(f"a request rate must be positive, got {rate}")
        shapes, period = self.shapes, self.shapes[-1].arrival_s + 1.0
        copies = max(1, math.ceil(min_duration_s * rate / period)) if min_duration_s > 0 else 1
        stride = 1 + max((max(s.hash_ids, default=-1) for s in shapes if s.hash_ids), default=-1)
        return [
            replace(
                s,
                arrival_s=(c * period + s.arrival_s) / rate,
                hash_ids=tuple(h + c * stride for h in s.hash_ids) if c and s.hash_ids is not None else s.hash_ids,
            )
            for c in range(copies)
            for s in shapes
        ]

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


def trace_workload(name: str, requests: Sequence[TraceRequest]) -> Workload:
    """A trace's requests (``arrival_s`` on the trace's clock, seconds) as a workload: sorted, the first at 0, the
    clock scaled so the mean gap is 1 s (its bursts and lulls kept); ``native_rate`` is the rate it had. Hash ids are
    renumbered 0, 1, ... in order of first use (equal stay equal), so any id a file uses makes a valid prompt."""
    if len(requests) < 2:
        raise ValueError(f"{name}: a trace needs at least two requests (their spacing sets the rate)")
    rows = sorted(requests, key=lambda r: r.arrival_s)
    start, span = rows[0].arrival_s, rows[-1].arrival_s - rows[0].arrival_s
    if span <= 0:
        raise ValueError(f"{name}: every request arrives at the same time; the trace has no rate to scale")
    scale = (len(rows) - 1) / span
    dense: dict[int, int] = {}
    out = []
    for r in rows:
        ids = None if r.hash_ids is None else tuple(dense.setdefault(h, len(dense)) for h in r.hash_ids)
        out.append(replace(r, arrival_s=(r.arrival_s - start) * scale, hash_ids=ids))
    return Workload(name, out, native_rate=scale)
