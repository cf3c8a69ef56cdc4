"""Engine settings: what one worker's engine needs to know. Validated on construction; errors name the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

DEFAULT_MODEL = "smollm2-135m-instruct"  # the built-in model (engine.model_loader converts it once)
DTYPES = ("float32", "bfloat16", "float16")  # names only: reading a config must not import torch
# auto: flashinfer on CUDA when installed, else sdpa; sdpa: gather + torch SDPA (the CPU path); flex: FlexAttention
# with a paged block mask; flashinfer: FlashInfer's paged kernels (CUDA only). See engine/attention/backend.py
AttentionBackendName = Literal["auto", "sdpa", "flex", "flashinfer"]
# the KV cache's storage (vLLM's names): the model's dtype, or 8-bit values with a float32 scale per (token, head)
KVCacheDtype = Literal["auto", "int8", "fp8_e4m3"]
DEFAULT_CPU_KV_BYTES = 256 * 1024 * 1024  # the KV budget of a CPU engine given neither blocks nor bytes
TierName = Literal["host", "disk"]
KV_TIERS: tuple[TierName, ...] = ("host", "disk")  # below the device, in the order a block falls through them
KVPlace = Literal["device", "host", "disk"]  # where a block's KV is: the device cache or a tier below it


@dataclass(slots=True)
class KVOffloadConfig:
    """Where KV blocks that leave the prefix cache go instead of being dropped (engine/kv_tiers.py); each tier is
    optional. The host tier is shared memory (/dev/shm) shared by this node's workers of the same model under
    ``host_pool``; the disk tier is a folder that outlives the worker (a restart finds its pages)."""

    host_memory_mb: int = 0  # 0: no host tier; else the node's shared pool holds at most this many MiB
    disk_dir: str | None = None  # None: no disk tier
    disk_mb: int = 0  # the disk tier's bound (needed with disk_dir)
    host_pool: str = "default"  # workers of one model on a node under the same name share their host tier
    # pages written and read on the engine's own thread at once, without the tier threads: a seeded simulation
    # (cluster/sim) must not depend on thread timing; serving keeps the threads (a read overlaps the forward)
    inline_io: bool = False

    def __post_init__(self) -> None:
        for name in ("host_memory_mb", "disk_mb"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"kv_offload.{name} must be an integer >= 0, got {value!r}")
        if (self.disk_dir is None) != (self.disk_mb == 0):
            raise ValueError("kv_offload.disk_dir and kv_offload.disk_mb go together: a disk tier needs both")
        if not self.host_pool or not all(c.isalnum() or c in "-_." for c in self.host_pool) or self.host_pool[0] == ".":
            raise ValueError(
                f"kv_offload.host_pool must be a plain name (letters, digits, - _ .), got {self.host_pool!r}"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.host_memory_mb or self.disk_dir)


SpeculativeMethod = Literal["ngram", "draft"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)
DRAFT_BLOCK_SIZE = 4  # the draft engine's blocks: each proposal recomputes at most this many tokens before it


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding in a decode (or colocated) engine (engine/speculative.py): each decoding request gets up to
    ``num_tokens`` proposed tokens, which the model verifies in the same forward; greedy output is unchanged, and so
    is the distribution of sampled output. ``ngram``: the proposal continues the latest earlier occurrence of the
    request's last ``ngram_max`` .. ``ngram_min`` tokens in its prompt and output (prompt lookup). ``draft``: a
    smaller model with the same vocabulary (``draft_model``) proposes greedily, on its own paged KV cache of
    ``draft_kv_memory_mb``."""

    method: SpeculativeMethod = "ngram"
    num_tokens: int = 4  # the most proposed tokens per request and step; each request adapts its own below it
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: str | None = None  # a model folder (or the built-in model's name), for method: draft
    draft_kv_memory_mb: int = 64
    # no proposals in a step with more decoding requests than this (vLLM's speculative_disable_by_batch_size): a
    # proposal's verified rows slow every request of the step, which at a large batch costs more than it gains
    disable_above_batch: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative.method must be one of {list(SPECULATIVE_METHODS)}, got {self.method!r}")
        for name in ("num_tokens", "ngram_min", "ngram_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 32:
                raise ValueError(f"speculative.{name} must be an integer in [1, 32], got {value!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"speculative.ngram_min ({self.ngram_min}) must be <= speculative.ngram_max ({self.ngram_max})"
            )
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("speculative.draft_model is needed with method: draft, and only then")
        for name in ("draft_kv_memory_mb", "disable_above_batch"):
            value = getattr(self, name)
            if value is None and name == "disable_above_batch":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"speculative.{name} must be a positive integer, got {value!r}")


MAX_COMPILED_BATCHES = 8  # compile_decode_batches: each size costs a compile at start-up (about 35 s on 2 cores)


def worker_ranks(tensor_parallel_size: int, expert_parallel_size: int) -> int:
    """A worker's ranks: its tensor degree, or its expert degree when only its experts are split."""
    return max(tensor_parallel_size, expert_parallel_size)


def check_parallel(tensor_parallel_size: int, expert_parallel_size: int) -> None:
    """ValueError naming ``expert_parallel_size`` for a layout the ranks cannot take: the experts ride on the
    tensor-parallel ranks (vLLM's ``--enable-expert-parallel``), or on ranks of their own whose attention is whole."""
    if expert_parallel_size not in (1, tensor_parallel_size) and tensor_parallel_size != 1:
        raise ValueError(
            f"expert_parallel_size {expert_parallel_size}: the experts are split over the worker's ranks, so it is 1, "
            f"tensor_parallel_size ({tensor_parallel_size}), or any with tensor_parallel_size 1"
        )


