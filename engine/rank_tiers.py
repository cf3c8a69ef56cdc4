"""KV tiers at tensor_parallel_size N: every rank pages its own KV heads; rank 0 decides, the other ranks follow.

Each rank has tiers of its own (``KVTiers``) in folders of its own: ``tier_fingerprint`` names the rank's heads, so a
page holds one rank's heads of one block, under the same chained hash on every rank. Rank 0 holds the block manager
and the scheduler, so it decides and tells the other ranks through the step channel's TIERS messages (msgspec, in
order with the steps, so each lands before the next step touches the blocks it names):

1. ``Save``: blocks left the prefix cache. Every rank copies its heads of them out of its cache at once and writes
   the pages it lacks (a rank that lost a page writes it again the next time the block goes down).
2. ``Load``: a prompt's prefix continues in rank 0's tiers. Every rank reads and checks its pages of those hashes.
3. ``Poll``: once rank 0's own read ended, each other rank says how many pages it read and checked, in chain order
   (-1: still reading; a rank that has not ended within ``RANK_LOAD_TIMEOUT_S`` counts as none). Bounded by the
   group's timeout; never a wait for a disk.
4. ``End``: every rank writes the first n pages into the load's blocks, n the fewest any rank read, and forgets the
   load (n = 0: an abort). A block is loaded only when every rank's part of it is there and checked; a page missing
   or bad on any rank makes that block and the rest of the prefix be computed, on every rank.

Only rank 0's tiers report KV events and figures, so a router's index counts each block once.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING

import msgspec
import torch

from engine.config import EngineConfig, KVOffloadConfig
from engine.kv_cache import KVCache
from engine.kv_tiers import KVTiers, TierLoad, tier_fingerprint
from engine.tensor_parallel import HeadSplit, StepChannel, StepKind, TPError

if TYPE_CHECKING:
    from engine.engine_parts import EngineParts
    from engine.request import Request

logger = logging.getLogger(__name__)

RANK_LOAD_TIMEOUT_S = 30.0  # a rank whose pages of a load are not read by then: the load takes none of its blocks
STILL_READING = -1


class Save(msgspec.Struct, tag="save"):
    blocks: list[tuple[int, list[int], int]]  # (chained hash, token ids, block id) of each evicted block


class Load(msgspec.Struct, tag="load"):
    load_id: int
    block_ids: list[int]
    hashes: list[int]
    token_ids: list[list[int]]


class Poll(msgspec.Struct, tag="poll"):
    load_ids: list[int]  # answered with a list[int]: pages read and checked per load, or STILL_READING


class End(msgspec.Struct, tag="end"):
    load_id: int
    blocks: int  # the first this many pages go into their blocks (0: none)


TierMessage = Save | Load | Poll | End
_decoder = msgspec.msgpack.Decoder(TierMessage)
_counts = msgspec.msgpack.Decoder(list[int])
_encoder = msgspec.msgpack.Encoder()


def build_tiers(
    config: EngineConfig,
    kv_cache: KVCache,
    model: torch.nn.Module,
    split: HeadSplit | None,
    channel: StepChannel | None,
) -> KVTiers | None:
    """Rank 0's tiers (None without ``kv_offload``): at a degree above 1, ones that tell the other ranks
    (``channel``) what to save and load."""
    offload = config.kv_offload
    if offload is None or not offload.enabled:
        return None
    fingerprint = tier_fingerprint(kv_cache.spec, model, split)
    if channel is None:
        return KVTiers(offload, kv_cache, fingerprint)
    return LeaderTiers(offload, kv_cache, fingerprint, channel)


def follower_tiers(parts: EngineParts) -> FollowerTiers | None:
    """A rank other than 0: its own tiers, driven by rank 0's TIERS messages (None without ``kv_offload``)."""
    offload = parts.config.kv_offload
    if offload is None or not offload.enabled:
        return None
    fingerprint = tier_fingerprint(parts.kv_cache.spec, parts.model, parts.runner.head_split)
    return FollowerTiers(KVTiers(offload, parts.kv_cache, fingerprint))


