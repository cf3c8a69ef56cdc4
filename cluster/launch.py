"""Starting and stopping a served cluster: Ray, one placement group per pool, worker actors, router, HTTP server.

``start_serving(config)`` returns a ``ServeHandle`` once every worker has reported its addresses and the HTTP server
is accepting connections; ``handle.stop()`` undoes all of it (server, actors, placement groups, and Ray itself when
it was started here). Every wait is bounded: a pool the cluster cannot place is a clear error naming the pool and
what it asked for, not a hang.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field

from cluster.config import ClusterConfig, ConfigError

logger = logging.getLogger(__name__)


@dataclass
class WorkerRecord:
    name: str
    role: str
    actor: object
    info: dict = field(default_factory=dict)


@dataclass
class ServeHandle:
    config: ClusterConfig
    base_url: str
    router: object
    workers: list[WorkerRecord]
    placement_groups: list
    started_ray: bool
    _server: object = None
    _thread: threading.Thread | None = None
    _monitor_stop: threading.Event = field(default_factory=threading.Event)
    _loop: asyncio.AbstractEventLoop | None = None

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def worker_infos(self) -> list[dict]:
        return [dict(w.info, name=w.name, role=w.role) for w in self.workers]

    def stop(self, timeout_s: float = 30.0) -> None:
        import ray

        self._monitor_stop.set()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        for worker in self.workers:
            try:
                ray.get(worker.actor.stop.remote(), timeout=10)
            except Exception:  # dead or stuck: it is killed next anyway
                pass
            ray.kill(worker.actor, no_restart=True)
        for group in self.placement_groups:
            ray.util.remove_placement_group(group)
        if self.started_ray:
            ray.shutdown()


def _pool_layout(config: ClusterConfig) -> list[tuple[str, str, object]]:
    """(pool name, worker role, pool section) for every pool that gets workers."""
    if config.mode == "colocated":
        # the same workers as the disaggregated layout would use, each doing both phases
        return [("prefill", "colocated", config.pools.prefill), ("decode", "colocated", config.pools.decode)]
    return [("prefill", "prefill", config.pools.prefill), ("decode", "decode", config.pools.decode)]


def _engine_settings(config: ClusterConfig, pool, role: str) -> dict:
    import torch

    return {
        "model": config.model.name,
        "dtype": config.model.dtype,
        "device": "cuda" if pool.gpus_per_replica > 0 and torch.cuda.is_available() else "cpu",
        "block_size": config.transfer.block_size,
        "num_kv_blocks": pool.kv_blocks,
        "kv_cache_memory_bytes": pool.kv_memory_mb * 1024 * 1024,
        "max_model_len": config.model.max_model_len,
        "max_batch_tokens": pool.max_batch_tokens,
        "max_num_seqs": pool.max_num_seqs,
        "enable_prefix_caching": pool.enable_prefix_caching,
        "torch_threads": pool.torch_threads,
    }


def _ensure_ray(config: ClusterConfig, address: str | None) -> bool:
    import ray

    if ray.is_initialized():
        return False
    address = address or config.ray.address
    if address:
        ray.init(address=address, namespace=config.ray.namespace, logging_level=logging.WARNING)
        return True
    needed = sum(pool.replicas * pool.cpus_per_replica for _, _, pool in _pool_layout(config))
    ray.init(
        num_cpus=max(int(needed + 0.999), os.cpu_count() or 1),
        namespace=config.ray.namespace,
        include_dashboard=False,
        logging_level=logging.WARNING,
    )
    return True


def start_serving(
    config: ClusterConfig, address: str | None = None, host: str | None = None, port: int | None = None
) -> ServeHandle:
    import ray
    import uvicorn
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from cluster.actors import WorkerActor
    from cluster.api import create_app
    from cluster.router import Router
    from engine.model_loader import load_tokenizer, resolve_model_path

    model_path = str(resolve_model_path(config.model.name))  # converts the default model once, before the workers
    tokenizer = load_tokenizer(model_path)
    started_ray = _ensure_ray(config, address)
    bind_host = config.ray.worker_host
    if bind_host == "auto":
        bind_host = ray.util.get_node_ip_address()
    router = Router(config, host=bind_host)
    groups, workers = [], []
    transfer = {
        "deadline_s": config.transfer.deadline_s,
        "lease_s": config.transfer.lease_s,
        "wire_dtype": config.transfer.kv_wire_dtype,
        "secret": config.transfer.secret,
    }
    remote_cls = ray.remote(max_restarts=config.ray.max_restarts, max_task_retries=0)(WorkerActor)
    try:
        for pool_name, role, pool in _pool_layout(config):
            if pool.replicas == 0:
                continue
            bundle = {"CPU": pool.cpus_per_replica, **({"GPU": pool.gpus_per_replica} if pool.gpus_per_replica else {}),
                      **pool.resources}
            group = ray.util.placement_group([dict(bundle) for _ in range(pool.replicas)], strategy=pool.placement_strategy)
            groups.append(group)
            try:
                ray.get(group.ready(), timeout=config.ray.start_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise ConfigError(
                    f"pools.{pool_name}: the Ray cluster cannot place {pool.replicas} x {bundle} "
                    f"(available: {ray.available_resources()})"
                ) from None
            engine = _engine_settings(config, pool, role)
            engine["model"] = model_path
            for index in range(pool.replicas):
                name = f"{pool_name}-{index}"
                options = {"name": name, "role": role, "router_address": router.event_address, "host": bind_host,
                           "secret": config.transfer.secret}
                actor = remote_cls.options(
                    name=f"pdserve-{name}",
                    num_cpus=pool.cpus_per_replica,
                    num_gpus=pool.gpus_per_replica,
                    resources=pool.resources or None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
                ).remote(role, options, engine, config.transfer.backend, transfer, config.transfer.failure_policy,
                         config.transfer.zmq_transport, config.transfer.stream_layers)
                workers.append(WorkerRecord(name, role, actor))
        infos = ray.get([w.actor.info.remote() for w in workers], timeout=config.ray.start_timeout_s)
        for record, info in zip(workers, infos):
            record.info = info
            router.add_worker(record.name, record.role, info["command_address"], info.get("kv_address"))
    except BaseException:
        for record in workers:
            ray.kill(record.actor, no_restart=True)
        for group in groups:
            ray.util.remove_placement_group(group)
        if started_ray:
            ray.shutdown()
        raise

    max_model_len = config.model.max_model_len or int(
        getattr(__import__("transformers").AutoConfig.from_pretrained(model_path), "max_position_embeddings", 2048)
    )
    app = create_app(router, tokenizer, config, max_model_len)
    http_host = host or config.router.host
    http_port = config.router.port if port is None else port
    sock = socket.socket(socket.AF_INET6 if ":" in http_host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((http_host, http_port))
    http_port = sock.getsockname()[1]

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="pdserve-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.02)
    url_host = f"[{http_host}]" if ":" in http_host else http_host
    handle = ServeHandle(config, f"http://{url_host}:{http_port}", router, workers, groups, started_ray, server, thread)
    threading.Thread(target=_monitor, args=(handle,), name="pdserve-monitor", daemon=True).start()
    return handle


def _monitor(handle: ServeHandle, interval_s: float = 0.5) -> None:
    """Re-register a worker that Ray restarted (it comes back with new addresses)."""
    import ray

    while not handle._monitor_stop.wait(interval_s):
        for record in handle.workers:
            try:
                info = ray.get(record.actor.info.remote(), timeout=5)
            except Exception as exc:  # dead or restarting: stop routing to it now, not after the heartbeat timeout
                handle.router.mark_dead_threadsafe(record.name, f"worker process gone ({type(exc).__name__})")
                continue
            if info.get("command_address") != record.info.get("command_address"):
                logger.warning("worker %s restarted (pid %s); re-registering", record.name, info.get("pid"))
                record.info = info
                handle.router.add_worker_threadsafe(record.name, record.role, info["command_address"], info.get("kv_address"))
