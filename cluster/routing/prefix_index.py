"""Which workers hold which prompt prefixes, and in which KV tier, as the router learns it from their ``KvEvents``
(docs/architecture.md, "KV-aware routing": why the view is never an over-estimate for long).

A chained hash names a whole prefix, so a flat map ``hash -> workers`` per tier (device, host, disk) is a radix tree:
``match`` stops, per worker, at the first block it lacks, as the engine's lookup does; ``match_tiers`` continues a
device match through the blocks the worker would load back from host or disk. A ``seq`` gap (one counter across the
tiers) drops every tier of the worker's view; a snapshot (``reset``) replaces one tier. Tentative entries (``expect``,
device only) are confirmed by a device ``stored``, dropped by a device ``removed`` or after ``tentative_ttl_s`` (at
most ``max_tentative`` per worker); snapshots and gaps keep them (the worker may not have computed them yet).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Tier = Literal["device", "host", "disk"]  # as ``KvEvents.tier``
TIERS: tuple[Tier, ...] = ("device", "host", "disk")
TENTATIVE_TTL_S = 10.0  # a dispatched prompt's blocks not confirmed by a KV event within this are dropped
MAX_TENTATIVE = 16_384  # tentative hashes per worker (the oldest dropped first)


@dataclass(frozen=True, slots=True)
class TierBlocks:
    """A prompt's leading blocks one worker holds: on device, then the ones after them it would load back."""

    device: int
    host: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk


