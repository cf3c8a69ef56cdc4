"""Where a request goes: the workers a prompt is dispatched to, and the commands that start it there.

Split from the router (cluster/routing/router.py), which owns the streams and the event loop: this is the placement
decision alone. A disaggregated request reserves decode KV first (``cluster/routing/reservations.py``), then goes to a
prefill worker, or is prefilled on the decode worker itself when what it lacks is short (conditional
disaggregation); a colocated request goes to one worker. Each pick is the routing policy's first
(``cluster/routing/policies.py``), unless the request names an earlier one (``affinity``) whose workers are live and
routable: the API's n > 1 choices after the first land where the prompt is already cached. Every decision is
counted in /metrics with its reason, and every placement is recorded (``Placements``) for later affinity.

Each chosen worker whose pool caches prefixes is also recorded in the router's prefix index as (tentatively) holding
the prompt's blocks, at dispatch (``PrefixIndex.expect``): a follow-up that comes before the worker's KV events
(a chat's next turn, a shared prefix's second request while the first is still computing) finds where its prefix is
going to be. The decode worker is recorded too: it keeps what it receives (and what it computes itself).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cluster.config import ClusterConfig
from cluster.routing.errors import NoWorkers
from cluster.routing.membership import Membership, WorkerHandle
from cluster.routing.metrics import RouterMetrics
from cluster.routing.policies import DecisionReason, Placements, Policy, PrefixMatch, decision_reason
from cluster.routing.reservations import DecodeReservations
from cluster.routing.streams import Stream
from engine.blocks import prompt_block_hashes, reusable_prefix_tokens
from engine.request import SamplingParams
from worker.messages import Command, Generate, Prefill


class Dispatcher:
    def __init__(
        self,
        config: ClusterConfig,
        policies: dict[str, Policy],
        members: Membership,
        reservations: DecodeReservations,
        metrics: RouterMetrics,
        send: Callable[[WorkerHandle, Command], None],
        placements: Placements,
    ) -> None:
        self.config = config
        self.policies = policies
        self.members = members
        self.reservations = reservations
        self.metrics = metrics
        self._send = send
        self.placements = placements

    async def dispatch(
        self, stream: Stream, prompt: list[int], params: SamplingParams, deadline: float, affinity: str | None = None
    ) -> None:
        role = "colocated" if self.config.mode == "colocated" else "decode"
        self.reservations.check_fits(self.members.routable(role), role, len(prompt), params.max_tokens)
        hashes = prompt_block_hashes(prompt, self.config.transfer.block_size)  # once: each pick matches them anew
        # looked up at each dispatch (a retry too): the earlier request's workers, if the router remembers them
        prefer = self.placements.get(affinity) if affinity is not None else None
        if self.config.mode == "colocated":
            worker = self.pick("colocated", prompt, hashes, prefer.decode if prefer else None)
            stream.decode = worker.name
            worker.inflight += 1
            self._expect(worker, hashes)
            self._send(worker, Generate(stream.wire_rid, prompt, params))
            stream.timing["router_queue_s"] = time.monotonic() - stream.started_s
            self.placements.record(stream.rid, stream.prefill, stream.decode)
            return
        # decode workers hold the chats they decoded: kv_aware asks those first
        match = self.prefix_match(prompt, hashes)
        prefer_decode = prefer.decode if prefer else None
        decode, reply = await self.reservations.reserve(
            lambda: self.members.routable("decode"), stream.wire_rid, prompt, params, deadline, match, prefer_decode
        )
        self.count_decision("decode", decode, self.members.routable("decode"), match, prefer_decode)
        # the stream's decode worker is ``decode`` already: made so as its reply was read (``Router._granted``)
        self._expect(decode, hashes)
        stream.timing["decode_cached_tokens"] = float(reply.cached_tokens)
        self.metrics.decode_cached_tokens.inc(reply.cached_tokens)
        if reply.prefill_local:
            # conditional disaggregation: what the decode worker lacks (``len(prompt) - reply.cached_tokens``) is at
            # most ``router.local_prefill_max_tokens``, so it computes it itself, started with the reservation (no
            # prefill worker, no transfer, no second command); its first token comes in ``tokens`` events
            self.metrics.prefill_path.labels("local").inc()
            stream.timing["prefill_local"] = 1.0
            stream.timing["router_queue_s"] = time.monotonic() - stream.started_s
            self.placements.record(stream.rid, stream.prefill, stream.decode)
            return
        prefill = self.pick("prefill", prompt, hashes, prefer.prefill if prefer else None)
        stream.prefill = prefill.name
        prefill.inflight += 1
        self._expect(prefill, hashes)
        command = Prefill(
            stream.wire_rid, prompt, params, reply.kv_address, reply.blocks, cached_tokens=reply.cached_tokens
        )
        self._send(prefill, command)
        self.metrics.prefill_path.labels("remote").inc()
        stream.timing["router_queue_s"] = time.monotonic() - stream.started_s
        self.placements.record(stream.rid, stream.prefill, stream.decode)

    def _expect(self, worker: WorkerHandle, hashes: list[int]) -> None:
        """The worker will hold the prompt's blocks once it has them (its prefix cache, if its pool has one on)."""
        pools = self.config.pools
        caching = {
            "prefill": pools.prefill.enable_prefix_caching,
            "decode": pools.decode.enable_prefix_caching,
            "colocated": pools.prefill.enable_prefix_caching and pools.decode.enable_prefix_caching,
        }
        if caching.get(worker.role, False):
            self.members.prefix_index.expect(worker.name, hashes)

    def pick(self, role: str, prompt: list[int], hashes: list[int], prefer: str | None = None) -> WorkerHandle:
        """The worker a prompt goes to (prefill or colocated): ``prefer`` (an earlier request's worker, ``affinity``)
        when it is live and routable, else the policy's first, given what each worker holds of the prompt (only
        kv_aware weighs it); the decision and the prefix it found are counted in /metrics."""
        live, policy = self.members.routable(role), self.policies[role]
        match = self.prefix_match(prompt, hashes)
        preferred = next((w for w in live if w.name == prefer), None) if prefer is not None else None
        if preferred is not None:
            self.count_decision(role, preferred, live, match, prefer)
            return preferred
        candidates = policy.order(live, match)
        if not candidates:
            raise NoWorkers(f"no live {role} worker")
        chosen = candidates[0]
        self.count_decision(role, chosen, live, match)
        return chosen

    def count_decision(
        self,
        role: str,
        chosen: WorkerHandle,
        live: list[WorkerHandle],
        match: PrefixMatch,
        prefer: str | None = None,
    ) -> None:
        """/metrics: why this worker was chosen (an earlier request's ``affinity``, else the policy's prefix or load),
        and how much of the prompt it already holds."""
        metrics = self.metrics
        reason: DecisionReason = (
            "affinity" if chosen.name == prefer else decision_reason(self.policies[role], chosen, live, match)
        )
        metrics.routing_decisions.labels(role, reason).inc()
        metrics.routed_prompt_tokens.labels(role).inc(match.num_prompt_tokens)
        metrics.prefix_matched_tokens.labels(role).inc(match.tokens(chosen.name))

    def prefix_match(self, prompt: list[int], hashes: list[int]) -> PrefixMatch:
        """Per worker, the prompt tokens its prefix cache would spare (the router's view, from KV events): the
        prompt's full-block hashes (``engine.blocks.prompt_block_hashes``, the engine's own function) matched
        against the index, and cut by the engine's rule that at least one prompt token is computed."""
        block_size, index = self.config.transfer.block_size, self.members.prefix_index
        if not len(index):  # no worker reports a cached block (prefix caching off, or nothing computed yet)
            return PrefixMatch(len(prompt))
        blocks = index.match(hashes)
        tokens = {name: reusable_prefix_tokens(n, len(prompt), block_size) for name, n in blocks.items()}
        return PrefixMatch(len(prompt), {name: n for name, n in tokens.items() if n > 0})
