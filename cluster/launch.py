"""Starting and stopping a served cluster: worker pools, router, HTTP server.

``start_serving(config)`` returns a ``ServeHandle`` once every worker has reported its addresses and the HTTP server
is accepting connections; ``handle.stop()`` undoes all of it (server, workers, placement groups, and Ray itself when
it was started here). ``in_process=True`` runs the workers as threads without Ray (development, fast tests).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

from cluster.config import ClusterConfig
from cluster.pools import LocalPools, RayPools, WorkerRecord, pool_layout

logger = logging.getLogger(__name__)


@dataclass
class ServeHandle:
    config: ClusterConfig
    base_url: str
    router: object
    pools: LocalPools | RayPools
    started_ray: bool
    server: object
    thread: threading.Thread

    @property
    def workers(self) -> list[WorkerRecord]:
        return self.pools.workers

    @property
    def num_workers(self) -> int:
        return len(self.pools.workers)

    def worker_infos(self) -> list[dict]:
        return [dict(w.info, name=w.name, role=w.role) for w in self.pools.workers]

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.pools.stop()
        if self.started_ray:
            import ray

            ray.shutdown()


def _ensure_ray(config: ClusterConfig, address: str | None) -> bool:
    import ray

    if ray.is_initialized():
        return False
    address = address or config.ray.address
    if address:
        ray.init(address=address, namespace=config.ray.namespace, logging_level=logging.WARNING)
        return True
    needed = sum(pool.replicas * pool.cpus_per_replica for _, _, pool in pool_layout(config))
    # log_to_driver=False: workers log to Ray's session files, and commands that print JSON keep stdout clean
    ray.init(address="local", num_cpus=max(int(needed + 0.999), os.cpu_count() or 1), namespace=config.ray.namespace,
             include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    return True


def _bind_host(config: ClusterConfig, in_process: bool) -> str:
    if config.ray.worker_host != "auto":
        return config.ray.worker_host
    if in_process:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


def start_serving(config: ClusterConfig, address: str | None = None, host: str | None = None, port: int | None = None,
                  in_process: bool = False) -> ServeHandle:
    import uvicorn
    from transformers import AutoConfig

    from cluster.api import create_app
    from cluster.router import Router
    from engine.model_loader import load_tokenizer, resolve_model_path

    model_path = str(resolve_model_path(config.model.name))  # converts the default model once, before the workers
    tokenizer = load_tokenizer(model_path)
    max_model_len = config.model.max_model_len or int(
        getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 2048))
    started_ray = False if in_process else _ensure_ray(config, address)
    bind_host = _bind_host(config, in_process)
    router = Router(config, host=bind_host)
    try:
        worker_host = bind_host if in_process else config.ray.worker_host
        pools = (LocalPools if in_process else RayPools)(config, model_path, router.event_address, worker_host)
    except BaseException:
        if started_ray:
            import ray

            ray.shutdown()
        raise
    for record in pools.workers:
        router.add_worker(record.name, record.role, record.info["command_address"], record.info.get("kv_address"))

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
            pools.stop()
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.02)
    pools.start_monitor(router)
    url_host = f"[{http_host}]" if ":" in http_host else http_host
    return ServeHandle(config, f"http://{url_host}:{http_port}", router, pools, started_ray, server, thread)
