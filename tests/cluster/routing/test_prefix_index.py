"""The router's prefix index: match, eviction, gaps and restarts; and the router hashes prompts as the engine does."""

from __future__ import annotations

import random

import pytest

from cluster.routing.membership import Membership
from cluster.routing.metrics import RouterMetrics
from cluster.routing.prefix_index import PrefixIndex
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


def kv_events(address: str, seq: int, stored=(), removed=(), reset=False) -> KvEvents:
    return KvEvents(worker="p0", address=address, seq=seq, stored=list(stored), removed=list(removed), reset=reset)


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
