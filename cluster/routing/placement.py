"""Where a prompt goes: the routing policy's first choice (``cluster/routing/policies.py``) among routable workers.

A request may name an earlier one (``affinity``) whose routable worker goes first: n > 1 choices land where the
prompt is cached. Each decision is counted in /metrics with its reason; a chosen worker whose pool caches prefixes is
recorded as tentatively holding the prompt (``PrefixIndex.expect``), so a follow-up that comes before its KV events
finds it.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.config import ClusterConfig
from cluster.routing.errors import NoWorkers, RequestFailed
from cluster.routing.membership import Membership, WorkerHandle
from cluster.routing.metrics import RouterMetrics
from cluster.routing.policies import DecisionReason, Policy, PrefixMatch, decision_reason, make_policy
from engine.blocks import reserved_blocks, reusable_prefix_tokens


class Placer:
    def __init__(
        self,
        config: ClusterConfig,
        members: Membership,
        metrics: RouterMetrics,
        policies: dict[str, Policy] | None = None,
    ) -> None:
        """``policies`` per role: the config's unless given (the simulator seeds its own)."""
        self.config, self.members, self.metrics = config, members, metrics
        weights = config.router.kv_aware.model_dump()
        self.policies = policies or {
            "prefill": make_policy(config.router.prefill_policy, **weights),
            "decode": make_policy(config.router.decode_policy, **weights),
            "colocated": make_policy(config.router.decode_policy, **weights),
        }
        pools = config.pools
        self._caching = {
            "prefill": pools.prefill.enable_prefix_caching,
            "decode": pools.decode.enable_prefix_caching,
            "colocated": pools.prefill.enable_prefix_caching and pools.decode.enable_prefix_caching,
        }

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int, extra_headroom: int = 0) -> int:
        """KV blocks a decode worker reserves for a request, by the engine's own rule (``extra_headroom``: a move's
        room for the tokens made until its source stops it, ``Reserve.extra_headroom_tokens``)."""
        config = self.config
        headroom = config.pools.decode.reserve_headroom_tokens + extra_headroom
        block_size = config.transfer.block_size
        return reserved_blocks(num_prompt_tokens, max_tokens, headroom, block_size, config.model.max_model_len)

    def check_fits(self, role: str, num_prompt_tokens: int, max_tokens: int) -> None:
        """A prompt no worker's whole KV cache can hold is refused now (400), not after queueing until timeout."""
        sizes = [w.stats.load.total_blocks for w in self.members.routable(role) if w.stats is not None]
        if not sizes:
            return  # no heartbeat yet: the worker itself refuses what cannot fit
        needed = self.blocks_needed(num_prompt_tokens, max_tokens)
        if needed > max(sizes):
            raise RequestFailed(
                f"the prompt needs {needed} KV blocks of {self.config.transfer.block_size} tokens; the largest "
                f"{role} worker's KV cache holds {max(sizes)}",
                "context_length_exceeded",
                400,
            )

    def prefix_match(self, prompt_len: int, hashes: list[int]) -> PrefixMatch:
        """Per worker, the prompt tokens its prefix cache would spare, on device and loaded back from its host and
        disk tiers. The engine's reuse rule cuts the whole chain (at least one prompt token is still computed), so
        the block it recomputes comes off the deepest tier."""
        index, block_size = self.members.prefix_index, self.config.transfer.block_size
        if not len(index):  # prefix caching off, or nothing computed yet
            return PrefixMatch(prompt_len)
        device: dict[str, int] = {}
        host: dict[str, int] = {}
        disk: dict[str, int] = {}
        for name, blocks in index.match_tiers(hashes).items():
            left = reusable_prefix_tokens(blocks.total, prompt_len, block_size)
            for tokens, held in ((device, blocks.device), (host, blocks.host), (disk, blocks.disk)):
                n = min(held * block_size, left)
                if n > 0:
                    tokens[name] = n
                left -= n
        return PrefixMatch(prompt_len, device, host, disk)

    def order(
        self, role: str, workers: Sequence[WorkerHandle], match: PrefixMatch, prefer: str | None = None
    ) -> list[WorkerHandle]:
        order = self.policies[role].order(workers, match)
        if prefer is None:
            return order
        return [w for w in order if w.name == prefer] + [w for w in order if w.name != prefer]

    def pick(self, role: str, prompt_len: int, hashes: list[int], prefer: str | None = None) -> WorkerHandle:
        """The worker a prompt goes to (prefill or colocated), counted and expected to hold the prompt."""
        live = self.members.routable(role)
        match = self.prefix_match(prompt_len, hashes)
        candidates = self.order(role, live, match, prefer)
        if not candidates:
            raise NoWorkers(f"no live {role} worker")
        chosen = candidates[0]
        self.count_decision(role, chosen, live, match, prefer)
        self.expect(chosen, hashes)
        return chosen

    def count_decision(
        self, role: str, chosen: WorkerHandle, live: Sequence[WorkerHandle], match: PrefixMatch, prefer: str | None
    ) -> None:
        """/metrics: why this worker was chosen (affinity, prefix or load) and how much of the prompt it holds."""
        reason: DecisionReason = (
            "affinity" if chosen.name == prefer else decision_reason(self.policies[role], chosen, live, match)
        )
        metrics = self.metrics
        metrics.routing_decisions.labels(role, reason).inc()
        metrics.routed_prompt_tokens.labels(role).inc(match.num_prompt_tokens)
        # to compare with the workers' prefix_hit_tokens (device) and host_hit_tokens / disk_hit_tokens
        metrics.prefix_matched_tokens.labels(role).inc(match.tokens(chosen.name, "device"))
        for tier in ("host", "disk"):
            metrics.tier_matched_tokens.labels(role, tier).inc(match.tokens(chosen.name, tier))

    def expect(self, worker: WorkerHandle, hashes: list[int]) -> None:
        """Record that the worker will hold the prompt's blocks, if its pool caches prefixes."""
        if self._caching.get(worker.role, False):
            self.members.prefix_index.expect(worker.name, hashes)
