"""The worker pools behind a router: Ray actors in placement groups (``RayPools``), or threads (``LocalPools``).

Both start each worker from its ``WorkerSpec`` (``ClusterConfig.worker_specs``). On Ray each pool gets a placement
group from its config section, each replica an actor pinned to a bundle and restarted up to ``ray.max_restarts``
times; a monitor thread marks dead actors dead at once and re-registers restarted ones (new addresses). Threads
behave the same but for placement and restarts. Live resizing (cluster/run/scaling.py; where an added replica is
placed and why: docs/planner.md, "Live resizing") gets each new replica the pool's next unused name.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cluster.config import ClusterConfig, ConfigError, pool_layout
from cluster.routing.errors import ScaleError
from cluster.run.actors import TPRankActor, WorkerActor
from transfer.nccl_env import NCCL_PROCESS_ENV
from worker.spec import WorkerSpec

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

logger = logging.getLogger(__name__)

SCALE_UP_WAIT_S = 30.0  # Ray: how long ``add_replica`` waits for a new actor before leaving it pending
DRAIN_TIMEOUT_S = 60.0  # default: how long a removed or switching worker may take to finish what it holds
DRAIN_POLL_S = 0.05  # how often a draining worker is asked whether it is drained


def drain_timeout(value: object) -> float | None:
    """A client's ``drain_timeout_s`` (None: the default); ScaleError naming the field unless a number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ScaleError("drain_timeout_s", f"drain_timeout_s must be a number > 0, got {value!r}")
    return float(value)


@dataclass(eq=False)  # a worker is itself: membership tests (``in pending``) compare identity
class WorkerRecord:
    name: str
    role: str
    # LocalPools: the WorkerActor itself; RayPools: its Ray actor handle (methods called through ``.remote()``, which
    # Ray types dynamically); None until started
    actor: Any
    info: dict[str, Any] = field(default_factory=dict)
    pool: str = ""
    group: PlacementGroup | None = None  # Ray: the placement group it was placed in
    bundle: int = 0  # ... and its bundle there
    own_group: bool = False  # Ray: a group of its own (an added replica, a tensor-parallel one): removed with it
    ranks: list[Any] = field(default_factory=list)  # several ranks (pool.ranks): ranks 1..N-1 (``TPRankActor``s)
    spec: WorkerSpec | None = None  # Ray, tensor-parallel: what a restart of all its ranks starts again
    restarts: int = 0  # ... and how many times they were restarted together
    restarting: bool = False
    switching: bool = False  # a role switch is under way (cluster/run/role_switch.py): the monitor leaves it alone


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
        spec = self.pool_spec(pool, f"{pool}-{self._next_index[pool]}")
        self._next_index[pool] += 1
        return spec

    def pool_spec(self, pool: str, name: str) -> WorkerSpec:
        """A worker of ``pool`` named ``name`` (a new one, or one switching into the pool)."""
        section = getattr(self.config.pools, pool).model_copy(update={"replicas": 1})
        one = self.config.model_copy(update={"pools": self.config.pools.model_copy(update={pool: section})})
        spec = next(s for s in one.worker_specs(self._model_path, self._router_addresses, self._host) if s.pool == pool)
        spec.name = name
        return spec

    def switched(self, record: WorkerRecord, spec: WorkerSpec, info: dict[str, Any]) -> None:
        """The record of a worker now serving in another pool (same name, same placement)."""
        record.pool, record.role, record.spec, record.info = spec.pool, spec.role.value, spec, info

    def begin_removal(self, record: WorkerRecord) -> None:
        self.workers = [r for r in self.workers if r is not record]
        self.draining = self.draining + [record]

    def _started(self, record: WorkerRecord, on_ready: Callable[[WorkerRecord], None]) -> None:
        self.pending = [r for r in self.pending if r is not record]
        self.workers = self.workers + [record]
        on_ready(record)

    def wait_drained(self, record: WorkerRecord, until: float, stop: threading.Event) -> bool:
        """Poll ``drained`` until it says so (a worker whose process is gone counts as drained) or monotonic ``until``
        passes; False then, or once ``stop`` is set."""
        while not stop.is_set():
            try:
                if self.drained(record):
                    return True
            except Exception:  # its thread or process is gone: nothing left to wait for
                return True
            if time.monotonic() >= until:
                return False
            stop.wait(DRAIN_POLL_S)
        return False

    def drained(self, record: WorkerRecord) -> bool:
        raise NotImplementedError

    def forget(self, record: WorkerRecord) -> None:
        self.draining = [r for r in self.draining if r is not record]
        self.pending = [r for r in self.pending if r is not record]


