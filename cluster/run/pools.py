"""The worker pools behind a router: Ray actors in placement groups (``RayPools``), or threads (``LocalPools``).

Both start each worker from its ``WorkerSpec`` (``ClusterConfig.worker_specs``). On Ray each pool gets a placement
group from its config section, each replica an actor pinned to a bundle and restarted up to ``ray.max_restarts``
times; a monitor thread marks dead actors dead at once and re-registers restarted ones (new addresses). Threads
behave the same but for placement and restarts. Live resizing (cluster/run/scaling.py): an added replica gets the
pool's next unused name (never reused while an old one may drain) and a bundle a removed replica freed, else a
placement group of its own: one that cannot be placed stays pending, the demand Ray's autoscaler adds nodes for (a
placement group cannot grow, and a bigger pool group that does not fit would hold back the whole pool).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.config import ClusterConfig, ConfigError, pool_layout
from cluster.run.actors import WorkerActor
from transfer.nccl_env import NCCL_PROCESS_ENV
from worker.spec import WorkerSpec

logger = logging.getLogger(__name__)

SCALE_UP_WAIT_S = 30.0  # Ray: how long ``add_replica`` waits for a new actor before leaving it pending


@dataclass(eq=False)  # a worker is itself: membership tests (``in pending``) compare identity
class WorkerRecord:
    name: str
    role: str
    actor: object
    info: dict = field(default_factory=dict)
    pool: str = ""
    group: object | None = None  # Ray: the placement group it was placed in
    bundle: int = 0  # ... and its bundle there
    own_group: bool = False  # Ray: a group of its own (an added replica): removed with it


class _Resizable:
    """What both pools share for live resizing."""

    def _init_resizing(self, config: ClusterConfig, model_path: str, router_addresses: list[str], host: str) -> None:
        self.config, self._model_path, self._router_addresses, self._host = config, model_path, router_addresses, host
        self.workers: list[WorkerRecord] = []  # replaced, never changed in place: the monitor iterates it
        self.draining: list[WorkerRecord] = []
        self.pending: list[WorkerRecord] = []  # Ray: started, not placed yet
        self._next_index = {name: pool.replicas for name, _, pool in pool_layout(config)}

    def active(self, pool: str) -> list[WorkerRecord]:
        """The pool's serving workers (pending ones included), oldest first."""
        return [r for r in self.workers + self.pending if r.pool == pool]

    def new_spec(self, pool: str) -> WorkerSpec:
        """The pool's next worker's spec, under the next unused name."""
        section = getattr(self.config.pools, pool).model_copy(update={"replicas": 1})
        one = self.config.model_copy(update={"pools": self.config.pools.model_copy(update={pool: section})})
        spec = next(s for s in one.worker_specs(self._model_path, self._router_addresses, self._host) if s.pool == pool)
        spec.name = f"{pool}-{self._next_index[pool]}"
        self._next_index[pool] += 1
        return spec

    def begin_removal(self, record: WorkerRecord) -> None:
        self.workers = [r for r in self.workers if r is not record]
        self.draining = self.draining + [record]

    def forget(self, record: WorkerRecord) -> None:
        self.draining = [r for r in self.draining if r is not record]
        self.pending = [r for r in self.pending if r is not record]


class LocalPools(_Resizable):
    def __init__(self, config: ClusterConfig, model_path: str, router_addresses: list[str], host: str) -> None:
        self._init_resizing(config, model_path, router_addresses, host)
        try:
            for spec in config.worker_specs(model_path, router_addresses, host):
                actor = WorkerActor(spec)
                self.workers.append(WorkerRecord(spec.name, spec.role.value, actor, actor.info(), spec.pool))
        except BaseException:
            self.stop()
            raise

    def add_replica(self, pool: str, on_ready: Callable[[WorkerRecord], None]) -> WorkerRecord:
        """A thread: ready, and ``on_ready`` called, when this returns."""
        spec = self.new_spec(pool)
        actor = WorkerActor(spec)
        record = WorkerRecord(spec.name, spec.role.value, actor, actor.info(), pool)
        self.workers = self.workers + [record]
        on_ready(record)
        return record

    def drained(self, record: WorkerRecord) -> bool:
        return bool(record.actor.info().get("drained"))

    def stop_replica(self, record: WorkerRecord) -> None:
        record.actor.stop()
        self.forget(record)

    def start_monitor(self, router) -> None:
        pass  # threads do not die alone; nothing restarts them

    def stop(self) -> None:
        for record in self.workers + self.draining:
            record.actor.stop()

    def kill_local_workers(self, after_clean_stop: bool = False) -> None:
        pass  # threads of this process: they end with it

    def responsive(self, timeout_s: float) -> bool:
        return True


