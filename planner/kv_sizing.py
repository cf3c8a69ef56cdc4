"""KV sizing from a model's shape: bytes per token, tokens per GiB, and how many requests of a context fit a GPU.

From config.json alone, since sizing comes before any download: the attention shape and the parameter count it
implies (SwiGLU decoders, dense or with routed and shared experts, per-head or latent attention; exact for the dense
presets, within 0.5% of the published totals for the mixture-of-experts ones), and a mixture of experts' parameters
per token (those of the experts a token is routed to). The KV formula is the engine's own
(``engine.kv_cache.kv_bytes_per_token``), so the figure is what a worker allocates. Activations, CUDA graphs and
fragmentation are left to ``--gpu-memory-utilization`` (default 0.9, as in vLLM).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from engine.blocks import DTYPE_BYTES, kv_bytes_per_token, kv_shape_from_config, per_head_kv_values, routed_experts
from engine.config import check_parallel
from engine.model_loader import DEFAULT_MODEL, cache_dir
from engine.model_probe import config_refusal

GIB = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}

# each model's config.json fields on the Hugging Face Hub (the repository in ``source``), copied verbatim
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.2-1b": (
        "meta-llama/Llama-3.2-1B config.json",
        {
            "model_type": "llama",
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
            "max_position_embeddings": 131072,
        },
    ),
    "llama-3.1-8b": (
        "meta-llama/Llama-3.1-8B config.json",
        {
            "model_type": "llama",
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "vocab_size": 128256,
            "tie_word_embeddings": False,
            "max_position_embeddings": 131072,
        },
    ),
    "llama-3.1-70b": (
        "meta-llama/Llama-3.1-70B config.json",
        {
            "model_type": "llama",
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "vocab_size": 128256,
            "tie_word_embeddings": False,
            "max_position_embeddings": 131072,
        },
    ),
    "llama-2-70b": (
        "meta-llama/Llama-2-70b-hf config.json",
        {
            "model_type": "llama",
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "vocab_size": 32000,
            "tie_word_embeddings": False,
            "max_position_embeddings": 4096,
        },
    ),
    "qwen2.5-7b": (
        "Qwen/Qwen2.5-7B config.json",
        {
            "model_type": "qwen2",
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "vocab_size": 152064,
            "tie_word_embeddings": False,
            "max_position_embeddings": 131072,
        },
    ),
    "mistral-7b": (
        "mistralai/Mistral-7B-v0.3 config.json",
        {
            "model_type": "mistral",
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "vocab_size": 32768,
            "tie_word_embeddings": False,
            "max_position_embeddings": 32768,
        },
    ),
    "mixtral-8x7b": (
        "mistralai/Mixtral-8x7B-v0.1 config.json",
        {
            "model_type": "mixtral",
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "vocab_size": 32000,
            "tie_word_embeddings": False,
            "max_position_embeddings": 32768,
        },
    ),
    "qwen3-235b-a22b": (
        "Qwen/Qwen3-235B-A22B config.json",
        {
            "model_type": "qwen3_moe",
            "num_hidden_layers": 94,
            "num_attention_heads": 64,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "moe_intermediate_size": 1536,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "vocab_size": 151936,
            "tie_word_embeddings": False,
            "max_position_embeddings": 40960,
        },
    ),
    "deepseek-v3": (
        "deepseek-ai/DeepSeek-V3 config.json (the main model; its one multi-token-prediction layer is not served)",
        {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 3,
            "moe_layer_freq": 1,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "vocab_size": 129280,
            "tie_word_embeddings": False,
            "max_position_embeddings": 163840,
        },
    ),
    "smollm2-135m": (
        "HuggingFaceTB/SmolLM2-135M config.json",
        {
            "model_type": "llama",
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
            "max_position_embeddings": 8192,
        },
    ),
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What sizing needs of a model: its attention shape and the fields its parameter count follows from."""

    name: str
    source: str  # where the fields came from: a preset's config.json, or a folder's
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    per_head_kv_values: int | None = None  # latent attention: decompressed K+V values per token and layer
    # a mixture of experts (routed_experts 0: dense): each MoE layer's routed experts, the shared ones' total width,
    # how many a token is routed to, and how many layers have them (the others: a dense MLP of intermediate_size)
    routed_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    moe_layers: int = 0
    expert_bias: bool = False  # gpt-oss: every expert projection and the router carry a bias
    expert_parallel_size: int = 1  # a rank's shape (``rank_shape``): 1/E of the routed experts, whole
    # multi-head latent attention (DeepSeek): its projections instead of q, k and v (kv_lora_rank 0: none)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @classmethod
    def from_config(cls, name: str, source: str, config: dict[str, Any]) -> ModelShape:
        model_type = str(config.get("model_type", ""))
        refusal = config_refusal(config)
        if refusal is not None:
            raise ValueError(f"{source}: {refusal}")
        try:  # the Llama-style field names; the engine's probe reads any family from the model itself
            layers, kv_heads, head_dim = kv_shape_from_config(config)
        except ValueError as exc:
            raise ValueError(f"{source}: model type {model_type!r}: {exc}") from None
        try:
            return cls(
                name=name,
                source=source,
                model_type=model_type,
                num_layers=layers,
                num_attention_heads=int(config["num_attention_heads"]),
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                hidden_size=int(config["hidden_size"]),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=bool(config.get("attention_bias", False)),
                mlp_bias=bool(config.get("mlp_bias", False)),
                per_head_kv_values=per_head_kv_values(config),
                **_experts(config, layers),
                **_latent(config),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: lacks a usable field {exc}") from exc

    @property
    def parameters(self) -> int:
        """Weights of a SwiGLU decoder with this shape, as transformers builds it (Qwen2's q/k/v biases, Qwen3's q/k
        norms, any ``attention_bias`` / ``mlp_bias``, every routed and shared expert and the routers included; the LM
        head unless tied): what a replica holds."""
        return self._count(self.routed_experts / self.expert_parallel_size)

    @property
    def active_parameters(self) -> int:
        """The parameters one token's forward reads: a mixture of experts' routed experts only those it is routed to
        (DeepSeek-V3: 37 B of 671 B); a dense model's all of them. A rank of expert degree E computes 1/E of a
        token's routed experts, on average."""
        return self._count(self.experts_per_token / self.expert_parallel_size)

    def _count(self, experts: float) -> int:
        hidden = self.hidden_size
        mlp = 3 * hidden * self.intermediate_size + (2 * self.intermediate_size + hidden) * self.mlp_bias
        norms = 4 if self.model_type in ("gemma2", "gemma3", "gemma3_text") else 2  # Gemma: before and after each
        per_layer = self._attention() + norms * hidden
        dense_layers = self.num_layers - self.moe_layers
        total = self.num_layers * per_layer + dense_layers * mlp
        if self.moe_layers:
            expert = 3 * hidden * self.expert_intermediate_size
            expert += (2 * self.expert_intermediate_size + hidden) * self.expert_bias
            router = (hidden + self.expert_bias) * self.routed_experts
            shared = 3 * hidden * self.shared_intermediate_size
            shared += hidden * (self.model_type == "qwen2_moe" and self.shared_intermediate_size > 0)  # its gate
            total += round(self.moe_layers * (experts * expert + shared + router))
        embeddings = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2)
        return total + embeddings + hidden

    def _attention(self) -> int:
        """One layer's attention weights: q, k, v and o per head, or latent attention's projections and norms."""
        hidden, heads = self.hidden_size, self.num_attention_heads
        if self.kv_lora_rank:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = hidden * heads * qk
            if self.q_lora_rank:
                q = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk
            kv = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + heads * self.v_head_dim * hidden
        q_width, kv_width = heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
        if self.model_type in ("qwen2", "qwen2_moe"):  # q, k and v always carry a bias there; o does not
            attention += q_width + 2 * kv_width
        elif self.attention_bias:
            attention += q_width + 2 * kv_width + hidden
        if self.model_type in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"):  # RMSNorm over each head's q and k
            attention += 2 * self.head_dim
        if self.model_type == "gpt_oss":  # a sink per head
            attention += heads
        return attention

    def rank_shape(self, tensor_parallel_size: int, expert_parallel_size: int = 1) -> ModelShape:
        """What one rank holds at ``tensor_parallel_size`` N (engine.tensor_parallel): 1/N of the q heads, of a dense
        MLP and of the shared experts, its KV heads (one, replicated, when there are fewer than N; a latent row whole),
        the embedding, LM head, norms and routers whole; the routed experts whole, 1/E of them at
        ``expert_parallel_size`` E (engine.expert_parallel: the plans leave experts uncut; at N = 1 the E ranks each
        hold the rest whole). So its ``parameters`` are
        one GPU's weights and its KV heads one GPU's KV. ValueError naming the degree when the model does not split."""
        check_parallel(tensor_parallel_size, expert_parallel_size)
        if expert_parallel_size > 1 and not self.routed_experts:
            raise ValueError(f"expert_parallel_size {expert_parallel_size}: the model has no routed experts to split")
        if expert_parallel_size > 1 and self.routed_experts % expert_parallel_size:
            raise ValueError(
                f"expert_parallel_size {expert_parallel_size} does not divide the model's {self.routed_experts} routed "
                "experts"
            )
        if tensor_parallel_size == 1:  # the attention and dense layers whole on each of the expert degree's ranks
            return replace(self, expert_parallel_size=expert_parallel_size)
        from engine.tensor_parallel import head_split

        split = head_split(self.num_attention_heads, self.num_kv_heads, tensor_parallel_size, 0)
        widths = {
            "intermediate_size": self.intermediate_size,
            "shared_expert_intermediate_size": self.shared_intermediate_size,
        }
        for name, width in widths.items():
            if width % tensor_parallel_size:
                raise ValueError(
                    f"tensor_parallel_size {tensor_parallel_size} does not divide the model's {name} {width}"
                )
        return replace(
            self,
            num_attention_heads=split.q_heads,
            num_kv_heads=split.kv_heads,
            intermediate_size=self.intermediate_size // tensor_parallel_size,
            shared_intermediate_size=self.shared_intermediate_size // tensor_parallel_size,
            expert_parallel_size=expert_parallel_size,
        )


