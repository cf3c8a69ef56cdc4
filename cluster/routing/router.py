"""The live router: the ``RouterCore`` (cluster/routing/core.py) on the HTTP server's event loop, with its sockets.

It adds a sealed PUSH socket per worker for commands (``worker/protocol.py``), one PULL socket for all events (each
MAC checked before it is read), pings and heartbeat expiry. Every call into the core is followed by ``_flush``: its
commands go out, its updated flows wake their responses. ``generate`` is one request as the API streams it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

import zmq
import zmq.asyncio

from cluster.config import ClusterConfig
from cluster.routing.admission import Admission
from cluster.routing.core import RouterCore
from cluster.routing.flow import Flow, TokenEvent
from cluster.routing.membership import WorkerHandle
from cluster.routing.metrics import RouterMetrics
from engine.request import SamplingParams
from transfer.errors import AuthError
from transfer.zap import ZapHandler, connect_curve, plane_keys, serve_curve
from worker.messages import MAX_MESSAGE_BYTES, Command, Event, Ping
from worker.protocol import (
    Channel,
    Rejection,
    RejectionLog,
    Signer,
    Verifier,
    frame_bound,
    rejected,
    with_start_value,
    zmq_endpoint,
)
from worker.tracing import REQUEST_SPAN, Tracing, epoch_ns, mark_error, timing_attributes, traceparent_of

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 1.0  # workers that hear nothing from the router for a while free everything they hold
TICK_S = 0.1  # deadlines and heartbeat expiry are checked this often
# events queued per worker connection while this router is busy (its RCVHWM): a step's tokens, a heartbeat and a
# prefix-cache batch per loop turn, a fast GPU worker's minute of them; past it the worker's own queue takes the rest
EVENT_QUEUE_PER_WORKER = 20_000


class PoolScaler(Protocol):
    """What resizes the pools for POST /admin/scale and switches roles for POST /admin/role: cluster/run/scaling.py's
    Scaler, or a router process's RemoteScaler (the values as the client sent them; bad ones raise ScaleError)."""

    async def scale_async(self, pool: object, replicas: object, drain_timeout_s: object = None) -> dict: ...

    async def switch_role_async(
        self, worker: object, to: object, drain_timeout_s: object = None, wait: object = False
    ) -> dict: ...


