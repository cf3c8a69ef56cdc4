"""The router's prefix index: match, eviction, gaps and restarts; and the router hashes prompts as the engine does."""

from __future__ import annotations

import random

import pytest

from cluster.routing.membership import Membership
from cluster.routing.metrics import RouterMetrics
from cluster.routing.prefix_index import PrefixIndex, TierBlocks
from engine.blocks import prompt_block_hashes, reusable_prefix_tokens
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from tests.helpers.engine import random_prompts
from worker.messages import KvEvents

BS = 4


def hashes(tokens: list[int]) -> list[int]:
    return prompt_block_hashes(tokens, BS)


SHARED = list(range(100, 116))  # four full blocks


def test_match_counts_each_workers_leading_blocks():
    index = PrefixIndex()
    index.apply("a", 0, hashes(SHARED + [1, 2, 3, 4]), [])  # 5 blocks
    index.apply("b", 0, hashes(SHARED[:8]), [])  # the first 2
    index.apply("c", 0, hashes([9] * 16), [])  # something else
    prompt = hashes(SHARED + [1, 2, 3, 4, 5, 6, 7, 8])
    assert index.match(prompt) == {"a": 5, "b": 2}
    assert index.match(hashes([7] * 8)) == {}
    assert index.match([]) == {}


def test_a_later_block_without_the_first_is_no_match():
    """Chained hashes: holding block 3 of a prompt means nothing if block 1 is gone (the engine's lookup stops too)."""
    index = PrefixIndex()
    full = hashes(SHARED)
    index.apply("a", 0, full[1:], [])
    assert index.match(full) == {}
    index.apply("a", 1, [full[0]], [])
    assert index.match(full) == {"a": 4}


def test_eviction_shortens_the_match_and_frees_the_entry():
    index = PrefixIndex()
    full = hashes(SHARED)
    index.apply("a", 0, full, [])
    index.apply("b", 0, full, [])
    index.apply("a", 1, [], [full[2]])
    assert index.match(full) == {"a": 2, "b": 4}
    index.apply("b", 1, [], full)
    assert index.match(full) == {"a": 2} and index.blocks_held("b") == 0
    assert len(index) == 3  # no entry for a hash nobody holds


def test_reset_replaces_the_view_and_a_gap_drops_it():
    index = PrefixIndex()
    full = hashes(SHARED)
    index.apply("a", 0, full, [])
    assert index.apply("a", 1, full[:1], [], reset=True)  # a snapshot: only the first block is held now
    assert index.match(full) == {"a": 1}
    assert not index.apply("a", 5, full[1:2], [])  # messages 2-4 were missed: what they removed is unknown
    assert index.blocks_held("a") == 1  # dropped, then only this message's stored hash (held, for sure)
    assert index.match(full) == {}  # block 0 is no longer known to be held
    assert index.apply("a", 6, [full[0]], [])  # in order again
    assert index.match(full) == {"a": 2}


def test_forget_clears_one_worker_only():
    index = PrefixIndex()
    full = hashes(SHARED)
    index.apply("a", 0, full, [])
    index.apply("b", 0, full, [])
    index.forget("a")
    assert index.match(full) == {"b": 4} and index.workers() == ["b"]
    index.forget("b")
    assert len(index) == 0 and index.match(full) == {}


@pytest.fixture
def members():
    return Membership(RouterMetrics())


def kv_events(address: str, seq: int, stored=(), removed=(), reset=False, tier="device") -> KvEvents:
    return KvEvents(
        worker="p0", address=address, seq=seq, stored=list(stored), removed=list(removed), reset=reset, tier=tier
    )


