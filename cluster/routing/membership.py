"""Which workers the router knows, which are alive, and the command socket to each.

A worker is alive from registration until its heartbeats stop (``HEARTBEAT_TIMEOUT_S``), its command queue fills,
or Ray reports its process gone; then ``on_dead`` tells the router, which fails or retries what the worker held.
A restarted worker registers again under the same name with new addresses and is alive again.

It also keeps what each worker's prefix cache holds (``prefix_index``, fed by the workers' ``KvEvents``): a worker's
view is dropped whenever it (re-)registers or is marked dead, since a new process starts with an empty cache and a
dead one serves nothing; a worker revived after a stall starts from empty and is refilled by its next snapshot.

Live resizing (cluster/run/scaling.py): a worker being removed is first ``DRAINING`` (``drain``): no new request goes
there (``routable`` leaves it out, so do the dispatcher's prefill, decode-reservation, colocated and affinity
choices), while the requests it holds go on streaming and it still gets pings. ``remove`` forgets it once the pool
has stopped it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from cluster.routing.metrics import RouterMetrics
from cluster.routing.prefix_index import PrefixIndex
from worker.messages import Command, Drain, KvEvents, Stats
from worker.protocol import MAX_FRAME_BYTES, Channel, Signer

logger = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 2.0  # ten missed heartbeats (a worker's heartbeat thread sends one every 0.2 s)
STALL_TIMEOUT_S = 300.0  # heartbeats still come but the worker's loop has not come round: stuck, not slow
ROLES = ("prefill", "decode", "colocated")


class WorkerState(str, enum.Enum):
    """Where a registered worker is in its life as the pool sees it (``alive`` says whether it answers)."""

    ACTIVE = "active"  # takes new requests (when alive and not degraded)
    DRAINING = "draining"  # being removed: finishes what it holds, gets nothing new


@dataclass(slots=True)
class WorkerHandle:
    name: str
    role: str
    command_address: str
    socket: zmq.asyncio.Socket
    kv_address: str | None = None
    stats: Stats | None = None  # its last heartbeat (None until the first)
    last_seen: float = field(default_factory=time.monotonic)  # any event from it
    stats_seen: float | None = None  # its last heartbeat (what ``stats`` says is that old)
    alive: bool = True
    inflight: int = 0
    state: WorkerState = WorkerState.ACTIVE

    @property
    def degraded(self) -> str:
        """Why the worker says it should get no new work, as of its last heartbeat ("" when healthy or unknown)."""
        return self.stats.degraded if self.stats is not None else ""


class Membership:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        metrics: RouterMetrics,
        secret: str | None,
        on_dead: Callable[[str, str], None],
        router_index: int = 0,
    ) -> None:
        self._ctx = ctx
        self._router_index = router_index  # in every command: workers send a request's events to its own router
        self._metrics = metrics
        if not secret:
            raise ValueError("the router needs the cluster secret (transfer.secret; start_serving makes one)")
        self._secret = secret  # commands are sealed with keys derived from it (worker/protocol.py)
        self._signers: dict[str, Signer] = {}  # per worker command address
        self._on_dead = on_dead
        self.workers: dict[str, WorkerHandle] = {}
        self.prefix_index = PrefixIndex()

    def add(self, name: str, role: str, command_address: str, kv_address: str | None = None) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        # MAXMSGSIZE too, though a PUSH socket receives nothing: every socket has it, so none can be forgotten
        for option, value in (
            (zmq.LINGER, 0),
            (zmq.SNDHWM, 100_000),
            (zmq.SNDTIMEO, 1000),
            (zmq.MAXMSGSIZE, MAX_FRAME_BYTES),
        ):
            sock.setsockopt(option, value)
        sock.connect(command_address)
        old = self.workers.pop(name, None)
        if old is not None:
            old.socket.close(0)
        self.workers[name] = WorkerHandle(name, role, command_address, sock, kv_address)
        if old is not None:  # restarted by Ray while draining: it is still being removed
            self.workers[name].state = old.state
        self.forget_prefixes(name)  # a (re-)registered process starts with an empty prefix cache
        self._update_gauge()
        if old is not None and old.alive and old.command_address != command_address:
            # restarted before its death was noticed: what the old process held is gone with it
            logger.warning("worker %s came back as a new process before its death was seen", name)
            self._on_dead(name, "worker restarted")

    def get(self, name: str | None) -> WorkerHandle | None:
        return self.workers.get(name or "")

    def live(self, role: str | None = None) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.alive and (role is None or w.role == role)]

    def routable(self, role: str) -> list[WorkerHandle]:
        """Live workers that may get new requests: not those that report themselves degraded, nor draining ones."""
        return [w for w in self.live(role) if not w.degraded and w.state is WorkerState.ACTIVE]

    def drain(self, name: str, deadline_s: float) -> bool:
        """Route nothing new to the worker, and tell it (``Drain``) so it knows when it is idle; False if unknown."""
        worker = self.workers.get(name)
        if worker is None:
            return False
        if worker.state is not WorkerState.DRAINING:
            logger.info("worker %s draining", name)
        worker.state = WorkerState.DRAINING
        self.send(worker, Drain(deadline_s=deadline_s))
        return True

    def remove(self, name: str) -> WorkerHandle | None:
        """Forget a worker the pool has stopped: its socket, its prefix-cache view, its signer."""
        worker = self.workers.pop(name, None)
        if worker is None:
            return None
        worker.alive = False
        worker.socket.close(0)
        self.prefix_index.forget(name)
        self._signers.pop(worker.command_address, None)
        self._metrics.prefix_index_blocks.labels(name, worker.role).set(0)
        self._update_gauge()
        return worker

    def mark_dead(self, name: str, reason: str) -> None:
        worker = self.workers.get(name)
        if worker is None or not worker.alive:
            return
        worker.alive = False
        logger.warning("worker %s marked dead: %s", name, reason)
        self.forget_prefixes(name)
        self._update_gauge()
        self._on_dead(name, reason)

    def expire(self, now: float) -> None:
        for worker in list(self.workers.values()):
            if worker.alive and now - worker.last_seen > HEARTBEAT_TIMEOUT_S:
                self.mark_dead(worker.name, f"no heartbeat for {HEARTBEAT_TIMEOUT_S:.0f} s")
            elif worker.alive and worker.stats is not None and worker.stats.loop_age_s > STALL_TIMEOUT_S:
                self.mark_dead(worker.name, f"worker loop stalled for {worker.stats.loop_age_s:.0f} s")

    def send(self, worker: WorkerHandle, message: Command) -> None:
        """Seal and send a command, stamped with this router's index and the time (the message is changed)."""
        signer = self._signers.get(worker.command_address)
        if signer is None:  # a new worker, or a restarted one (new address): forget the replaced ones' signers
            live = {w.command_address for w in self.workers.values()}
            for address in [a for a in self._signers if a not in live]:
                del self._signers[address]
            signer = self._signers[worker.command_address] = Signer(
                self._secret, Channel.COMMANDS, worker.command_address
            )
        message.router, message.sent_at = self._router_index, time.time()
        try:
            worker.socket.send(signer.seal(message), zmq.NOBLOCK)
        except zmq.Again:
            self.mark_dead(worker.name, "command queue full")

    def heard_from(self, name: str, heartbeat: Stats | None = None) -> WorkerHandle | None:
        """Note an authenticated event from a worker; None when it comes from another incarnation of that worker.

        ``heartbeat`` (the event, when it is one) carries its worker's command address, which tells incarnations
        apart: a heartbeat queued by a process that has since died, or sent by its Ray-restarted successor before the
        pool re-registers it, neither refreshes nor revives the registered entry. A heartbeat from the registered
        process when it was marked dead revives it: it was slow or cut off (a long stall, a full queue, a monitor
        timeout), not gone; what it held was failed or retried when it was marked dead, and the router's aborts free
        those requests."""
        worker = self.workers.get(name)
        if worker is not None and heartbeat is not None and heartbeat.address != worker.command_address:
            return None
        if worker is not None:
            worker.last_seen = time.monotonic()
            if not worker.alive and heartbeat is not None and heartbeat.loop_age_s <= STALL_TIMEOUT_S:
                worker.alive = True
                logger.warning("worker %s is heard from again; back in the pool", worker.name)
                self._metrics.worker_revivals.inc()
                self._update_gauge()
        return worker

    def on_kv_events(self, event: KvEvents, worker: WorkerHandle | None) -> None:
        """Apply a worker's prefix-cache changes, if they come from the registered incarnation of a worker."""
        if worker is None or event.address != worker.command_address or not worker.alive:
            return  # an old process's events, or a dead worker's: its view was dropped and stays so
        index = self.prefix_index
        if index.apply(worker.name, event.seq, event.stored, event.removed, event.reset):
            self._metrics.kv_events.labels("reset" if event.reset else "delta").inc()
        else:
            self._metrics.kv_events.labels("gap").inc()
        self._metrics.prefix_index_blocks.labels(worker.name, worker.role).set(index.blocks_held(worker.name))

    def forget_prefixes(self, name: str) -> None:
        self.prefix_index.forget(name)
        worker = self.workers.get(name)
        if worker is not None:
            self._metrics.prefix_index_blocks.labels(name, worker.role).set(0)

    def close(self) -> None:
        for worker in self.workers.values():
            worker.socket.close(0)

    def pools(self) -> dict[str, dict]:
        """Per pool (a worker's name is ``<pool>-<index>``): how many replicas serve and which ones drain."""
        out: dict[str, dict] = {}
        for w in self.workers.values():
            pool = out.setdefault(w.name.rsplit("-", 1)[0], {"replicas": 0, "workers": [], "draining": []})
            if w.state is WorkerState.DRAINING:
                pool["draining"].append(w.name)
            else:
                pool["replicas"] += 1
                pool["workers"].append(w.name)
        return out

    def status(self) -> list[dict]:
        now = time.monotonic()
        return [
            {
                "name": w.name,
                "role": w.role,
                "alive": w.alive,
                "state": w.state.value,
                "inflight": w.inflight,
                "last_seen_s": round(now - w.last_seen, 3),
                "stats_age_s": None if w.stats_seen is None else round(now - w.stats_seen, 3),
                **heartbeat_status(w.stats),
            }
            for w in self.workers.values()
        ]

    def _update_gauge(self) -> None:
        for role in ROLES:
            self._metrics.workers_alive.labels(role).set(len(self.live(role)))


def heartbeat_status(stats: Stats | None) -> dict:
    """A heartbeat as ``/status`` shows it: one flat map (address, degraded, loop_age_s, then every load and counter
    field under its own name); empty before the first heartbeat."""
    if stats is None:
        return {}
    return {
        "address": stats.address,
        "degraded": stats.degraded,
        "loop_age_s": stats.loop_age_s,
        **msgspec.structs.asdict(stats.load),
        **msgspec.structs.asdict(stats.counters),
    }
