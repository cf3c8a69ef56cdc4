"""Live role switching: ``pdserve role --worker NAME --to prefill|decode`` and ``POST /admin/role``.

A worker moves between the prefill and decode pools keeping its loaded weights, where a restart would load them
again. It runs in the main process beside the scaler (cluster/run/scaling.py), which owns the pools: every router
drains the worker (a decode worker's running requests move to the other decode workers), a thread here polls
``pools.drained`` until the drain deadline, then the worker rebuilds its engine for the new pool in place
(``WorkerRuntime.switch_role``: the new pool's KV cache, a new command address, so a command for its old role is
refused) and every router registers it in its new pool. A switch that cannot drain in its deadline is called off and
the worker serves on in its old role; a worker that dies mid-switch is started again in the new role. Phases and
times are in ``/status`` (the routers' view) and in this module's records (``pdserve role``'s answer).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass

from cluster.config import ClusterConfig
from cluster.routing.errors import ScaleError
from cluster.routing.membership import SwitchPhase
from cluster.run.pools import DRAIN_TIMEOUT_S, LocalPools, RayPools, WorkerRecord, drain_timeout

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
REBUILD_TIMEOUT_S = 120.0  # for the worker's loop to take the switch up and rebuild its engine
KEPT_RECORDS = 64  # finished switches kept for ``records``
# what must be equal in both pools for a worker to move between them in place: its placement and its weights
SAME_IN_BOTH_POOLS = (
    "gpus_per_replica",
    "cpus_per_replica",
    "resources",
    "tensor_parallel_size",
    "expert_parallel_size",
    "cpu_linear_tuning",
)


@dataclass(slots=True)
class SwitchRecord:
    worker: str
    from_role: str
    to: str
    phase: SwitchPhase = SwitchPhase.DRAINING
    started_at: float = 0.0  # wall clock
    drain_s: float | None = None  # from the switch's start until the worker was drained
    reconfigure_s: float | None = None  # the worker's rebuild for its new role (or its restart)
    total_s: float | None = None
    error: str = ""

    def as_dict(self) -> dict:
        return {**asdict(self), "phase": self.phase.value}


class RoleSwitcher:
    def __init__(self, config: ClusterConfig, pools: LocalPools | RayPools, routers) -> None:
        """``routers``: the in-process ``Router`` or ``RouterProcesses`` (the scaler's ``MembershipSink``, with
        ``switch_phase_threadsafe``)."""
        self.config, self.pools, self.routers = config, pools, routers
        self._lock = threading.Lock()
        self._records: list[SwitchRecord] = []
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()

    # ---- asking ------------------------------------------------------------------------------------------------

    def check(self, worker: object, to: object, drain_timeout_s: object = None) -> tuple[WorkerRecord, str, float]:
        """The worker's record, its new pool and the drain deadline; ScaleError naming the field when the switch
        cannot be done as asked."""
        if self.config.mode != "disaggregated":
            raise ScaleError("to", "workers switch role in disaggregated mode only (a colocated worker does both)")
        if not isinstance(to, str) or to not in ROLES:
            raise ScaleError("to", f"to must be one of {', '.join(ROLES)}, got {to!r}")
        record = next((r for r in self.pools.workers if r.name == worker), None)
        if record is None:
            raise ScaleError("worker", f"worker must name a serving worker, got {worker!r}")
        if record.pool == to:
            raise ScaleError("to", f"{record.name} is already a {to} worker")
        if self.in_flight(record.pool) or self.in_flight(to):
            raise ScaleError("worker", "one role switch at a time per pool: one is under way")
        if len(self.pools.active(record.pool)) < 2:
            raise ScaleError("worker", f"{record.name} is the last {record.pool} worker; disaggregated mode needs one")
        pools = self.config.pools
        for name in SAME_IN_BOTH_POOLS:
            here, there = getattr(getattr(pools, record.pool), name), getattr(getattr(pools, to), name)
            if here != there:
                raise ScaleError(
                    "to",
                    f"pools.{record.pool}.{name} is {here!r} and pools.{to}.{name} is {there!r}: a worker switches in "
                    "place only between pools of the same placement and weights",
                )
        if getattr(pools, to).ranks > 1:
            raise ScaleError("to", "a worker of several ranks does not switch role in place")
        drain_s = drain_timeout(drain_timeout_s) or DRAIN_TIMEOUT_S
        return record, to, drain_s

    def switch(self, worker: object, to: object, drain_timeout_s: object = None, wait: object = False) -> dict:
        """Begin the switch (``wait``: and see it end); its record as a dict. Bad values raise ScaleError."""
        if not isinstance(wait, bool):
            raise ScaleError("wait", f"wait must be true or false, got {wait!r}")
        with self._lock:
            record, to, drain_s = self.check(worker, to, drain_timeout_s)
            switch = SwitchRecord(record.name, record.pool, to, started_at=time.time())
            self._records = self._records[-KEPT_RECORDS:] + [switch]
            record.switching = True
            self.routers.drain_worker_threadsafe(record.name, drain_s, to)
            thread = threading.Thread(
                target=self._run, args=(record, switch, drain_s), name=f"pdserve-switch-{record.name}", daemon=True
            )
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()
        logger.info("role switch: %s %s -> %s (drain deadline %.0f s)", record.name, record.pool, to, drain_s)
        if wait:
            thread.join(drain_s + REBUILD_TIMEOUT_S + 30)
        return switch.as_dict()

    def in_flight(self, pool: str) -> bool:
        """A switch out of or into ``pool`` is under way."""
        return any(not s.phase.ended and pool in (s.from_role, s.to) for s in self._records)

    def records(self) -> list[dict]:
        return [s.as_dict() for s in self._records]

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def close(self) -> None:
        """Stop waiting for drains (the cluster is stopping)."""
        self._closing.set()

    # ---- the switch --------------------------------------------------------------------------------------------

    def _run(self, record: WorkerRecord, switch: SwitchRecord, drain_s: float) -> None:
        started = time.monotonic()
        try:
            if not self.pools.wait_drained(record, started + drain_s, self._closing):
                if self._closing.is_set():
                    return
                switch.phase, switch.error = SwitchPhase.CALLED_OFF, f"not drained within {drain_s:.0f} s"
                self.routers.switch_phase_threadsafe(record.name, SwitchPhase.CALLED_OFF.value)
                logger.warning("role switch of %s called off: %s", record.name, switch.error)
                return
            switch.drain_s = round(time.monotonic() - started, 3)
            switch.phase = SwitchPhase.RECONFIGURING
            self.routers.switch_phase_threadsafe(record.name, SwitchPhase.RECONFIGURING.value)
            rebuilt = time.monotonic()
            spec = self.pools.pool_spec(switch.to, record.name)
            try:
                info = self.pools.switch_role(record, spec, REBUILD_TIMEOUT_S)
                result = SwitchPhase.DONE
            except Exception as exc:  # noqa: BLE001 - died (or broke) mid-switch: started again in the new role
                logger.error(
                    "role switch of %s failed mid-way (%s); starting it as a %s worker", record.name, exc, switch.to
                )
                switch.error = f"{type(exc).__name__}: {exc}"[:300]
                try:
                    info = self.pools.restart_as(record, spec)
                except Exception as again:  # noqa: BLE001 - it stays out of both pools; the routers drop it
                    switch.phase = SwitchPhase.FAILED
                    switch.error += f"; restart failed: {type(again).__name__}: {again}"[:300]
                    logger.exception("role switch of %s: the restart failed too", record.name)
                    self.routers.mark_dead_threadsafe(record.name, "died switching role; restart failed")
                    return
                result = SwitchPhase.RESTARTED
            switch.reconfigure_s = round(time.monotonic() - rebuilt, 3)
            self.pools.switched(record, spec, info)
            self.routers.add_worker_threadsafe(
                record.name, spec.role.value, info["command_address"], info.get("kv_address"), result.value
            )
            switch.phase = result
            logger.info(
                "role switch: %s is a %s worker (drained in %.2f s, rebuilt in %.2f s)",
                record.name,
                switch.to,
                switch.drain_s,
                switch.reconfigure_s,
            )
        finally:
            record.switching = False
            switch.total_s = round(time.monotonic() - started, 3)
