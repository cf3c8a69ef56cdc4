"""What every worker shares: an engine, a command socket, an event socket, and one loop thread that owns both.

``WorkerRuntime(spec, role_class)`` owns one role (``worker/role.py``, the request logic, testable without sockets;
cluster/run/actors.py picks it) and everything around it. Only the loop thread touches the (not thread-safe) engine.
Per turn it drains commands (without blocking while there is work) and lets the role tick; frees orphaned requests
and acts on draining (``RouterBook``, worker/routers.py); sends the prefix cache's net change to every router as
``KvEvents`` (a full snapshot after an undelivered batch and every ``KV_RESYNC_INTERVAL_S``, so a router that dropped
its view on a ``seq`` gap is whole again soon); and refreshes the stats, which a heartbeat thread sends every
``stats_interval_s`` even while a long forward holds the loop (``loop_age_s`` tells slow from stuck). A command that
fails answers with an ``error`` event; a tick that raises fails every request the worker holds.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from engine.block_manager import KvEventBatch
from engine.config import KVPlace
from engine.engine_parts import check_same_weights
from engine.llm_engine import LLMEngine
from transfer.errors import AuthError
from transfer.zap import ZapHandler, connect_curve, plane_keys, serve_curve
from worker.messages import (
    MAX_KV_EVENT_HASHES,
    Command,
    Drain,
    ErrorCode,
    Event,
    Export,
    KvEvents,
    Ping,
    Stats,
    Undrain,
    WorkerCounters,
    command_queue_bound,
    kind,
    max_command_bytes,
)
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
from worker.role import Role
from worker.routers import RouterBook
from worker.spec import WorkerSpec, resolve_spec
from worker.tp_rank import join_group
from worker.tracing import RequestSpans, Tracing

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class RoleSwitch:
    """A role switch asked of the loop thread, and how it ended (``WorkerRuntime.switch_role``)."""

    spec: WorkerSpec
    role_class: type[Role]
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None


DEGRADED_AFTER_FAILURES = 3  # loop failures within DEGRADED_WINDOW_S that make a worker degraded
DEGRADED_WINDOW_S = 30.0  # ... and a degraded worker with no failure for this long is healthy again
KV_RESYNC_INTERVAL_S = 30.0  # a full snapshot of the prefix cache's hashes to every router this often


class WorkerRuntime:
    """One worker: its engine, its role (``role_class.from_spec``), its sockets and its two threads."""

    def __init__(self, spec: WorkerSpec, role_class: type[Role]) -> None:
        """``spec`` as the cluster config built it; ``self.spec`` is resolved here, in the worker's own process."""
        if not spec.runtime.secret:
            raise ValueError(f"worker {spec.name}: no cluster secret (the launcher gives every worker one)")
        if spec.role is not role_class.kind:
            raise ValueError(f"worker {spec.name}: a {spec.role.value} spec given to the {role_class.kind.value} role")
        spec = resolve_spec(spec)
        self.spec = spec
        self.options = options = spec.runtime
        self.name = spec.name
        # made first: close() ends it whatever fails after
        self.tracing = Tracing(options.tracing, self.name) if options.tracing is not None else None
        self.spans = RequestSpans(self.tracing, self.name, spec.role.value) if self.tracing is not None else None
        # rank 0 of a tensor-parallel worker: the other ranks (worker/tp_rank.py) run each step it announces
        self.engine = LLMEngine(spec.engine, join_group(spec, 0))
        try:
            self.engine.warm_up()
        except BaseException:
            self.engine.close()
            if self.tracing is not None:
                self.tracing.close()
            raise
        self._ctx = zmq.Context()
        self._keys = plane_keys(options.secret)
        self._zap = ZapHandler(self._ctx, self._keys, self.name)  # before anything binds
        # bounded by the largest command a router sends and what routers can have in flight here
        max_command = max_command_bytes(self.engine.max_model_len, options.max_body_bytes)
        self._commands = self._socket(zmq.PULL)
        self._commands.setsockopt(zmq.MAXMSGSIZE, frame_bound(max_command))
        self._commands.setsockopt(zmq.RCVHWM, command_queue_bound(spec.engine.max_num_seqs, options.router_queue_size))
        serve_curve(self._commands, self._keys)
        self._zap.watch(self._commands)  # a stranger is dropped in ZeroMQ's handshake (transfer/zap.py)
        port = self._commands.bind_to_random_port(f"tcp://{options.host}")
        self.command_address = with_start_value(f"tcp://{options.host}:{port}")
        self._verifier = Verifier(options.secret, Channel.COMMANDS, self.command_address, max_command)
        self.epoch = 0  # role switches made; each takes a new command address on the same socket
        self._switch: RoleSwitch | None = None  # asked of the loop thread (``switch_role``)
        self._switch_lock = threading.Lock()
        self._rejections = RejectionLog(self.name)
        self._routers = options.router_addresses
        if not self._routers:
            raise ValueError(f"worker {spec.name}: no router address")
        self._events = self._event_sockets()  # the loop thread's
        self._book = RouterBook(self.name, len(self._routers), options.orphan_timeout_s)
        self._stop = threading.Event()
        self._dead = threading.Event()  # kill(): nothing leaves this worker any more
        self._thread: threading.Thread | None = None
        self._heartbeat: threading.Thread | None = None
        self._loop_seen = time.monotonic()
        self._snapshot: Stats | None = None
        self._failures_s: list[float] = []  # when the loop last failed (within DEGRADED_WINDOW_S)
        self._loop_problem = ""  # why the loop made this worker degraded; "" while it is healthy
        self._kv_seq = 0  # KvEvents messages sent by this incarnation (each router checks for gaps)
        self._next_kv_resync_s = time.monotonic() + KV_RESYNC_INTERVAL_S
        try:
            self.role = role_class.from_spec(spec, self.engine, self.emit)
        except BaseException:
            self.close()
            raise
        self.role.spans = self.spans

    @property
    def counters(self) -> WorkerCounters:
        """The heartbeat's ``counters``: the role's, which this runtime adds to."""
        return self.role.counters

    def _event_sockets(self) -> list[tuple[zmq.Socket, Signer]]:
        """One PUSH socket and signer per router (index = the router's index), for one thread's use."""
        sockets = []
        for address in self._routers:
            sock = self._socket(zmq.PUSH)
            connect_curve(sock, self._keys)
            sock.connect(zmq_endpoint(address))
            sockets.append((sock, Signer(self.options.secret, Channel.EVENTS, address)))
        return sockets

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.options.hwm)
        sock.setsockopt(zmq.RCVHWM, self.options.hwm)
        sock.setsockopt(zmq.SNDTIMEO, self.options.send_timeout_ms)
        sock.setsockopt(zmq.RCVTIMEO, self.options.send_timeout_ms)
        return sock

    # ---- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._snapshot = self.stats()
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-loop", daemon=True)
        self._heartbeat = threading.Thread(target=self._beat, name=f"{self.name}-heartbeat", daemon=True)
        self._thread.start()
        self._heartbeat.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        for thread in (self._thread, self._heartbeat):
            if thread is not None:
                thread.join(timeout_s)
        self.close()

    def kill(self, timeout_s: float = 10.0) -> None:
        """Die as a SIGKILLed process does, as everyone else sees it (in-process pools, chaos bench): nothing leaves
        this worker any more, the threads stop at their next turn and the sockets close. Nothing is failed or freed:
        the router learns of the death from the missing heartbeats, peers from their own timeouts.
        """
        self._dead.set()
        self._stop.set()
        for thread in (self._thread, self._heartbeat):
            if thread is not None:
                thread.join(timeout_s)
        if any(t is not None and t.is_alive() for t in (self._thread, self._heartbeat)):
            logger.error("%s: killed, but a thread is still inside a step; its sockets stay open", self.name)
            return
        self.close()

    def close(self) -> None:
        role = getattr(self, "role", None)  # absent when the role's own constructor failed
        if role is not None:
            role.close()
        if self.spans is not None:
            self.spans.close()
        if self.tracing is not None:
            self.tracing.close()
        self.engine.close()
        self._commands.close(0)
        for sock, _ in self._events:
            sock.close(0)
        self._zap.close()
        self._ctx.term()

    def info(self) -> dict:
        return {
            "name": self.name,
            "role": self.role.kind.value,
            "epoch": self.epoch,
            "command_address": self.command_address,
            "degraded": self.degraded,
            "draining": self._book.draining,
            "drained": self._book.drained,
            **self.role.info(),
        }

    def snapshot(self) -> dict:
        """The last stats, as plain data (Ray actor methods return it)."""
        return msgspec.to_builtins(self._snapshot)

    # ---- switching role ----------------------------------------------------------------------------------------

    def switch_role(self, spec: WorkerSpec, role_class: type[Role], timeout_s: float) -> dict:
        """Become a worker of another role with the same weights, once drained: the loop thread rebuilds the engine
        for ``spec`` (``LLMEngine.reconfigured``: a KV cache of the new pool's size) and the role around it, and takes
        a new command address on the same socket, so a command sealed for the old role is refused (``bad_mac``),
        never applied. Returns ``info()`` after it. ValueError, with nothing changed, while the worker holds a
        request or when the weights do not serve ``spec``; TimeoutError if the loop did not take it up in
        ``timeout_s``, RuntimeError if the worker stopped or was killed first. A failure after the old role closed
        leaves the worker degraded (a pool restarts it)."""
        if spec.name != self.name or spec.role is not role_class.kind:
            raise ValueError(f"worker {self.name}: a {spec.role.value} spec for {spec.name} given to switch to")
        switch = RoleSwitch(spec, role_class)
        with self._switch_lock:
            if self._switch is not None:
                raise ValueError(f"worker {self.name}: a role switch is already under way")
            self._switch = switch
        deadline = time.monotonic() + timeout_s
        while not switch.done.wait(0.05):
            gone = self._stop.is_set()  # stopped or killed: its loop takes nothing up any more
            if gone or time.monotonic() > deadline:
                with self._switch_lock:
                    if self._switch is switch:  # not taken up: withdrawn
                        self._switch = None
                        why = "stopped" if gone else f"did not take up the switch in {timeout_s:.0f} s"
                        raise (RuntimeError if gone else TimeoutError)(f"worker {self.name}: {why}")
                switch.done.wait()  # under way: it ends (a rebuild is bounded by the model's size)
        if switch.error is not None:
            raise switch.error
        return self.info()

    def _take_switch(self) -> None:
        """Between turns: the switch asked for, if any."""
        with self._switch_lock:
            switch, self._switch = self._switch, None
        if switch is None:
            return
        try:
            self._rebuild(switch.spec, switch.role_class)
        except BaseException as exc:  # noqa: BLE001 - the caller gets it
            switch.error = exc if isinstance(exc, Exception) else RuntimeError(str(exc))
        finally:
            switch.done.set()

    def _rebuild(self, spec: WorkerSpec, role_class: type[Role]) -> None:
        if self.role.holds_requests():
            raise ValueError(f"worker {self.name} still holds requests: it switches role only once drained")
        spec = resolve_spec(spec)
        check_same_weights(self.engine.config, spec.engine)  # before anything closes
        old_role, counters = self.role, self.role.counters
        old_role.close()
        try:
            engine = self.engine.reconfigured(spec.engine)
            engine.warm_up()
            role = role_class.from_spec(spec, engine, self.emit)
        except BaseException as exc:
            self._loop_problem = f"role switch to {spec.role.value} failed: {type(exc).__name__}: {exc}"[:300]
            logger.exception("%s: %s", self.name, self._loop_problem)
            raise
        role.counters = counters
        counters.role_switches += 1
        if self.spans is not None:
            assert self.tracing is not None
            self.spans.close()
            self.spans = RequestSpans(self.tracing, self.name, spec.role.value)
        role.spans = self.spans
        self.engine, self.role, self.spec = engine, role, spec
        self.epoch += 1
        # a new address on the same socket: the routers' signers for the old one no longer open here
        max_command = max_command_bytes(engine.max_model_len, self.options.max_body_bytes)
        self.command_address = with_start_value(zmq_endpoint(self.command_address))
        self._verifier = Verifier(self.options.secret, Channel.COMMANDS, self.command_address, max_command)
        self._book = RouterBook(self.name, len(self._routers), self.options.orphan_timeout_s)
        self._kv_seq = 0  # the new address's KV events count from 0, a snapshot first
        engine.resync_kv_events()
        logger.info(
            "%s: now a %s worker (epoch %d) at %s", self.name, spec.role.value, self.epoch, self.command_address
        )

    # ---- the loop ----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._switch is not None:
                self._take_switch()
            # a router is silent only up to the last look at its socket: a ping that came during a long step is
            # unread, not missing
            looked_s = time.monotonic()
            try:
                # no spin while only transfers are pending: it would take a core from the forward on a small box
                wait_ms = 0 if self.engine.has_unfinished() else 1 if self.role.has_work() else 5
                self._drain_commands(timeout_ms=wait_ms)
                looked_s = time.monotonic()
                self.role.tick()
                self.engine.keep_alive()  # idle rank 0 of a tensor-parallel worker: its ranks must hear from it
            except Exception as exc:  # the loop must survive anything one step throws
                logger.exception("%s: step failed; failing the requests it held", self.name)
                self._note_failure(exc)
                self.role.fail_all("worker step failed")
            now = time.monotonic()
            for rid in self._book.orphans(looked_s, self.engine.requests):
                self.role.abort(rid)
                self.role.emit_error(rid, "router unreachable", ErrorCode.WORKER_ERROR)
            self._book.prune(now, self.engine.requests)
            if self.spans is not None:
                self.spans.prune(self.engine.requests)
            self._publish_kv_events(now)
            if self._book.draining:
                self._book.drain_turn(now, self.role.holds_requests, self.role.fail_all)
            self._loop_seen = now
            self._snapshot = self.stats()  # a few len() calls: cheap enough to keep the heartbeat's view current

    # ---- health ------------------------------------------------------------------------------------------------

    def _note_failure(self, exc: Exception) -> None:
        """Count a loop failure; several close together make the worker degraded (the engine's step already fails
        only the requests a fault belongs to, so a loop that still fails is broken, not unlucky)."""
        now = time.monotonic()
        self.counters.step_failures += 1
        self._failures_s = [t for t in self._failures_s if now - t < DEGRADED_WINDOW_S] + [now]
        if len(self._failures_s) >= DEGRADED_AFTER_FAILURES:
            if not self._loop_problem:
                logger.error(
                    "%s: degraded: the loop failed %d times in %.0f s",
                    self.name,
                    len(self._failures_s),
                    DEGRADED_WINDOW_S,
                )
            self._loop_problem = (
                f"loop failed {len(self._failures_s)} times in {DEGRADED_WINDOW_S:.0f} s; last: "
                f"{type(exc).__name__}: {exc}"[:300]
            )

    @property
    def degraded(self) -> str:
        """Why this worker should get no new work ("" when healthy): its loop keeps failing, or the role's own check
        (a dead transfer I/O thread). The router stops routing to it; under Ray the pool restarts it."""
        if self._loop_problem and self._failures_s and time.monotonic() - self._failures_s[-1] > DEGRADED_WINDOW_S:
            self._loop_problem = ""
        return self._loop_problem or self.engine.health_problem or self.role.health_problem()

    def _beat(self) -> None:
        """Every router hears every heartbeat (each router process keeps its own view of the pool)."""
        sockets = self._event_sockets()
        try:
            while not self._stop.wait(self.options.stats_interval_s):
                snapshot = self._snapshot  # built by the loop thread, never changed after: a copy with the age
                assert snapshot is not None  # start() builds the first before this thread starts
                beat = msgspec.structs.replace(snapshot, loop_age_s=round(time.monotonic() - self._loop_seen, 3))
                for sock, signer in sockets:
                    try:
                        sock.send(signer.seal(beat), zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # that router is gone or slow; the next beat tries again
        finally:
            for sock, _ in sockets:
                sock.close(0)

    def _drain_commands(self, timeout_ms: int, limit: int = 256) -> None:
        if not self._commands.poll(timeout_ms):
            return
        for _ in range(limit):
            try:
                data = self._commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if self._commands.getsockopt(zmq.RCVMORE):  # commands are one frame: drop the rest unread
                    while self._commands.getsockopt(zmq.RCVMORE):
                        self._commands.recv(zmq.NOBLOCK, copy=False)
                    raise rejected(Rejection.MULTIPART)
                # the MAC is checked before anything is decoded; what is left is a typed command
                command: Command = self._verifier.open(data)  # type: ignore[assignment]
            except AuthError as exc:
                self.counters.control_rejected += 1
                self._rejections.note(exc)
                continue
            now = time.monotonic()
            router = command.router
            if router >= len(self._routers):
                self.counters.control_rejected += 1  # sealed with our secret, so a bug, not an attack
                self._rejections.note(rejected(Rejection.MALFORMED, f"router index {router!r}"))
                continue
            self._book.heard(router, now)
            if isinstance(command, Ping):
                continue
            if isinstance(command, Drain):
                self._book.begin_drain(router, command.deadline_s, command.fail_at_deadline)
                continue
            if isinstance(command, Undrain):
                self._book.end_drain()
                continue
            rid = command.rid
            self._book.claim(rid, router, now)
            if isinstance(command, Export):  # its transfer is named by the target's id: its news goes there too
                self._book.claim(command.target_rid, router, now)
            # how long the command sat in the socket while a step ran (same-host clocks; 0 if unknown)
            waited = 0.0 if command.sent_at is None else max(0.0, time.time() - command.sent_at)
            arrival_s = time.monotonic() - waited
            if self.spans is not None:
                self.spans.on_command(command)
            self.role.take(command, arrival_s)

    def emit(self, event: Event) -> None:
        """Send an event to the router that owns its request; a ``tokens`` message goes out split per router."""
        if self._dead.is_set():
            return
        if self.spans is not None:
            self.spans.on_event(event)
        for index, part in self._book.route(event):
            self._send_event(index, part)

    def _publish_kv_events(self, now: float) -> None:
        """Send the prefix cache's changes since the last turn to every router (nothing when nothing changed), and
        those of the KV tiers below it, one message per tier."""
        if now >= self._next_kv_resync_s:
            self._next_kv_resync_s = now + KV_RESYNC_INTERVAL_S
            self.engine.resync_kv_events()
        batches = self.engine.drain_kv_events()
        if not batches or self._dead.is_set():
            return
        if not all([self._send_kv_batch(tier, batch) for tier, batch in batches]):
            self.engine.resync_kv_events()  # that router's view would drift: the next batch is a snapshot for all

    def _send_kv_batch(self, tier: KVPlace, batch: KvEventBatch) -> bool:
        """One tier's batch to every router, split at ``MAX_KV_EVENT_HASHES``; False if some router missed it."""
        changes = [(h, True) for h in batch.stored] + [(h, False) for h in batch.removed]
        delivered = True
        for start in range(0, max(1, len(changes)), MAX_KV_EVENT_HASHES):  # a reset with nothing held is one message
            part = changes[start : start + MAX_KV_EVENT_HASHES]
            event = KvEvents(
                worker=self.name,
                address=self.command_address,
                seq=self._kv_seq,
                stored=[h for h, stored in part if stored],
                removed=[h for h, stored in part if not stored],
                reset=batch.reset and start == 0,
                tier=tier,
            )
            self._kv_seq += 1
            for sock, signer in self._events:
                try:
                    sock.send(signer.seal(event), zmq.NOBLOCK)
                except zmq.ZMQError:  # full (Again) or closing: never the loop's end
                    delivered = False
        return delivered

    def _send_event(self, index: int, event: Event) -> None:
        sock, signer = self._events[index]
        try:
            sock.send(signer.seal(event))
        except zmq.Again:
            logger.error("%s: router %d unreachable; dropped a %s event", self.name, index, kind(event))

    def stats(self) -> Stats:
        """A fresh heartbeat (never changed once built: the heartbeat thread sends it while the loop goes on)."""
        return Stats(
            worker=self.name,
            role=self.role.kind.value,
            address=self.command_address,
            load=self.role.load(),
            counters=msgspec.structs.replace(self.role.totals(), handshake_refused=self._zap.refused),
            degraded=self.degraded,
            draining=self._book.draining,
            kv_paths=self.role.kv_paths(),
            epoch=self.epoch,
        )