class Router:
    def __init__(
        self,
        config: ClusterConfig,
        host: str = "127.0.0.1",
        index: int = 0,
        admission: Admission | None = None,
        max_event_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        """``index``: this router among ``config.router.processes``; every command carries it, so workers send each
        request's events to the router that owns it. ``admission``: the queue bound shared by those processes.
        ``max_event_bytes``: the largest event a worker of the config sends (``ClusterConfig.max_event_bytes``), the
        event socket's bound."""
        if not config.transfer.secret:
            raise ValueError("the router needs the cluster secret (transfer.secret; start_serving makes one)")
        self.config, self.host, self.index = config, host, index
        self.metrics = RouterMetrics(multiprocess=config.router.processes > 1)
        self.core = RouterCore(config, self.metrics, admission)
        self.members = self.core.members
        self.scaler: PoolScaler | None = None  # POST /admin/scale
        tracing = config.observability.tracing_options()
        self.tracing = Tracing(tracing, f"router-{index}") if tracing is not None else None
        self._ctx = zmq.asyncio.Context()
        self._keys = plane_keys(config.transfer.secret)
        # before anything binds; a peer without the cluster's keys is dropped in ZeroMQ's handshake (transfer/zap.py)
        self._zap = ZapHandler(self._ctx, self._keys, f"router-{index}", self._count_refused)
        self._events = self._socket(zmq.PULL)
        self._events.setsockopt(zmq.MAXMSGSIZE, frame_bound(max_event_bytes))  # a larger frame: its sender dropped
        self._events.setsockopt(zmq.RCVHWM, EVENT_QUEUE_PER_WORKER)
        serve_curve(self._events, self._keys)
        self._zap.watch(self._events)
        port = self._events.bind_to_random_port(f"tcp://{host}")
        self.event_address = with_start_value(f"tcp://{host}:{port}")
        # outlives a restart of _receive_events, so a replay is refused across it too
        self._event_verifier = Verifier(config.transfer.secret, Channel.EVENTS, self.event_address, max_event_bytes)
        self._links: dict[str, tuple[zmq.asyncio.Socket, Signer]] = {}  # per worker: its command socket and signer
        self._tasks: list[asyncio.Task] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def flows(self) -> dict[str, Flow]:
        """The requests in flight, by wire id."""
        return self.core.flows

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def _count_refused(self, reason: str) -> None:  # the ZAP thread's; prometheus counters are thread-safe
        self.metrics.control_rejected.labels(Rejection.HANDSHAKE.value).inc()

    # ---- membership ----------------------------------------------------------------------------------------------

    def add_worker(
        self,
        name: str,
        role: str,
        command_address: str,
        kv_address: str | None = None,
        switch_result: str | None = None,
    ) -> None:
        """Register a worker (again: restarted, or in its new role after a switch, ``switch_result``)."""
        old = self._links.pop(name, None)
        if old is not None:
            old[0].close(0)
        sock = self._socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.SNDTIMEO, 1000)
        connect_curve(sock, self._keys)
        sock.connect(zmq_endpoint(command_address))
        self._links[name] = (sock, Signer(self.config.transfer.secret, Channel.COMMANDS, command_address))
        self._run(self.core.add_worker, name, role, command_address, kv_address, time.monotonic(), switch_result)

    def mark_dead(self, name: str, reason: str = "worker died") -> None:
        self._run(self.core.mark_dead, name, reason, time.monotonic())

    def drain_worker(self, name: str, deadline_s: float, switch_to: str | None = None) -> None:
        self._run(self.core.drain, name, deadline_s, time.monotonic(), switch_to)

    def switch_phase(self, name: str, phase: str) -> None:
        self._run(self.core.switch_phase, name, phase, time.monotonic())

    def migrate(self, request_id: str | None, worker: str | None, to: str | None) -> dict[str, str]:
        """Move a request (by the client's id) or every decoding request of a decode worker that this router process
        holds, to ``to`` or where the policy says: request id -> "moving" or why not."""
        core, now = self.core, time.monotonic()
        flows = [
            flow
            for flow in dict.fromkeys(core.flows.values())
            if flow.rid == request_id or (worker is not None and flow.decode == worker)
        ]
        results = {flow.rid: core.migrate(flow, now, to) or "moving" for flow in flows}
        self._flush()
        return results

    def remove_worker(self, name: str) -> None:
        self._run(self.core.remove_worker, name, time.monotonic())
        link = self._links.pop(name, None)
        if link is not None:
            link[0].close(0)

    def add_worker_threadsafe(
        self,
        name: str,
        role: str,
        command_address: str,
        kv_address: str | None = None,
        switch_result: str | None = None,
    ) -> None:
        self._call_threadsafe(self.add_worker, name, role, command_address, kv_address, switch_result)

    def mark_dead_threadsafe(self, name: str, reason: str) -> None:
        self._call_threadsafe(self.mark_dead, name, reason, wait_s=0.0)

    def drain_worker_threadsafe(self, name: str, deadline_s: float, switch_to: str | None = None) -> None:
        self._call_threadsafe(self.drain_worker, name, deadline_s, switch_to)

    def switch_phase_threadsafe(self, name: str, phase: str) -> None:
        self._call_threadsafe(self.switch_phase, name, phase)

    def remove_worker_threadsafe(self, name: str) -> None:
        self._call_threadsafe(self.remove_worker, name)

    def _call_threadsafe(self, function: Callable, *args, wait_s: float = 5.0) -> None:
        """Run ``function`` on the router's loop and wait (bounded), so the change is in effect on return."""
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
        return self.members.routable(role)

    # ---- the core's output ---------------------------------------------------------------------------------------

    def _run(self, function: Callable, *args) -> None:
        function(*args)
        self._flush()

    def _flush(self) -> None:
        core = self.core
        while core.outbox:
            name, command = core.outbox.popleft()
            if not self._send(name, command):
                core.mark_dead(name, "command queue full", time.monotonic())
        for flow in core.take_updated():
            if flow.waiter is not None:
                flow.waiter.set()

    def _send(self, name: str, command: Command) -> bool:
        """Seal and send a command; False when its queue is full."""
        link = self._links.get(name)
        if link is None:
            return True  # removed meanwhile: nothing to tell it
        sock, signer = link
        command.router, command.sent_at = self.index, time.time()
        rid = getattr(command, "rid", None)
        if rid is not None and (flow := self.core.flows.get(rid)) is not None:
            command.trace = flow.trace
        try:
            sock.send(signer.seal(command), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    # ---- event loop ----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._tasks.append(asyncio.create_task(self._supervise("receive_events", self._receive_events)))
        self._tasks.append(asyncio.create_task(self._supervise("watch_heartbeats", self._watch_heartbeats)))

    async def _supervise(self, name: str, body) -> None:
        """Run a background loop forever, restarting it after a crash (a dead task would stop the router hearing
        its workers while /health says ok)."""
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
        for sock, _ in self._links.values():
            sock.close(0)
        self._events.close(0)
        await asyncio.to_thread(self._zap.close)  # its socket is on this context: closed before term
        self._ctx.term()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.close)  # the last spans' export: off the loop

    async def _receive_events(self) -> None:
        """Events failing the MAC check are dropped unread, counted in ``pdserve_control_rejected_total{reason}``."""
        verifier, rejections = self._event_verifier, RejectionLog("router")
        while True:
            data = await self._events.recv()
            try:
                if self._events.getsockopt(zmq.RCVMORE):  # events are one frame: drop the rest unread
                    while self._events.getsockopt(zmq.RCVMORE):
                        await self._events.recv(copy=False)
                    raise rejected(Rejection.MULTIPART)
                event = verifier.open(data)
            except AuthError as exc:
                assert exc.reason is not None  # Verifier.open names why it dropped a frame
                self.metrics.control_rejected.labels(exc.reason.value).inc()
                rejections.note(exc)
                continue
            try:
                self.on_event(event)  # type: ignore[arg-type]  # an event socket's verifier decodes events
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("router: dropped a bad event: %s", exc)

    def on_event(self, event: Event) -> None:
        self._run(self.core.on_event, event, time.monotonic())

    async def _watch_heartbeats(self) -> None:
        last_ping = 0.0
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            if now - last_ping >= PING_INTERVAL_S:
                last_ping = now
                for worker in self.members.live():
                    self._send(worker.name, Ping())
            for name, reason in self.members.expired(now):
                self.core.mark_dead(name, reason, now)
            self._run(self.core.on_tick, now)

    # ---- requests ------------------------------------------------------------------------------------------------

    async def generate(
        self, prompt: list[int], params: SamplingParams, request_id: str | None = None, affinity: str | None = None
    ) -> AsyncGenerator[TokenEvent, None]:
        """Stream a request's text; raises RequestFailed (with its HTTP status) when it cannot be served.

        Each event is everything that arrived since the last: a slow reader gets one larger event, not a backlog.
        ``affinity``: an earlier request's client id whose workers this one prefers (unknown ids are ignored)."""
        flow = self.core.submit(request_id or uuid.uuid4().hex, prompt, params, time.monotonic(), affinity)
        flow.waiter = ready = asyncio.Event()
        span = None
        if self.tracing is not None:
            span = self.tracing.start(
                "pdserve.route",
                REQUEST_SPAN.get(),
                {
                    "pdserve.request.id": flow.rid,
                    "pdserve.prompt_tokens": len(prompt),
                    "pdserve.max_tokens": params.max_tokens,
                    "pdserve.mode": self.config.mode,
                },
                start_ns=epoch_ns(flow.started_s),
            )
            flow.trace = traceparent_of(span)
        self._flush()
        try:
            while True:
                event = flow.take()
                if event is None:
                    if flow.error is not None:
                        raise flow.error
                    ready.clear()  # nothing can arrive between take() and here: no await in between
                    await ready.wait()
                    continue
                yield event
                if flow.finished:
                    return
        finally:
            self._run(self.core.release, flow, time.monotonic())
            if span is not None:
                self._end_span(span, flow)

    def _end_span(self, span, flow: Flow) -> None:
        """The route span's figures, at the request's end: its workers, prefix hit, stages, and how it ended."""
        timing = flow.timing
        if timing.router_queue_s is not None:
            span.add_event("dispatched", timestamp=epoch_ns(flow.started_s + timing.router_queue_s))
        if flow.first_token_s is not None:
            span.add_event("first_token", timestamp=epoch_ns(flow.first_token_s))
        attributes = {
            "pdserve.status": flow.status.value,
            "pdserve.output_tokens": flow.num_output_tokens,
            "pdserve.retries": flow.retries,
            "pdserve.migrations": flow.migrations,
            **timing_attributes(timing),
        }
        for name, worker in (("prefill", flow.prefill), ("decode", flow.decode)):
            if worker is not None:
                attributes[f"pdserve.worker.{name}"] = worker
        if timing.decode_cached_tokens is not None:
            attributes["pdserve.prefix_hit_tokens"] = timing.decode_cached_tokens
        span.set_attributes(attributes)
        if flow.error is not None:
            mark_error(span, flow.error.code, str(flow.error))
        elif not flow.finished:
            span.set_attribute("pdserve.cancelled", True)  # the client left before its finish
        span.end()

    def status(self) -> dict:
        core = self.core
        return {
            "mode": self.config.mode,
            "model": self.config.served_model_name,
            "inflight": len(core.flows),
            "queue_depth": core.queue_depth,
            "router": {
                "index": self.index,
                "pid": os.getpid(),
                "processes": self.config.router.processes,
                "queue_depth_all": core.admission.total,
                "requests_finished": self.metrics.local_value("pdserve_requests_total", outcome="finished"),
            },
            "pools": self.members.pools(),
            "workers": self.members.status(time.monotonic()),
        }
