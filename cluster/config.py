"""The cluster's one YAML file, validated on load: unknown keys and bad values are errors naming file and field.

Sections: ``model`` (what to serve), ``mode`` (disaggregated or colocated), ``pools`` (prefill and decode workers:
replicas, GPUs or a CPU share, KV cache size, batching limits), ``transfer`` (KV backend, block size, deadlines,
failure policy), ``router`` (HTTP bind, routing policies, queue bound, API key, request limits), ``slo`` (targets
the load test and planner use) and ``ray`` (which cluster to join). ``docs/configuration.md`` documents every field.

``check_network_exposure`` runs on the final config at start-up (after command-line overrides): a server or worker
reachable from other machines without an API key is refused unless the config says so explicitly.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.model_loader import DEFAULT_MODEL


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Strict):
    name: str = DEFAULT_MODEL  # the built-in default, or a local folder of a Llama-family model
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_model_len: int | None = Field(default=None, gt=0)


class PoolSection(_Strict):
    replicas: int = Field(default=1, ge=0)
    gpus_per_replica: float = Field(default=0, ge=0)  # 0: a CPU worker
    cpus_per_replica: float = Field(default=1, gt=0)  # Ray CPU share (also used on GPU nodes)
    torch_threads: int | None = Field(default=None, gt=0)
    kv_blocks: int | None = Field(default=None, gt=0)  # explicit; otherwise from kv_memory_mb
    kv_memory_mb: int = Field(default=256, gt=0)
    max_batch_tokens: int = Field(default=2048, gt=0)
    max_num_seqs: int = Field(default=64, gt=0)
    enable_prefix_caching: bool = True
    reserve_headroom_tokens: int = Field(default=0, ge=0)  # decode: reserved per request beyond prompt + 1 token
    resources: dict[str, float] = Field(default_factory=dict)  # extra Ray resources per replica (pin to node types)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"


class PoolsSection(_Strict):
    prefill: PoolSection = PoolSection()
    decode: PoolSection = PoolSection()


class TransferSection(_Strict):
    backend: Literal["zmq", "nccl", "local"] = "zmq"
    block_size: int = Field(default=16, gt=0)
    deadline_s: float = Field(default=30.0, gt=0)  # expect -> KV complete, else the request fails
    lease_s: float = Field(default=30.0, gt=0)  # prefill holds exported KV this long without word from decode
    failure_policy: Literal["fail", "recompute"] = "fail"
    kv_wire_dtype: Literal["raw", "int8"] = "raw"
    zmq_transport: Literal["tcp", "ipc"] = "tcp"  # ipc: Unix sockets, only when prefill and decode share a node
    stream_layers: bool = True  # False: send the KV after the whole prefill (the baseline the overlap is measured against)
    # the cluster secret: MACs every control message and event and the KV handshake; None: a random one per start
    secret: str | None = None


class LimitsSection(_Strict):
    """Caps on what one request body may hold, checked at the API before anything is tokenized or sent to a worker."""

    max_stop_strings: int = Field(default=16, gt=0)
    max_stop_string_chars: int = Field(default=256, gt=0)
    max_stop_token_ids: int = Field(default=64, gt=0)
    max_logit_bias_entries: int = Field(default=300, gt=0)  # OpenAI's own limit
    max_messages: int = Field(default=1024, gt=0)
    max_content_parts: int = Field(default=256, gt=0)  # per message
    max_json_depth: int = Field(default=32, gt=0)


class RouterSection(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: pick a free port
    prefill_policy: Literal["round_robin", "least_loaded", "power_of_two"] = "least_loaded"
    decode_policy: Literal["round_robin", "least_loaded", "power_of_two"] = "least_loaded"
    queue_size: int = Field(default=256, ge=0)  # requests waiting for decode KV before 429
    api_key: str | None = None
    allow_unauthenticated: bool = False  # serve a non-loopback address without api_key, deliberately
    request_timeout_s: float = Field(default=300.0, gt=0)
    worker_timeout_s: float = Field(default=10.0, gt=0)  # a control call to a worker
    orphan_timeout_s: float = Field(default=10.0, gt=0)  # workers free every request after this long without the router
    max_body_bytes: int = Field(default=1 << 20, gt=0)
    served_model_name: str | None = None  # the name /v1/models reports; default: model.name
    # frontend processes serving the one port (SO_REUSEPORT), each connected to every worker; 1: in this process
    processes: int = Field(default=1, ge=1, le=64)
    limits: LimitsSection = LimitsSection()


class SLOSection(_Strict):
    ttft_s: float = Field(default=2.0, gt=0)
    tpot_s: float = Field(default=0.2, gt=0)


class RaySection(_Strict):
    address: str | None = None  # None: start a local cluster; "auto": join the one started by `ray up`
    namespace: str = "pdserve"
    start_timeout_s: float = Field(default=120.0, gt=0)
    worker_host: str = "127.0.0.1"  # where workers and the router bind data-plane sockets; "auto": the node's IP
    max_restarts: int = Field(default=3, ge=-1)  # Ray restarts of a dead worker (-1: forever)


class ClusterConfig(_Strict):
    model: ModelSection = ModelSection()
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    pools: PoolsSection = PoolsSection()
    transfer: TransferSection = TransferSection()
    router: RouterSection = RouterSection()
    slo: SLOSection = SLOSection()
    ray: RaySection = RaySection()

    @model_validator(mode="after")
    def _pools_can_serve(self) -> "ClusterConfig":
        if self.mode == "disaggregated" and (self.pools.prefill.replicas < 1 or self.pools.decode.replicas < 1):
            raise ValueError("pools: disaggregated mode needs at least one prefill and one decode replica")
        if self.mode == "colocated" and self.pools.prefill.replicas + self.pools.decode.replicas < 1:
            raise ValueError("pools: colocated mode needs at least one worker")
        return self

    @property
    def served_model_name(self) -> str:
        return self.router.served_model_name or self.model.name


def is_loopback(host: str) -> bool:
    """Only literal loopback addresses and ``localhost`` count; any other name may resolve to a public address."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name, "auto", "" or "*": reachable from elsewhere for all we know


def check_network_exposure(config: ClusterConfig, http_host: str | None = None) -> None:
    """Refuse to bind the HTTP server (``http_host`` overrides ``router.host``) or the workers to a non-loopback
    address without ``router.api_key``, unless ``router.allow_unauthenticated`` says that is meant."""
    if config.router.api_key or config.router.allow_unauthenticated:
        return
    for field, host in (("router.host", http_host or config.router.host), ("ray.worker_host", config.ray.worker_host)):
        if not is_loopback(host):
            raise ConfigError(
                f"{field}: {host!r} is reachable from other machines, and router.api_key is not set: anyone who can "
                "reach it could use the cluster. Set router.api_key, bind a loopback address, or set "
                "router.allow_unauthenticated: true to serve without a key deliberately")


def _format_error(source: str, error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(top level)"
        lines.append(f"{source}: {field}: {item['msg']}")
    return "\n".join(lines)


def parse_config(data: dict | None, source: str = "<config>") -> ClusterConfig:
    try:
        return ClusterConfig.model_validate(data or {})
    except ValidationError as exc:
        raise ConfigError(_format_error(source, exc)) from None


def load_config(path: str | Path) -> ClusterConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return parse_config(data, str(path))
