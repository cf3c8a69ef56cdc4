"""Which workers hold which prompt prefixes, as the router learns it from their KV events.

Workers report the chained hashes their prefix caches store and evict (``worker.messages.KvEvents``, drained from
``engine.block_manager.BlockManager``). A chained hash names a whole prefix (the hash of block i covers every token
before it), so a flat map ``hash -> workers`` already is a radix tree over blocks, with no tree to keep balanced:
``match`` walks a prompt's hashes in order and stops, per worker, at the first block that worker lacks, which is
exactly where the engine's own lookup stops. The router hashes a prompt with the engine's function
(``engine.blocks.prompt_block_hashes``), so the two agree by construction.

Never an over-estimate for long: a worker's view is dropped when it restarts (re-registration), dies, or a message
of its event stream is missing (a gap in ``seq``); deltas applied to a subset of what the worker holds keep it a
subset, and the worker's next snapshot (after a reset, a failed send, or every ``KV_RESYNC_INTERVAL_S``) makes it
whole again. Memory is bounded by the workers' caches: at most one entry per block per worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}  # block hash -> workers that hold it
        self._held: dict[str, set[int]] = {}  # worker -> the hashes it holds
        self._next_seq: dict[str, int] = {}  # worker -> the seq its next message must carry (absent: any)

    def apply(self, worker: str, seq: int, stored: Iterable[int], removed: Iterable[int], reset: bool = False) -> bool:
        """Take one KvEvents message; False when it shows a missed message (that worker's view was dropped first:
        what is applied after a gap is a subset of what the worker holds, never more)."""
        expected = self._next_seq.get(worker)
        in_order = expected is None or seq == expected
        if reset or not in_order:
            self.forget(worker)
        self._next_seq[worker] = seq + 1
        held = self._held.setdefault(worker, set())
        for block_hash in removed:
            if block_hash in held:
                held.discard(block_hash)
                holders = self._holders[block_hash]
                holders.discard(worker)
                if not holders:
                    del self._holders[block_hash]
        for block_hash in stored:
            if block_hash not in held:
                held.add(block_hash)
                self._holders.setdefault(block_hash, set()).add(worker)
        return in_order or reset

    def forget(self, worker: str) -> None:
        """Drop everything known of a worker (it restarted, died, or its event stream has a gap)."""
        self._next_seq.pop(worker, None)
        for block_hash in self._held.pop(worker, set()):
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[block_hash]

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker that holds the first block: how many leading blocks of the prompt it holds (workers that hold
        none are absent). One pass, stopping when no worker is left."""
        if not block_hashes:
            return {}
        first = self._holders.get(block_hashes[0])
        if not first:
            return {}
        matched: dict[str, int] = {}
        candidates = set(first)
        for depth, block_hash in enumerate(block_hashes[1:], start=1):
            holders = self._holders.get(block_hash, set())
            for worker in candidates - holders:
                matched[worker] = depth
            candidates &= holders
            if not candidates:
                return matched
        for worker in candidates:
            matched[worker] = len(block_hashes)
        return matched

    def blocks_held(self, worker: str) -> int:
        return len(self._held.get(worker, ()))

    def workers(self) -> list[str]:
        """Workers with at least one block known."""
        return [worker for worker, held in self._held.items() if held]

    def __len__(self) -> int:
        """Distinct hashes held by any worker."""
        return len(self._holders)