def test_a_restarted_worker_starts_empty_and_old_events_are_ignored(members):
    full = hashes(SHARED)
    members.add("p0", "prefill", "tcp://127.0.0.1:5001", None, 0.0)
    worker = members.get("p0")
    members.on_kv_events(kv_events("tcp://127.0.0.1:5001", 0, full), worker)
    assert members.prefix_index.match(full) == {"p0": 4}
    members.add("p0", "prefill", "tcp://127.0.0.1:5002", None, 0.0)  # re-registered: a new process, an empty cache
    assert members.prefix_index.match(full) == {}
    worker = members.get("p0")
    members.on_kv_events(kv_events("tcp://127.0.0.1:5001", 1, full), worker)  # queued by the old process
    assert members.prefix_index.match(full) == {}
    members.on_kv_events(kv_events("tcp://127.0.0.1:5002", 0, full[:2]), worker)
    assert members.prefix_index.match(full) == {"p0": 2}


def test_a_dead_worker_holds_nothing(members):
    full = hashes(SHARED)
    members.add("p0", "prefill", "tcp://127.0.0.1:5001", None, 0.0)
    worker = members.get("p0")
    members.on_kv_events(kv_events("tcp://127.0.0.1:5001", 0, full), worker)
    members.mark_dead("p0", "test")
    assert members.prefix_index.match(full) == {}
    members.on_kv_events(kv_events("tcp://127.0.0.1:5001", 1, full), worker)  # late: still dead
    assert members.prefix_index.match(full) == {}


