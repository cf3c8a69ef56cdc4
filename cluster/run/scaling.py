"""Live resizing: ``pdserve scale --pool decode --replicas N`` and ``POST /admin/scale`` on a running cluster.

It runs in the main process, which owns the pools; routers only hear membership news (docs/planner.md, "Live
resizing"). Growing: ``pools.add_replica`` starts a worker under the pool's next name; every router registers it once
it reports its addresses. Shrinking (newest first): every router drains the worker, a thread here polls
``pools.drained`` until the deadline plus ``DRAIN_GRACE_S``, then every router forgets it and the pool stops it.
``scale`` returns once the new workers serve, removals still draining; one scale at a time.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Protocol

from cluster.config import ClusterConfig
from cluster.routing.errors import ScaleError
from cluster.run.pools import DRAIN_TIMEOUT_S, LocalPools, RayPools, WorkerRecord, drain_timeout
from cluster.run.role_switch import RoleSwitcher

logger = logging.getLogger(__name__)

POOLS = ("prefill", "decode")
MAX_REPLICAS = 1024  # a bound on one request, not a recommendation
DRAIN_GRACE_S = 10.0  # after the deadline: for the worker to fail what it held and end its KV leases


class MembershipSink(Protocol):
    """The in-process ``Router``, or ``RouterProcesses`` (every router process)."""

    def add_worker_threadsafe(
        self, name: str, role: str, command_address: str, kv_address: str | None = None
    ) -> None: ...

    def drain_worker_threadsafe(self, name: str, deadline_s: float) -> None: ...

    def remove_worker_threadsafe(self, name: str) -> None: ...

    def switch_phase_threadsafe(self, name: str, phase: str) -> None: ...

    def mark_dead_threadsafe(self, name: str, reason: str) -> None: ...


class Scaler:
    def __init__(self, config: ClusterConfig, pools: LocalPools | RayPools, routers: MembershipSink) -> None:
        self.config = config
        self.pools = pools
        self.routers = routers
        self._lock = threading.Lock()
        self._removals: list[threading.Thread] = []
        self._closing = threading.Event()
        self.roles = RoleSwitcher(config, pools, routers)  # POST /admin/role: a worker changing pools in place

    def check(self, pool: object, replicas: object, drain_timeout_s: object = None) -> tuple[str, int, float | None]:
        """The values as a client sent them, typed; raises ScaleError naming the field."""
        if not isinstance(pool, str) or pool not in POOLS:
            raise ScaleError("pool", f"pool must be one of {', '.join(POOLS)}, got {pool!r}")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or not 0 <= replicas <= MAX_REPLICAS:
            raise ScaleError("replicas", f"replicas must be an integer from 0 to {MAX_REPLICAS}, got {replicas!r}")
        drain_s = drain_timeout(drain_timeout_s)
        if self.config.mode == "disaggregated" and replicas < 1:
            raise ScaleError("replicas", f"disaggregated mode needs at least one {pool} replica")
        other = next(p for p in POOLS if p != pool)
        if self.config.mode == "colocated" and replicas + len(self.pools.active(other)) < 1:
            raise ScaleError("replicas", "colocated mode needs at least one worker")
        return pool, replicas, drain_s

    def scale(self, pool: object, replicas: object, drain_timeout_s: object = None) -> dict:
        """Returns the membership after it (removals still draining); bad values (``check``) raise ScaleError."""
        pool, replicas, drain_s = self.check(pool, replicas, drain_timeout_s)
        deadline_s = drain_s or DRAIN_TIMEOUT_S
        if self.roles.in_flight(pool):
            raise ScaleError("pool", f"a worker is switching role out of or into {pool}: scale it once that ends")
        with self._lock:
            current = self.pools.active(pool)
            for _ in range(replicas - len(current)):
                record = self.pools.add_replica(pool, self._register)
                logger.info("scale: %s started (%s)", record.name, "serving" if record.info else "pending")
            for record in reversed(current[replicas:]):  # the newest first
                self._begin_removal(record, deadline_s)
        return self.membership()

    async def scale_async(self, pool: object, replicas: object, drain_timeout_s: object = None) -> dict:
        return await asyncio.to_thread(self.scale, pool, replicas, drain_timeout_s)

    def switch_role(self, worker: object, to: object, drain_timeout_s: object = None, wait: object = False) -> dict:
        """``RoleSwitcher.switch`` (cluster/run/role_switch.py), with the membership after it."""
        return {"switch": self.roles.switch(worker, to, drain_timeout_s, wait), **self.membership()}

    def switch_pool(self, source: object, to: object) -> dict:
        """The newest serving worker of pool ``source`` switches to ``to`` (the autoscaler's move): its record.
        ScaleError when none can (RoleSwitcher.check)."""
        candidates = [r for r in self.pools.workers if r.pool == source and not r.switching]
        if not candidates:
            raise ScaleError("pool", f"no serving {source} worker to switch")
        return self.roles.switch(candidates[-1].name, to)

    async def switch_role_async(
        self, worker: object, to: object, drain_timeout_s: object = None, wait: object = False
    ) -> dict:
        return await asyncio.to_thread(self.switch_role, worker, to, drain_timeout_s, wait)

    def membership(self) -> dict:
        """Per pool: serving workers, those still starting (Ray: not placed yet), those draining."""
        pools = self.pools
        return {
            "pools": {
                name: {
                    "replicas": len(pools.active(name)),
                    "workers": [r.name for r in pools.workers if r.pool == name],
                    "pending": [r.name for r in pools.pending if r.pool == name],
                    "draining": [r.name for r in pools.draining if r.pool == name],
                    "switching": [r.name for r in pools.workers if r.pool == name and r.switching],
                }
                for name in POOLS
            }
        }

    def wait_idle(self, timeout_s: float) -> bool:
        """False if a removal or a role switch is still running after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for thread in list(self._removals):
            thread.join(max(0.0, deadline - time.monotonic()))
        switches_idle = self.roles.wait_idle(max(0.0, deadline - time.monotonic()))
        return switches_idle and not any(t.is_alive() for t in self._removals)

    def close(self) -> None:
        """Stop waiting for drains (the cluster is stopping: the pools stop every worker, draining ones too)."""
        self._closing.set()
        self.roles.close()

    # ---- internals ---------------------------------------------------------------------------------------------

    def _register(self, record: WorkerRecord) -> None:
        info = record.info
        self.routers.add_worker_threadsafe(record.name, record.role, info["command_address"], info.get("kv_address"))

    def _begin_removal(self, record: WorkerRecord, deadline_s: float) -> None:
        if record in self.pools.pending:  # never started: nothing to drain
            self.pools.stop_replica(record)
            return
        self.pools.begin_removal(record)
        self.routers.drain_worker_threadsafe(record.name, deadline_s)
        thread = threading.Thread(
            target=self._finish_removal, args=(record, deadline_s), name=f"pdserve-drain-{record.name}", daemon=True
        )
        self._removals = [t for t in self._removals if t.is_alive()] + [thread]
        thread.start()

    def _finish_removal(self, record: WorkerRecord, deadline_s: float) -> None:
        started = time.monotonic()
        drained = self.pools.wait_drained(record, started + deadline_s + DRAIN_GRACE_S, self._closing)
        if self._closing.is_set():
            return
        if not drained:
            logger.error("scale: %s did not drain within %.0f s; stopping it", record.name, deadline_s)
        self.routers.remove_worker_threadsafe(record.name)
        self.pools.stop_replica(record)
        logger.info("scale: %s removed after %.1f s", record.name, time.monotonic() - started)