class LocalPools(_Resizable):
    def __init__(self, config: ClusterConfig, model_path: str, router_addresses: list[str], host: str) -> None:
        self._init_resizing(config, model_path, router_addresses, host)
        try:
            for spec in config.worker_specs(model_path, router_addresses, host):
                self.workers.append(self._start(spec, config.ray.start_timeout_s))
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _start(spec: WorkerSpec, timeout_s: float) -> WorkerRecord:
        """Rank 0 here; ranks 1..N-1 of a tensor-parallel worker are built in threads meanwhile (they meet it)."""
        size = spec.engine.ranks
        if size == 1:
            actor = WorkerActor(spec)
            return WorkerRecord(spec.name, spec.role.value, actor, actor.info(), spec.pool)
        spec = dataclasses.replace(spec, tp_rendezvous=rendezvous_path())
        built: dict[int, TPRankActor | BaseException] = {}

        def build(rank: int) -> None:
            try:
                built[rank] = TPRankActor(spec, rank)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
                built[rank] = exc

        threads = [threading.Thread(target=build, args=(r,), daemon=True) for r in range(1, size)]
        for thread in threads:
            thread.start()
        try:
            actor = WorkerActor(spec)
        finally:
            for thread in threads:
                thread.join(timeout_s)
        ranks = [
            built.get(r, TimeoutError(f"{spec.name}: rank {r} not built within {timeout_s:.0f} s"))
            for r in range(1, size)
        ]
        failed = next((r for r in ranks if isinstance(r, BaseException)), None)
        if failed is not None:
            actor.stop()
            raise failed
        return WorkerRecord(spec.name, spec.role.value, actor, actor.info(), spec.pool, ranks=ranks)

    def add_replica(self, pool: str, on_ready: Callable[[WorkerRecord], None]) -> WorkerRecord:
        """A thread: ready, and ``on_ready`` called, when this returns."""
        record = self._start(self.new_spec(pool), self.config.ray.start_timeout_s)
        self._started(record, on_ready)
        return record

    def drained(self, record: WorkerRecord) -> bool:
        return bool(record.actor.info().get("drained"))

    def switch_role(self, record: WorkerRecord, spec: WorkerSpec, timeout_s: float) -> dict[str, Any]:
        """The worker's ``info()`` in its new role (``WorkerActor.switch_role``)."""
        return record.actor.switch_role(spec, timeout_s)

    def restart_as(self, record: WorkerRecord, spec: WorkerSpec) -> dict[str, Any]:
        """A worker that died mid-switch, started again as ``spec`` (a load): its ``info()``."""
        _stop_local(record)
        started = self._start(spec, self.config.ray.start_timeout_s)
        record.actor, record.ranks, record.restarts = started.actor, started.ranks, record.restarts + 1
        return started.info

    def stop_replica(self, record: WorkerRecord) -> None:
        _stop_local(record)
        self.forget(record)

    def start_monitor(self, router) -> None:
        pass  # threads do not die alone; nothing restarts them

    def stop(self) -> None:
        for record in self.workers + self.draining:
            _stop_local(record)

    def kill_local_workers(self, after_clean_stop: bool = False) -> None:
        pass  # threads of this process: they end with it

    def responsive(self, timeout_s: float) -> bool:
        return True


