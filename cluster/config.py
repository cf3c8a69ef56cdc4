"""The cluster's one YAML file, validated on load: unknown keys and bad values are errors naming file and field.

Every field is declared here, in its section, and documented in docs/configuration.md. A field the workers run with
has the name, type and default of the worker dataclass field it sets (``EngineConfig``, ``TransferConfig``,
``WorkerSpec``, ``RuntimeOptions``; tests/cluster/test_config_sections.py keeps them equal), and each section checks
its values by building those dataclasses. ``ClusterConfig.worker_specs`` is the one translation into what the workers
run: a pool's engine fields and the transfer section's go over by name (``_shared``).
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.blocks import kv_blocks_for, model_kv_bytes_per_token, rank_kv_heads
from engine.config import (
    DEFAULT_CPU_KV_BYTES,
    DEFAULT_MODEL,
    AttentionBackendName,
    EngineConfig,
    KVCacheDtype,
    KVOffloadConfig,
    SpeculativeConfig,
    resolve_dtype,
    worker_ranks,
)
from transfer.config import TransferConfig
from worker.spec import FailurePolicy, RuntimeOptions, TransferBackend, WorkerRole, WorkerSpec, ZmqTransport
from worker.tracing import TracingOptions, traces_endpoint

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

MIB = 1024 * 1024


class ConfigError(ValueError):
    """The message names the file and the field."""


def _shared(section: BaseModel, cls: type) -> dict[str, Any]:
    """The section's values of the fields ``cls`` (a worker dataclass) has too: a field of the same name is the same
    setting, of the same type and default (tests/cluster/test_config_sections.py)."""
    names = {item.name for item in dataclasses.fields(cls)}
    return {name: getattr(section, name) for name in type(section).model_fields if name in names}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Strict):
    name: str = DEFAULT_MODEL  # the built-in default, or a local folder of a Llama-family model
    # the engine's (EngineConfig)
    dtype: str = "auto"
    max_model_len: int | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelSection:
        EngineConfig(**_shared(self, EngineConfig))
        return self


class PoolSection(_Strict):
    replicas: int = Field(default=1, ge=0)
    gpus_per_replica: float = Field(default=0, ge=0)  # 0: a CPU worker
    cpus_per_replica: float = Field(default=1, gt=0)  # Ray CPU share (also used on GPU nodes)
    # the KV budget (the engine takes bytes); null: DEFAULT_CPU_KV_BYTES on the CPU, on a GPU what
    # gpu_memory_utilization leaves after the weights and a profiling forward
    kv_memory_mb: int | None = Field(default=None, gt=0)
    resources: dict[str, float] = Field(default_factory=dict)  # extra Ray resources per replica (pin to node types)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # the engine's (EngineConfig)
    torch_threads: int | None = None
    cpu_linear_tuning: bool = True
    kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    attention_backend: AttentionBackendName = "auto"
    kv_cache_dtype: KVCacheDtype = (
        "auto"  # prefill and decode must agree in disaggregated mode (the KV moves as stored)
    )
    cuda_graphs: bool = True
    compile_decode_batches: list[int] | None = None  # CPU: a torch.compile'd decode step per listed batch size
    # a cold compile runs in a background process while the worker serves eagerly (false: the start waits for it)
    compile_decode_background: bool = True
    max_batch_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    # the ways a replica's ranks cut every layer, and a mixture's routed experts (EngineConfig): its ranks are the
    # larger (``ranks``), each with the pool's per-replica CPUs and GPUs
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    kv_offload: KVOffloadConfig | None = None  # host and disk tiers below the device KV (engine/kv_tiers.py)
    speculative: SpeculativeConfig | None = None  # decode and colocated pools (engine/speculative.py)
    # the worker's (WorkerSpec)
    reserve_headroom_tokens: int = 0

    @property
    def ranks(self) -> int:
        return worker_ranks(self.tensor_parallel_size, self.expert_parallel_size)

    @model_validator(mode="after")
    def _check(self) -> PoolSection:
        engine = EngineConfig(**_shared(self, EngineConfig))
        WorkerSpec("check", WorkerRole.DECODE, engine, RuntimeOptions([]), **_shared(self, WorkerSpec))
        return self


class TransferSection(_Strict):
    block_size: int = Field(default=16, gt=0)  # tokens per KV block (the engines' block_size)
    # the cluster secret: MACs every control message and event and the KV handshake; None: a random one per start
    secret: str | None = None
    # the transfer layer's (TransferConfig)
    deadline_s: float = 30.0
    lease_s: float = 30.0
    kv_wire_dtype: str = "raw"
    checksum: bool = True
    direct_write: bool = True
    # the worker's (WorkerSpec; ``backend`` is its transfer_backend)
    failure_policy: FailurePolicy = "fail"
    zmq_transport: ZmqTransport = "tcp"
    stream_layers: bool = True
    backend: TransferBackend = "auto"

    @model_validator(mode="after")
    def _check(self) -> TransferSection:
        TransferConfig(**_shared(self, TransferConfig))
        return self


class PoolsSection(_Strict):
    prefill: PoolSection = PoolSection()
    decode: PoolSection = PoolSection()


class LimitsSection(_Strict):
    """Caps on one request body, checked at the API before anything is tokenized or sent to a worker."""

    max_stop_strings: int = Field(default=16, gt=0)
    max_stop_string_chars: int = Field(default=256, gt=0)
    max_stop_token_ids: int = Field(default=64, gt=0)
    max_logit_bias_entries: int = Field(default=300, gt=0)  # OpenAI's own limit
    max_messages: int = Field(default=1024, gt=0)
    max_content_parts: int = Field(default=256, gt=0)  # per message
    max_json_depth: int = Field(default=32, gt=0)
    max_choices: int = Field(default=256, gt=0)  # prompts x n: the requests one body fans out to


class KvAwareSection(_Strict):
    """The kv_aware policy's weights (cluster/routing/policies.py)."""

    prefix_weight: float = Field(default=2.0, ge=0)  # a whole prompt cached is worth this many queued requests
    load_weight: float = Field(default=1.0, ge=0)
    # a host-tier hit saves the prefill but costs a copy to the device: worth this fraction of a device hit
    host_weight: float = Field(default=0.8, ge=0, le=1)
    # a disk-tier hit saves the prefill but costs a slower copy: worth this fraction of a device hit
    disk_weight: float = Field(default=0.5, ge=0, le=1)


