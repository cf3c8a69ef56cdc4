"""The cluster's one YAML file, validated on load: unknown keys and bad values are errors naming file and field.

Sections: ``model`` (what to serve), ``mode`` (disaggregated or colocated), ``pools`` (prefill and decode workers:
replicas, GPUs or a CPU share, KV cache size, batching limits), ``transfer`` (KV backend, block size, deadlines,
failure policy), ``router`` (HTTP bind, routing policies, queue bound, API key, request limits), ``slo`` (targets
the load test and planner use) and ``ray`` (which cluster to join). ``docs/configuration.md`` documents every field.

``check_network_exposure`` (``cluster/network_exposure.py``) runs on the final config at start-up (after
command-line overrides): a server or worker reachable from other machines without an API key is refused unless the
config says so explicitly.

The config is translated once: ``ClusterConfig.worker_specs`` builds every worker's ``WorkerSpec`` (engine, transfer
and control-plane settings, worker/spec.py) here and nowhere else. Defaults live once, in the dataclasses the specs
are made of (``EngineConfig``, ``TransferConfig``, ``RuntimeOptions``); the sections below take theirs from them.
The device is not chosen here: the process that reads the config may have no GPU (a Ray head node). Each worker
picks its own in its process (``worker.spec.resolve_device``).

``load_config`` takes a path or the name of a config shipped inside the package (``local``, ``gpu-node.yaml``):
``cluster/config_files.py`` finds and reads the file (``configs/`` is package data, found through importlib.resources,
so an installed wheel works outside the source tree), ``parse_config`` validates it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# moved to their own modules; re-exported because very many callers import them from cluster.config (neither
# module imports this one at run time, so there is no cycle)
from cluster.config_files import ConfigError, find_config, read_config_file  # noqa: F401
from cluster.network_exposure import check_network_exposure  # noqa: F401
from engine.blocks import kv_blocks_for
from engine.config import DEFAULT_CPU_KV_BYTES, AttentionBackendName, EngineConfig, resolve_dtype
from engine.model_loader import DEFAULT_MODEL
from transfer.base import TransferConfig
from worker.spec import FailurePolicy, RuntimeOptions, TransferBackend, WorkerRole, WorkerSpec, ZmqTransport

MIB = 1024 * 1024


def _default(cls: type, name: str):
    """The default of field ``name`` of dataclass ``cls``: the one place that number is written."""
    for item in dataclasses.fields(cls):
        if item.name == name:
            if item.default is not dataclasses.MISSING:
                return item.default
            if callable(item.default_factory):
                return item.default_factory()
    raise AttributeError(f"{cls.__name__} has no field {name!r} with a default")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Strict):
    name: str = DEFAULT_MODEL  # the built-in default, or a local folder of a Llama-family model
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _default(EngineConfig, "dtype")  # auto: bf16 on GPU
    max_model_len: int | None = Field(default=None, gt=0)


class PoolSection(_Strict):
    replicas: int = Field(default=1, ge=0)
    gpus_per_replica: float = Field(default=0, ge=0)  # 0: a CPU worker
    cpus_per_replica: float = Field(default=1, gt=0)  # Ray CPU share (also used on GPU nodes)
    torch_threads: int | None = Field(default=None, gt=0)
    kv_blocks: int | None = Field(default=None, gt=0)  # explicit; otherwise from kv_memory_mb
    # explicit KV budget; null: DEFAULT_CPU_KV_BYTES on the CPU, on a GPU what gpu_memory_utilization leaves after the
    # weights and a profiling forward
    kv_memory_mb: int | None = Field(default=None, gt=0)
    gpu_memory_utilization: float = Field(default=_default(EngineConfig, "gpu_memory_utilization"), gt=0, le=1)
    attention_backend: AttentionBackendName = _default(EngineConfig, "attention_backend")
    cuda_graphs: bool = _default(EngineConfig, "cuda_graphs")  # GPU decode steps replay captured graphs
    max_batch_tokens: int = Field(default=_default(EngineConfig, "max_batch_tokens"), gt=0)
    max_num_seqs: int = Field(default=_default(EngineConfig, "max_num_seqs"), gt=0)
    enable_prefix_caching: bool = _default(EngineConfig, "enable_prefix_caching")
    reserve_headroom_tokens: int = Field(default=0, ge=0)  # decode: reserved per request beyond prompt + 1 token
    resources: dict[str, float] = Field(default_factory=dict)  # extra Ray resources per replica (pin to node types)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"


class PoolsSection(_Strict):
    prefill: PoolSection = PoolSection()
    decode: PoolSection = PoolSection()


class TransferSection(_Strict):
    # nccl: KV tensors between GPUs (a pool on the CPU is an error); gloo: the same code on the CPU
    backend: TransferBackend = _default(WorkerSpec, "transfer_backend")
    block_size: int = Field(default=_default(EngineConfig, "block_size"), gt=0)
    # expect -> KV complete, else the request fails
    deadline_s: float = Field(default=_default(TransferConfig, "deadline_s"), gt=0)
    # prefill holds exported KV this long without word from decode
    lease_s: float = Field(default=_default(TransferConfig, "lease_s"), gt=0)
    failure_policy: FailurePolicy = _default(WorkerSpec, "failure_policy")
    kv_wire_dtype: Literal["raw", "int8"] = _default(TransferConfig, "wire_dtype")
    zmq_transport: ZmqTransport = _default(
        WorkerSpec, "zmq_transport"
    )  # ipc: only when prefill and decode share a node
    stream_layers: bool = (
        True  # False: send the KV after the whole prefill (the baseline the overlap is measured against)
    )
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
    max_choices: int = Field(default=256, gt=0)  # prompts x n: the requests one body fans out to


class KvAwareSection(_Strict):
    """The kv_aware policy's cost (cluster/routing/policies.py): prefix_weight * matched / prompt tokens - load_weight * load."""

    prefix_weight: float = Field(default=2.0, ge=0)  # a whole prompt cached is worth this many queued requests
    load_weight: float = Field(default=1.0, ge=0)


