from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.blocks import prompt_block_hashes


def test_allocate_grow_free_roundtrip():
    bm = BlockManager(num_blocks=4, block_size=4)
    table, cached = bm.allocate(list(range(6)), 6)
    assert len(table) == 2 and cached == 0 and bm.num_free_blocks == 2
    assert bm.grow(table, 12) and len(table) == 3
    assert not bm.grow(table, 24) and len(table) == 3  # refused, unchanged
    bm.free(table)
    bm.check_all_free()


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.allocate(list(range(13)), 13) is None
    assert bm.num_free_blocks == 3


def test_prefix_blocks_are_shared_and_revived():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    first, _ = bm.allocate(tokens, 10)
    bm.register_full_blocks(first, tokens, 10, 0)
    second, cached = bm.allocate(tokens[:8] + [99, 98], 10)
    assert cached == 8 and second[:2] == first[:2] and second[2] != first[2]
    assert bm.blocks[first[0]].ref_count == 2
    bm.free(first)
    bm.free(second)
    third, cached = bm.allocate(tokens[:8] + [7], 9)  # freed blocks keep their hash until reused
    assert cached == 8
    bm.free(third)
    bm.check_all_free()


def test_hash_chain_depends_on_the_whole_prefix():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    table, _ = bm.allocate(a, 9)
    bm.register_full_blocks(table, a, 9, 0)
    other, cached = bm.allocate([0, 2, 3, 4, 5, 6, 7, 8, 9], 9)  # same second block, different first
    assert cached == 0
    bm.free(table)
    bm.free(other)


def test_double_free_is_an_error():
    bm = BlockManager(num_blocks=2, block_size=4)
    table, _ = bm.allocate([1, 2], 2)
    copy = list(table)
    bm.free(table)
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(copy)


# ---- KV events: what the prefix cache stored and evicted, drained by the worker -------------------------------------


