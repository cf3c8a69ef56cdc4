"""Placement with KV tiers: the router core fed workers' per-tier KV events picks by where the prompt is cached.

No socket, no worker: the core gets ``KvEvents`` and heartbeats as typed events (as in test_core.py) and says where it
would send each prompt. Also: the engine's reuse rule cuts the device + host + disk chain, and the config's weights
reach the policies.
"""

from __future__ import annotations

import pytest

from cluster.config import ConfigError
from cluster.routing.admission import Admission
from cluster.routing.core import RouterCore
from cluster.routing.metrics import RouterMetrics
from cluster.routing.policies import KvAware
from cluster.routing.prefix_index import Tier
from engine.blocks import prompt_block_hashes
from engine.request import SamplingParams
from tests.helpers.cluster import tiny_cluster_config
from worker.messages import Generate, KvEvents, Stats, WorkerCounters, WorkerLoad

BLOCK = 16  # the config's transfer.block_size
PROMPT = list(range(1, 4 * BLOCK + 1))  # four full blocks
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def colocated_core(*names: str, **kv_aware: float) -> RouterCore:
    """A colocated kv_aware core with these workers, equally loaded."""
    config = tiny_cluster_config(
        "unused-model", mode="colocated", router={"decode_policy": "kv_aware", "kv_aware": kv_aware}
    )
    assert config.transfer.block_size == BLOCK
    core = RouterCore(config, RouterMetrics(), Admission(8))
    for name in names:
        core.add_worker(name, "colocated", f"tcp://{name}", f"tcp://{name}/kv", 0.0)
        load = WorkerLoad(free_blocks=90, total_blocks=96)
        stats = Stats(worker=name, role="colocated", address=f"tcp://{name}", load=load, counters=WorkerCounters())
        core.on_event(stats, 0.0)
    return core


def publish(core: RouterCore, name: str, seq: int, blocks: int, tier: Tier = "device", first: int = 0) -> None:
    """``name`` reports that ``tier`` holds PROMPT's blocks ``first`` to ``first + blocks``."""
    hashes = prompt_block_hashes(PROMPT, BLOCK)[first : first + blocks]
    core.on_event(KvEvents(worker=name, address=f"tcp://{name}", seq=seq, stored=hashes, tier=tier), 0.0)


def routed_to(core: RouterCore) -> str:
    core.submit("r", list(PROMPT), PARAMS, 0.0)
    [(worker, command)] = [(w, c) for w, c in core.outbox if isinstance(c, Generate)]
    return worker


def test_a_device_holder_beats_a_host_holder_which_beats_one_holding_nothing():
    core = colocated_core("colocated-0", "colocated-1")
    publish(core, "colocated-0", 0, 4, "host")
    publish(core, "colocated-1", 0, 4)
    assert routed_to(core) == "colocated-1"

    core = colocated_core("colocated-0", "colocated-1")
    publish(core, "colocated-1", 0, 4, "host")
    assert routed_to(core) == "colocated-1"
    metrics = core.metrics
    assert metrics.local_value("pdserve_routing_decisions_total", pool="colocated", reason="prefix") == 1
    # the last prompt block is always computed: three of the four are loaded back from host
    assert metrics.local_value("pdserve_tier_matched_tokens_total", pool="colocated", tier="host") == 3 * BLOCK
    assert metrics.local_value("pdserve_prefix_matched_tokens_total", pool="colocated") == 0


def test_a_disk_tier_counts_after_the_device_prefix():
    core = colocated_core("colocated-0", "colocated-1")
    publish(core, "colocated-0", 0, 2)  # two blocks on device
    publish(core, "colocated-1", 0, 2)
    publish(core, "colocated-1", 1, 2, "disk", first=2)  # and the next two on disk
    assert routed_to(core) == "colocated-1"
    metrics = core.metrics
    assert metrics.local_value("pdserve_prefix_matched_tokens_total", pool="colocated") == 2 * BLOCK
    assert metrics.local_value("pdserve_tier_matched_tokens_total", pool="colocated", tier="disk") == BLOCK


def test_the_reuse_rule_cuts_the_deepest_tier():
    core = colocated_core("colocated-0", "colocated-1", "colocated-2")
    publish(core, "colocated-0", 0, 2)
    publish(core, "colocated-0", 1, 2, "host", first=2)
    publish(core, "colocated-1", 0, 1, "host")
    publish(core, "colocated-1", 1, 3, "disk", first=1)
    publish(core, "colocated-2", 0, 4)
    match = core.placer.prefix_match(len(PROMPT), prompt_block_hashes(PROMPT, BLOCK))
    tiers = ("device", "host", "disk")
    assert [match.tokens("colocated-0", t) for t in tiers] == [2 * BLOCK, BLOCK, 0]
    assert [match.tokens("colocated-1", t) for t in tiers] == [0, BLOCK, 2 * BLOCK]
    assert [match.tokens("colocated-2", t) for t in tiers] == [3 * BLOCK, 0, 0]


def test_the_configs_tier_weights_reach_the_policies():
    core = colocated_core("colocated-0", host_weight=0.3, disk_weight=0.1)
    policy = core.placer.policies["colocated"]
    assert isinstance(policy, KvAware) and (policy.host_weight, policy.disk_weight) == (0.3, 0.1)
    defaults = tiny_cluster_config("unused-model").router.kv_aware
    assert (defaults.host_weight, defaults.disk_weight) == (0.8, 0.5)
    with pytest.raises(ConfigError, match="host_weight"):
        tiny_cluster_config("unused-model", router={"kv_aware": {"host_weight": 1.5}})


def test_a_host_hit_worth_nothing_leaves_the_choice_to_load():
    core = colocated_core("colocated-0", "colocated-1", host_weight=0.0)
    publish(core, "colocated-1", 0, 4, "host")
    core.on_event(  # colocated-1 is the busier one
        Stats(
            worker="colocated-1",
            role="colocated",
            address="tcp://colocated-1",
            load=WorkerLoad(waiting=1, free_blocks=90, total_blocks=96),
            counters=WorkerCounters(),
        ),
        0.0,
    )
    assert routed_to(core) == "colocated-0"
    assert core.metrics.local_value("pdserve_routing_decisions_total", pool="colocated", reason="load") == 1