class RouterSection(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: pick a free port
    prefill_policy: Literal["round_robin", "least_loaded", "power_of_two", "kv_aware"] = "least_loaded"
    # decode_policy also orders colocated workers (where kv_aware weighs their prefix caches)
    decode_policy: Literal["round_robin", "least_loaded", "power_of_two", "kv_aware"] = "least_loaded"
    kv_aware: KvAwareSection = KvAwareSection()
    queue_size: int = Field(default=256, ge=0)  # requests waiting for decode KV before 429
    # conditional disaggregation: a prompt whose part the chosen decode worker does not hold in its prefix cache is
    # at most this many tokens is prefilled on that decode worker, with no transfer; 0: every prompt goes to prefill
    local_prefill_max_tokens: int = Field(default=0, ge=0)
    api_key: str | None = None
    allow_unauthenticated: bool = False  # serve a non-loopback address without api_key, deliberately
    request_timeout_s: float = Field(default=300.0, gt=0)
    worker_timeout_s: float = Field(default=10.0, gt=0)  # a control call to a worker
    # workers free every request after this long without the router
    orphan_timeout_s: float = Field(default=_default(RuntimeOptions, "router_timeout_s"), gt=0)
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
    allow_unauthenticated: bool = False  # join a Ray cluster without token authentication, deliberately


class AutoscalePoolBounds(_Strict):
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=4, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalePoolBounds:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is over max_replicas ({self.max_replicas})")
        return self


class AutoscaleSection(_Strict):
    """The optional autoscaling policy (cluster/run/autoscale.py): off unless ``enabled``."""

    enabled: bool = False
    interval_s: float = Field(default=10.0, gt=0)  # how often live metrics are read
    breaches: int = Field(default=3, ge=1)  # consecutive intervals a condition must hold before acting
    cooldown_s: float = Field(default=60.0, ge=0)  # after a pool is resized, no other change to it this long
    queue_per_replica: float = Field(default=4.0, gt=0)  # decode: queued requests per replica that mean "too few"
    scale_down_fraction: float = Field(default=0.5, gt=0, lt=1)  # p90s under this share of the SLO: "too many"
    min_requests: int = Field(default=5, ge=1)  # an interval with fewer finished requests says nothing on latency
    prefill: AutoscalePoolBounds = AutoscalePoolBounds()
    decode: AutoscalePoolBounds = AutoscalePoolBounds()
    # a `pdserve profile` JSON: `pdserve serve` sizes pools with the planner's model of it (planner/autoscale_model.py)
    # instead of the threshold rule; a relative path is from the directory `pdserve serve` runs in
    profile: str | None = None
    target_utilization: float = Field(default=0.7, gt=0, le=1)  # the model keeps each pool's busy share under this

    @field_validator("profile")
    @classmethod
    def _profile_exists(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_file():
            raise ValueError(f"no such profile file: {value} (write one with `pdserve profile`)")
        return value


class ClusterConfig(_Strict):
    model: ModelSection = ModelSection()
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    pools: PoolsSection = PoolsSection()
    transfer: TransferSection = TransferSection()
    router: RouterSection = RouterSection()
    slo: SLOSection = SLOSection()
    ray: RaySection = RaySection()
    autoscale: AutoscaleSection = AutoscaleSection()

    @model_validator(mode="after")
    def _pools_can_serve(self) -> ClusterConfig:
        if self.mode == "disaggregated" and (self.pools.prefill.replicas < 1 or self.pools.decode.replicas < 1):
            raise ValueError("pools: disaggregated mode needs at least one prefill and one decode replica")
        if self.mode == "colocated" and self.pools.prefill.replicas + self.pools.decode.replicas < 1:
            raise ValueError("pools: colocated mode needs at least one worker")
        problem = self.transfer_backend_problem()
        if problem:
            raise ValueError(problem)
        return self

    def transfer_backend_problem(self) -> str:
        """Why ``transfer.backend`` cannot work with these pools ("" when it can): nccl moves KV between GPUs, so a
        disaggregated pool on the CPU would quietly fall back to gloo. Saying gloo is how to ask for that."""
        if self.transfer.backend != "nccl" or self.mode != "disaggregated":
            return ""  # colocated workers move no KV
        cpu_pools = [name for name, _, pool in pool_layout(self) if pool.replicas and pool.gpus_per_replica == 0]
        if not cpu_pools:
            return ""
        names = " and ".join(f"pools.{name}" for name in cpu_pools)
        return (
            f"transfer.backend: nccl moves KV between GPUs, but {names} has gpus_per_replica: 0; "
            "use transfer.backend: gloo for the same transfer code on the CPU"
        )

    # ---- the one translation into what the workers run -------------------------------------------------------------

    def engine_config(self, pool: PoolSection, model_path: str) -> EngineConfig:
        """One pool's engine settings; ``model_path``: the model folder (the default model converted once)."""
        return EngineConfig(
            model=model_path,
            dtype=self.model.dtype,
            block_size=self.transfer.block_size,
            num_kv_blocks=pool.kv_blocks,
            kv_cache_memory_bytes=None if pool.kv_memory_mb is None else pool.kv_memory_mb * MIB,
            gpu_memory_utilization=pool.gpu_memory_utilization,
            attention_backend=pool.attention_backend,
            cuda_graphs=pool.cuda_graphs,
            max_model_len=self.model.max_model_len,
            max_batch_tokens=pool.max_batch_tokens,
            max_num_seqs=pool.max_num_seqs,
            enable_prefix_caching=pool.enable_prefix_caching,
            torch_threads=pool.torch_threads,
        )

    def transfer_config(self) -> TransferConfig:
        """The transfer layer's limits; its device is set in each worker (``worker.spec.resolve_spec``)."""
        return TransferConfig(
            deadline_s=self.transfer.deadline_s,
            lease_s=self.transfer.lease_s,
            wire_dtype=self.transfer.kv_wire_dtype,
            secret=self.transfer.secret,
        )

    def runtime_options(self, router_addresses: list[str], host: str) -> RuntimeOptions:
        """``router_addresses``: every router process's event socket, by index; ``host``: where workers bind."""
        return RuntimeOptions(
            router_addresses=list(router_addresses),
            host=host,
            secret=self.transfer.secret,
            router_timeout_s=self.router.orphan_timeout_s,
        )

    def nccl_peers(self, role: str) -> int:
        """The KV pair groups one worker of this role forms: one per worker of the other pool."""
        other = {"prefill": self.pools.decode, "decode": self.pools.prefill}.get(role)
        return other.replicas if other is not None and self.mode == "disaggregated" else 0

    def worker_specs(self, model_path: str, router_addresses: list[str], host: str) -> list[WorkerSpec]:
        """Every worker of every pool, in pool order: ``<pool>-<index>``, the pool's role, engine and GPUs."""
        problem = self.transfer_backend_problem()  # also after assignments, which skip the model validator
        if problem:
            raise ConfigError(problem)
        specs = []
        for pool_name, role, pool in pool_layout(self):
            for index in range(pool.replicas):  # each spec its own objects: a worker may resolve its own in place
                specs.append(
                    WorkerSpec(
                        name=f"{pool_name}-{index}",
                        role=role,
                        pool=pool_name,
                        engine=self.engine_config(pool, model_path),
                        runtime=self.runtime_options(router_addresses, host),
                        transfer=self.transfer_config(),
                        transfer_backend=self.transfer.backend,
                        zmq_transport=self.transfer.zmq_transport,
                        stream_layers=self.transfer.stream_layers,
                        failure_policy=self.transfer.failure_policy,
                        reserve_headroom_tokens=pool.reserve_headroom_tokens,
                        gpus=pool.gpus_per_replica,
                        nccl_peers=self.nccl_peers(role),
                    )
                )
        return specs

    @property
    def served_model_name(self) -> str:
        return self.router.served_model_name or self.model.name

    @staticmethod
    def pool_kv_bytes(pool: PoolSection) -> int | None:
        """A pool's KV budget per replica as the engine will size it: ``kv_memory_mb`` when set, the engine's CPU
        default on a CPU pool, and None on a GPU pool (each worker measures its free memory at start)."""
        if pool.kv_memory_mb is not None:
            return pool.kv_memory_mb * MIB
        return None if pool.gpus_per_replica > 0 else DEFAULT_CPU_KV_BYTES

    def pool_kv_blocks(self, pool: PoolSection, bytes_per_block: int) -> int | None:
        """A pool's KV blocks per replica by the engine's rule (``engine.blocks.kv_blocks_for``: ``kv_blocks``, else
        whole blocks of ``pool_kv_bytes``); None on a GPU pool that sizes its cache from measured memory at start."""
        kv_bytes = self.pool_kv_bytes(pool)
        if kv_bytes is None and not pool.kv_blocks:
            return None
        return kv_blocks_for(kv_bytes or 0, bytes_per_block, pool.kv_blocks)

    def pool_dtype(self, pool: PoolSection) -> str:
        """The dtype a pool's workers run (``model.dtype``, with ``auto`` resolved as in each worker: bfloat16 on a
        GPU pool, float32 on a CPU one)."""
        return resolve_dtype(self.model.dtype, "cuda" if pool.gpus_per_replica > 0 else "cpu")

    @property
    def served_dtype(self) -> str:
        """The dtype of the cluster's KV (that of its first pool with replicas; every pool shares it or the transfer
        handshake refuses the pair)."""
        pools = [pool for _, _, pool in pool_layout(self) if pool.replicas] or [self.pools.prefill]
        return self.pool_dtype(pools[0])


def pool_layout(config: ClusterConfig) -> list[tuple[str, WorkerRole, PoolSection]]:
    """(pool name, worker role, pool section) for every pool; colocated mode keeps the workers, not the split."""
    if config.mode == "colocated":
        return [
            ("prefill", WorkerRole.COLOCATED, config.pools.prefill),
            ("decode", WorkerRole.COLOCATED, config.pools.decode),
        ]
    return [("prefill", WorkerRole.PREFILL, config.pools.prefill), ("decode", WorkerRole.DECODE, config.pools.decode)]


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


def load_config(name_or_path: str | Path) -> ClusterConfig:
    """Load and validate a config file, given by path or by a shipped config's name (``find_config``)."""
    data, source = read_config_file(name_or_path)
    return parse_config(data, source)
