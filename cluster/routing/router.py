"""The router's request flow: pick workers, reserve decode KV, dispatch, and fan the workers' events back out.

It lives in the HTTP server's event loop and talks to workers over ZeroMQ (typed messages, ``worker/messages.py``,
sealed by ``worker/protocol.py``): one PUSH socket per worker for commands, one PULL socket for every worker's events,
each event handled by its type (``_dispatch``). Tokens never pass through Ray. The requests in flight, and what each
one leaves behind at its end (metrics, timing, its workers' load), are kept in ``cluster/routing/request_table.py``.

Disaggregated request (``generate``):
1. Reserve decode KV (``cluster/routing/reservations.py``): the first decode worker in policy order that has room reserves
   blocks; otherwise the request waits in a bounded queue (429 when full, 503 with no live decode worker).
2. Dispatch the prompt to a prefill worker with the decode worker's KV address and reserved block ids; when that
   decode worker already holds the prompt's first blocks (``reserved.cached_tokens``: its prefix cache, e.g. a chat's
   history it just decoded), only the blocks after them are computed for it and sent. When what it lacks is at most
   ``router.local_prefill_max_tokens``, it gets ``prefill_here`` instead: it computes that part itself, no transfer,
   and its first token comes with its ``tokens`` events (conditional disaggregation).
3. Prefill's ``first_token`` event is streamed to the client at once and forwarded to the decode worker (``start``);
   decode's ``tokens`` events follow until a finish reason. Workers send text (they detokenize, in the engine); the
   router only relays it, through each stream's coalescing buffer (``cluster/routing/streams.py``).
4. Any exit that is not a normal finish (client gone, timeout, worker error) sends ``abort`` to every worker that
   holds state for the request. Every request ends with a finish or an explicit error.
Colocated requests skip 1-3: one worker gets ``generate`` and streams every token.

Log probabilities and the prefix-cache hit travel with the tokens (``FirstToken`` and ``TokenItem`` fields) into the
stream, which hands them out with the tokens they belong to. Each request's placement (its prefill and decode
workers, or its colocated one) is remembered for a while (``placements``), so that a later request can ask for the
same workers (``generate(..., affinity=<earlier request id>)``): the API's n > 1 choices after the first land where
the prompt is already in the prefix cache, so it is computed once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from cluster.config import ClusterConfig
from cluster.routing.admission import Admission
from cluster.routing.dispatch import Dispatcher
from cluster.routing.errors import RequestFailed
from cluster.routing.membership import Membership, WorkerHandle
from cluster.routing.metrics import RouterMetrics
from cluster.routing.policies import Placements, make_policy
from cluster.routing.request_table import MAX_RECORDS, RequestTable, response_timing
from cluster.routing.reservations import DecodeReservations
from cluster.routing.streams import TokenEvent
from engine.request import SamplingParams
from worker.messages import (
    Command,
    ErrorCode,
    ErrorEvent,
    Event,
    FirstToken,
    KvEvents,
    Ping,
    Reserved,
    Start,
    Stats,
    Tokens,
)
from worker.protocol import MAX_FRAME_BYTES, AuthError, Channel, Rejection, RejectionLog, Verifier

logger = logging.getLogger(__name__)

MAX_RETRIES = 2  # re-dispatches of a request whose worker died before its first token
PING_INTERVAL_S = 1.0  # workers that hear nothing from the router for a while free everything they hold


class Router:
    def __init__(
        self, config: ClusterConfig, host: str = "127.0.0.1", index: int = 0, admission: Admission | None = None
    ) -> None:
        """``index``: this router among ``config.router.processes`` router processes (cluster/run/frontend.py); every
        command carries it, so workers send each request's events to the router that owns it. ``admission``: the
        queue bound shared by those processes (default: this process's own)."""
        self.config = config
        self.host = host
        self.index = index
        self.metrics = RouterMetrics(multiprocess=config.router.processes > 1)
        policies = {
            "prefill": make_policy(config.router.prefill_policy, **config.router.kv_aware.model_dump()),
            "decode": make_policy(config.router.decode_policy, **config.router.kv_aware.model_dump()),
            "colocated": make_policy(config.router.decode_policy, **config.router.kv_aware.model_dump()),
        }
        self._ctx = zmq.asyncio.Context()
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.setsockopt(zmq.RCVHWM, 1_000_000)
        self._events.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a larger frame drops its sender unbuffered
        port = self._events.bind_to_random_port(f"tcp://{host}")
        self.event_address = f"tcp://{host}:{port}"
        # outlives a restart of _receive_events, so a replay is refused across it too
        self._event_verifier = Verifier(config.transfer.secret, Channel.EVENTS, self.event_address)
        self._tasks: list[asyncio.Task] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.members = Membership(self._ctx, self.metrics, config.transfer.secret, self._fail_streams_of, index)
        self.reservations = DecodeReservations(
            config,
            policies["decode"],
            self.metrics,
            admission or Admission(config.router.queue_size),
            self._send,
            on_granted=self._granted,
        )
        self.requests = RequestTable(self.metrics, self.members, self._send, self._wake)
        self.streams = self.requests.streams  # by wire id: the requests in flight
        self.last_timing = self.requests.last_timing  # finished requests' timing, for the response
        self.dispatcher = Dispatcher(
            config, policies, self.members, self.reservations, self.metrics, self._send, Placements(MAX_RECORDS)
        )
        self.placements = self.dispatcher.placements  # where recent requests went, for later requests' ``affinity``
        self.scaler = None  # POST /admin/scale: cluster/run/scaling.py's Scaler, or a router process's RemoteScaler
        self._policies = policies
        self._handlers = {
            Stats: self._on_stats,
            Reserved: self.reservations.on_reserved,
            FirstToken: self._on_first_token,
            Tokens: self._on_tokens,
            ErrorEvent: self._on_error,
            KvEvents: self.members.on_kv_events,
        }

    # ---- membership (cluster/routing/membership.py) --------------------------------------------------------------------

    def add_worker(self, name: str, role: str, command_address: str, kv_address: str | None = None) -> None:
        self.members.add(name, role, command_address, kv_address)

    def add_worker_threadsafe(self, name: str, role: str, command_address: str, kv_address: str | None = None) -> None:
        """Register from another thread (the monitor that sees Ray restart a worker; live resizing)."""
        self._call_threadsafe(self.add_worker, name, role, command_address, kv_address)

    def mark_dead(self, name: str, reason: str = "worker died") -> None:
        self.members.mark_dead(name, reason)

    def mark_dead_threadsafe(self, name: str, reason: str) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.mark_dead, name, reason)

    def drain_worker(self, name: str, deadline_s: float) -> None:
        """Live resizing (cluster/run/scaling.py): route nothing new to the worker; it finishes what it holds."""
        self.members.drain(name, deadline_s)

    def remove_worker(self, name: str) -> None:
        """Forget a worker the pool stopped after its drain. A request it still held (it was stopped at the drain
        deadline) gets an explicit error, or a transparent retry if nothing reached its client yet."""
        self._fail_streams_of(name, "worker removed by scale-down")
        self.members.remove(name)
        self._wake()

    def drain_worker_threadsafe(self, name: str, deadline_s: float) -> None:
        self._call_threadsafe(self.drain_worker, name, deadline_s)

    def remove_worker_threadsafe(self, name: str) -> None:
        self._call_threadsafe(self.remove_worker, name)

    def _call_threadsafe(self, function, *args, wait_s: float = 5.0) -> None:
        """Run ``function`` on the router's loop and wait (bounded) until it has: a membership change made from
        another thread is in effect when this returns (the next request sees it)."""
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if self.loop is None or on_loop:
            function(*args)
            return
        done = threading.Event()

        def call() -> None:
            try:
                function(*args)
            finally:
                done.set()

        try:
            self.loop.call_soon_threadsafe(call)
        except RuntimeError:  # the loop is closed: the router is gone, and so is what it would change
            return
        done.wait(wait_s)

    def live(self, role: str) -> list[WorkerHandle]:
        """The workers new requests may go to: alive and not degraded."""
        return self.members.routable(role)

    def _fail_streams_of(self, name: str, reason: str) -> None:
        """A dead worker's requests get an explicit error (or a retry, in generate): never a silent stall. A prefill
        worker's only until their first token: from then on the decode worker holds the KV and needs it no more."""
        self.reservations.on_worker_dead(name)
        for stream in list(self.streams.values()):
            if not stream.finished and (name == stream.decode or name == stream.prefill and not stream.first_token_s):
                stream.fail(RequestFailed(f"{reason} ({name})", "worker_died", 503))

    # ---- event loop --------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._tasks.append(asyncio.create_task(self._supervise("receive_events", self._receive_events)))
        self._tasks.append(asyncio.create_task(self._supervise("watch_heartbeats", self._watch_heartbeats)))

    async def _supervise(self, name: str, body) -> None:
        """Run one of the router's background loops forever: a crash is logged, counted and the loop restarted.

        Without this a crashed task dies silently and the router stops hearing its workers while /health says ok.
        """
        while True:
            try:
                await body()
                raise RuntimeError("returned")  # the loops never end on their own
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("router: background task %s crashed; restarting it", name)
                self.metrics.task_restarts.labels(name).inc()
                await asyncio.sleep(0.05)  # a loop that crashes at once must not spin

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self.members.close()
        self._events.close(0)
        self._ctx.term()

    async def _receive_events(self) -> None:
        """Every event's MAC is checked (worker/protocol.py) before it is unpacked; what fails is dropped and
        counted in ``pdserve_control_rejected_total{reason}``."""
        verifier, rejections = self._event_verifier, RejectionLog("router")
        while True:
            data = await self._events.recv()
            try:
                if self._events.getsockopt(zmq.RCVMORE):  # events are one frame: drop the rest unread
                    while self._events.getsockopt(zmq.RCVMORE):
                        await self._events.recv(copy=False)
                    raise AuthError(Rejection.MULTIPART)
                event = verifier.open(data)
            except AuthError as exc:
                self.metrics.control_rejected.labels(exc.reason.value).inc()
                rejections.note(exc)
                continue
            try:
                self._dispatch(event)  # type: ignore[arg-type]  # an event socket's verifier decodes events
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("router: dropped a bad event: %s", exc)

    async def _watch_heartbeats(self) -> None:
        last_ping = 0.0
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            if now - last_ping >= PING_INTERVAL_S:
                last_ping = now
                for worker in self.members.live():
                    self._send(worker, Ping())
            self.members.expire(now)

    def _dispatch(self, event: Event) -> None:
        """One authenticated event, to its handler by type (every event names its worker)."""
        worker = self.members.heard_from(event.worker, event if isinstance(event, Stats) else None)
        self._handlers[type(event)](event, worker)  # type: ignore[operator]

    def _on_stats(self, stats: Stats, worker: WorkerHandle | None) -> None:
        if worker is not None:
            worker.stats, worker.stats_seen = stats, time.monotonic()
            self.metrics.observe_worker(stats)
        self._wake()

    def _granted(self, wire_rid: str, worker: WorkerHandle) -> None:
        """The stream's decode worker from its reservation's reply on, not from when its dispatch resumes: what the
        worker sends next may come in the same read (a local prefill's first token), and an abort must reach it."""
        stream = self.streams.get(wire_rid)
        if stream is not None:
            stream.decode = worker.name
            worker.inflight += 1  # until the request ends there (``RequestTable._unassign``)

    def _on_first_token(self, event: FirstToken, worker: WorkerHandle | None) -> None:
        stream = self.streams.get(event.rid)
        if stream is None or event.worker != stream.prefill:
            return  # not (or no longer) this worker's request: a stale or lying event
        stream.timing.update(response_timing(event.timing))
        if stream.first_token_s is None and worker is not None:
            # the prefill worker is done with it: its load (what the policies weigh) no longer counts the request
            worker.inflight = max(0, worker.inflight - 1)
        decode = self.members.get(stream.decode)
        if decode is not None:
            self._send(decode, Start(stream.wire_rid, event.token))
        logprobs = None if event.logprobs is None else [event.logprobs]
        self.requests.push(stream, 1, event.text, None, logprobs, event.prompt_logprobs, event.cached_tokens)

    def _on_tokens(self, event: Tokens, worker: WorkerHandle | None) -> None:
        name, streams = event.worker, self.streams
        for item in event.items:
            stream = streams.get(item.rid)
            if stream is None or name != stream.decode:
                continue
            if item.timing is not None:
                stream.timing.update(response_timing(item.timing))
            finish = item.finish_reason
            self.requests.push(
                stream,
                len(item.token_ids),
                item.text,
                None if finish is None else finish.value,
                item.logprobs,
                item.prompt_logprobs,
                item.cached_tokens,
            )

    def _on_error(self, error: ErrorEvent, worker: WorkerHandle | None) -> None:
        if self.reservations.on_error(error):  # the decode worker could not even try to reserve
            return
        stream = self.streams.get(error.rid)
        if stream is not None and error.worker in (stream.prefill, stream.decode):
            status = 400 if error.code is ErrorCode.INVALID_REQUEST else 500
            stream.fail(RequestFailed(error.message, error.code.value, status))

    def _wake(self) -> None:
        self.reservations.wake()

    def _send(self, worker: WorkerHandle, message: Command) -> None:
        self.members.send(worker, message)

    # ---- requests ----------------------------------------------------------------------------------------------

    async def generate(
        self, prompt: list[int], params: SamplingParams, request_id: str | None = None, affinity: str | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Stream a request's text; raises RequestFailed (with its HTTP status) when it cannot be served.

        Each event is everything that arrived since the caller last asked (``Stream.take``): a caller that is slow
        to come back (its client reads slowly) gets one larger event, not a backlog of small ones. ``affinity``: the
        client request id of an earlier request whose workers this one should go to when they are live and routable
        (and, for the decode worker, have room): an n > 1 request's later choices reuse the prompt the first one
        computed. An id the router no longer remembers (or never knew) is no preference."""
        rid = request_id or uuid.uuid4().hex
        stream = self.requests.open(rid, len(prompt))
        deadline = stream.started_s + self.config.router.request_timeout_s
        # one timer per request, not one per wait: the wait below runs once per token
        timer = asyncio.get_running_loop().call_at(
            deadline, stream.fail, RequestFailed("request timed out", "timeout", 504)
        )
        attempt = 0
        try:
            await self.dispatcher.dispatch(stream, prompt, params, deadline, affinity)
            while True:
                event = stream.take()
                if event is None:
                    error = stream.error
                    if error is None:
                        await stream.ready.wait()
                        continue
                    if error.code == "worker_died" and stream.num_output_tokens == 0 and attempt < MAX_RETRIES:
                        attempt += 1  # nothing reached the client yet: dispatch again, transparently
                        self.metrics.errors.labels("retried_after_worker_death").inc()
                        self.requests.redispatch(stream, f"{rid}.retry{attempt}")
                        await self.dispatcher.dispatch(stream, prompt, params, deadline, affinity)
                        continue
                    raise error
                if event.finish_reason is not None:
                    stream.finished = True
                    self.requests.record_finish(stream)
                yield event
                if stream.finished:
                    return
        except RequestFailed as exc:
            self.metrics.errors.labels(exc.code).inc()
            self.metrics.requests.labels("error").inc()
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the client went away, or stopped reading
            if not stream.finished:
                self.metrics.errors.labels("client_disconnected").inc()
                self.metrics.requests.labels("aborted").inc()
            raise
        finally:
            timer.cancel()
            if not stream.finished:
                self.abort(stream.wire_rid)
            self.requests.release(stream)

    def abort(self, wire_rid: str) -> None:
        """Tell every worker that holds state for the request to free it (``RequestTable.abort``)."""
        self.requests.abort(wire_rid)

    def status(self) -> dict:
        return {
            "mode": self.config.mode,
            "model": self.config.served_model_name,
            "inflight": len(self.streams),
            "queue_depth": self.reservations.queue_depth,
            "router": {
                "index": self.index,
                "pid": os.getpid(),
                "processes": self.config.router.processes,
                "queue_depth_all": self.reservations.queue_depth_all,
                "requests_finished": self.metrics.local_value("pdserve_requests_total", outcome="finished"),
            },
            "pools": self.members.pools(),
            "workers": self.members.status(),
        }
