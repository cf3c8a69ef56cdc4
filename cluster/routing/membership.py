"""Which workers the router knows, which are alive, what each last reported, and which flows count as its load.

A worker is alive from registration until its heartbeats stop (``expired``), its command queue fills, or Ray reports
it gone; a restarted one registers again under its name with new addresses. Its prefix-cache view is dropped
whenever it (re-)registers or dies. A ``DRAINING`` worker is not routable but finishes what it holds. No sockets
here: the live router (cluster/routing/router.py) keeps them.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from cluster.routing.flow import MovePhase
from cluster.routing.metrics import RouterMetrics
from cluster.routing.prefix_index import TIERS, PrefixIndex
from worker.messages import KvEvents, Stats

if TYPE_CHECKING:
    from cluster.routing.flow import Flow

logger = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 2.0  # ten missed heartbeats (a worker's heartbeat thread sends one every 0.2 s)
STALL_TIMEOUT_S = 300.0  # heartbeats still come but the worker's loop has not come round: stuck, not slow
ROLES = ("prefill", "decode", "colocated")


class WorkerState(str, enum.Enum):
    ACTIVE = "active"  # takes new requests (when alive and not degraded)
    DRAINING = "draining"  # being removed or switching role: finishes what it holds, gets nothing new


class SwitchPhase(str, enum.Enum):
    """A role switch's phases (cluster/run/role_switch.py runs it): the worker drains (a decode worker's running
    requests move away), then rebuilds its engine for the new role and rejoins under a new address; the routers see
    the first two, and how it ended as the worker rejoins (or serves on)."""

    DRAINING = "draining"
    RECONFIGURING = "reconfiguring"
    DONE = "done"
    CALLED_OFF = "called_off"  # not drained within its deadline: the worker serves on in its old role
    RESTARTED = "restarted"  # it died mid-switch and was started again in the new role
    FAILED = "failed"  # it died mid-switch and could not be started again

    @property
    def ended(self) -> bool:
        return self not in (SwitchPhase.DRAINING, SwitchPhase.RECONFIGURING)


@dataclass(slots=True)
class SwitchView:
    to: str  # the role it is switching to
    phase: SwitchPhase
    since: float  # monotonic: when the switch began


@dataclass(slots=True, eq=False)
class WorkerHandle:
    name: str
    role: str
    command_address: str
    kv_address: str | None = None
    stats: Stats | None = None  # its last heartbeat (None until the first)
    last_seen: float = 0.0  # any event from it
    stats_seen: float | None = None  # its last heartbeat (what ``stats`` says is that old)
    alive: bool = True
    state: WorkerState = WorkerState.ACTIVE
    flows: set[Flow] = field(default_factory=set)  # the flows it holds (``Flow.holders``)
    switch: SwitchView | None = None  # a role switch under way

    @property
    def inflight(self) -> int:
        return len(self.flows)

    @property
    def degraded(self) -> str:
        """Why the worker's last heartbeat asks for no new work ("" when healthy or unknown)."""
        return self.stats.degraded if self.stats is not None else ""


def free_blocks(worker: WorkerHandle) -> float:
    """The blocks a worker could reserve now: free blocks less those it is being asked for (none at its request
    limit; unknown before its first heartbeat: it answers for itself)."""
    if worker.stats is None:
        return float("inf")
    load = worker.stats.load
    asked = [n for f in worker.flows if (n := _asked_blocks(f, worker.name)) is not None]
    if 0 < load.max_requests <= load.requests + len(asked):
        return 0
    return load.free_blocks - sum(asked)


def _asked_blocks(flow: Flow, name: str) -> int | None:
    """The blocks a flow asks worker ``name`` to reserve now (for its prompt, or to move there); None: none."""
    if flow.asking == name:
        return flow.blocks_needed
    move = flow.move
    return (
        move.blocks_needed if move is not None and move.target == name and move.phase is MovePhase.RESERVING else None
    )