class RayPools(_Resizable):
    def __init__(self, config: ClusterConfig, model_path: str, router_addresses: list[str], host: str) -> None:
        import ray

        self._init_resizing(config, model_path, router_addresses, host)
        self.groups: list = []
        self._free_bundles: dict[str, list[tuple[object, int]]] = {}  # per pool: bundles removed replicas freed
        self._stop = threading.Event()
        self.node_id = ray.get_runtime_context().get_node_id()  # where `pdserve serve` runs
        self._remote_cls = ray.remote(max_restarts=config.ray.max_restarts, max_task_retries=0)(WorkerActor)
        specs = config.worker_specs(model_path, router_addresses, host)
        try:
            for pool_name, _, pool in pool_layout(config):
                if pool.replicas == 0:
                    continue
                bundle = _bundle(pool)
                group = ray.util.placement_group(
                    [dict(bundle) for _ in range(pool.replicas)],
                    strategy=pool.placement_strategy,
                    name=f"pdserve-{pool_name}",
                )
                self.groups.append(group)
                try:
                    ray.get(group.ready(), timeout=config.ray.start_timeout_s)
                except ray.exceptions.GetTimeoutError:
                    raise ConfigError(
                        f"pools.{pool_name}: the Ray cluster cannot place {pool.replicas} x {bundle} "
                        f"(available: {ray.available_resources()})"
                    ) from None
                for index, spec in enumerate(s for s in specs if s.pool == pool_name):
                    actor = self._start_actor(spec, pool, group, index)
                    self.workers.append(WorkerRecord(spec.name, spec.role.value, actor, {}, pool_name, group, index))
            infos = ray.get([w.actor.info.remote() for w in self.workers], timeout=config.ray.start_timeout_s)
            for record, info in zip(self.workers, infos):
                record.info = info
        except BaseException:
            self.stop()
            raise

    def _start_actor(self, spec, pool, group, index: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return self._remote_cls.options(
            name=f"pdserve-{spec.name}",
            num_cpus=pool.cpus_per_replica,
            num_gpus=spec.gpus,
            resources=pool.resources or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
            runtime_env={"env_vars": dict(NCCL_PROCESS_ENV)},  # in the process before it starts (transfer/nccl_env)
        ).remote(spec)

    def add_replica(self, pool_name: str, on_ready: Callable[[WorkerRecord], None]) -> WorkerRecord:
        """``on_ready`` is called once the actor has started: before this returns if within ``SCALE_UP_WAIT_S``,
        else from a thread that waits while the record sits in ``pending``."""
        import ray

        spec, pool = self.new_spec(pool_name), getattr(self.config.pools, pool_name)
        free = self._free_bundles.get(pool_name) or []
        if free:
            (group, index), own = free.pop(), False
        else:
            group = ray.util.placement_group([_bundle(pool)], strategy="PACK", name=f"pdserve-{spec.name}")
            index, own = 0, True
            self.groups.append(group)
        actor = self._start_actor(spec, pool, group, index)
        record = WorkerRecord(spec.name, spec.role.value, actor, {}, pool_name, group, index, own)
        self.pending = self.pending + [record]
        try:
            record.info = ray.get(actor.info.remote(), timeout=SCALE_UP_WAIT_S)
        except ray.exceptions.GetTimeoutError:
            logger.warning("%s: not placed within %.0f s; it joins when Ray places it", spec.name, SCALE_UP_WAIT_S)
            threading.Thread(target=self._await_start, args=(record, on_ready), daemon=True).start()
            return record
        self._started(record, on_ready)
        return record

    def _await_start(self, record: WorkerRecord, on_ready: Callable[[WorkerRecord], None]) -> None:
        import ray

        while not self._stop.is_set() and record in self.pending:
            try:
                record.info = ray.get(record.actor.info.remote(), timeout=5)
            except ray.exceptions.GetTimeoutError:
                continue
            except Exception:
                logger.exception("%s: failed to start", record.name)
                self.forget(record)
                return
            if record in self.pending:  # not removed meanwhile
                self._started(record, on_ready)
            return

    def _started(self, record: WorkerRecord, on_ready: Callable[[WorkerRecord], None]) -> None:
        self.pending = [r for r in self.pending if r is not record]
        self.workers = self.workers + [record]
        on_ready(record)

    def drained(self, record: WorkerRecord) -> bool:
        """A pending or dead worker counts as drained."""
        import ray

        if not record.info:
            return True
        try:
            return bool(ray.get(record.actor.info.remote(), timeout=5).get("drained"))
        except Exception:
            return True

    def stop_replica(self, record: WorkerRecord, timeout_s: float = 5.0) -> None:
        """Stop and kill the actor; its own group is removed, or its bundle given back to the pool."""
        import ray

        try:
            ray.wait([record.actor.stop.remote()], timeout=timeout_s)
        except Exception:
            pass
        try:
            ray.kill(record.actor, no_restart=True)
        except Exception:
            pass
        if record.own_group:
            try:
                ray.util.remove_placement_group(record.group)
            except Exception:
                pass
            self.groups = [g for g in self.groups if g is not record.group]
        elif record.group is not None:
            self._free_bundles.setdefault(record.pool, []).append((record.group, record.bundle))
        self.forget(record)

    def start_monitor(self, router, interval_s: float = 0.5) -> None:
        threading.Thread(target=self._monitor, args=(router, interval_s), name="pdserve-monitor", daemon=True).start()

    def _monitor(self, router, interval_s: float) -> None:
        """Mark a dead actor dead, re-register a restarted one, restart a degraded one (counts against
        ``ray.max_restarts``)."""
        import ray

        while not self._stop.wait(interval_s):
            for record in self.workers:
                try:
                    info = ray.get(record.actor.info.remote(), timeout=5)
                except Exception as exc:
                    if not self._stop.is_set():
                        router.mark_dead_threadsafe(record.name, f"worker process gone ({type(exc).__name__})")
                    continue
                if info.get("command_address") != record.info.get("command_address"):
                    logger.warning("worker %s restarted (pid %s); re-registering", record.name, info.get("pid"))
                    record.info = info
                    router.add_worker_threadsafe(
                        record.name, record.role, info["command_address"], info.get("kv_address")
                    )
                elif info.get("degraded"):
                    # a worker whose loop keeps failing fails every request it gets: restart its process
                    logger.error("worker %s is degraded (%s); restarting it", record.name, info["degraded"])
                    router.mark_dead_threadsafe(record.name, f"degraded: {info['degraded']}")
                    ray.kill(record.actor, no_restart=False)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask every worker to stop (in parallel, bounded), then kill the actors and free their placement groups."""
        import ray

        self._stop.set()
        records = self.workers + self.draining + self.pending
        pending = [record.actor.stop.remote() for record in records]
        try:
            ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        except Exception:  # a dead worker or a dead Ray: the actors are killed next anyway
            pass
        for record in records:
            try:
                ray.kill(record.actor, no_restart=True)
            except Exception:
                pass
        for group in self.groups:
            try:
                ray.util.remove_placement_group(group)
            except Exception:
                pass

    def responsive(self, timeout_s: float) -> bool:
        """Whether Ray answers a call to a worker within ``timeout_s`` (not once its raylet is gone)."""
        import ray

        if not self.workers:
            return True
        answered = threading.Event()

        def probe() -> None:
            try:
                ray.get(self.workers[0].actor.info.remote(), timeout=timeout_s)
                answered.set()
            except Exception:
                pass

        threading.Thread(target=probe, name="pdserve-ray-probe", daemon=True).start()
        return answered.wait(timeout_s)

    def kill_local_workers(self, after_clean_stop: bool = False) -> None:
        """SIGKILL this node's worker processes still alive: the last resort when Ray's own processes are gone.

        Only PIDs our actors reported, on this node, and still running a Ray worker are touched."""
        for record in self.workers + self.draining:
            pid = record.info.get("pid")
            if not isinstance(pid, int) or record.info.get("node_id") != self.node_id:
                continue
            if _is_ray_worker(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                    # after a clean stop the process was only still on its way out: not worth a warning
                    logger.log(
                        logging.DEBUG if after_clean_stop else logging.WARNING,
                        "killed worker %s (pid %d)",
                        record.name,
                        pid,
                    )
                except OSError:
                    pass


def _bundle(pool) -> dict[str, float]:
    bundle = {"CPU": pool.cpus_per_replica, **pool.resources}
    if pool.gpus_per_replica:
        bundle["GPU"] = pool.gpus_per_replica
    return bundle


def _is_ray_worker(pid: int) -> bool:
    if not os.path.isdir("/proc"):  # no procfs (macOS): trust the PID our actor reported
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"ray" in f.read()
    except OSError:
        return False