def resolve_dtype(dtype: str, device: str) -> str:
    """``"auto"``: bfloat16 on CUDA (half the bytes to load, hold and ship, full speed on tensor cores), float32 on
    the CPU (bfloat16 matmuls are slow there, and token-exactness against transformers is checked there)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


@dataclass(slots=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # resolved where the device is known: resolve_dtype
    device: str = "cpu"
    block_size: int = 16
    kv_blocks: int | None = None  # explicit block count; otherwise from kv_cache_memory_bytes
    # None: DEFAULT_CPU_KV_BYTES on the CPU; on CUDA what gpu_memory_utilization leaves after the weights and a
    # profiling forward at the largest batch (measured free memory, as vLLM does)
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9  # CUDA: the fraction of the GPU's memory this engine may use, all included
    attention_backend: AttentionBackendName = "auto"
    kv_cache_dtype: KVCacheDtype = "auto"
    cuda_graphs: bool = True  # CUDA: decode steps replay graphs captured per batch-size bucket; ignored on the CPU
    # CPU: decode-only steps of up to the largest of these batch sizes run a torch.compile'd static step, rows padded
    # to the next listed size, each size compiled once per machine (30-120 s for SmolLM2 on 2 cores) and then loaded
    # from $PDSERVE_CACHE at every start (seconds; engine/compile_cache.py); None: eager
    compile_decode_batches: list[int] | None = None
    # a step not yet on disk compiles in a background process while the engine serves eagerly; of a kept one the start
    # loads the smallest size and a thread the others when first met (engine/background_compile.py,
    # engine/compile_cache.py; at a tensor-parallel degree of 1); false: the start compiles or loads every size
    compile_decode_background: bool = True
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_batch_tokens: int = 2048  # tokens per forward: longer prompts are prefilled in chunks
    max_num_seqs: int = 64  # requests in the running batch
    enable_prefix_caching: bool = True
    torch_threads: int | None = None
    # CPU, float32: the linears' products are timed at load for decode's row counts and each count takes the fastest
    # (engine.cpu_linear; a packed copy of the weights is kept if one is); false: torch's linear everywhere
    cpu_linear_tuning: bool = True
    # a prefill worker's engine: no decode graphs (nor their static gather storage)
    prefill_only: bool = False
    # CUDA, measured KV budget: NCCL pair groups this process will hold (their buffers live on this GPU), and a fixed
    # reserve for what loads after the profile (lazily loaded kernels, new streams' workspaces)
    nccl_peers: int = 0
    memory_reserve_bytes: int = 1024 * 1024 * 1024
    # the ways this engine's ranks cut every layer and the KV heads (engine.tensor_parallel)
    tensor_parallel_size: int = 1
    # the ways they split a mixture's routed experts (engine.expert_parallel): 1, the tensor degree, or any with a
    # tensor degree of 1 (then every rank holds the whole attention and every KV head): ``ranks``
    expert_parallel_size: int = 1
    kv_offload: KVOffloadConfig | None = None  # host and disk tiers below the device KV (None: evicted KV is dropped)
    speculative: SpeculativeConfig | None = None  # proposed tokens verified per decode step (None: one token a step)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name, allowed in (("attention_backend", AttentionBackendName), ("kv_cache_dtype", KVCacheDtype)):
            if getattr(self, name) not in get_args(allowed):
                raise ValueError(f"{name} must be one of {list(get_args(allowed))}, got {getattr(self, name)!r}")
        if isinstance(self.kv_offload, dict):  # from YAML or a message
            self.kv_offload = KVOffloadConfig(**self.kv_offload)
        if isinstance(self.speculative, dict):
            self.speculative = SpeculativeConfig(**self.speculative)
        if self.kv_offload is not None and self.kv_offload.enabled:
            if not self.enable_prefix_caching:
                raise ValueError("kv_offload keeps blocks the prefix cache evicts: it needs enable_prefix_caching")
        if self.kv_cache_dtype != "auto" and self.attention_backend == "flashinfer":
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} (a scale per token and head) is read by the sdpa and flex "
                "attention backends, not by attention_backend 'flashinfer' (its kernels take one scale per tensor)"
            )
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("block_size", "max_batch_tokens", "max_num_seqs", "tensor_parallel_size", "expert_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        check_parallel(self.tensor_parallel_size, self.expert_parallel_size)
        if self.compile_decode_batches is not None:
            self._check_compile_batches(self.compile_decode_batches)
        for name in ("nccl_peers", "memory_reserve_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("kv_blocks", "kv_cache_memory_bytes", "max_model_len", "torch_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or null, got {value!r}")

    @property
    def ranks(self) -> int:
        """The engine's ranks (processes, devices): ``worker_ranks``."""
        return worker_ranks(self.tensor_parallel_size, self.expert_parallel_size)

    def _check_compile_batches(self, batches: object) -> None:
        name = "compile_decode_batches"
        if not isinstance(batches, list | tuple) or not batches:
            raise ValueError(f"{name} must be a non-empty list of batch sizes or null, got {batches!r}")
        for value in batches:
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= self.max_num_seqs:
                raise ValueError(
                    f"{name} entries must be integers in [1, max_num_seqs={self.max_num_seqs}], got {value!r}"
                )
        if len(set(batches)) != len(batches) or len(batches) > MAX_COMPILED_BATCHES:
            raise ValueError(f"{name} must be at most {MAX_COMPILED_BATCHES} distinct sizes, got {list(batches)}")
        if self.device != "cpu":
            raise ValueError(f"{name} is for the CPU; on {self.device!r} cuda_graphs replays captured decode steps")
        self.compile_decode_batches = list(batches)
