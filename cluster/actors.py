"""Ray actors for the workers: thin shells around the Ray-free worker classes (also used as-is in-process).

Ray places and restarts them (``max_restarts``); everything they do per request goes over ZeroMQ. Actor methods
are only for set-up and inspection: ``info`` (addresses, pid, node), ``snapshot`` (load), ``stop``, and
``kill`` (die abruptly: the in-process chaos bench).
"""

from __future__ import annotations

import os

from worker.runtime import WorkerOptions
from engine.config import EngineConfig


class WorkerActor:
    def __init__(
        self, role: str, options: dict, engine: dict, backend: str, transfer: dict, failure_policy: str,
        transport: str = "tcp", stream_layers: bool = True, headroom_tokens: int = 0,
    ) -> None:
        import ray

        if options.get("host") == "auto":  # each worker binds its own node's address
            options["host"] = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        worker_options = WorkerOptions(engine=EngineConfig(**engine), **options)
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        if role == "prefill":
            from prefill.worker import PrefillWorker
            from transfer.base import TransferConfig

            transfer_config = TransferConfig(**transfer, device=worker_options.engine.device)
            self.worker = PrefillWorker(worker_options, backend, transfer_config, stream_layers)
        elif role == "decode":
            from decode.worker import DecodeWorker
            from transfer.base import TransferConfig

            transfer_config = TransferConfig(**transfer, device=worker_options.engine.device)
            self.worker = DecodeWorker(worker_options, backend, transfer_config, failure_policy, transport,
                                       headroom_tokens)
        elif role == "colocated":
            from worker.colocated import ColocatedWorker

            self.worker = ColocatedWorker(worker_options)
        else:
            raise ValueError(f"unknown worker role {role!r}")
        self.worker.start()

    def info(self) -> dict:
        return {**self.worker.info(), "pid": os.getpid(), "node_id": self.node_id}

    def snapshot(self) -> dict:
        return self.worker.snapshot()

    def stop(self) -> None:
        self.worker.stop()

    def kill(self) -> None:
        """Die abruptly, as a SIGKILL'd process would (in-process pools have no process to kill)."""
        self.worker.kill()