class _TierView:
    """One tier's entries, both ways round."""

    __slots__ = ("held", "holders")

    def __init__(self) -> None:
        self.holders: dict[int, set[str]] = {}  # block hash -> workers that hold it
        self.held: dict[str, set[int]] = {}  # worker -> the hashes it holds

    def add(self, worker: str, block_hash: int) -> bool:
        held = self.held.setdefault(worker, set())
        if block_hash in held:
            return False
        held.add(block_hash)
        self.holders.setdefault(block_hash, set()).add(worker)
        return True

    def discard(self, worker: str, block_hash: int) -> None:
        held = self.held.get(worker)
        if held is None or block_hash not in held:
            return
        held.discard(block_hash)
        holders = self.holders[block_hash]
        holders.discard(worker)
        if not holders:
            del self.holders[block_hash]

    def forget(self, worker: str) -> None:
        for block_hash in list(self.held.get(worker, ())):
            self.discard(worker, block_hash)
        self.held.pop(worker, None)


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
        self._views: dict[Tier, _TierView] = {tier: _TierView() for tier in TIERS}
        self._device = self._views["device"]  # confirmed and tentative entries
        self._next_seq: dict[str, int] = {}  # worker -> the seq its next message must carry (absent: any)
        # worker -> unconfirmed device hash -> expiry, oldest first
        self._tentative: dict[str, OrderedDict[int, float]] = {}

    def apply(
        self,
        worker: str,
        seq: int,
        stored: Iterable[int],
        removed: Iterable[int],
        reset: bool = False,
        tier: Tier = "device",
    ) -> bool:
        """Take one KvEvents message about one tier; False after a gap (that worker's confirmed views of every tier
        are dropped first), unless the message is a snapshot and no other tier's view was lost."""
        if tier not in self._views:
            raise ValueError(f"KV tier must be one of {TIERS}, got {tier!r}")
        expected = self._next_seq.get(worker)
        in_order = expected is None or seq == expected
        lost_elsewhere = 0
        if not in_order:
            lost_elsewhere = sum(self._drop_confirmed(worker, other) for other in TIERS if other != tier)
        if reset or not in_order:
            self._drop_confirmed(worker, tier)
        self._next_seq[worker] = seq + 1
        view = self._views[tier]
        tentative: dict[int, float] = self._tentative.get(worker, {}) if tier == "device" else {}
        for block_hash in removed:
            tentative.pop(block_hash, None)
            view.discard(worker, block_hash)
        for block_hash in stored:
            tentative.pop(block_hash, None)  # confirmed
            view.add(worker, block_hash)
        return in_order or (reset and not lost_elsewhere)

    def expect(self, worker: str, block_hashes: Iterable[int]) -> int:
        """Record at dispatch that ``worker`` will hold these blocks on device; returns how many were new to the index.

        Hashes it is already known to hold stay as they are (a confirmed entry stays confirmed)."""
        if self.max_tentative == 0 or self.tentative_ttl_s == 0:
            return 0
        now = self._clock()
        self._expire(now)
        expires = now + self.tentative_ttl_s
        device = self._device
        tentative = self._tentative.setdefault(worker, OrderedDict())
        added = 0
        for block_hash in block_hashes:
            if block_hash in tentative:  # sent again: it lives as long as the latest dispatch
                tentative[block_hash] = expires
                tentative.move_to_end(block_hash)
            elif device.add(worker, block_hash):
                tentative[block_hash] = expires
                added += 1
        while len(tentative) > self.max_tentative:
            oldest, _ = tentative.popitem(last=False)
            device.discard(worker, oldest)
        return added

    def forget(self, worker: str) -> None:
        """Drop everything known of a worker (restarted or died), in every tier, tentative entries too."""
        self._next_seq.pop(worker, None)
        self._tentative.pop(worker, None)
        for view in self._views.values():
            view.forget(worker)

    def _drop_confirmed(self, worker: str, tier: Tier) -> int:
        """A snapshot or a gap: what the worker's events said of ``tier`` is void, what the router sent it (tentative)
        stays. Returns how many entries went."""
        view = self._views[tier]
        keep: Container[int] = self._tentative.get(worker, ()) if tier == "device" else ()
        gone = [h for h in view.held.get(worker, ()) if h not in keep]
        for block_hash in gone:
            view.discard(worker, block_hash)
        return len(gone)

    def _expire(self, now: float) -> None:
        for worker, tentative in self._tentative.items():
            while tentative:
                block_hash, expires = next(iter(tentative.items()))
                if expires > now:
                    break
                del tentative[block_hash]
                self._device.discard(worker, block_hash)

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker that holds the first block on device: how many leading blocks of the prompt its device holds
        (tentative count)."""
        if not block_hashes:
            return {}
        self._expire(self._clock())
        holders_of = self._device.holders
        first = holders_of.get(block_hashes[0])
        if not first:
            return {}
        matched: dict[str, int] = {}
        candidates = set(first)
        for depth, block_hash in enumerate(block_hashes[1:], start=1):
            holders = holders_of.get(block_hash, set())
            for worker in candidates - holders:
                matched[worker] = depth
            candidates &= holders
            if not candidates:
                return matched
        for worker in candidates:
            matched[worker] = len(block_hashes)
        return matched

    def match_tiers(self, block_hashes: Sequence[int]) -> dict[str, TierBlocks]:
        """Per worker that holds the first block in some tier: its device match (``match``), then the consecutive
        blocks after it that it holds in host (counted as host) or else disk, which it loads back before computing.

        The chain stops at a block in neither, even one on device again: whether the engine attends a device block
        found after a loaded one is its choice, and the index does not over-estimate."""
        device = self.match(block_hashes)
        host, disk = self._views["host"], self._views["disk"]
        if not block_hashes or not (host.holders or disk.holders):
            return {worker: TierBlocks(n) for worker, n in device.items()}
        first = block_hashes[0]
        candidates = set(device) | host.holders.get(first, set()) | disk.holders.get(first, set())
        matched: dict[str, TierBlocks] = {}
        for worker in candidates:
            depth = device.get(worker, 0)
            in_host, in_disk = host.held.get(worker, set()), disk.held.get(worker, set())
            from_host = from_disk = 0
            for block_hash in block_hashes[depth:]:
                if block_hash in in_host:
                    from_host += 1
                elif block_hash in in_disk:
                    from_disk += 1
                else:
                    break
            matched[worker] = TierBlocks(depth, from_host, from_disk)
        return matched

    def blocks_held(self, worker: str, tier: Tier = "device") -> int:
        """Blocks known for the worker in ``tier`` (on device: tentative ones included)."""
        return len(self._views[tier].held.get(worker, ()))

    def tentative_blocks(self, worker: str) -> int:
        """Of the device's, the ones dispatched but not yet confirmed by a KV event."""
        return len(self._tentative.get(worker, ()))

    def workers(self) -> list[str]:
        """Workers known to hold something, in any tier."""
        names = {worker for view in self._views.values() for worker, held in view.held.items() if held}
        return sorted(names)

    def __len__(self) -> int:
        """Distinct hashes per tier, summed over the tiers (expired tentative ones linger until the next ``match`` or
        ``expect``)."""
        return sum(len(view.holders) for view in self._views.values())
