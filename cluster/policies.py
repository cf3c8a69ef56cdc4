"""Routing policies: the order in which a pool's workers are tried for a request.

Load weighs in every policy except plain round robin, and ties break at random, so a burst does not pile onto the
worker that happens to sort first (Dynamo #589, #7836). Load is what the worker last reported (queue, running, KV
use) plus what the router has sent it since (``inflight``), so back-to-back picks see each other.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Protocol

from worker.messages import Stats


class Candidate(Protocol):
    name: str
    inflight: int
    stats: Stats | None  # its last heartbeat (None before the first)


def load_score(worker: Candidate) -> float:
    if worker.stats is None:  # not heard from yet: only what the router sent it counts
        return float(worker.inflight)
    load = worker.stats.load
    kv_used = 1.0 - load.free_blocks / load.total_blocks if load.total_blocks > 0 else 0.0
    return load.waiting + load.awaiting_kv + worker.inflight + kv_used


class RoundRobin:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._counter = itertools.count()

    def order(self, workers: Sequence[Candidate]) -> list[Candidate]:
        if not workers:
            return []
        start = next(self._counter) % len(workers)
        return list(workers[start:]) + list(workers[:start])


class LeastLoaded:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def order(self, workers: Sequence[Candidate]) -> list[Candidate]:
        return sorted(workers, key=lambda w: (load_score(w), self._rng.random()))


class PowerOfTwo:
    """Two random workers, the less loaded first; the rest after them as fallbacks."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def order(self, workers: Sequence[Candidate]) -> list[Candidate]:
        pool = list(workers)
        self._rng.shuffle(pool)
        head = sorted(pool[:2], key=load_score)
        return head + pool[2:]


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "power_of_two": PowerOfTwo}


def make_policy(name: str, rng: random.Random | None = None):
    if name not in POLICIES:
        raise ValueError(f"routing policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name](rng)