def test_router_hashes_equal_the_engines_for_random_prompts(tiny_llama_path):
    """The router's view, built only from the engine's drained events, predicts the engine's own prefix hits."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), kv_blocks=256, block_size=BS))
    blocks = engine.block_manager
    index = PrefixIndex()
    seq = 0

    def publish() -> None:
        nonlocal seq
        batch = blocks.drain_kv_events()
        if batch is not None:
            index.apply("w", seq, batch.stored, batch.removed, batch.reset)
            seq += 1

    publish()  # the warm-up's reset
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    rng = random.Random(3)
    for prompt in random_prompts(12, 1, 60, seed=11):
        published = hashes(prompt)
        predicted = reusable_prefix_tokens(index.match(published).get("w", 0), len(prompt), BS)
        hits_before = blocks.prefix_hit_tokens
        [result] = engine.generate([prompt], params)
        assert result.error is None
        assert blocks.prefix_hit_tokens - hits_before == predicted  # the router's estimate is the engine's hit
        publish()
        # every full prompt block the engine computed is known under the router's hash of it
        assert index.match(published) == ({"w": len(published)} if published else {})
        follow_up = prompt[: rng.randrange(len(prompt) + 1)] + [rng.randrange(256) for _ in range(rng.randrange(9))]
        hits_before = blocks.prefix_hit_tokens
        expected = reusable_prefix_tokens(index.match(hashes(follow_up)).get("w", 0), len(follow_up), BS)
        if follow_up:
            [result] = engine.generate([follow_up], params)
            assert blocks.prefix_hit_tokens - hits_before == expected
            publish()
    engine.check_no_leaks()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_blocks_expected_at_dispatch_count_until_an_event_confirms_or_they_expire():
    """A prompt dispatched to a worker is found there before its KV events arrive; the worker's ``stored`` event
    confirms it (it no longer expires), and what no event confirms is gone after the bound."""
    clock = Clock()
    index = PrefixIndex(tentative_ttl_s=5.0, clock=clock)
    full = hashes(SHARED)
    assert index.expect("a", full) == 4
    assert index.match(full) == {"a": 4} and index.tentative_blocks("a") == 4
    index.apply("a", 0, full[:3], [])  # the worker stored three of them (the fourth is still computing)
    assert index.tentative_blocks("a") == 1 and index.blocks_held("a") == 4
    index.expect("b", full)  # sent to b too, but b never reports it
    clock.now += 5.0
    assert index.match(full) == {"a": 3}  # b's and a's unconfirmed block expired; a's confirmed ones stay
    assert index.blocks_held("b") == 0 and index.tentative_blocks("a") == 0 and len(index) == 3
    assert index.expect("a", full) == 1  # only the block not held is new; confirmed ones stay confirmed
    assert index.tentative_blocks("a") == 1


def test_a_removed_event_or_a_restart_drops_expected_blocks_and_a_snapshot_keeps_them():
    clock = Clock()
    index = PrefixIndex(tentative_ttl_s=5.0, clock=clock)
    full = hashes(SHARED)
    index.expect("a", full)
    index.apply("a", 0, [], [full[3]])  # evicted (it was stored and evicted before this event was sent)
    assert index.match(full) == {"a": 3} and index.tentative_blocks("a") == 3
    index.apply("a", 1, [], [], reset=True)  # a snapshot of what is computed: the dispatched blocks stay
    assert index.match(full) == {"a": 3}
    index.forget("a")  # restarted or dead: nothing of it is known
    assert index.match(full) == {} and index.tentative_blocks("a") == 0 and len(index) == 0


def test_expected_blocks_are_bounded_per_worker():
    index = PrefixIndex(tentative_ttl_s=60.0, max_tentative=3)
    first, second = hashes(SHARED), hashes([7] * 8)
    index.expect("a", first)
    assert index.tentative_blocks("a") == 3 and index.match(first) == {}  # the oldest (block 0) went first
    index.expect("a", second)
    assert index.tentative_blocks("a") == 3 and index.blocks_held("a") == 3
    assert index.match(second) == {"a": 2}
    assert PrefixIndex(max_tentative=0).expect("a", first) == 0  # 0: no tentative entries at all


# ---- KV tiers below the device: host and disk views per worker --------------------------------------------------


def test_a_host_snapshot_then_device_events_continue_the_chain_from_the_device_match():
    index = PrefixIndex()
    full = hashes(SHARED)
    assert index.apply("a", 0, full, [], reset=True, tier="host")  # evicted to host earlier: all four there
    assert index.match(full) == {}  # nothing on device: the device match is as before
    assert index.match_tiers(full) == {"a": TierBlocks(0, 4, 0)}
    index.apply("a", 1, full[:2], [])  # two loaded back (or recomputed) onto the device
    assert index.match(full) == {"a": 2}
    assert index.match_tiers(full) == {"a": TierBlocks(2, 2, 0)}  # device first, then host for the rest
    index.apply("a", 2, [], full[2:], tier="host")  # the host pool dropped the last two...
    index.apply("a", 3, full[3:], [], tier="disk")  # ...and the disk tier holds only the last
    assert index.match_tiers(full) == {"a": TierBlocks(2, 0, 0)}  # block 2 is nowhere: the chain stops there
    index.apply("a", 4, full[2:3], [], tier="disk")
    assert index.match_tiers(full) == {"a": TierBlocks(2, 0, 2)}
    index.apply("a", 5, full[2:], [], tier="host")  # in host and disk: loaded from host
    assert index.match_tiers(full) == {"a": TierBlocks(2, 2, 0)}
    assert [index.blocks_held("a", tier) for tier in ("device", "host", "disk")] == [2, 4, 2]


def test_the_tier_chain_stops_at_a_block_in_neither_tier():
    index = PrefixIndex()
    full = hashes(SHARED)
    index.apply("a", 0, [full[0], full[2]], [])  # device holds blocks 0 and 2
    index.apply("a", 1, [full[1]], [], tier="host")
    assert index.match_tiers(full) == {"a": TierBlocks(1, 1, 0)}  # block 2 is on device again: not counted
    index.apply("b", 0, full[1:], [], tier="disk")  # no first block anywhere: nothing to load it onto
    assert "b" not in index.match_tiers(full)


def test_a_snapshot_of_one_tier_keeps_the_others():
    index = PrefixIndex()
    full = hashes(SHARED)
    index.apply("a", 0, full, [])
    index.apply("a", 1, full, [], tier="host")
    index.apply("a", 2, full[:1], [], tier="disk")
    assert index.apply("a", 3, full[:2], [], reset=True, tier="host")  # the host tier now holds only two
    assert [index.blocks_held("a", tier) for tier in ("device", "host", "disk")] == [4, 2, 1]
    assert index.apply("a", 4, [], [], reset=True, tier="device")  # device emptied (a restart of its engine)
    assert index.match_tiers(full) == {"a": TierBlocks(0, 2, 0)}
    assert index.blocks_held("a", "disk") == 1


def test_a_seq_gap_drops_every_tier_and_keeps_the_dispatched_blocks():
    index = PrefixIndex()
    full = hashes(SHARED)
    index.apply("a", 0, full[:2], [])
    index.apply("a", 1, full, [], tier="host")
    index.apply("a", 2, full, [], tier="disk")
    index.expect("a", full)  # blocks 2 and 3 are tentative on device
    assert not index.apply("a", 7, full[:1], [], tier="host")  # a message of some tier was missed
    assert [index.blocks_held("a", tier) for tier in ("device", "host", "disk")] == [2, 1, 0]
    assert index.tentative_blocks("a") == 2  # what the router sent it stays
    assert index.match_tiers(full) == {"a": TierBlocks(0, 1, 0)}  # only what this message stored is known
    # a device snapshot after a gap: the device view is whole, but what host and disk held is still lost
    index.apply("a", 8, full, [], tier="host")
    assert not index.apply("a", 10, full[:1], [], reset=True)
    assert index.match_tiers(full) == {"a": TierBlocks(1, 0, 0)}  # block 0 from the snapshot; 1 nowhere
    index.forget("a")
    assert index.match_tiers(full) == {} and len(index) == 0 and index.workers() == []


def test_a_device_snapshot_after_a_gap_is_whole_when_no_other_tier_was_known():
    """As before the tiers: a worker with no host or disk tier recovers with its next device snapshot."""
    index = PrefixIndex()
    full = hashes(SHARED)
    index.apply("a", 0, full, [])
    assert index.apply("a", 5, full[:3], [], reset=True)
    assert index.match(full) == {"a": 3}


def test_forget_drops_every_tier():
    index = PrefixIndex()
    full = hashes(SHARED)
    index.apply("a", 0, full, [], tier="host")
    index.apply("a", 1, full, [], tier="disk")
    index.apply("b", 0, full, [], tier="disk")
    assert index.workers() == ["a", "b"] and len(index) == 8
    index.forget("a")
    assert index.match_tiers(full) == {"b": TierBlocks(0, 0, 4)} and index.workers() == ["b"]
    assert index.blocks_held("a", "host") == index.blocks_held("a", "disk") == 0


def test_membership_applies_each_tier_and_shows_blocks_per_tier_in_metrics():
    metrics = RouterMetrics()
    members = Membership(metrics)
    full, address = hashes(SHARED), "tcp://127.0.0.1:5001"
    members.add("p0", "prefill", address, None, 0.0)
    worker = members.get("p0")
    members.on_kv_events(kv_events(address, 0, full, reset=True, tier="host"), worker)
    members.on_kv_events(kv_events(address, 1, full[:1]), worker)
    members.on_kv_events(kv_events(address, 2, full[3:], tier="disk"), worker)

    def blocks(tier: str) -> float:
        return metrics.local_value("pdserve_prefix_index_blocks", worker="p0", pool="prefill", tier=tier)

    assert members.prefix_index.match_tiers(full) == {"p0": TierBlocks(1, 3, 0)}
    assert (blocks("device"), blocks("host"), blocks("disk")) == (1, 4, 1)
    members.on_kv_events(kv_events(address, 4, full[:2]), worker)  # message 3 was lost: every tier dropped
    assert (blocks("device"), blocks("host"), blocks("disk")) == (2, 0, 0)
    assert metrics.local_value("pdserve_kv_events_total", kind="gap") == 1
    assert metrics.local_value("pdserve_kv_events_total", kind="reset") == 1
    members.mark_dead("p0", "test")
    assert (blocks("device"), blocks("host"), blocks("disk")) == (0, 0, 0)
