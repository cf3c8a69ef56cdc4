"""Decode KV reservations at the router: ask a decode worker to hold blocks for a prompt before prefill starts.

A request needs ``blocks_needed`` blocks on one decode worker (prompt, first token, configured headroom). Decode
workers are tried in policy order, skipping those whose last heartbeat shows too few free blocks; the first that
reserves wins. When none can, the request waits in a bounded queue (``router.queue_size``, one limit across every
router process: ``cluster/routing/admission.py``) until a heartbeat or a finished request signals capacity; a full queue is
``Overloaded`` (429), no live decode worker is ``NoWorkers`` (503). A prompt no worker's whole cache can hold, or one
a decode worker refuses for what it is (``invalid_request``), ends at once with 400.

Every ``reserve`` carries an attempt number, and replies are matched on (request, worker, attempt): a reply that
comes after the router gave up can never resolve another worker's reservation nor a later attempt's on the same
worker; an ``ok`` that came too late is undone on its worker with ``unreserve`` for that attempt only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from cluster.config import ClusterConfig
from cluster.routing.admission import Admission
from cluster.routing.errors import NoWorkers, Overloaded, RequestFailed
from cluster.routing.membership import WorkerHandle
from cluster.routing.metrics import RouterMetrics
from cluster.routing.policies import Policy, PrefixMatch
from engine.blocks import reserved_blocks
from engine.request import SamplingParams
from worker.messages import Command, ErrorCode, ErrorEvent, Reserve, Reserved, Unreserve

logger = logging.getLogger(__name__)

MAX_WORKERS_TRIED = 3  # decode workers asked per round before the request waits for capacity


class DecodeReservations:
    def __init__(
        self,
        config: ClusterConfig,
        policy: Policy,
        metrics: RouterMetrics,
        admission: Admission,
        send: Callable[[WorkerHandle, Command], None],
        on_granted: Callable[[str, WorkerHandle], None] | None = None,
    ) -> None:
        """``on_granted(wire rid, worker)``: called as an ``ok`` reply to a waiting attempt is read, before ``reserve``
        returns, so that the caller makes the worker the request's at once (what the worker sends next may come in
        the same read, and an abort must reach it); the request counts in the worker's ``inflight`` from then on."""
        self.config = config
        self.block_size = config.transfer.block_size
        self._policy = policy
        self._metrics = metrics
        self._admission = admission
        self._send = send
        self._on_granted = on_granted
        # (wire rid, worker, attempt) -> the worker asked, and the future of its reply: Reserved, an ErrorEvent, or
        # None (the worker was marked dead)
        self._pending: dict[
            tuple[str, str, int], tuple[WorkerHandle, asyncio.Future[Reserved | ErrorEvent | None]]
        ] = {}
        self._attempts = 0
        self._capacity = asyncio.Event()
        self.queue_depth = 0  # this router's requests waiting for decode KV

    @property
    def queue_depth_all(self) -> int:
        """Requests waiting for decode KV in every router process."""
        return self._admission.total

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """KV blocks a decode worker reserves for a request: prompt, first token and the configured headroom (the
        engine's own rule, ``engine.blocks.reserved_blocks``, so the router never plans with another count)."""
        return reserved_blocks(
            num_prompt_tokens,
            max_tokens,
            self.config.pools.decode.reserve_headroom_tokens,
            self.block_size,
            self.config.model.max_model_len,
        )

    def check_fits(self, workers: list[WorkerHandle], role: str, num_prompt_tokens: int, max_tokens: int) -> None:
        """A prompt that no worker's whole KV cache can hold is refused now (400), not after queueing until timeout."""
        sizes = [w.stats.load.total_blocks for w in workers if w.stats is not None]
        if not sizes:
            return  # no heartbeat yet: the worker itself refuses what cannot fit
        needed = self.blocks_needed(num_prompt_tokens, max_tokens)
        if needed > max(sizes):
            raise RequestFailed(
                f"the prompt needs {needed} KV blocks of {self.block_size} tokens; the largest {role} worker's KV "
                f"cache holds {max(sizes)}",
                "context_length_exceeded",
                400,
            )

    def wake(self) -> None:
        """Capacity may have been freed (a heartbeat, a finished request): queued requests try again."""
        self._capacity.set()
        self._capacity = asyncio.Event()

    async def reserve(
        self,
        live: Callable[[], list[WorkerHandle]],
        wire_rid: str,
        prompt: list[int],
        params: SamplingParams,
        deadline: float,
        match: PrefixMatch | None = None,
        prefer: str | None = None,
    ) -> tuple[WorkerHandle, Reserved]:
        """The decode worker that reserved, and its reply (blocks, KV address); raises RequestFailed otherwise.
        ``on_granted`` has been called for it already, as its reply was read.

        ``match``: what each decode worker holds of the prompt (the router's prefix index). With ``kv_aware`` the
        worker that holds a chat's history is asked first, so the next turn reserves (and receives) only the blocks
        it lacks; the other policies ignore it. ``prefer``: a worker asked before the policy's order whenever it is
        live and has room (an earlier request's, the router's ``affinity``); without room, the policy's order."""
        needed = self.blocks_needed(len(prompt), params.max_tokens)
        queued = False
        try:
            while True:
                workers = live()
                if not workers:
                    raise NoWorkers("no live decode worker")
                fits = [w for w in workers if w.stats is None or w.stats.load.free_blocks >= needed]
                for _ in range(min(MAX_WORKERS_TRIED, len(fits))):
                    # ordered anew before each attempt: the load other requests' attempts added meanwhile counts
                    worker = self._order(fits, match, prefer)[0]
                    fits.remove(worker)
                    reply = await self._try(worker, wire_rid, prompt, params)
                    if isinstance(reply, Reserved) and reply.ok:
                        return worker, reply
                    if isinstance(reply, ErrorEvent) and reply.code is ErrorCode.INVALID_REQUEST:
                        # refused for what the request is, not for lack of room: no other worker or wait helps
                        raise RequestFailed(reply.message, ErrorCode.INVALID_REQUEST.value, 400)
                if not queued:
                    if not self._admission.enter():  # one limit across every router process
                        raise Overloaded("every decode worker's KV cache is reserved and the queue is full")
                    queued = True
                    self.queue_depth += 1
                    self._metrics.queue_depth.set(self.queue_depth)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Overloaded("no decode KV became free before the request timed out")
                try:
                    await asyncio.wait_for(self._capacity.wait(), timeout=min(0.5, remaining))
                except asyncio.TimeoutError:
                    pass
        finally:
            if queued:
                self._admission.leave()
                self.queue_depth -= 1
                self._metrics.queue_depth.set(self.queue_depth)

    def _order(self, fits: list[WorkerHandle], match: PrefixMatch | None, prefer: str | None) -> list[WorkerHandle]:
        """The policy's order, with the preferred worker first when it is among those with room."""
        order = self._policy.order(fits, match)
        if prefer is None:
            return order
        preferred = [w for w in order if w.name == prefer]
        return preferred + [w for w in order if w.name != prefer]

    async def _try(
        self, worker: WorkerHandle, rid: str, prompt: list[int], params: SamplingParams
    ) -> Reserved | ErrorEvent | None:
        future = asyncio.get_running_loop().create_future()
        self._attempts += 1
        key = (rid, worker.name, self._attempts)
        self._pending[key] = (worker, future)
        # the attempt counts as the worker's load while it is asked, so that concurrent picks (which order the
        # workers before either reply comes back) see each other; a granted reservation counts from its reply on
        worker.inflight += 1
        try:
            local_max = self.config.router.local_prefill_max_tokens  # the worker applies the rule (dispatch.py)
            self._send(worker, Reserve(rid, prompt, params, attempt=self._attempts, local_prefill_max_tokens=local_max))
            return await asyncio.wait_for(future, timeout=self.config.router.worker_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("decode worker %s did not answer a reservation in time", worker.name)
            return None
        finally:
            self._pending.pop(key, None)
            worker.inflight = max(0, worker.inflight - 1)

    def on_reserved(self, reply: Reserved, worker: WorkerHandle | None) -> None:
        """A decode worker's ``reserved`` reply."""
        asked, future = self._pending.get((reply.rid, reply.worker, reply.attempt), (None, None))
        if asked is not None and future is not None and not future.done():
            if reply.ok and self._on_granted is not None:
                self._on_granted(reply.rid, asked)
            future.set_result(reply)
        elif reply.ok and worker is not None:
            # a reply that came after we gave up: undo that attempt (a later one on the same worker stays)
            self._send(worker, Unreserve(reply.rid, attempt=reply.attempt))

    def on_worker_dead(self, worker_name: str) -> None:
        """A worker marked dead answers none of its pending reservations: try the next worker now, not after
        ``worker_timeout_s`` (if it answers after all, its late ``ok`` is undone like any other)."""
        for (_, name, _), (_, future) in list(self._pending.items()):
            if name == worker_name and not future.done():
                future.set_result(None)  # no answer: the next worker is tried, as after a timeout

    def on_error(self, error: ErrorEvent) -> bool:
        """An ``error`` event that answers a pending reservation (the worker could not even try); True if it did."""
        future = next((f for (r, w, _), (_, f) in self._pending.items() if r == error.rid and w == error.worker), None)
        if future is None or future.done():
            return False
        future.set_result(error)
        return True