class RebalanceSection(_Strict):
    """Moving a running request off a decode worker whose KV is about to run out (cluster/routing/core.py)."""

    # a decode worker with fewer free blocks than running requests (one of them preempts within a block's worth of
    # steps) moves its longest-to-go request to the decode worker with the most room, instead of preempting
    enabled: bool = False
    max_moves_per_worker: int = Field(default=1, ge=1)  # moves off one worker at a time


class RouterSection(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: pick a free port
    prefill_policy: Literal["round_robin", "least_loaded", "power_of_two", "kv_aware"] = "least_loaded"
    # decode_policy also orders colocated workers (where kv_aware weighs their prefix caches)
    decode_policy: Literal["round_robin", "least_loaded", "power_of_two", "kv_aware"] = "least_loaded"
    kv_aware: KvAwareSection = KvAwareSection()
    queue_size: int = Field(default=256, ge=0)  # requests waiting for decode KV before 429
    # conditional disaggregation: a prompt whose part the decode worker's prefix cache lacks is at most this many
    # tokens is prefilled there, with no transfer; 0: every prompt goes to prefill
    local_prefill_max_tokens: int = Field(default=0, ge=0)
    # a draining decode worker (scale-down, Drain) moves its running requests to the others instead of finishing
    # them there: the drain takes about a KV transfer, not the longest generation (docs/request-lifecycle.md)
    migrate_on_drain: bool = True
    rebalance: RebalanceSection = RebalanceSection()
    api_key: str | None = None
    allow_unauthenticated: bool = False  # serve a non-loopback address without api_key, deliberately
    request_timeout_s: float = Field(default=300.0, gt=0)
    worker_timeout_s: float = Field(default=10.0, gt=0)  # a control call to a worker
    max_body_bytes: int = Field(default=1 << 20, gt=0)
    served_model_name: str | None = None  # the name /v1/models reports; default: model.name
    # frontend processes serving the one port (SO_REUSEPORT), each connected to every worker; 1: in this process
    processes: int = Field(default=1, ge=1, le=64)
    limits: LimitsSection = LimitsSection()
    orphan_timeout_s: float = 10.0  # workers free every request after this long without the router (RuntimeOptions)

    @model_validator(mode="after")
    def _check(self) -> RouterSection:
        RuntimeOptions([], orphan_timeout_s=self.orphan_timeout_s)
        return self


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
    # a `pdserve profile` JSON: the planner's model of it sizes pools instead of the threshold rule (relative to the
    # directory `pdserve serve` runs in)
    profile: str | None = None
    target_utilization: float = Field(default=0.7, gt=0, le=1)  # the model keeps each pool's busy share under this
    # the pools' replicas together (a device budget): a pool that must grow when it is spent takes a worker from the
    # other pool, within that pool's min_replicas and cool-down; no pool shrinks alone, its workers are held for the
    # other (null: each pool grows and shrinks within its own bounds)
    max_workers: int | None = Field(default=None, ge=2)
    # one pool to grow and the other to shrink in the same interval: a worker of the shrinking pool switches role
    # (its weights kept: cluster/run/role_switch.py) instead of one stopping and another loading the model
    switch_roles: bool = True

    @field_validator("profile")
    @classmethod
    def _profile_exists(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_file():
            raise ValueError(f"no such profile file: {value} (write one with `pdserve profile`)")
        return value


class ObservabilitySection(_Strict):
    """Request traces over OTLP/HTTP (worker/tracing.py, docs/observability.md). Tracing is on when an endpoint is
    set here or in ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` where ``pdserve serve``
    runs; the router passes the resolved endpoint to every worker."""

    otlp_endpoint: str | None = None  # e.g. http://127.0.0.1:4318 (OTLP's /v1/traces is added to a bare endpoint)
    sample_ratio: float = Field(default=1.0, ge=0, le=1)  # share of new traces kept; a client's sampled one is kept
    service_name: str = "pdserve"
    otlp_headers: dict[str, str] = Field(default_factory=dict)  # sent with every export (a collector's API key)

    @model_validator(mode="after")
    def _check(self) -> ObservabilitySection:
        if self.otlp_endpoint is not None:
            self.tracing_options()
        return self

    def tracing_options(self) -> TracingOptions | None:
        """Where this cluster's traces go (None: tracing off)."""
        endpoint = traces_endpoint(self.otlp_endpoint)
        if endpoint is None:
            return None
        return TracingOptions(
            endpoint=endpoint,
            sample_ratio=self.sample_ratio,
            service_name=self.service_name,
            headers=dict(self.otlp_headers),
        )


class ClusterConfig(_Strict):
    model: ModelSection = ModelSection()
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    pools: PoolsSection = PoolsSection()
    transfer: TransferSection = TransferSection()
    router: RouterSection = RouterSection()
    slo: SLOSection = SLOSection()
    ray: RaySection = RaySection()
    autoscale: AutoscaleSection = AutoscaleSection()
    observability: ObservabilitySection = ObservabilitySection()

    @model_validator(mode="after")
    def _pools_can_serve(self) -> ClusterConfig:
        if self.mode == "disaggregated" and (self.pools.prefill.replicas < 1 or self.pools.decode.replicas < 1):
            raise ValueError("pools: disaggregated mode needs at least one prefill and one decode replica")
        if self.mode == "colocated" and self.pools.prefill.replicas + self.pools.decode.replicas < 1:
            raise ValueError("pools: colocated mode needs at least one worker")
        problem = self.transfer_backend_problem()
        if problem:
            raise ValueError(problem)
        prefill = self.pools.prefill
        decode = self.pools.decode
        if self.mode == "disaggregated" and prefill.kv_cache_dtype != decode.kv_cache_dtype:
            raise ValueError(
                f"pools.decode.kv_cache_dtype {decode.kv_cache_dtype!r} differs from pools.prefill.kv_cache_dtype "
                f"{prefill.kv_cache_dtype!r}: the KV moves between them as stored, so both pools need the same"
            )
        quantized = {prefill.kv_cache_dtype, decode.kv_cache_dtype} - {"auto"}
        if self.transfer.kv_wire_dtype != "raw" and quantized:
            raise ValueError(
                f"transfer.kv_wire_dtype {self.transfer.kv_wire_dtype!r} would compress an already quantized KV cache "
                f"(kv_cache_dtype {sorted(quantized)[0]!r}); leave it 'raw'"
            )
        if self.mode == "disaggregated" and not self.transfer.stream_layers and prefill.ranks > 1:
            raise ValueError(
                f"transfer.stream_layers: false cannot hold with pools.prefill.tensor_parallel_size "
                f"{prefill.tensor_parallel_size} (expert_parallel_size {prefill.expert_parallel_size}): each of its "
                f"{prefill.ranks} ranks sends its heads of every layer from inside the forward, so it "
                "streams anyway; leave it true"
            )
        if self.mode == "disaggregated" and prefill.speculative is not None:
            raise ValueError(
                "pools.prefill.speculative: a prefill worker samples one token per request, so it has nothing to "
                "propose; set speculative on pools.decode"
            )
        return self

    def transfer_backend_problem(self) -> str:
        """Why ``transfer.backend`` cannot work with these pools ("" when it can): nccl on a CPU pool would quietly
        fall back to gloo, which has to be asked for by name."""
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
        """``model_path``: the model folder (the default model converted once)."""
        return EngineConfig(
            model=model_path,
            dtype=self.model.dtype,
            block_size=self.transfer.block_size,
            kv_cache_memory_bytes=None if pool.kv_memory_mb is None else pool.kv_memory_mb * MIB,
            max_model_len=self.model.max_model_len,
            **_shared(pool, EngineConfig),
        )

    def transfer_config(self) -> TransferConfig:
        """Its device is set in each worker (``worker.spec.resolve_spec``)."""
        return TransferConfig(**_shared(self.transfer, TransferConfig))

    def runtime_options(self, router_addresses: list[str], host: str) -> RuntimeOptions:
        """``router_addresses``: every router process's event socket, by index; ``host``: where workers bind."""
        return RuntimeOptions(
            router_addresses=list(router_addresses),
            host=host,
            secret=self.transfer.secret,
            orphan_timeout_s=self.router.orphan_timeout_s,
            tracing=self.observability.tracing_options(),
            max_body_bytes=self.router.max_body_bytes,
            router_queue_size=self.router.queue_size,
        )

    def max_event_bytes(self, model_path: str, max_model_len: int) -> int:
        """The bound of the router's event socket: the largest event any worker of the pools can send
        (``worker.messages.max_event_bytes``), its KV tokens from the pool's blocks (a GPU pool's, measured at start,
        as if every running request held a whole context)."""
        from worker.messages import max_event_bytes

        per_token = model_kv_bytes_per_token(model_path, self.pool_dtype(self.pools.prefill))
        bound = 0
        for _, _, pool in pool_layout(self):
            blocks = self.pool_kv_blocks(pool, per_token * self.transfer.block_size)
            kv_tokens = pool.max_num_seqs * max_model_len if blocks is None else blocks * self.transfer.block_size
            step = 1 + (pool.speculative.num_tokens if pool.speculative is not None else 0)
            bound = max(bound, max_event_bytes(max_model_len, pool.max_num_seqs, kv_tokens, step))
        return bound

    def nccl_peers(self, role: str) -> int:
        """The KV pair groups one worker of this role forms: one per worker of the other pool."""
        other = {"prefill": self.pools.decode, "decode": self.pools.prefill}.get(role)
        return other.replicas if other is not None and self.mode == "disaggregated" else 0

    def worker_specs(self, model_path: str, router_addresses: list[str], host: str) -> list[WorkerSpec]:
        """Every worker of every pool, in pool order, named ``<pool>-<index>``."""
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
        """A pool's KV bytes per replica as the engine sizes it; None on a GPU pool (measured at start)."""
        if pool.kv_memory_mb is not None:
            return pool.kv_memory_mb * MIB
        return None if pool.gpus_per_replica > 0 else DEFAULT_CPU_KV_BYTES

    def pool_kv_blocks(self, pool: PoolSection, bytes_per_block: int, num_kv_heads: int | None = None) -> int | None:
        """A pool's KV blocks per replica by the engine's rule; None on a GPU pool that measures its memory at start.
        ``bytes_per_block``: every KV head's; with the model's ``num_kv_heads``, a tensor-parallel replica's blocks
        are its ranks' (each rank's budget holds its heads only)."""
        kv_bytes = self.pool_kv_bytes(pool)
        if kv_bytes is None and not pool.kv_blocks:
            return None
        if num_kv_heads and pool.tensor_parallel_size > 1:
            bytes_per_block = bytes_per_block * rank_kv_heads(num_kv_heads, pool.tensor_parallel_size) // num_kv_heads
        return kv_blocks_for(kv_bytes or 0, bytes_per_block, pool.kv_blocks)

    def pool_dtype(self, pool: PoolSection) -> str:
        """``model.dtype`` with ``auto`` resolved as each worker does (bfloat16 on a GPU pool, float32 on a CPU one)."""
        return resolve_dtype(self.model.dtype, "cuda" if pool.gpus_per_replica > 0 else "cpu")

    @property
    def served_dtype(self) -> str:
        """The KV dtype: the first pool's with replicas (the transfer handshake refuses pools that differ)."""
        pools = [pool for _, _, pool in pool_layout(self) if pool.replicas] or [self.pools.prefill]
        return self.pool_dtype(pools[0])


def pool_layout(config: ClusterConfig) -> list[tuple[str, WorkerRole, PoolSection]]:
    """(pool name, worker role, pool section) for every pool; colocated mode keeps the workers, not the split."""
    prefill, decode = (
        (WorkerRole.COLOCATED,) * 2 if config.mode == "colocated" else (WorkerRole.PREFILL, WorkerRole.DECODE)
    )
    return [("prefill", prefill, config.pools.prefill), ("decode", decode, config.pools.decode)]


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
    return parse_config(*read_config_file(name_or_path))


# ---- finding and reading the file ---------------------------------------------------------------------------

SHIPPED_CONFIGS = "configs"  # the package that holds the shipped YAML files (package data)


def shipped_configs() -> list[str]:
    return sorted(entry.name for entry in resources.files(SHIPPED_CONFIGS).iterdir() if entry.name.endswith(".yaml"))


def find_config(name_or_path: str | Path) -> Path | Traversable:
    """``name_or_path`` when it is a file, else the shipped config of that name (``local`` or ``local.yaml``)
    wherever the package is installed; ConfigError if neither."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    name = str(name_or_path)
    if name and "/" not in name and "\\" not in name:  # a bare name: look among the shipped configs
        shipped = resources.files(SHIPPED_CONFIGS)
        for candidate in (name, f"{name}.yaml"):
            entry = shipped.joinpath(candidate)
            if candidate.endswith(".yaml") and entry.is_file():
                return entry
    raise ConfigError(
        f"{name_or_path}: config file not found (shipped configs, by name: {', '.join(shipped_configs())})"
    )


def read_config_file(name_or_path: str | Path) -> tuple[dict | None, str]:
    """The unvalidated sections (None for an empty file) and the file's name for error messages."""
    source = find_config(name_or_path)
    try:
        data = yaml.safe_load(source.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    return data, str(source)
