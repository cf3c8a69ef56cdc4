"""Which workers hold which prompt prefixes, as the router learns it from their KV events (``KvEvents``).

A chained hash names a whole prefix, so a flat map ``hash -> workers`` (one entry per block per worker) is a radix
tree: ``match`` stops, per worker, at the first block it lacks, as the engine's lookup does (both hash with
``engine.blocks.prompt_block_hashes``). Never an over-estimate for long: a worker's view is dropped when it
re-registers, dies or misses a message (a ``seq`` gap), and its next snapshot makes it whole again.
Tentative entries (``expect``) record at dispatch that the chosen worker will hold the prompt, so a follow-up finds
it before the worker's events come (as SGLang's cache-aware router does): a ``stored`` event confirms one,
``removed`` drops it, else it expires after ``tentative_ttl_s`` (at most ``max_tentative`` per worker). Snapshots
and gaps keep them (the worker may not have computed them yet); ``forget`` drops them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

TENTATIVE_TTL_S = 10.0  # a dispatched prompt's blocks not confirmed by a KV event within this are dropped
MAX_TENTATIVE = 16_384  # tentative hashes per worker (the oldest dropped first)


class PrefixIndex:
    def __init__(
        self,
        tentative_ttl_s: float = TENTATIVE_TTL_S,
        max_tentative: int = MAX_TENTATIVE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if tentative_ttl_s < 0 or max_tentative < 0:
            raise ValueError("tentative_ttl_s and max_tentative must be >= 0")
        self.tentative_ttl_s = tentative_ttl_s
        self.max_tentative = max_tentative
        self._clock = clock
        self._holders: dict[int, set[str]] = {}  # block hash -> workers that hold it
        self._held: dict[str, set[int]] = {}  # worker -> the hashes it holds (confirmed or tentative)
        self._next_seq: dict[str, int] = {}  # worker -> the seq its next message must carry (absent: any)
        # worker -> unconfirmed hash -> expiry, oldest first
        self._tentative: dict[str, OrderedDict[int, float]] = {}

    def apply(self, worker: str, seq: int, stored: Iterable[int], removed: Iterable[int], reset: bool = False) -> bool:
        """Take one KvEvents message; False after a gap (that worker's confirmed view is dropped first)."""
        expected = self._next_seq.get(worker)
        in_order = expected is None or seq == expected
        if reset or not in_order:
            self._drop_confirmed(worker)
        self._next_seq[worker] = seq + 1
        tentative = self._tentative.get(worker, {})
        for block_hash in removed:
            tentative.pop(block_hash, None)
            self._discard(worker, block_hash)
        held = self._held.setdefault(worker, set())
        for block_hash in stored:
            tentative.pop(block_hash, None)  # confirmed
            if block_hash not in held:
                held.add(block_hash)
                self._holders.setdefault(block_hash, set()).add(worker)
        return in_order or reset

    def expect(self, worker: str, block_hashes: Iterable[int]) -> int:
        """Record at dispatch that ``worker`` will hold these blocks; returns how many were new to the index.

        Hashes it is already known to hold stay as they are (a confirmed entry stays confirmed)."""
        if self.max_tentative == 0 or self.tentative_ttl_s == 0:
            return 0
        now = self._clock()
        self._expire(now)
        expires = now + self.tentative_ttl_s
        held = self._held.setdefault(worker, set())
        tentative = self._tentative.setdefault(worker, OrderedDict())
        added = 0
        for block_hash in block_hashes:
            if block_hash in tentative:  # sent again: it lives as long as the latest dispatch
                tentative[block_hash] = expires
                tentative.move_to_end(block_hash)
            elif block_hash not in held:
                held.add(block_hash)
                self._holders.setdefault(block_hash, set()).add(worker)
                tentative[block_hash] = expires
                added += 1
        while len(tentative) > self.max_tentative:
            oldest, _ = tentative.popitem(last=False)
            self._discard(worker, oldest)
        return added

    def forget(self, worker: str) -> None:
        """Drop everything known of a worker (restarted or died), tentative entries too."""
        self._next_seq.pop(worker, None)
        self._tentative.pop(worker, None)
        for block_hash in self._held.pop(worker, set()):
            self._unlink(worker, block_hash)

    def _drop_confirmed(self, worker: str) -> None:
        """A snapshot or a gap: what the worker's events said is void, what the router sent it (tentative) stays."""
        self._next_seq.pop(worker, None)
        tentative = self._tentative.get(worker, {})
        held = self._held.get(worker, set())
        for block_hash in [h for h in held if h not in tentative]:
            held.discard(block_hash)
            self._unlink(worker, block_hash)

    def _discard(self, worker: str, block_hash: int) -> None:
        held = self._held.get(worker)
        if held is not None and block_hash in held:
            held.discard(block_hash)
            self._unlink(worker, block_hash)

    def _unlink(self, worker: str, block_hash: int) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[block_hash]

    def _expire(self, now: float) -> None:
        for worker, tentative in self._tentative.items():
            while tentative:
                block_hash, expires = next(iter(tentative.items()))
                if expires > now:
                    break
                del tentative[block_hash]
                self._discard(worker, block_hash)

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker that holds the first block: how many leading blocks of the prompt it holds (tentative count)."""
        if not block_hashes:
            return {}
        self._expire(self._clock())
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
        """Blocks known for the worker, tentative ones included."""
        return len(self._held.get(worker, ()))

    def tentative_blocks(self, worker: str) -> int:
        """Of those, the ones dispatched but not yet confirmed by a KV event."""
        return len(self._tentative.get(worker, ()))

    def workers(self) -> list[str]:
        return [worker for worker, held in self._held.items() if held]

    def __len__(self) -> int:
        """Distinct hashes held by any worker (expired tentative ones linger until the next ``match`` or ``expect``)."""
        return len(self._holders)