class RayPools(_Resizable):
    def __init__(self, config: ClusterConfig, model_path: str, router_addresses: list[str], host: str) -> None:
        import ray

        self._init_resizing(config, model_path, router_addresses, host)
        self.groups: list[PlacementGroup] = []
        self._free_bundles: dict[str, list[tuple[PlacementGroup, int]]] = {}  # per pool: bundles removed replicas freed
        self._stop = threading.Event()
        self.node_id = ray.get_runtime_context().get_node_id()  # where `pdserve serve` runs
        self._remote_cls = ray.remote(max_restarts=config.ray.max_restarts, max_task_retries=0)(WorkerActor)
        # a tensor-parallel worker's ranks are restarted together, by the monitor, never one by Ray alone
        self._leader_cls = ray.remote(max_restarts=0, max_task_retries=0)(WorkerActor)
        self._rank_cls = ray.remote(max_restarts=0, max_task_retries=0)(TPRankActor)
        specs = config.worker_specs(model_path, router_addresses, host)
        try:
            for pool_name, _, pool in pool_layout(config):
                if pool.replicas == 0:
                    continue
                pool_specs = [s for s in specs if s.pool == pool_name]
                if pool.ranks == 1:  # one group for the pool, a bundle per replica
                    group = self._placement(pool_name, pool, pool.replicas, pool.placement_strategy, pool_name)
                    placed = [(spec, group, index, False) for index, spec in enumerate(pool_specs)]
                else:  # a group per replica: its N ranks on one node
                    size = pool.ranks
                    placed = [
                        (s, self._placement(pool_name, pool, size, "STRICT_PACK", s.name), 0, True) for s in pool_specs
                    ]
                for spec, group, index, own in placed:
                    record = WorkerRecord(spec.name, spec.role.value, None, {}, pool_name, group, index, own, spec=spec)
                    self._start(record, pool)
                    self.workers.append(record)
            for record in self.workers:
                self._await_info(record, config.ray.start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _placement(self, pool_name: str, pool, bundles: int, strategy: str, name: str):
        """A ready placement group of ``bundles`` x the pool's bundle; ConfigError naming the pool when it cannot be
        placed within ``ray.start_timeout_s``."""
        import ray

        bundle = _bundle(pool)
        group = ray.util.placement_group(
            [dict(bundle) for _ in range(bundles)], strategy=strategy, name=f"pdserve-{name}"
        )
        self.groups.append(group)
        try:
            ray.get(group.ready(), timeout=self.config.ray.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            what = f"{pool.replicas} x {bundle}"
            if pool.ranks > 1:
                degrees = f"tensor_parallel_size {pool.tensor_parallel_size}, expert_parallel_size {pool.expert_parallel_size}"
                what = f"{pool.ranks} x {bundle} on one node ({degrees})"
            raise ConfigError(
                f"pools.{pool_name}: the Ray cluster cannot place {what} (available: {ray.available_resources()})"
            ) from None
        return group

    def _start(self, record: WorkerRecord, pool, suffix: str = "") -> None:
        """Start the record's actors in its group: one, or a tensor-parallel worker's N ranks meeting at a fresh
        rendezvous (bundle r for rank r). ``suffix``: after a name still taken (a live name may not be reused at
        once)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert record.spec is not None and record.group is not None
        spec, size, group = record.spec, pool.ranks, record.group
        if size > 1:
            spec = dataclasses.replace(spec, tp_rendezvous=rendezvous_path())

        def options(name: str, bundle: int) -> dict:
            return dict(
                name=name,
                num_cpus=pool.cpus_per_replica,
                num_gpus=spec.gpus,
                resources=pool.resources or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle),
                runtime_env={"env_vars": dict(NCCL_PROCESS_ENV)},  # in the process before it starts (transfer/nccl_env)
            )

        if size == 1:
            name = f"pdserve-{spec.name}{suffix}"
            record.actor = self._remote_cls.options(**options(name, record.bundle)).remote(spec)
            return
        suffix = f"-{record.restarts}" if record.restarts else ""
        record.ranks = [
            self._rank_cls.options(**options(f"pdserve-{spec.name}-rank{r}{suffix}", r)).remote(spec, r)
            for r in range(1, size)
        ]
        record.actor = self._leader_cls.options(**options(f"pdserve-{spec.name}{suffix}", 0)).remote(spec)

    def _await_info(self, record: WorkerRecord, timeout_s: float) -> None:
        """Wait for the worker to start (a tensor-parallel one: every rank), keeping what each reports."""
        import ray

        record.info = ray.get(record.actor.info.remote(), timeout=timeout_s)
        if record.ranks:
            record.info["ranks"] = ray.get([r.info.remote() for r in record.ranks], timeout=timeout_s)

    def add_replica(self, pool_name: str, on_ready: Callable[[WorkerRecord], None]) -> WorkerRecord:
        """``on_ready`` is called once the actor has started: before this returns if within ``SCALE_UP_WAIT_S``,
        else from a thread that waits while the record sits in ``pending``."""
        import ray

        spec, pool = self.new_spec(pool_name), getattr(self.config.pools, pool_name)
        size = pool.ranks
        free = self._free_bundles.get(pool_name) or []
        if free and size == 1:
            (group, index), own = free.pop(), False
        else:  # not waited for: one that cannot be placed stays pending (the autoscaler's demand)
            strategy = "STRICT_PACK" if size > 1 else "PACK"
            group = ray.util.placement_group([_bundle(pool)] * size, strategy=strategy, name=f"pdserve-{spec.name}")
            index, own = 0, True
            self.groups.append(group)
        record = WorkerRecord(spec.name, spec.role.value, None, {}, pool_name, group, index, own, spec=spec)
        self._start(record, pool)
        self.pending = self.pending + [record]
        try:
            self._await_info(record, SCALE_UP_WAIT_S)
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
                self._await_info(record, 5)
            except ray.exceptions.GetTimeoutError:
                continue
            except Exception:
                logger.exception("%s: failed to start", record.name)
                self.forget(record)
                return
            if record in self.pending:  # not removed meanwhile
                self._started(record, on_ready)
            return

    def drained(self, record: WorkerRecord) -> bool:
        """A pending or dead worker counts as drained."""
        import ray

        if not record.info:
            return True
        try:
            return bool(ray.get(record.actor.info.remote(), timeout=5).get("drained"))
        except Exception:
            return True

    def switch_role(self, record: WorkerRecord, spec: WorkerSpec, timeout_s: float) -> dict[str, Any]:
        """The worker's ``info()`` in its new role (``WorkerActor.switch_role``); a Ray error if its process died."""
        import ray

        return ray.get(record.actor.switch_role.remote(spec, timeout_s), timeout=timeout_s + 30)

    def restart_as(self, record: WorkerRecord, spec: WorkerSpec) -> dict[str, Any]:
        """A worker that died mid-switch: its actor killed for good and started again as ``spec`` in the same bundle
        (a load, counted against ``ray.max_restarts``): its ``info()``."""
        self._stop_actors([record], timeout_s=2.0)
        record.restarts += 1
        record.spec = spec
        self._start(record, getattr(self.config.pools, spec.pool), suffix=f"-{record.restarts}")
        self._await_info(record, self.config.ray.start_timeout_s)
        return record.info

    def stop_replica(self, record: WorkerRecord, timeout_s: float = 5.0) -> None:
        """Stop and kill the actors; its own group is removed, or its bundle given back to the pool."""
        import ray

        self._stop_actors([record], timeout_s)
        if record.own_group:
            try:
                ray.util.remove_placement_group(record.group)
            except Exception:
                pass
            self.groups = [g for g in self.groups if g is not record.group]
        elif record.group is not None:
            self._free_bundles.setdefault(record.pool, []).append((record.group, record.bundle))
        self.forget(record)

    @staticmethod
    def _stop_actors(records: list[WorkerRecord], timeout_s: float) -> None:
        """Ask each worker to stop (rank 0 first: it tells its ranks), bounded, then kill every actor for good."""
        import ray

        for actors in ([r.actor for r in records], [rank for r in records for rank in r.ranks]):
            waits = [actor.stop.remote() for actor in actors]
            try:
                ray.wait(waits, num_returns=len(waits), timeout=timeout_s)
            except Exception:  # a dead worker or a dead Ray: the actors are killed next anyway
                pass
        for actor in [a for r in records for a in (r.actor, *r.ranks)]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass

    def start_monitor(self, router, interval_s: float = 0.5) -> None:
        threading.Thread(target=self._monitor, args=(router, interval_s), name="pdserve-monitor", daemon=True).start()

    def _monitor(self, router, interval_s: float) -> None:
        """Mark a dead actor dead, re-register a restarted one, restart a degraded one (counts against
        ``ray.max_restarts``); a tensor-parallel worker with any rank gone or its group broken restarts whole."""
        import ray

        while not self._stop.wait(interval_s):
            for record in self.workers:
                if record.restarting or record.switching:
                    continue
                try:
                    info = ray.get(record.actor.info.remote(), timeout=5)
                    ranks = ray.get([r.info.remote() for r in record.ranks], timeout=5) if record.ranks else []
                except Exception as exc:
                    if self._stop.is_set():
                        continue
                    router.mark_dead_threadsafe(record.name, f"worker process gone ({type(exc).__name__})")
                    if record.ranks:
                        self._restart_together(router, record, f"a rank's process is gone ({type(exc).__name__})")
                    continue
                stopped = next((f"rank {r['rank']}: {r['ended']}" for r in ranks if not r["serving"]), "")
                if record.ranks and (stopped or info.get("degraded")):
                    router.mark_dead_threadsafe(record.name, f"degraded: {stopped or info['degraded']}")
                    self._restart_together(router, record, stopped or info["degraded"])
                elif info.get("command_address") != record.info.get("command_address"):
                    logger.warning("worker %s restarted (pid %s); re-registering", record.name, info.get("pid"))
                    if info.get("role") != record.role:  # Ray restarts an actor with the spec it was made with
                        self._restore_role(router, record)
                        continue
                    record.info = info
                    router.add_worker_threadsafe(
                        record.name, record.role, info["command_address"], info.get("kv_address")
                    )
                elif info.get("degraded"):
                    # a worker whose loop keeps failing fails every request it gets: restart its process
                    logger.error("worker %s is degraded (%s); restarting it", record.name, info["degraded"])
                    router.mark_dead_threadsafe(record.name, f"degraded: {info['degraded']}")
                    ray.kill(record.actor, no_restart=False)

    def _restore_role(self, router, record: WorkerRecord) -> None:
        """A worker that switched role and was then restarted by Ray comes back in the role it was created with:
        switched again, idle as it is, to the role of its pool (from a thread; the monitor leaves it alone meanwhile),
        then registered."""
        assert record.spec is not None  # every record RayPools makes carries its spec
        record.switching = True
        spec = record.spec

        def restore() -> None:
            try:
                info = self.switch_role(record, spec, self.config.ray.start_timeout_s)
            except Exception:
                logger.exception("worker %s: could not take its %s role again after a restart", record.name, spec.pool)
                router.mark_dead_threadsafe(record.name, f"restarted in a role other than {spec.pool}")
            else:
                record.info = info
                router.add_worker_threadsafe(record.name, record.role, info["command_address"], info.get("kv_address"))
            finally:
                record.switching = False

        threading.Thread(target=restore, name=f"pdserve-restore-{record.name}", daemon=True).start()

    def _restart_together(self, router, record: WorkerRecord, why: str) -> None:
        """Kill all of a tensor-parallel worker's ranks and start them again in the same bundles, at a fresh
        rendezvous, from a thread (loading takes a while); re-registered once all of them are up."""
        limit = self.config.ray.max_restarts
        if limit != -1 and record.restarts >= limit:
            logger.error("worker %s: all %d restarts used; it stays dead (%s)", record.name, limit, why)
            record.restarting = True  # for good: the monitor leaves it alone
            return
        record.restarting = True
        logger.error("worker %s: restarting its %d ranks together (%s)", record.name, len(record.ranks) + 1, why)

        def restart() -> None:
            try:
                self._stop_actors([record], timeout_s=2.0)
                record.restarts += 1
                self._start(record, getattr(self.config.pools, record.pool))
                self._await_info(record, self.config.ray.start_timeout_s)
            except Exception:
                logger.exception("worker %s: restart failed", record.name)
            else:
                info = record.info
                router.add_worker_threadsafe(record.name, record.role, info["command_address"], info.get("kv_address"))
            record.restarting = False  # a failed restart is retried at the next turn, while restarts are left

        threading.Thread(target=restart, name=f"pdserve-restart-{record.name}", daemon=True).start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask every worker to stop (in parallel, bounded), then kill the actors and free their placement groups."""
        import ray

        self._stop.set()
        self._stop_actors(self.workers + self.draining + self.pending, timeout_s)
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
        for record, info in [(r, i) for r in self.workers + self.draining for i in (r.info, *r.info.get("ranks", []))]:
            pid = info.get("pid")
            if not isinstance(pid, int) or info.get("node_id") != self.node_id:
                continue
            if _is_ray_worker(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                    # after a clean stop the process was only still on its way out: not worth a warning
                    level = logging.DEBUG if after_clean_stop else logging.WARNING
                    logger.log(level, "killed worker %s (pid %d)", record.name, pid)
                except OSError:
                    pass


def _stop_local(record: WorkerRecord) -> None:
    record.actor.stop()  # rank 0 tells its ranks to stop
    for rank in record.ranks:
        rank.stop()


def rendezvous_path() -> str:
    """A fresh FileStore path for one incarnation of a tensor-parallel worker (its ranks share the node's /tmp)."""
    return os.path.join(tempfile.gettempdir(), f"pdserve-tp-{uuid.uuid4().hex}")


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
