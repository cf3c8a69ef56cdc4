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

**Tentative entries** (``expect``): the router also records, when it dispatches a prompt, that the chosen workers
will hold its blocks, before their KV events say so (SGLang's cache-aware router inserts into its tree at dispatch
too). Without them a follow-up sent while the first request is still computing, or before its events arrive, finds
no holder and may go elsewhere, and then both workers compute (and keep) the same prefix. A tentative entry is
confirmed by the worker's ``stored`` event, dropped by its ``removed`` event, and otherwise expires after
``tentative_ttl_s`` (the prompt was never stored: the request failed, or the worker caches nothing); at most
``max_tentative`` per worker (the oldest go first), so a router that dispatches to a worker whose events never come
cannot grow it. An over-estimate therefore lasts at most ``tentative_ttl_s``. A worker's snapshot (``reset``) or a
gap keeps its tentative entries (they are about requests the worker may not have computed yet); ``forget`` (a
restart or death) drops them with the rest.
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
        # worker -> its unconfirmed hashes and when each expires, oldest first (expiry grows with insertion)
        self._tentative: dict[str, OrderedDict[int, float]] = {}

    def apply(self, worker: str, seq: int, stored: Iterable[int], removed: Iterable[int], reset: bool = False) -> bool:
        """Take one KvEvents message; False when it shows a missed message (that worker's view was dropped first:
        what is applied after a gap is a subset of what the worker holds, never more)."""
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
        """Record at dispatch that ``worker`` will hold these blocks (the prompt sent to it), until its KV events
        confirm or remove them or ``tentative_ttl_s`` passes; returns how many were new to the index. Hashes it is
        already known to hold are left as they are (a confirmed entry stays confirmed)."""
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
        """Drop everything known of a worker (it restarted or died), tentative entries too."""
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
        """Drop the tentative entries whose time is up (oldest first: each worker's are in expiry order)."""
        for worker, tentative in self._tentative.items():
            while tentative:
                block_hash, expires = next(iter(tentative.items()))
                if expires > now:
                    break
                del tentative[block_hash]
                self._discard(worker, block_hash)

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker that holds the first block: how many leading blocks of the prompt it holds (workers that hold
        none are absent). One pass, stopping when no worker is left. Tentative entries count (expired ones are
        dropped first)."""
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
        """Workers with at least one block known."""
        return [worker for worker, held in self._held.items() if held]

    def __len__(self) -> int:
        """Distinct hashes held by any worker (tentative ones included; expired ones may linger until the next
        ``match`` or ``expect``)."""
        return len(self._holders)