class Membership:
    def __init__(self, metrics: RouterMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: for the prefix index's tentative entries (simulated time in the planner)."""
        self._metrics = metrics
        self.workers: dict[str, WorkerHandle] = {}
        self.prefix_index = PrefixIndex(clock=clock)

    def add(self, name: str, role: str, command_address: str, kv_address: str | None, now: float) -> bool:
        """Register a worker (again after a restart); True when the old process was still thought alive."""
        old = self.workers.get(name)
        worker = self.workers[name] = WorkerHandle(name, role, command_address, kv_address, last_seen=now)
        if old is not None:
            worker.state, worker.flows = old.state, old.flows  # draining stays draining; its flows are failed
        self.forget_prefixes(name)  # a (re-)registered process starts with an empty prefix cache
        self._update_gauge()
        restarted = old is not None and old.alive and old.command_address != command_address
        if restarted:
            logger.warning("worker %s came back as a new process before its death was seen", name)
        return restarted

    def get(self, name: str | None) -> WorkerHandle | None:
        return self.workers.get(name or "")

    def live(self, role: str | None = None) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.alive and (role is None or w.role == role)]

    def routable(self, role: str) -> list[WorkerHandle]:
        """Live workers that may get new requests: neither degraded nor draining."""
        return [w for w in self.live(role) if not w.degraded and w.state is WorkerState.ACTIVE]

    def drain(self, name: str) -> bool:
        """False if unknown."""
        worker = self.workers.get(name)
        if worker is None:
            return False
        if worker.state is not WorkerState.DRAINING:
            logger.info("worker %s draining", name)
        worker.state = WorkerState.DRAINING
        return True

    def undrain(self, name: str) -> bool:
        """A drain called off: the worker is routable again (False if unknown)."""
        worker = self.workers.get(name)
        if worker is None:
            return False
        worker.state, worker.switch = WorkerState.ACTIVE, None
        logger.info("worker %s serves again", name)
        return True

    def remove(self, name: str) -> None:
        self.forget_prefixes(name)
        worker = self.workers.pop(name, None)
        if worker is not None:
            worker.alive = False
            self._update_gauge()

    def mark_dead(self, name: str, reason: str) -> bool:
        """True if the worker was alive until now."""
        worker = self.workers.get(name)
        if worker is None or not worker.alive:
            return False
        worker.alive = False
        logger.warning("worker %s marked dead: %s", name, reason)
        self.forget_prefixes(name)
        self._update_gauge()
        return True

    def expired(self, now: float) -> list[tuple[str, str]]:
        """Live workers not heard from for ``HEARTBEAT_TIMEOUT_S``, or whose loop is stuck, and why."""
        out = []
        for worker in self.workers.values():
            if worker.alive and now - worker.last_seen > HEARTBEAT_TIMEOUT_S:
                out.append((worker.name, f"no heartbeat for {HEARTBEAT_TIMEOUT_S:.0f} s"))
            elif worker.alive and worker.stats is not None and worker.stats.loop_age_s > STALL_TIMEOUT_S:
                out.append((worker.name, f"worker loop stalled for {worker.stats.loop_age_s:.0f} s"))
        return out

    def heard_from(self, name: str, now: float, heartbeat: Stats | None = None) -> WorkerHandle | None:
        """Note an authenticated event from a worker; None when it comes from another incarnation of that worker.

        A heartbeat's command address tells incarnations apart: a dead process's, or its successor's before it
        re-registers, neither refreshes nor revives the entry. One from the registered process marked dead revives
        it: it was slow or cut off, not gone (what it held was failed or retried then)."""
        worker = self.workers.get(name)
        if worker is not None and heartbeat is not None and heartbeat.address != worker.command_address:
            return None
        if worker is not None:
            worker.last_seen = now
            if heartbeat is not None:
                worker.stats, worker.stats_seen = heartbeat, now
                if not worker.alive and heartbeat.loop_age_s <= STALL_TIMEOUT_S:
                    worker.alive = True
                    logger.warning("worker %s is heard from again; back in the pool", worker.name)
                    self._metrics.worker_revivals.inc()
                    self._update_gauge()
        return worker

    def on_kv_events(self, event: KvEvents, worker: WorkerHandle | None) -> None:
        """Apply a worker's prefix-cache changes, if they come from its registered incarnation."""
        if worker is None or event.address != worker.command_address or not worker.alive:
            return  # an old process's events, or a dead worker's: its view was dropped and stays so
        if self.prefix_index.apply(worker.name, event.seq, event.stored, event.removed, event.reset, event.tier):
            self._metrics.kv_events.labels("reset" if event.reset else "delta").inc()
        else:
            self._metrics.kv_events.labels("gap").inc()
        self._publish_prefix_blocks(worker.name, worker.role)  # every tier: a gap drops them all

    def forget_prefixes(self, name: str) -> None:
        self.prefix_index.forget(name)
        worker = self.workers.get(name)
        if worker is not None:
            self._publish_prefix_blocks(name, worker.role)

    def _publish_prefix_blocks(self, name: str, role: str) -> None:
        gauge, index = self._metrics.prefix_index_blocks, self.prefix_index
        for tier in TIERS:
            gauge.labels(name, role, tier).set(index.blocks_held(name, tier))

    def pools(self) -> dict[str, dict]:
        """Per pool: how many replicas serve, which ones drain and which switch role (a prefill or decode worker is in
        its role's pool, whatever its name; colocated workers by their name, ``<pool>-<index>``)."""
        out: dict[str, dict] = {}
        for w in self.workers.values():
            name = w.name.rsplit("-", 1)[0] if w.role == "colocated" else w.role
            pool = out.setdefault(name, {"replicas": 0, "workers": [], "draining": [], "switching": []})
            if w.switch is not None:
                pool["switching"].append(w.name)
            if w.state is WorkerState.DRAINING:
                pool["draining"].append(w.name)
            else:
                pool["replicas"] += 1
                pool["workers"].append(w.name)
        return out

    def status(self, now: float) -> list[dict]:
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
                **switch_status(w.switch, now),
            }
            for w in self.workers.values()
        ]

    def _update_gauge(self) -> None:
        for role in ROLES:
            self._metrics.workers_alive.labels(role).set(len(self.live(role)))


def switch_status(switch: SwitchView | None, now: float) -> dict:
    """A role switch under way, for ``/status``."""
    if switch is None:
        return {}
    return {"switch": {"to": switch.to, "phase": switch.phase.value, "elapsed_s": round(now - switch.since, 3)}}


def heartbeat_status(stats: Stats | None) -> dict:
    """A heartbeat as one flat map for ``/status``; empty before the first."""
    if stats is None:
        return {}
    return {
        "address": stats.address,
        "degraded": stats.degraded,
        "loop_age_s": stats.loop_age_s,
        "epoch": stats.epoch,
        "kv_paths": stats.kv_paths,
        **msgspec.structs.asdict(stats.load),
        **msgspec.structs.asdict(stats.counters),
    }
