from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from cluster.routing.policies import (
    KvAware,
    LeastLoaded,
    PowerOfTwo,
    PrefixMatch,
    RoundRobin,
    decision_reason,
    load_score,
    make_policy,
)
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


# ---- kv_aware: cached-prefix overlap against load ---------------------------------------------------------------


def test_kv_aware_prefers_the_worker_holding_more_of_the_prompt():
    workers = [W("none"), W("half"), W("all")]
    match = PrefixMatch(100, {"half": 48, "all": 96})
    for seed in range(10):
        policy = KvAware(random.Random(seed))
        order = policy.order(workers, match)
        assert [w.name for w in order] == ["all", "half", "none"]
        assert decision_reason(policy, order[0], workers, match) == "prefix"
        assert decision_reason(LeastLoaded(), order[0], workers, match) == "load"  # it did not look


def test_kv_aware_trades_overlap_against_load_by_its_weights():
    cached, idle = W("cached", stats=heartbeat(waiting=3)), W("idle")
    match = PrefixMatch(100, {"cached": 100})  # worth prefix_weight requests of load
    assert KvAware(prefix_weight=2.0).order([cached, idle], match)[0].name == "idle"  # 3 queued outweigh it
    assert KvAware(prefix_weight=4.0).order([cached, idle], match)[0].name == "cached"
    assert KvAware(prefix_weight=4.0, load_weight=2.0).order([cached, idle], match)[0].name == "idle"
    assert KvAware(prefix_weight=1.0, load_weight=0.0).order([cached, idle], match)[0].name == "cached"
    busy = W("busy", inflight=1)  # one in flight: a whole cached prompt still wins at the default weights
    assert KvAware().order([busy, W("free")], PrefixMatch(10, {"busy": 8}))[0].name == "busy"


def test_kv_aware_ties_go_to_the_lower_load_then_at_random():
    loaded, light = W("loaded", inflight=1), W("light")
    # same overlap on both: the prefix term cancels and load decides
    match = PrefixMatch(64, {"loaded": 32, "light": 32})
    assert KvAware(random.Random(0)).order([loaded, light], match)[0].name == "light"
    assert decision_reason(KvAware(), light, [loaded, light], match) == "load"
    # equal scores with unequal loads (overlap makes up the difference exactly): the lower load first
    even = PrefixMatch(100, {"loaded": 50})
    policy = KvAware(prefix_weight=2.0)
    assert policy.score(loaded, even) == policy.score(light, even)
    assert [w.name for w in policy.order([loaded, light], even)] == ["light", "loaded"]
    tied, workers = KvAware(random.Random(1)), [W("a"), W("b"), W("c")]
    firsts = Counter(tied.order(workers, PrefixMatch(10))[0].name for _ in range(300))
    assert set(firsts) == {"a", "b", "c"} and min(firsts.values()) > 50


def test_kv_aware_without_a_match_orders_by_load_and_the_others_ignore_it():
    workers = [W("busy", stats=heartbeat(waiting=2)), W("idle")]
    assert KvAware().order(workers)[0].name == "idle"  # the decode reservations' call: no prompt information
    match = PrefixMatch(10, {"busy": 8})
    assert LeastLoaded().order(workers, match)[0].name == "idle"
    assert len(PowerOfTwo().order(workers, match)) == 2 and len(RoundRobin().order(workers, match)) == 2
    assert decision_reason(KvAware(), workers[1], workers, None) == "load"


def test_make_policy_passes_the_kv_aware_weights():
    policy = make_policy("kv_aware", prefix_weight=5.0, load_weight=0.5, host_weight=0.3, disk_weight=0.1)
    assert isinstance(policy, KvAware) and (policy.prefix_weight, policy.load_weight) == (5.0, 0.5)
    assert (policy.host_weight, policy.disk_weight) == (0.3, 0.1)
    assert isinstance(make_policy("least_loaded", prefix_weight=5.0), LeastLoaded)
    with pytest.raises(ValueError, match="weights"):
        KvAware(prefix_weight=-1)
    with pytest.raises(ValueError, match="weights"):
        KvAware(disk_weight=-0.5)


# ---- kv_aware with KV tiers: a block loaded back from host or disk is worth a fraction of a device hit ----------


def test_kv_aware_prefers_device_over_host_over_disk_over_nothing_at_equal_load():
    workers = [W("none"), W("disk"), W("host"), W("device")]
    match = PrefixMatch(100, {"device": 96}, {"host": 96}, {"disk": 96})
    for seed in range(10):
        policy = KvAware(random.Random(seed))
        assert [w.name for w in policy.order(workers, match)] == ["device", "host", "disk", "none"]
    none, disk, host, device = workers
    policy = KvAware()
    # a tier hit is loaded, not computed: choosing it over a worker holding nothing is a prefix decision
    assert decision_reason(policy, host, [none, host], match) == "prefix"
    assert decision_reason(policy, device, [host, device], match) == "prefix"
    assert match.tokens("host") == 96 and match.tokens("host", "device") == 0 and match.tokens("none") == 0


def test_kv_aware_adds_a_tier_continuation_to_a_device_prefix():
    shorter, longer = W("device only"), W("device then host")
    match = PrefixMatch(100, {"device only": 48, "device then host": 48}, {"device then host": 48})
    assert KvAware().order([shorter, longer], match)[0].name == "device then host"
    assert match.tokens("device then host") == 96


def test_kv_aware_tier_weights_trade_a_load_against_a_copy():
    cached_in_host, idle = W("host", inflight=1), W("idle")
    match = PrefixMatch(100, {}, {"host": 100})
    assert KvAware(host_weight=0.8).order([cached_in_host, idle], match)[0].name == "host"  # 2 * 0.8 > 1
    assert KvAware(host_weight=0.4).order([cached_in_host, idle], match)[0].name == "idle"  # 2 * 0.4 < 1
    ignored = KvAware(host_weight=0.0)  # a host hit worth nothing: load alone decides, and says so
    assert ignored.order([cached_in_host, idle], match)[0].name == "idle"
    even = [W("host"), W("idle")]
    assert decision_reason(ignored, even[0], even, match) == "load"
