"""Paged KV bookkeeping: the free list, reference counts and prefix cache (the tensors are in ``kv_cache.py``).

A full block carries a chained hash of its tokens, so prompts that start alike share physical blocks; a freed block
keeps its hash in the LRU free list until handed out again. ``allocate`` gets all it needs now or changes nothing.
KV events feed the router's prefix index (``cluster/routing/prefix_index.py``): hashes *stored* (a full block enters
the lookup table) and *removed* (its block reused, or the cache reset), kept as the net change since the last
``drain_kv_events`` (once per worker loop turn), so a batch is two disjoint sets. On overflow or a cache reset they
collapse into one *reset* with a snapshot of every hash held, so a reader that never drains costs nothing and one
that does never drifts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.blocks import blocks_for_tokens, chain_hash, reusable_prefix_tokens

__all__ = ["Block", "BlockManager", "HashEvents", "KvEventBatch", "chain_hash"]

DEFAULT_KV_EVENT_CAPACITY = 4096  # pending stored + removed hashes before the buffer collapses into a reset


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)  # kept to rule out hash collisions


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """What changed in the prefix cache since the last drain. ``reset``: forget everything held before; ``stored``
    is then the whole snapshot. Otherwise ``stored`` and ``removed`` are disjoint (apply in any order)."""

    stored: list[int]
    removed: list[int]
    reset: bool = False


class HashEvents:
    """The net change to a set of block hashes since the last drain (dicts as ordered sets), collapsing into one
    reset with a snapshot on overflow or when asked; thread-safe, since a KV tier's threads note changes too."""

    def __init__(self, capacity: int = DEFAULT_KV_EVENT_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"kv_event_capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._stored: dict[int, None] = {}  # held now, not held at the last drain
        self._removed: dict[int, None] = {}  # held at the last drain, not held now
        self._reset_pending = False
        self._lock = threading.Lock()

    def stored(self, block_hash: int) -> None:
        self._note(block_hash, self._stored, self._removed)

    def removed(self, block_hash: int) -> None:
        self._note(block_hash, self._removed, self._stored)

    def _note(self, block_hash: int, into: dict[int, None], opposite: dict[int, None]) -> None:
        with self._lock:
            if self._reset_pending:
                return  # the snapshot at the next drain covers it
            if block_hash in opposite:
                del opposite[block_hash]  # changed back since the last drain: no change
            else:
                into[block_hash] = None
                if len(self._stored) + len(self._removed) > self.capacity:
                    self._reset_locked()

    def _reset_locked(self) -> None:
        self._reset_pending = True
        self._stored.clear()
        self._removed.clear()

    def resync(self) -> None:
        """Make the next drain a reset with a snapshot."""
        with self._lock:
            self._reset_locked()

    def drain(self, snapshot: Callable[[], list[int]]) -> KvEventBatch | None:
        """The changes since the last drain (None: none); a pending reset takes ``snapshot()`` (every hash held)."""
        with self._lock:
            if self._reset_pending:
                self._reset_pending = False
                return KvEventBatch(stored=snapshot(), removed=[], reset=True)
            if not self._stored and not self._removed:
                return None
            batch = KvEventBatch(stored=list(self._stored), removed=list(self._removed))
            self._stored.clear()
            self._removed.clear()
            return batch


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        kv_event_capacity: int = DEFAULT_KV_EVENT_CAPACITY,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU: evict first
        self._hash_to_block: dict[int, int] = {}
        self.prefix_hit_tokens = 0
        self.events = HashEvents(kv_event_capacity)
        # with KV tiers below (engine/kv_tiers.py): hashed blocks taken for reuse since the engine last saved them
        # (hash, tokens, block id), to be copied down before anything overwrites them
        self.record_evictions = False
        self.evicted: list[tuple[int, tuple[int, ...], int]] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def _cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Physical ids of the longest run of cached full blocks that starts the sequence."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        prev: int | None = None
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            chunk = tuple(token_ids[start : start + bs])
            prev = chain_hash(prev, chunk)
            block_id = self._hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
        return hits

    def allocate(
        self, token_ids: list[int], num_tokens: int, use_prefix_cache: bool = True
    ) -> tuple[list[int], int] | None:
        """Blocks for the first ``num_tokens`` slots of a sequence, reusing cached prefix blocks: (block table,
        tokens whose KV is cached), or None (nothing changed) when free blocks are short."""
        cached = self._cached_prefix(token_ids) if use_prefix_cache else []
        del cached[reusable_prefix_tokens(len(cached), len(token_ids), self.block_size) // self.block_size :]
        num_new = self.blocks_for(num_tokens) - len(cached)
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        if self.num_free_blocks - revived < num_new:
            return None
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        table = cached + [self._take_free_block() for _ in range(num_new)]
        num_cached_tokens = len(cached) * self.block_size
        if use_prefix_cache and self.enable_prefix_caching:
            self.prefix_hit_tokens += num_cached_tokens
        return table, num_cached_tokens

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None and self._hash_to_block.get(block.block_hash) == block_id:
            del self._hash_to_block[block.block_hash]
            self.events.removed(block.block_hash)
            if self.record_evictions:
                self.evicted.append((block.block_hash, block.token_ids, block_id))
        block.block_hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend a block table in place to hold ``num_tokens``; False (and no change) if blocks are short."""
        num_new = self.blocks_for(num_tokens) - len(table)
        if num_new <= 0:
            return True
        if num_new > self.num_free_blocks:
            return False
        table.extend(self._take_free_block() for _ in range(num_new))
        return True

    def truncate(self, table: list[int], num_tokens: int) -> None:
        """Free the table's blocks past those ``num_tokens`` need (never hashed: they hold no computed token)."""
        keep = self.blocks_for(num_tokens)
        if len(table) > keep:
            tail = table[keep:]
            del table[keep:]
            self.free(tail)

    def register_full_blocks(self, table: list[int], token_ids: list[int], num_computed: int, num_hashed: int) -> int:
        """Give the newly completed full blocks their chained hash; returns the new count of hashed blocks."""
        if not self.enable_prefix_caching:
            return num_hashed
        num_full = min(num_computed // self.block_size, len(table))
        prev = self.blocks[table[num_hashed - 1]].block_hash if num_hashed else None
        bs = self.block_size
        for i in range(num_hashed, num_full):
            block = self.blocks[table[i]]
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            if block.block_hash is None:
                block.block_hash = chain_hash(prev, chunk)
                block.token_ids = chunk
                if block.block_hash not in self._hash_to_block:  # a duplicate of a held block stays unlisted
                    self._hash_to_block[block.block_hash] = block.block_id
                    self.events.stored(block.block_hash)
            prev = block.block_hash
        return max(num_hashed, num_full)

    @property
    def released_block_id(self) -> int:
        """What a block table holds in place of a block it handed back early (``release``): the KV cache's padding
        sink, past every block this manager hands out, so a read of it is harmless (and masked)."""
        return len(self.blocks)

    def release(self, table: list[int], index: int) -> None:
        """Hand back the table's block ``index`` before the rest (it left every layer's sliding window)."""
        self.free([table[index]])
        table[index] = self.released_block_id

    def free(self, table: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free list (hashes kept)."""
        released = self.released_block_id
        for block_id in reversed(table):
            if block_id == released:
                continue
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        table.clear()

    def reset_prefix_cache(self) -> None:
        for block_id in self._free:
            self.blocks[block_id].block_hash = None
            self.blocks[block_id].token_ids = ()
        self._hash_to_block = {h: b for h, b in self._hash_to_block.items() if self.blocks[b].ref_count > 0}
        self.resync_kv_events()  # the readers learn what is left in one snapshot, not hash by hash

    # ---- KV events ---------------------------------------------------------------------------------------------

    def resync_kv_events(self) -> None:
        """Make the next drain a reset with a snapshot of every hash held (after an overflow or cache reset; the
        worker also asks when it could not deliver a batch, and now and then to repair a reader)."""
        self.events.resync()

    def drain_kv_events(self) -> KvEventBatch | None:
        """The changes since the last drain (None: none). A reset's ``stored`` is every hash held, one per block."""
        return self.events.drain(lambda: list(self._hash_to_block))

    def check_all_free(self) -> None:
        """Raise if any block is still referenced: the leak check every test ends with."""
        held = [b.block_id for b in self.blocks if b.ref_count != 0]
        if held or self.num_free_blocks != self.num_blocks:
            raise AssertionError(f"KV blocks still held: {held[:20]} ({len(held)} of {self.num_blocks})")