class LeaderTiers(KVTiers):
    """Rank 0's tiers: its own pages as at degree 1, and every save and load told to the other ranks; a load ends
    when every rank's read has (``poll``), taking the blocks every rank has."""

    def __init__(self, config: KVOffloadConfig, kv_cache: KVCache, fingerprint: bytes, channel: StepChannel) -> None:
        super().__init__(config, kv_cache, fingerprint)
        self.channel = channel
        self._load_ids = itertools.count(1)

    def _tell(self, message: TierMessage, reply: bool = False) -> list[bytes] | None:
        """``message`` to every other rank (their answers, with ``reply``); None when the group is broken (the
        next step fails on it: the worker's health says so)."""
        try:
            return self.channel.control(_encoder.encode(message), reply, StepKind.TIERS)
        except TPError as exc:
            logger.error("KV tiers: the other ranks were not told (%s)", exc)
            return None

    def save(self, evicted: list[tuple[int, tuple[int, ...], int]]) -> None:
        if evicted:
            self._tell(Save([(block_hash, list(tokens), block_id) for block_hash, tokens, block_id in evicted]))
        super().save(evicted)

    def start_load(
        self, request: Request, token_ids: list[int], first_block: int, hashes: list[int], counts_as_cached: bool
    ) -> TierLoad:
        load = super().start_load(request, token_ids, first_block, hashes, counts_as_cached)
        load.load_id = next(self._load_ids)
        self._tell(Load(load.load_id, load.block_ids, load.hashes, [list(t) for t in load.token_ids]))
        return load

    def poll(self) -> list[TierLoad]:
        """Loads read on every rank, each cut to the pages every rank read and checked."""
        ready = [load for load in self._pending.values() if load.done.is_set()]
        if not ready:
            return []
        replies = self._tell(Poll([load.load_id for load in ready]), reply=True)
        answers = [_decode_counts(data, len(ready)) for data in (replies or [b""] * self.channel.group.size)[1:]]
        now, done = time.monotonic(), []
        for i, load in enumerate(ready):
            counts = [answer[i] for answer in answers]
            if STILL_READING in counts:
                if now - load.started_s < RANK_LOAD_TIMEOUT_S:
                    continue
                logger.warning("KV tiers: a rank did not read its pages within %.0f s: computed", RANK_LOAD_TIMEOUT_S)
            del load.tiers[min([len(load.tiers), *(max(count, 0) for count in counts)]) :]
            del self._pending[load.request_id]
            done.append(load)
        return done

    def write(self, load: TierLoad) -> int:
        self._tell(End(load.load_id, len(load.tiers) if load.buffer is not None else 0))
        return super().write(load)

    def drop(self, load: TierLoad) -> None:
        self._tell(End(load.load_id, 0))
        super().drop(load)

    def cancel(self, request_id: str) -> None:
        load = self._pending.pop(request_id, None)
        if load is not None:
            self._tell(End(load.load_id, 0))

    def wait(self, timeout_s: float) -> None:
        """As at degree 1; when only the other ranks' reads are left, ``timeout_s`` (no busy loop of polls)."""
        if all(load.done.is_set() for load in self._pending.values()):
            time.sleep(timeout_s)
        else:
            super().wait(timeout_s)


def _decode_counts(data: bytes, expected: int) -> list[int]:
    """A rank's answer to a poll; one that cannot be read counts as no pages read."""
    try:
        counts = _counts.decode(data)
    except msgspec.DecodeError:
        counts = []
    return counts if len(counts) == expected else [0] * expected


class FollowerTiers:
    """A rank other than 0: its tiers, doing what rank 0's TIERS messages say (``TPFollower`` passes them here)."""

    def __init__(self, tiers: KVTiers) -> None:
        self.tiers = tiers
        self.loads: dict[int, TierLoad] = {}  # by rank 0's load id: reading, or read and waiting for ``End``

    def control(self, data: bytes) -> bytes:
        message = _decoder.decode(data)
        if isinstance(message, Save):
            self.tiers.save([(block_hash, tuple(tokens), block_id) for block_hash, tokens, block_id in message.blocks])
        elif isinstance(message, Load):
            tokens = [tuple(t) for t in message.token_ids]
            load = TierLoad(f"load-{message.load_id}", 0, message.block_ids, message.hashes, tokens, False)
            load.load_id = message.load_id
            self.loads[message.load_id] = load
            self.tiers.read_async(load)
        elif isinstance(message, Poll):
            return _encoder.encode([self._pages_read(load_id) for load_id in message.load_ids])
        else:
            ending = self.loads.pop(message.load_id, None)
            if message.blocks:
                if ending is None or not ending.done.is_set() or len(ending.tiers) < message.blocks:
                    # rank 0 would attend KV this rank does not hold: end the group rather than answer wrongly
                    raise RuntimeError(f"KV tiers: rank 0 loads {message.blocks} blocks this rank has not read")
                del ending.tiers[message.blocks :]
                self.tiers.write(ending)
            elif ending is not None:
                self.tiers.drop(ending)
        return b""

    def _pages_read(self, load_id: int) -> int:
        load = self.loads.get(load_id)
        if load is None:
            return 0
        return len(load.tiers) if load.done.is_set() else STILL_READING

    def close(self) -> None:
        self.loads.clear()
        self.tiers.close()
