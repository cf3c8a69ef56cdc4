"""The faults a simulation injects, drawn from its seed as a schedule of concrete actions (so that a failing run can
be shrunk to the fewest actions that still fail, and each action replayed alone).

A message fault names a message by its ordinal (the n-th request command the router sent, the n-th request event a
worker sent; heartbeats, prefix-cache news and pings are not counted, so the ordinals of one seed stay put when a fault
changes how many of those flow); a KV fault names the n-th KV piece delivered; the other faults name a time and a
worker or request.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass


class FaultKind(str, enum.Enum):
    DROP = "drop"  # a control message lost
    DUPLICATE = "duplicate"  # ... delivered twice
    DELAY = "delay"  # ... delivered late (``amount`` seconds)
    REORDER = "reorder"  # ... overtaken by the messages after it
    KV_LOSS = "kv_loss"  # a KV piece lost
    KV_CORRUPT = "kv_corrupt"  # ... its bytes changed on the way (the checksum must catch it)
    KV_LATE = "kv_late"  # ... delivered ``amount`` seconds late (past the receiver's deadline, maybe)
    KV_TRUNCATE = "kv_truncate"  # ... cut short: its payload holds fewer bytes than its header says
    CRASH = "crash"  # a worker dies at ``at_s`` (everything it held is gone) and restarts empty ``amount`` s later
    PARTITION = "partition"  # a worker and the router cannot hear each other for ``amount`` seconds
    SLOW = "slow"  # a worker's loop turns ten times slower for ``amount`` seconds
    CLIENT_ABORT = "client_abort"  # a client goes away at ``at_s`` (request ``target``)
    DRAIN = "drain"  # a decode worker is drained at ``at_s`` (its streams move to the other one)
    SCALE_UP = "scale_up"  # a worker joins pool ``target`` at ``at_s`` (the router places work on it at once)
    TIER_LOSS = "tier_loss"  # a page of the KV disk tier goes missing at ``at_s`` (seeds that run with tiers)
    TIER_CORRUPT = "tier_corrupt"  # ... a page's bytes change (its checksum must catch it)

    @property
    def on_message(self) -> bool:
        return self in MESSAGE_FAULTS

    @property
    def on_kv(self) -> bool:
        return self in KV_FAULTS


MESSAGE_FAULTS = frozenset({FaultKind.DROP, FaultKind.DUPLICATE, FaultKind.DELAY, FaultKind.REORDER})
KV_FAULTS = frozenset({FaultKind.KV_LOSS, FaultKind.KV_CORRUPT, FaultKind.KV_LATE, FaultKind.KV_TRUNCATE})
TIER_FAULTS = frozenset({FaultKind.TIER_LOSS, FaultKind.TIER_CORRUPT})
ALL_FAULTS = frozenset(FaultKind)


@dataclass(frozen=True, slots=True, order=True)
class FaultAction:
    """One injected fault. ``at``: a message's or piece's ordinal (message and KV faults), else seconds of simulated
    time; ``target``: the direction of a message (``to_worker``, ``to_router``), a worker's name or a request's
    index; ``amount``: seconds (a delay, a crash's downtime, a partition's or a slowness's length)."""

    kind: FaultKind
    at: float
    target: str = ""
    amount: float = 0.0

    def __str__(self) -> str:
        where = f" {self.target}" if self.target else ""
        amount = f" +{self.amount:.3f}s" if self.amount and self.kind not in TIER_FAULTS else ""
        if self.kind in TIER_FAULTS:
            amount = f" page {self.amount:.4f}"
        unit = "#" if self.kind.on_message or self.kind.on_kv else "@"
        return f"{self.kind.value}{where} {unit}{self.at:g}{amount}"


def draw_schedule(
    rng: random.Random,
    kinds: frozenset[FaultKind],
    workers: list[str],
    decode_workers: list[str],
    arrivals: list[float],
) -> list[FaultAction]:
    """A few faults of each enabled kind, placed where the run has messages and requests in flight: a timed fault
    mostly within a tenth of a second after some request's arrival (a tiny model's request lasts about that long)."""
    actions: list[FaultAction] = []
    requests = len(arrivals)

    def when() -> float:
        return round(rng.choice(arrivals) + rng.uniform(0.0, 0.12), 4)

    for kind in sorted(kinds, key=lambda k: k.value):
        for _ in range(rng.randint(0, 2)):
            if kind.on_message:
                target = rng.choice(("to_worker", "to_router"))
                amount = rng.uniform(0.01, 3.0) if kind is FaultKind.DELAY else 0.0
                actions.append(FaultAction(kind, rng.randint(0, 8 * requests), target, round(amount, 4)))
            elif kind.on_kv:
                amount = rng.uniform(0.01, 4.0) if kind is FaultKind.KV_LATE else 0.0
                actions.append(FaultAction(kind, rng.randint(0, 6 * requests), "", round(amount, 4)))
            elif kind is FaultKind.CLIENT_ABORT:
                index = rng.randrange(requests)
                at = round(arrivals[index] + rng.uniform(0.0, 0.08), 4)
                actions.append(FaultAction(kind, at, str(index)))
            elif kind is FaultKind.DRAIN:
                actions.append(FaultAction(kind, when(), rng.choice(decode_workers)))
                break  # one drain: with two decode workers, the other one must stay
            elif kind is FaultKind.SCALE_UP:
                actions.append(FaultAction(kind, when(), rng.choice(("prefill", "decode"))))
                break  # one spare worker per pool is built
            elif kind in TIER_FAULTS:
                # ``amount`` picks the page: the ``int(amount * pages)``-th of the tier's pages then, in name order
                actions.append(FaultAction(kind, when(), "", round(rng.random(), 4)))
            else:  # CRASH, PARTITION, SLOW
                at = when()
                amount = round(rng.uniform(0.1, 4.0), 4)
                actions.append(FaultAction(kind, at, rng.choice(workers), amount))
    return sorted(actions)
