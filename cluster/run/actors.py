"""Ray actors for the workers: thin shells around the Ray-free worker classes (also used as-is in-process).

Ray places and restarts them (``max_restarts``); per-request traffic goes over ZeroMQ, actor methods are only for
set-up and inspection.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from worker.hardening import close_to_other_processes, dumpable
from worker.spec import WorkerRole, WorkerSpec

if TYPE_CHECKING:
    from worker.role import Role


def role_class(role: WorkerRole) -> type[Role]:
    """The request logic a worker of this kind runs (imported here: each pulls in its transfer side)."""
    if role is WorkerRole.PREFILL:
        from prefill.worker import PrefillRole

        return PrefillRole
    if role is WorkerRole.DECODE:
        from decode.worker import DecodeRole

        return DecodeRole
    from worker.colocated import ColocatedRole

    return ColocatedRole


def _closed_if_own_process() -> None:
    """A Ray actor's process is the worker's alone: closed to the user's other processes before it holds a secret or
    a cache. An in-process pool (no actor) leaves its host process as it is."""
    import ray

    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        close_to_other_processes()


class WorkerActor:
    def __init__(self, spec: WorkerSpec) -> None:
        """Runs in the worker's own process, where the host "auto" resolves to this node's address and the GPUs Ray
        gave it are visible (``worker.spec.resolve_spec``)."""
        import ray

        _closed_if_own_process()
        if spec.runtime.host == "auto":
            spec = spec.with_host(ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1")
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        from worker.runtime import WorkerRuntime  # the engine and torch: in the worker's process only

        self.worker = WorkerRuntime(spec, role_class(spec.role))
        self.worker.start()

    def info(self) -> dict:
        return {**self.worker.info(), "pid": os.getpid(), "node_id": self.node_id, "dumpable": dumpable()}

    def snapshot(self) -> dict:
        return self.worker.snapshot()

    def switch_role(self, spec: WorkerSpec, timeout_s: float) -> dict:
        """Serve in another role with the weights loaded (``WorkerRuntime.switch_role``): ``info()`` after it."""
        if spec.runtime.host == "auto":
            spec = spec.with_host(self.worker.spec.runtime.host)  # where this worker already listens
        self.worker.switch_role(spec, role_class(spec.role), timeout_s)
        return self.info()

    def stop(self) -> None:
        self.worker.stop()

    def kill(self) -> None:
        """Die abruptly, as a SIGKILL'd process would (in-process pools have no process to kill)."""
        self.worker.kill()


class TPRankActor:
    """A rank other than 0 of a tensor-parallel worker (worker/tp_rank.py), in its own process next to rank 0."""

    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        import ray

        from worker.tp_rank import TPRank  # the engine and torch: in the rank's process only

        _closed_if_own_process()
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        self.rank = TPRank(spec, rank)

    def info(self) -> dict:
        return {**self.rank.info(), "pid": os.getpid(), "node_id": self.node_id, "dumpable": dumpable()}

    def stop(self) -> None:
        self.rank.stop()
