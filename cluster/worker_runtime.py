"""What every worker shares: an engine, a command socket, an event socket, and one loop thread that owns both.

The engine is not thread-safe and need not be: only the loop thread touches it. The loop drains commands (without
blocking while there is work), lets the role do one tick (step the engine, poll transfers) and refreshes a stats
snapshot. A separate heartbeat thread, with its own socket, sends that snapshot to the router
every ``stats_interval_s`` even while a long forward holds the loop (a 4k-token prefill on a CPU takes seconds), with
``loop_age_s`` saying how long ago the loop last came round, so the router can tell slow from stuck. Ray actor
methods only read ``snapshot()``.

A command that fails answers with an ``error`` event for its request and the loop goes on; an engine step that
raises fails every request the worker holds (each gets an error event, each frees its blocks) rather than leaving
them hanging.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq

from cluster.protocol import (MAX_FRAME_BYTES, AuthError, Channel, ProtocolError, Rejection, RejectionLog, Signer,
                              Verifier)
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

DEGRADED_AFTER_FAILURES = 3  # loop failures within DEGRADED_WINDOW_S that make a worker degraded
DEGRADED_WINDOW_S = 30.0  # ... and a degraded worker with no failure for this long is healthy again


@dataclass(slots=True)
class WorkerOptions:
    name: str
    role: str  # prefill | decode | colocated
    engine: EngineConfig
    router_address: str  # the router's event socket
    host: str = "127.0.0.1"  # where this worker binds its sockets
    stats_interval_s: float = 0.2
    send_timeout_ms: int = 2000
    hwm: int = 100_000
    secret: str | None = None  # the cluster secret (required): commands not sealed with it are dropped and counted
    router_timeout_s: float = 10.0  # no word from the router this long: free everything (it restarted or died)


class WorkerRuntime:
    role = "worker"

    def __init__(self, options: WorkerOptions) -> None:
        if not options.secret:
            raise ValueError(f"worker {options.name}: no cluster secret (the launcher gives every worker one)")
        self.options = options
        self.name = options.name
        self.engine = LLMEngine(options.engine)
        self.engine.warm_up()
        self._ctx = zmq.Context()
        self._commands = self._socket(zmq.PULL)
        port = self._commands.bind_to_random_port(f"tcp://{options.host}")
        self.command_address = f"tcp://{options.host}:{port}"
        self._verifier = Verifier(options.secret, Channel.COMMANDS, self.command_address)
        self._signer = Signer(options.secret, Channel.EVENTS, options.router_address)  # for _events (loop thread)
        self._rejections = RejectionLog(self.name)
        self._events = self._socket(zmq.PUSH)
        self._events.connect(options.router_address)
        self._stop = threading.Event()
        self._dead = threading.Event()  # kill(): nothing leaves this worker any more
        self._thread: threading.Thread | None = None
        self._heartbeat: threading.Thread | None = None
        self._loop_seen = time.monotonic()
        self._snapshot: dict = {}
        self._last_router_s = time.monotonic()
        self.counters: dict[str, float] = {"errors": 0, "aborts": 0, "control_rejected": 0, "step_failures": 0}
        self._failures_s: list[float] = []  # when the loop last failed (within DEGRADED_WINDOW_S)
        self._loop_problem = ""  # why the loop made this worker degraded; "" while it is healthy

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.options.hwm)
        sock.setsockopt(zmq.RCVHWM, self.options.hwm)
        sock.setsockopt(zmq.SNDTIMEO, self.options.send_timeout_ms)
        sock.setsockopt(zmq.RCVTIMEO, self.options.send_timeout_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a larger frame drops its sender before it is buffered
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
        """Die the way a process killed with SIGKILL does, as everyone else sees it (in-process pools, chaos bench).

        From now on nothing leaves this worker: no event, no error, no reservation reply, no heartbeat. The loop and
        the heartbeat stop at their next turn and every socket closes. Nothing is failed or freed on the way out: the
        router learns of the death only from the missing heartbeats, and peers only from their own timeouts.
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
        self._commands.close(0)
        self._events.close(0)
        self._ctx.term()

    def info(self) -> dict:
        return {"name": self.name, "role": self.role, "command_address": self.command_address,
                "degraded": self.degraded}

    def snapshot(self) -> dict:
        return dict(self._snapshot)

    # ---- the loop ----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                # no wait while the engine has a step to run; a short one while only transfers are pending
                # (spinning there would take a core from the forward on a small box); a longer one when idle
                wait_ms = 0 if self.engine.has_unfinished() else 1 if self.has_work() else 5
                self._drain_commands(timeout_ms=wait_ms)
                self.tick()
            except Exception as exc:  # the loop must survive anything one step throws
                logger.exception("%s: step failed; failing the requests it held", self.name)
                self._note_failure(exc)
                self.fail_all("worker step failed")
            now = time.monotonic()
            if now - self._last_router_s > self.options.router_timeout_s:
                self._last_router_s = now
                if self.engine.requests:
                    logger.warning("%s: no word from the router for %.0f s; freeing every request", self.name,
                                   self.options.router_timeout_s)
                    self.fail_all("router unreachable")
            self._loop_seen = now
            self._snapshot = self.stats()  # a few len() calls: cheap enough to keep the heartbeat's view current

    def _note_failure(self, exc: Exception) -> None:
        """Count a loop failure; several close together make the worker degraded (the engine's own step already
        fails only the requests a fault belongs to, so a loop that still fails is broken, not unlucky)."""
        now = time.monotonic()
        self.counters["step_failures"] += 1
        self._failures_s = [t for t in self._failures_s if now - t < DEGRADED_WINDOW_S] + [now]
        if len(self._failures_s) >= DEGRADED_AFTER_FAILURES:
            if not self._loop_problem:
                logger.error("%s: degraded: the loop failed %d times in %.0f s", self.name, len(self._failures_s),
                             DEGRADED_WINDOW_S)
            self._loop_problem = (f"loop failed {len(self._failures_s)} times in {DEGRADED_WINDOW_S:.0f} s; last: "
                                  f"{type(exc).__name__}: {exc}"[:300])

    @property
    def degraded(self) -> str:
        """Why this worker should get no new work ("" when healthy): its loop keeps failing, or a role's own check
        (a dead transfer I/O thread) fails. The router stops routing to it; under Ray the pool restarts it."""
        if self._loop_problem and self._failures_s and time.monotonic() - self._failures_s[-1] > DEGRADED_WINDOW_S:
            self._loop_problem = ""  # quiet for a whole window: healthy again
        return self._loop_problem or self.health_problem()

    def health_problem(self) -> str:
        """A role's own reason to be degraded ("" when none)."""
        return ""

    def _beat(self) -> None:
        sock = self._socket(zmq.PUSH)
        sock.connect(self.options.router_address)
        signer = Signer(self.options.secret, Channel.EVENTS, self.options.router_address)  # this socket's own
        try:
            while not self._stop.wait(self.options.stats_interval_s):
                beat = {"type": "stats", **self._snapshot, "loop_age_s": round(time.monotonic() - self._loop_seen, 3)}
                try:
                    sock.send(signer.seal(beat), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the router is gone or slow; the next beat tries again
        finally:
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
                    raise AuthError(Rejection.MULTIPART)
                message = self._verifier.open(data)  # the MAC is checked before anything is unpacked
            except AuthError as exc:
                self.counters["control_rejected"] += 1
                self._rejections.note(exc)
                continue
            self._last_router_s = time.monotonic()
            if message["type"] == "ping":
                continue
            rid = message.get("rid")
            # how long the command sat in the socket while a step ran (same-host clocks; 0 if unknown)
            sent_at = message.get("sent_at")
            waited = max(0.0, time.time() - sent_at) if isinstance(sent_at, (int, float)) else 0.0
            message["arrival_s"] = time.monotonic() - waited
            try:
                if message["type"] == "abort":
                    self.counters["aborts"] += 1
                    self.abort(rid)
                else:
                    self.handle(message)
            except (ValueError, KeyError, ProtocolError) as exc:
                self.counters["errors"] += 1
                self.emit_error(rid, str(exc), "invalid_request")

    def emit(self, message: dict) -> None:
        if self._dead.is_set():
            return
        try:
            self._events.send(self._signer.seal(message))
        except zmq.Again:
            logger.error("%s: router unreachable; dropped a %s event", self.name, message.get("type"))

    def emit_error(self, rid: str | None, message: str, code: str) -> None:
        self.emit({"type": "error", "rid": rid, "worker": self.name, "message": message, "code": code})

    def stats(self) -> dict:
        engine = self.engine
        return {
            "worker": self.name,
            "role": self.role,
            "waiting": len(engine.scheduler.waiting),
            "running": len(engine.scheduler.running),
            "requests": len(engine.requests),
            "free_blocks": engine.num_free_blocks,
            "total_blocks": engine.block_manager.num_blocks,
            "preemptions": engine.scheduler.num_preemptions,
            "prefix_hit_tokens": engine.block_manager.prefix_hit_tokens,
            "degraded": self.degraded,
            **self.counters,
        }

    # ---- what each role fills in -------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def handle(self, message: dict) -> None:
        raise ValueError(f"{self.role} worker does not take {message.get('type')!r} commands")

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def tick(self) -> None:
        raise NotImplementedError

    def fail_all(self, reason: str) -> None:
        for rid in list(self.engine.requests):
            self.abort(rid)
            self.emit_error(rid, reason, "worker_error")


def finish_timing(request) -> dict:
    """Where a request's time went inside this worker (seconds)."""
    timing = {}
    if request.scheduled_s is not None:
        timing["queue_s"] = request.scheduled_s - request.arrival_s
        if request.first_token_s is not None:
            timing["compute_s"] = request.first_token_s - request.scheduled_s
    return timing
