"""Routing policies: the order in which a pool's workers are tried for a request.

Every policy but round robin weighs load: the worker's last report (queue, running, KV use) plus what the router sent
it since (``inflight``), ties broken at random so a burst does not pile onto the worker that sorts first. ``kv_aware``
also weighs the prompt's cached prefix per tier (a ``PrefixMatch``, cluster/routing/prefix_index.py) by the score in
docs/configuration.md (``router.kv_aware``), higher is better; without a match it orders by load alone. The other
policies ignore the match.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

from cluster.routing.prefix_index import TIERS, Tier
from worker.messages import Stats


class Candidate(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def inflight(self) -> int: ...
    @property
    def stats(self) -> Stats | None: ...  # its last heartbeat (None before the first)


C = TypeVar("C", bound=Candidate)  # a policy orders whatever candidates it is given


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """One prompt's cached prefix per worker, as the router knows it (``Placer.prefix_match``): the leading tokens
    its device holds, then the ones after them it would load back from its host or disk tier instead of computing."""

    num_prompt_tokens: int
    device_tokens: Mapping[str, int] = field(default_factory=dict)  # worker name -> reusable leading tokens
    host_tokens: Mapping[str, int] = field(default_factory=dict)  # worker name -> reusable tokens after those
    disk_tokens: Mapping[str, int] = field(default_factory=dict)  # worker name -> reusable tokens after both

    def tokens(self, worker: str, tier: Tier | None = None) -> int:
        """The worker's reusable tokens in ``tier``; None: in every tier (loaded or not, none of them computed)."""
        if tier is None:
            return sum(self.tokens(worker, each) for each in TIERS)
        by_tier = self.device_tokens if tier == "device" else self.host_tokens if tier == "host" else self.disk_tokens
        return by_tier.get(worker, 0)


class Policy(Protocol):
    def order(self, workers: Sequence[C], match: PrefixMatch | None = None) -> list[C]: ...


# "affinity": not a policy's choice, the router's (an earlier request's worker, asked for by the request)
DecisionReason = Literal["prefix", "load", "affinity"]


def decision_reason(
    policy: Policy, chosen: Candidate, candidates: Sequence[Candidate], match: PrefixMatch | None
) -> DecisionReason:
    """Why a worker was chosen, for ``/metrics``: ``prefix`` when kv_aware chose one holding more of the prompt than
    another candidate (a tier hit counts at its weight: it is loaded, not computed), else ``load``."""
    if match is None or not isinstance(policy, KvAware):
        return "load"
    mine = policy.cached_fraction(chosen, match)
    return "prefix" if any(policy.cached_fraction(w, match) < mine for w in candidates) else "load"


def load_score(worker: Candidate) -> float:
    if worker.stats is None:  # not heard from yet: only what the router sent it counts
        return float(worker.inflight)
    load = worker.stats.load
    kv_used = 1.0 - load.free_blocks / load.total_blocks if load.total_blocks > 0 else 0.0
    return load.waiting + load.awaiting_kv + worker.inflight + kv_used


class RoundRobin:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._counter = itertools.count()

    def order(self, workers: Sequence[C], match: PrefixMatch | None = None) -> list[C]:
        if not workers:
            return []
        start = next(self._counter) % len(workers)
        return list(workers[start:]) + list(workers[:start])


class LeastLoaded:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def order(self, workers: Sequence[C], match: PrefixMatch | None = None) -> list[C]:
        return sorted(workers, key=lambda w: (load_score(w), self._rng.random()))


class PowerOfTwo:
    """Two random workers, the less loaded first; the rest after them as fallbacks."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def order(self, workers: Sequence[C], match: PrefixMatch | None = None) -> list[C]:
        pool = list(workers)
        self._rng.shuffle(pool)
        head = sorted(pool[:2], key=load_score)
        return head + pool[2:]


class KvAware:
    """Cached-prefix overlap against load (the score: docs/configuration.md, ``router.kv_aware``)."""

    def __init__(
        self,
        rng: random.Random | None = None,
        prefix_weight: float = 2.0,
        load_weight: float = 1.0,
        host_weight: float = 0.8,
        disk_weight: float = 0.5,
    ) -> None:
        if min(prefix_weight, load_weight, host_weight, disk_weight) < 0:
            raise ValueError("kv_aware weights must be >= 0")
        self._rng = rng or random.Random()
        self.prefix_weight = prefix_weight
        self.load_weight = load_weight
        self.host_weight = host_weight
        self.disk_weight = disk_weight

    def cached_fraction(self, worker: Candidate, match: PrefixMatch | None) -> float:
        """The prompt's share the worker would not compute, a tier hit weighted against a device one."""
        if match is None or match.num_prompt_tokens <= 0:
            return 0.0
        tokens, name = match.tokens, worker.name
        cached = (
            tokens(name, "device") + self.host_weight * tokens(name, "host") + self.disk_weight * tokens(name, "disk")
        )
        return cached / match.num_prompt_tokens

    def score(self, worker: Candidate, match: PrefixMatch | None) -> float:
        return self.prefix_weight * self.cached_fraction(worker, match) - self.load_weight * load_score(worker)

    def order(self, workers: Sequence[C], match: PrefixMatch | None = None) -> list[C]:
        return sorted(workers, key=lambda w: (-self.score(w, match), load_score(w), self._rng.random()))


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request was dispatched (no prefill worker when decode prefilled it; colocated: as ``decode``)."""

    prefill: str | None
    decode: str | None


class Placements:
    """Where recent requests last went, by client request id, for a later request's ``affinity``.

    Bounded: the oldest record goes first, so a client that never refers back cannot grow it."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._records: OrderedDict[str, Placement] = OrderedDict()

    def record(self, rid: str, prefill: str | None, decode: str | None) -> None:
        records = self._records
        records[rid] = Placement(prefill, decode)
        records.move_to_end(rid)
        if len(records) > self.capacity:
            records.popitem(last=False)

    def get(self, rid: str) -> Placement | None:
        return self._records.get(rid)

    def __len__(self) -> int:
        return len(self._records)


POLICIES: dict[str, Callable[[random.Random | None], Policy]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "power_of_two": PowerOfTwo,
    "kv_aware": KvAware,
}


def make_policy(name: str, rng: random.Random | None = None, **weights: float) -> Policy:
    """``weights``: kv_aware's (``router.kv_aware``); the other policies have none."""
    if name not in POLICIES:
        raise ValueError(f"routing policy must be one of {sorted(POLICIES)}, got {name!r}")
    return KvAware(rng, **weights) if name == "kv_aware" else POLICIES[name](rng)