def _experts(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """A mixture of experts' fields, under each family's names (Mixtral and gpt-oss: ``num_local_experts``, every
    layer; Qwen2/3-MoE: ``num_experts``, every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``;
    DeepSeek: ``n_routed_experts`` and ``n_shared_experts``, dense below ``first_k_dense_replace``)."""
    routed = routed_experts(config)
    if not routed:
        return {}
    width = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    if "first_k_dense_replace" in config:
        freq = int(config.get("moe_layer_freq", 1))
        first = int(config["first_k_dense_replace"])
        moe_layers = sum(1 for i in range(num_layers) if i >= first and i % freq == 0)
    else:
        step = int(config.get("decoder_sparse_step", 1))
        dense = set(config.get("mlp_only_layers") or [])
        moe_layers = sum(1 for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    shared = int(config.get("shared_expert_intermediate_size") or 0) or int(config.get("n_shared_experts") or 0) * width
    return {
        "routed_experts": routed,
        "experts_per_token": int(config.get("num_experts_per_tok") or config.get("experts_per_token") or 1),
        "expert_intermediate_size": width,
        "shared_intermediate_size": shared,
        "moe_layers": moe_layers,
        "expert_bias": config.get("model_type") == "gpt_oss",
    }


def _latent(config: dict[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention's projection widths (DeepSeek-V2/V3, Kimi-K2), when the config has them."""
    if not config.get("kv_lora_rank"):
        return {}
    return {
        "q_lora_rank": int(config.get("q_lora_rank") or 0),
        "kv_lora_rank": int(config["kv_lora_rank"]),
        "qk_nope_head_dim": int(config["qk_nope_head_dim"]),
        "qk_rope_head_dim": int(config["qk_rope_head_dim"]),
        "v_head_dim": int(config["v_head_dim"]),
    }


def normalize_dtype(name: str) -> str:
    """A dtype the engine serves in, from its name or a common alias (bf16, fp16, fp32)."""
    dtype = DTYPE_ALIASES.get(name.lower(), name.lower())
    if dtype not in DTYPE_BYTES:
        choices = sorted(DTYPE_BYTES) + sorted(DTYPE_ALIASES)
        raise ValueError(f"dtype must be one of {', '.join(choices)}, got {name!r}")
    return dtype


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{str(folder)!r} holds no config.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{str(path)!r} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} is not a JSON object")
    return data


def load_shape(model: str) -> ModelShape:
    """A preset name, the built-in default model, or a model folder (its config.json only). Before the default model
    is converted (the first ``pdserve serve``) its shape is the smollm2-135m preset's: the same architecture."""
    if model.lower() in PRESETS:
        source, config = PRESETS[model.lower()]
        return ModelShape.from_config(model.lower(), f"preset: {source}", config)
    if model == DEFAULT_MODEL:
        folder = cache_dir() / "models" / DEFAULT_MODEL
        if (folder / "config.json").is_file():
            return ModelShape.from_config(model, f"{folder / 'config.json'}", _read_config(folder))
        source, config = PRESETS["smollm2-135m"]
        return ModelShape.from_config(model, f"preset: {source} (the default model is not converted yet)", config)
    folder = Path(model).expanduser()
    if not folder.exists():
        raise ValueError(
            f"{model!r} is neither a preset ({', '.join(PRESETS)}), the default model {DEFAULT_MODEL!r}, "
            "nor an existing folder"
        )
    return ModelShape.from_config(str(folder), str(folder / "config.json"), _read_config(folder))


@dataclass(frozen=True, slots=True)
class KVSizing:
    """The answer of ``pdserve plan kv``; GPU and context fields are None when not asked. Every "fit" figure is a
    floor: a request that does not wholly fit is not counted."""

    model: str
    source: str
    dtype: str
    dtype_bytes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    tokens_per_gib: int
    parameters: int
    weight_bytes: int
    active_parameters: int  # per token: a mixture of experts' routed experts only those a token is routed to
    tensor_parallel_size: int = 1  # > 1: every figure above and below is one rank's (one GPU's), KV heads included
    expert_parallel_size: int = 1  # > 1: that rank's weights hold 1/E of the routed experts
    gpu_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    usable_bytes: int | None = None  # gpu memory x utilization
    kv_budget_bytes: int | None = None  # usable - weights, 0 when the weights alone do not fit
    kv_budget_tokens: int | None = None
    kv_budget_blocks: int | None = None
    weights_fit: bool | None = None
    context_tokens: int | None = None
    kv_bytes_per_request: int | None = None  # context tokens x bytes per token
    blocks_per_request: int | None = None  # what the engine allocates: whole blocks
    requests_fit: int | None = None  # budget tokens // context
    requests_fit_blocks: int | None = None  # budget blocks // blocks per request (what a worker can really hold)
    # latent attention: what per-head K and V of every head would take instead (the cache MLA avoids)
    per_head_equivalent_bytes_per_token: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def size_kv(
    shape: ModelShape,
    dtype: str,
    block_size: int,
    gpu_memory_gib: float | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    context_tokens: int | None = None,
    tensor_parallel_size: int = 1,
    expert_parallel_size: int = 1,
) -> KVSizing:
    """``tensor_parallel_size`` N: per GPU of a worker of N ranks (each holds the same tokens, its heads of them),
    ``expert_parallel_size`` E of them splitting the routed experts."""
    dtype = normalize_dtype(dtype)
    shape = shape.rank_shape(tensor_parallel_size, expert_parallel_size)
    if block_size <= 0:
        raise ValueError(f"block size must be positive, got {block_size}")
    dtype_bytes = DTYPE_BYTES[dtype]
    per_token = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype_bytes)
    per_block = per_token * block_size
    weight_bytes = shape.parameters * dtype_bytes
    fields: dict[str, Any] = {}
    if gpu_memory_gib is not None:
        memory = int(gpu_memory_gib * GIB)
        usable = int(memory * gpu_memory_utilization)
        budget = max(0, usable - weight_bytes)
        fields |= {
            "gpu_memory_bytes": memory,
            "gpu_memory_utilization": gpu_memory_utilization,
            "usable_bytes": usable,
            "kv_budget_bytes": budget,
            "kv_budget_tokens": budget // per_token,
            "kv_budget_blocks": budget // per_block,
            "weights_fit": weight_bytes <= usable,
        }
    if shape.per_head_kv_values is not None:
        fields["per_head_equivalent_bytes_per_token"] = shape.num_layers * shape.per_head_kv_values * dtype_bytes
    if context_tokens is not None:
        blocks = math.ceil(context_tokens / block_size)
        fields |= {
            "context_tokens": context_tokens,
            "kv_bytes_per_request": context_tokens * per_token,
            "blocks_per_request": blocks,
        }
        if gpu_memory_gib is not None:
            fields["requests_fit"] = fields["kv_budget_tokens"] // context_tokens
            fields["requests_fit_blocks"] = fields["kv_budget_blocks"] // blocks
    return KVSizing(
        model=shape.name,
        source=shape.source,
        dtype=dtype,
        dtype_bytes=dtype_bytes,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        block_size=block_size,
        kv_bytes_per_token=per_token,
        kv_bytes_per_block=per_block,
        tokens_per_gib=GIB // per_token,
        parameters=shape.parameters,
        weight_bytes=weight_bytes,
        active_parameters=shape.active_parameters,
        tensor_parallel_size=tensor_parallel_size,
        expert_parallel_size=expert_parallel_size,
        **fields,
    )


def _bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n:,} B ({n / size:,.2f} {unit})"
    return f"{n:,} B"


def format_table(s: KVSizing) -> str:
    """Two columns for a human: what was asked, then what fits."""
    rows = [
        ("model", f"{s.model} ({s.source})"),
        ("dtype", f"{s.dtype} ({s.dtype_bytes} bytes per value)"),
        ("shape", f"{s.num_layers} layers x {s.num_kv_heads} KV heads x {s.head_dim} head dim"),
        (
            "KV per token",
            f"{_bytes(s.kv_bytes_per_token)} = 2 x {s.num_layers} x {s.num_kv_heads} x {s.head_dim} x {s.dtype_bytes}",
        ),
        ("tokens per GiB", f"{s.tokens_per_gib:,}"),
        *(
            [("per-head equivalent", f"{_bytes(s.per_head_equivalent_bytes_per_token)} per token without the latent")]
            if s.per_head_equivalent_bytes_per_token
            else []
        ),
        ("KV per block", f"{_bytes(s.kv_bytes_per_block)} ({s.block_size} tokens)"),
        ("weights", f"{s.parameters / 1e9:,.3f} B parameters = {_bytes(s.weight_bytes)}"),
        *(
            [("per token", f"{s.active_parameters / 1e9:,.3f} B parameters (the experts a token is routed to)")]
            if s.active_parameters != s.parameters
            else []
        ),
    ]
    if s.tensor_parallel_size > 1:
        experts = f", 1/{s.expert_parallel_size} of the routed experts" if s.expert_parallel_size > 1 else ""
        rows.insert(
            0, ("per GPU", f"one of {s.tensor_parallel_size} tensor-parallel ranks: its KV heads, its weights{experts}")
        )
    if s.gpu_memory_bytes is not None:
        rows += [
            (
                "GPU memory",
                f"{_bytes(s.gpu_memory_bytes)} x {s.gpu_memory_utilization} = {_bytes(s.usable_bytes or 0)}",
            ),
            (
                "KV budget",
                f"{_bytes(s.kv_budget_bytes or 0)} = {s.kv_budget_tokens:,} tokens = {s.kv_budget_blocks:,} blocks",
            ),
        ]
    if s.context_tokens is not None:
        rows.append(
            (
                "per request",
                f"{s.context_tokens:,} tokens = {s.blocks_per_request:,} blocks = "
                f"{_bytes(s.kv_bytes_per_request or 0)}",
            )
        )
    if s.requests_fit is not None:
        rows.append(("requests that fit", f"{s.requests_fit_blocks:,} in whole blocks ({s.requests_fit:,} by tokens)"))
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    if s.weights_fit is False:
        lines.append("warning: the weights alone exceed the usable GPU memory; no KV fits")
    lines.append("not counted: activations, CUDA graphs, framework overhead (what the utilization leaves room for)")
    return "\n".join(lines)