def _fill(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate and 'compute' a sequence: its full blocks join the prefix cache."""
    table, _ = bm.allocate(tokens, len(tokens))
    bm.register_full_blocks(table, tokens, len(tokens), 0)
    return table


def test_kv_events_report_stored_hashes_once_per_drain():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    table = _fill(bm, tokens)
    batch = bm.drain_kv_events()
    assert batch is not None and not batch.reset and batch.removed == []
    assert batch.stored == prompt_block_hashes(tokens, 4)  # the two full blocks; the partial one has no hash
    assert bm.drain_kv_events() is None  # nothing new
    bm.free(table)
    assert bm.drain_kv_events() is None  # freed blocks keep their hash: still servable, nothing removed
    again, cached = bm.allocate(tokens, len(tokens))
    assert cached == 8 and bm.drain_kv_events() is None  # a hit stores nothing new
    bm.free(again)
    bm.check_all_free()


def test_kv_events_report_a_cached_block_reused_for_something_else():
    bm = BlockManager(num_blocks=4, block_size=4)
    first = list(range(8))
    bm.free(_fill(bm, first))
    stored = bm.drain_kv_events().stored
    assert len(stored) == 2
    # four fresh blocks: the two free uncached ones go first (LRU order), then the cached ones are handed out
    other = [100 + i for i in range(16)]
    table, cached = bm.allocate(other, 16)
    assert cached == 0
    batch = bm.drain_kv_events()
    assert batch is not None and sorted(batch.removed) == sorted(stored) and batch.stored == []
    bm.register_full_blocks(table, other, 16, 0)
    assert bm.drain_kv_events().stored == prompt_block_hashes(other, 4)
    bm.free(table)
    bm.check_all_free()


def test_a_hash_stored_and_evicted_between_drains_cancels_out():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.free(_fill(bm, [1, 2, 3, 4, 5]))  # block 0 cached, block 1 partial
    table, _ = bm.allocate(list(range(50, 58)), 8)  # takes both blocks: the cached one is evicted
    assert bm.drain_kv_events() is None  # stored then removed since the last drain: no change to report
    bm.free(table)
    bm.check_all_free()


def test_a_hash_removed_and_stored_again_between_drains_cancels_out():
    bm = BlockManager(num_blocks=1, block_size=4)
    tokens = [1, 2, 3, 4]
    bm.free(_fill(bm, tokens))
    assert bm.drain_kv_events().stored == prompt_block_hashes(tokens, 4)
    bm.free(_fill(bm, [9, 9, 9, 9]))  # evicts it and stores another
    bm.free(_fill(bm, tokens))  # evicts that and stores the first one again
    assert bm.drain_kv_events() is None


def test_a_duplicate_block_is_not_reported_twice():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    a, _ = bm.allocate(tokens, 8)  # two requests computing the same prompt at once: no cache hit for the second
    b, _ = bm.allocate(tokens, 8)
    bm.register_full_blocks(a, tokens, 8, 0)
    bm.register_full_blocks(b, tokens, 8, 0)
    assert bm.drain_kv_events().stored == prompt_block_hashes(tokens, 4)
    bm.free(a)
    bm.free(b)


def test_reset_of_the_prefix_cache_is_a_reset_with_a_snapshot_of_what_is_held():
    bm = BlockManager(num_blocks=8, block_size=4)
    held_tokens, freed_tokens = list(range(8)), list(range(20, 28))
    held = _fill(bm, held_tokens)
    bm.free(_fill(bm, freed_tokens))
    bm.drain_kv_events()
    bm.reset_prefix_cache()  # drops the freed blocks' hashes; the held request's stay
    batch = bm.drain_kv_events()
    assert batch.reset and batch.removed == [] and batch.stored == prompt_block_hashes(held_tokens, 4)
    assert bm.drain_kv_events() is None
    bm.free(held)
    bm.check_all_free()


def test_overflow_collapses_into_a_reset_and_a_bounded_snapshot():
    bm = BlockManager(num_blocks=6, block_size=2, kv_event_capacity=3)
    for round_ in range(5):  # never drained (a bare engine): the buffer stays bounded
        bm.free(_fill(bm, [round_ * 100 + i for i in range(12)]))
        assert len(bm.events._stored) + len(bm.events._removed) <= 3
    batch = bm.drain_kv_events()
    assert batch.reset and batch.removed == []
    assert batch.stored == prompt_block_hashes([400 + i for i in range(12)], 2)  # exactly what is held now
    assert len(batch.stored) <= bm.num_blocks
    assert bm.drain_kv_events() is None  # and deltas again from there
    bm.free(_fill(bm, [7, 7]))
    batch = bm.drain_kv_events()
    assert not batch.reset and len(batch.stored) == 1 and len(batch.removed) == 1
    bm.check_all_free()


def test_events_follow_the_cache_exactly_under_random_traffic():
    """Applying every drained batch to a set reproduces the manager's own lookup table, overflows included."""
    rng = random.Random(5)
    bm = BlockManager(num_blocks=24, block_size=4, kv_event_capacity=10)
    view: set[int] = set()
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    tables = []
    for step in range(300):
        if tables and (rng.random() < 0.5 or bm.num_free_blocks < 8):
            bm.free(tables.pop(rng.randrange(len(tables))))
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        table = _fill(bm, tokens) if bm.num_free_blocks >= 8 else None
        if table is not None:
            tables.append(table)
        if step % 91 == 0:
            bm.reset_prefix_cache()
        if rng.random() < 0.3:
            batch = bm.drain_kv_events()
            if batch is not None:
                if batch.reset:
                    view.clear()
                assert not set(batch.stored) & set(batch.removed)
                view = (view - set(batch.removed)) | set(batch.stored)
            assert view == set(bm._hash_to_block)
    for table in tables:
        bm.free(table)
    bm.check_all_free()


def test_no_events_without_prefix_caching():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    bm.free(_fill(bm, list(range(8))))
    assert bm.drain_kv_events() is None
