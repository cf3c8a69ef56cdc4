"""Starting and stopping a served cluster: worker pools, router, HTTP server.

``start_serving`` returns a ``ServeHandle`` once every worker has reported its addresses and the HTTP server accepts
connections; ``handle.stop()`` undoes all of it. ``in_process=True`` runs the workers as threads without Ray. With
``router.processes`` > 1 the HTTP side is N router processes on one port (``cluster/run/frontend.py``). Without a
``transfer.secret`` a random one is made, so the control plane and KV handshake are authenticated with no setup.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.admin_token import admin_credential, remove_token, write_token
from cluster.config import ClusterConfig, ConfigError, pool_layout
from cluster.network_exposure import check_network_exposure
from cluster.run.autoscale import Autoscaler, CapacityModel
from cluster.run.frontend import RouterProcesses
from cluster.run.pools import LocalPools, RayPools, WorkerRecord
from cluster.run.ray_cluster import connect_ray
from cluster.run.router_process import reuseport_socket
from cluster.run.scaling import Scaler

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger(__name__)


@dataclass
class ServeHandle:
    config: ClusterConfig
    base_url: str
    router: object  # the Router, or the RouterProcesses that stand for several
    pools: LocalPools | RayPools
    started_ray: bool
    server: uvicorn.Server | None  # uvicorn's server and its thread (None with several router processes)
    thread: threading.Thread | None
    frontends: RouterProcesses | None = None
    scaler: Scaler | None = None  # live resizing (cluster/run/scaling.py)
    autoscaler: Autoscaler | None = None  # the ``autoscale:`` policy's thread, when enabled
    token_file: Path | None = None  # /admin/*'s token for this address, without an API key (cluster/admin_token.py)

    @property
    def admin_headers(self) -> dict[str, str]:
        """What a client of ``/admin/*`` sends to this cluster."""
        return {"Authorization": f"Bearer {admin_credential(self.config)}"}

    def write_admin_token(self) -> None:
        """Keep ``/admin/*``'s token where this user's CLI finds it (no file with an API key: that is the
        credential, and the user has it)."""
        if not self.config.router.api_key:
            self.token_file = write_token(self.base_url, admin_credential(self.config))

    @property
    def workers(self) -> list[WorkerRecord]:
        return self.pools.workers

    @property
    def num_workers(self) -> int:
        return len(self.pools.workers)

    def worker_infos(self) -> list[dict]:
        return [dict(w.info, name=w.name, role=w.role) for w in self.pools.workers]

    def stop(self, timeout_s: float = 8.0) -> bool:
        """Stop the HTTP server, the workers and Ray, within ``timeout_s`` in all; False if Ray had to be abandoned.

        When SIGTERM reaches the whole process group Ray's own processes die first and any call into Ray may hang,
        so each phase is bounded and this node's workers are then killed by PID. After an unclean stop the caller
        should exit at once (Ray's exit handlers would hang too).
        """
        deadline = time.monotonic() + timeout_s
        if self.token_file is not None:
            remove_token(self.base_url, admin_credential(self.config))
        if self.autoscaler is not None:
            self.autoscaler.stop()
        if self.scaler is not None:
            self.scaler.close()
        if self.frontends is not None:
            self.frontends.stop(max(0.0, min(3.0, deadline - time.monotonic())))
        else:
            assert self.server is not None and self.thread is not None  # one router process: in this one
            self.server.should_exit = True
            self.thread.join(max(0.0, min(3.0, deadline - time.monotonic())))
        clean = self.pools.responsive(timeout_s=1.5)
        if not clean:
            logger.warning("pdserve: Ray does not answer (its processes were stopped first); killing the workers")
        elif not call_with_timeout(self.pools.stop, deadline - time.monotonic() - 1.0):
            logger.warning("pdserve: the workers did not stop in time; killing them")
            clean = False
        self.pools.kill_local_workers(after_clean_stop=clean)
        if self.started_ray and clean:
            import ray

            if not call_with_timeout(ray.shutdown, deadline - time.monotonic()):
                logger.warning("pdserve: Ray did not shut down in time")
                clean = False
        return clean


def call_with_timeout(function, timeout_s: float) -> bool:
    """Run ``function`` in a daemon thread; False if it has not returned within ``timeout_s`` (it is left behind)."""
    thread = threading.Thread(
        target=function, name=f"pdserve-stop-{getattr(function, '__name__', 'call')}", daemon=True
    )
    thread.start()
    thread.join(max(0.0, timeout_s))
    return not thread.is_alive()


def with_cluster_secret(config: ClusterConfig) -> ClusterConfig:
    """A copy with the configured cluster secret, or 32 random bytes made here.

    Every worker gets it in its spec; it only needs configuring to stay the same across restarts."""
    secret = config.transfer.secret
    if secret:
        if len(secret) < 16:
            logger.warning(
                "transfer.secret is %d characters: use at least 32 random ones (or none: one is made per start)",
                len(secret),
            )
        return config
    transfer = config.transfer.model_copy(update={"secret": secrets.token_hex(32)})
    return config.model_copy(update={"transfer": transfer})


def _bind_host(config: ClusterConfig, in_process: bool) -> str:
    if config.ray.worker_host != "auto":
        return config.ray.worker_host
    if in_process:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


def check_tensor_parallel(config: ClusterConfig, hf_config) -> None:
    """ConfigError naming the pool's field when the model cannot be split ``tensor_parallel_size`` ways (its experts
    ``expert_parallel_size`` ways)."""
    from engine.expert_parallel import degree_field
    from engine.tp_shard import check_degree

    for name, _, pool in pool_layout(config):
        if pool.replicas and pool.ranks > 1:
            try:
                check_degree(hf_config, pool.tensor_parallel_size, pool.expert_parallel_size)
            except ValueError as exc:
                raise ConfigError(f"pools.{name}.{degree_field(exc)}: {exc}") from None


def start_serving(
    config: ClusterConfig,
    address: str | None = None,
    host: str | None = None,
    port: int | None = None,
    in_process: bool = False,
    capacity_model: CapacityModel | None = None,
) -> ServeHandle:
    """``capacity_model``: the autoscaler's model of ``autoscale.profile`` (built by ``pdserve serve``, which may
    import the planner; this layer may not)."""
    check_network_exposure(config, host)  # before anything starts
    config = with_cluster_secret(config)
    import uvicorn
    from transformers import AutoConfig

    from cluster.openai.api import create_app
    from cluster.routing.router import Router
    from engine.model_loader import load_tokenizer, resolve_model_path

    model_path = str(resolve_model_path(config.model.name))  # converts the default model once, before the workers
    hf_config = AutoConfig.from_pretrained(model_path)
    check_tensor_parallel(config, hf_config)
    max_model_len = config.model.max_model_len or int(getattr(hf_config, "max_position_embeddings", 2048))
    http_host = host or config.router.host
    http_port = config.router.port if port is None else port
    url_host = f"[{http_host}]" if ":" in http_host else http_host
    # several router processes each load their own tokenizer
    tokenizer = load_tokenizer(model_path) if config.router.processes == 1 else None
    started_ray = False if in_process else connect_ray(config, address)
    bind_host = _bind_host(config, in_process)
    worker_host = bind_host if in_process else config.ray.worker_host
    if config.router.processes > 1:
        frontends, pools, http_port = _start_router_processes(
            config, model_path, max_model_len, bind_host, http_host, http_port, worker_host, in_process, started_ray
        )
        scaler = Scaler(config, pools, frontends)
        frontends.serve_scaling(scaler)
        handle = ServeHandle(
            config, f"http://{url_host}:{http_port}", frontends, pools, started_ray, None, None, frontends, scaler
        )
        handle.autoscaler = Autoscaler.start_if_enabled(config, scaler, handle.base_url, capacity_model)
        handle.write_admin_token()
        return handle
    router = Router(config, host=bind_host, max_event_bytes=config.max_event_bytes(model_path, max_model_len))
    try:
        pools = (LocalPools if in_process else RayPools)(config, model_path, [router.event_address], worker_host)
    except BaseException:
        _shutdown_ray(started_ray)
        raise
    for record in pools.workers:
        router.add_worker(record.name, record.role, record.info["command_address"], record.info.get("kv_address"))

    app = create_app(router, tokenizer, config, max_model_len)
    sock = socket.socket(socket.AF_INET6 if ":" in http_host else socket.AF_INET)
    try:
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
    except BaseException:  # a port taken, or a server that never started: nothing it started is left behind
        sock.close()
        pools.stop()
        _shutdown_ray(started_ray)
        raise
    pools.start_monitor(router)
    scaler = router.scaler = Scaler(config, pools, router)
    handle = ServeHandle(config, f"http://{url_host}:{http_port}", router, pools, started_ray, server, thread)
    handle.scaler = scaler
    handle.autoscaler = Autoscaler.start_if_enabled(config, scaler, handle.base_url, capacity_model)
    handle.write_admin_token()
    return handle


def _start_router_processes(
    config: ClusterConfig,
    model_path: str,
    max_model_len: int,
    bind_host: str,
    http_host: str,
    http_port: int,
    worker_host: str,
    in_process: bool,
    started_ray: bool,
):
    """N router processes on one port, held by a probe socket until all of them listen (cluster/run/frontend.py)."""
    probe = reuseport_socket(http_host, http_port)
    http_port = probe.getsockname()[1]
    frontends = None
    try:
        frontends = RouterProcesses(config, model_path, max_model_len, bind_host, http_host, http_port)
        pools = (LocalPools if in_process else RayPools)(config, model_path, frontends.event_addresses, worker_host)
        try:
            frontends.serve(
                [(r.name, r.role, r.info["command_address"], r.info.get("kv_address")) for r in pools.workers]
            )
        except BaseException:
            pools.stop()
            raise
    except BaseException:
        if frontends is not None:
            frontends.stop(timeout_s=3.0)
        _shutdown_ray(started_ray)
        raise
    finally:
        probe.close()  # it never listened: the router processes' sockets take every connection
    pools.start_monitor(frontends)
    return frontends, pools, http_port


def _shutdown_ray(started_ray: bool) -> None:
    if started_ray:
        import ray

        ray.shutdown()
