from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from cluster.policies import LeastLoaded, PowerOfTwo, RoundRobin, load_score, make_policy
from worker.messages import Stats, WorkerCounters, WorkerLoad


def heartbeat(**load: int) -> Stats:
    load = {"free_blocks": 100, "total_blocks": 100, **load}
    return Stats(
        worker="w", role="decode", address="tcp://127.0.0.1:1", load=WorkerLoad(**load), counters=WorkerCounters()
    )


@dataclass
class W:
    name: str
    inflight: int = 0
    stats: Stats | None = field(default_factory=heartbeat)


def test_round_robin_rotates():
    workers = [W("a"), W("b"), W("c")]
    policy = RoundRobin()
    assert [policy.order(workers)[0].name for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_weighs_queue_inflight_and_kv_use():
    idle, queued, busy_kv = W("idle"), W("queued", stats=heartbeat(waiting=3)), W("kv", stats=heartbeat(free_blocks=10))
    assert load_score(idle) < load_score(busy_kv) < load_score(queued)
    assert [w.name for w in LeastLoaded().order([queued, busy_kv, idle])] == ["idle", "kv", "queued"]


def test_ties_break_at_random_so_a_burst_spreads():
    workers = [W("a"), W("b"), W("c"), W("d")]
    policy = LeastLoaded(random.Random(1))
    firsts = Counter(policy.order(workers)[0].name for _ in range(400))
    assert set(firsts) == {"a", "b", "c", "d"} and min(firsts.values()) > 50


def test_least_loaded_sees_its_own_recent_picks():
    workers = [W("a"), W("b")]
    policy = LeastLoaded(random.Random(0))
    picks = []
    for _ in range(4):
        chosen = policy.order(workers)[0]
        chosen.inflight += 1  # what the router does on dispatch
        picks.append(chosen.name)
    assert Counter(picks) == {"a": 2, "b": 2}


def test_power_of_two_puts_the_less_loaded_of_two_first_and_keeps_fallbacks():
    workers = [W("a", inflight=5), W("b"), W("c", inflight=9)]
    for seed in range(20):
        order = PowerOfTwo(random.Random(seed)).order(workers)
        assert len(order) == 3 and load_score(order[0]) <= load_score(order[1])


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="routing policy"):
        make_policy("random_walk")
