"""The worker pools behind a router: Ray actors placed by one placement group per pool, or threads in this process.

``RayPools`` is the real deployment: each pool gets a placement group built from its section of the config (CPU
share, GPUs, extra resources, strategy), each replica an actor pinned to a bundle, named ``pdserve-<pool>-<i>`` and
restarted by Ray up to ``ray.max_restarts`` times. A pool the cluster cannot place is a ``ConfigError`` naming the
pool and what it asked for. A monitor thread notices dead actors at once (the router stops routing to them) and
re-registers restarted ones, which come back with new addresses. The "router" it tells is the in-process router, or,
with several router processes, the group that forwards to each of them (cluster/frontend.py).

``LocalPools`` runs the same worker classes as threads of this process, with no Ray: for development and for fast
tests of the data plane. Everything but placement and restarts behaves the same.

Both start each worker from its ``WorkerSpec`` (``ClusterConfig.worker_specs``, the one translation of the config);
Ray pickles the spec into the actor, and the worker picks its device there, in its own process.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass, field

from cluster.actors import WorkerActor
from cluster.config import ClusterConfig, ConfigError, pool_layout

logger = logging.getLogger(__name__)


@dataclass
class WorkerRecord:
    name: str
    role: str
    actor: object
    info: dict = field(default_factory=dict)


class LocalPools:
    def __init__(self, config: ClusterConfig, model_path: str, router_addresses: list[str], host: str) -> None:
        self.workers: list[WorkerRecord] = []
        try:
            for spec in config.worker_specs(model_path, router_addresses, host):
                actor = WorkerActor(spec)
                self.workers.append(WorkerRecord(spec.name, spec.role.value, actor, actor.info()))
        except BaseException:
            self.stop()
            raise

    def start_monitor(self, router) -> None:
        pass  # threads do not die alone; nothing restarts them

    def stop(self) -> None:
        for record in self.workers:
            record.actor.stop()

    def kill_local_workers(self, after_clean_stop: bool = False) -> None:
        pass  # threads of this process: they end with it

    def responsive(self, timeout_s: float) -> bool:
        return True


class RayPools:
    def __init__(self, config: ClusterConfig, model_path: str, router_addresses: list[str], host: str) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.workers: list[WorkerRecord] = []
        self.groups: list = []
        self._stop = threading.Event()
        self.node_id = ray.get_runtime_context().get_node_id()  # where `pdserve serve` runs
        remote_cls = ray.remote(max_restarts=config.ray.max_restarts, max_task_retries=0)(WorkerActor)
        specs = config.worker_specs(model_path, router_addresses, host)
        try:
            for pool_name, _, pool in pool_layout(config):
                if pool.replicas == 0:
                    continue
                bundle = {"CPU": pool.cpus_per_replica, **pool.resources}
                if pool.gpus_per_replica:
                    bundle["GPU"] = pool.gpus_per_replica
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
                    actor = remote_cls.options(
                        name=f"pdserve-{spec.name}",
                        num_cpus=pool.cpus_per_replica,
                        num_gpus=spec.gpus,
                        resources=pool.resources or None,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
                    ).remote(spec)
                    self.workers.append(WorkerRecord(spec.name, spec.role.value, actor))
            infos = ray.get([w.actor.info.remote() for w in self.workers], timeout=config.ray.start_timeout_s)
            for record, info in zip(self.workers, infos):
                record.info = info
        except BaseException:
            self.stop()
            raise

    def start_monitor(self, router, interval_s: float = 0.5) -> None:
        threading.Thread(target=self._monitor, args=(router, interval_s), name="pdserve-monitor", daemon=True).start()

    def _monitor(self, router, interval_s: float) -> None:
        """Stop routing to a dead actor at once; re-register a restarted one (new addresses); restart a degraded
        one (Ray counts it against ``ray.max_restarts``)."""
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
        """Ask every worker to stop (in parallel, bounded), then kill the actors and free the placement groups."""
        import ray

        self._stop.set()
        pending = [record.actor.stop.remote() for record in self.workers]
        try:
            ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        except Exception:  # a dead worker or a dead Ray: the actors are killed next anyway
            pass
        for record in self.workers:
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
        """Whether Ray still answers a call to a worker within ``timeout_s`` (it does not once its raylet is gone)."""
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
        """SIGKILL the worker processes this pool started on this node that are still alive (by their PIDs).

        The last resort of shutdown: with Ray's own processes gone (SIGTERM to the process group), nothing else would
        end them. Only PIDs our actors reported, on this node, and still running a Ray worker are touched.
        """
        for record in self.workers:
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


def _is_ray_worker(pid: int) -> bool:
    if not os.path.isdir("/proc"):  # no procfs (macOS): trust the PID our actor reported
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"ray" in f.read()
    except OSError:
        return False
