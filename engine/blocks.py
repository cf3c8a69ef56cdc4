"""KV block arithmetic the engine and the router share: reservations, prefix-cache hashes, bytes per token.

The router admits a request to a decode worker by the blocks it reserves there (the engine allocates exactly that
many), predicts from reported hashes which worker holds a prompt's leading blocks (``cluster/routing/prefix_index.py``),
and, like ``pdserve plan kv`` and the benchmarks, sizes KV from a config.json: all with these functions, so none
drifts from the engine. Torch-free, because the router imports it. A remote-KV reservation covers the prompt, the
first token (its KV computed by the first decode step) and ``headroom_tokens`` more, capped at what the request can
still generate; within it, decoding never asks for a block.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return -(-max(0, num_tokens) // block_size)


def reserved_tokens(
    num_prompt_tokens: int, max_tokens: int, headroom_tokens: int, max_model_len: int | None = None
) -> int:
    """Token slots a remote-KV reservation covers: prompt + first token + headroom (capped; never negative)."""
    headroom = min(headroom_tokens, max_tokens - 1)
    if max_model_len is not None:
        headroom = min(headroom, max_model_len - num_prompt_tokens - 1)
    return num_prompt_tokens + 1 + max(0, headroom)


def reserved_blocks(
    num_prompt_tokens: int, max_tokens: int, headroom_tokens: int, block_size: int, max_model_len: int | None = None
) -> int:
    """Blocks a decode worker reserves for a request (``KVImporter.reserve`` allocates exactly these)."""
    return blocks_for_tokens(reserved_tokens(num_prompt_tokens, max_tokens, headroom_tokens, max_model_len), block_size)


def reusable_prefix_tokens(num_cached_blocks: int, num_prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens a prefix cache holding the first ``num_cached_blocks`` full blocks spares computing. One prompt
    token is always computed for its logits (a prompt cached whole recomputes its last block)."""
    usable = min(num_cached_blocks, (num_prompt_tokens - 1) // block_size)
    return max(0, usable) * block_size


def complete_prompt_blocks(num_computed_tokens: int, num_prompt_tokens: int, block_size: int) -> int:
    """Leading prompt blocks whose KV is final once ``num_computed_tokens`` are computed: the full blocks, and the
    partial last one once the whole prompt is (the KV export's rule)."""
    if num_computed_tokens >= num_prompt_tokens:
        return blocks_for_tokens(num_prompt_tokens, block_size)
    return num_computed_tokens // block_size


def chain_hash(prev_hash: int | None, token_ids: Sequence[int]) -> int:
    """A full block's prefix-cache key: xxh3_64 of the previous key (0 for the first block, 8 bytes little endian)
    and the token ids as native int64. Chained, so a key names the whole prefix; the engine also compares tokens,
    which rules out collisions."""
    prefix = (prev_hash if prev_hash is not None else 0).to_bytes(8, "little")
    return xxhash.xxh3_64_intdigest(prefix + array("q", token_ids).tobytes())


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained keys of a sequence's full blocks, in order (a partial last block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    # ``chain_hash`` unrolled over one int64 buffer of the whole sequence (the router runs this per request)
    data = array("q", token_ids).tobytes()
    step = block_size * 8
    hashes: list[int] = []
    prev = 0
    for offset in range(0, len(token_ids) // block_size * step, step):
        prev = xxhash.xxh3_64_intdigest(prev.to_bytes(8, "little") + data[offset : offset + step])
        hashes.append(prev)
    return hashes


# bytes per K/V value of each dtype name the engine serves in (engine.model_loader.DTYPES), so sizing needs no torch
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes per value; ``KVSpec`` allocates by this too."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def rank_kv_heads(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """The KV heads one of ``tensor_parallel_size`` ranks caches: its share, or one (replicated) when there are fewer
    heads than ranks, as vLLM does (``engine.tensor_parallel.head_split``)."""
    return num_kv_heads // tensor_parallel_size if num_kv_heads >= tensor_parallel_size else 1


# a config's routed experts per layer, by family's name: DeepSeek; Mixtral, gpt-oss and Qwen-MoE's saved configs; Qwen-MoE
EXPERT_COUNT_FIELDS = ("n_routed_experts", "num_local_experts", "num_experts")


def routed_experts(config: Mapping[str, Any]) -> int:
    """The model's routed experts per mixture-of-experts layer, from its config.json's fields (0: a dense model)."""
    return int(next((config[name] for name in EXPERT_COUNT_FIELDS if config.get(name)), 0))


def kv_shape_from_config(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the cache, from config.json, as the engine's probe finds them in the loaded
    model (``engine.model_probe``): KV heads default to the attention heads, head dim to hidden / heads; latent
    attention (``kv_lora_rank``: DeepSeek) caches one latent row of ``kv_lora_rank + qk_rope_head_dim`` values,
    half in each of the K and V planes (``engine.attention.latent``)."""
    try:
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        if config.get("kv_lora_rank"):
            latent_width = int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])
            return int(config["num_hidden_layers"]), 1, -(-latent_width // 2)
        return int(config["num_hidden_layers"]), kv_heads, head_dim
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"model config lacks a usable attention shape field: {exc!r}") from exc


def per_head_kv_values(config: Mapping[str, Any]) -> int | None:
    """Latent attention only: the values per token and layer its decompressed per-head keys and values would take
    (heads x (nope + rope key + value widths)), the cache a model without the latent would need; else None."""
    if not config.get("kv_lora_rank"):
        return None
    key_dim = int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"])
    return int(config["num_attention_heads"]) * (key_dim + int(config["v_head_dim"]))


def kv_blocks_for(memory_bytes: int, bytes_per_block: int, explicit_blocks: int | None = None) -> int:
    """An explicit count, else as many whole blocks as the memory holds (at least one)."""
    return explicit_blocks or max(1, memory_bytes // bytes_per_block)


def model_kv_bytes_per_token(model_dir: str | Path, dtype: str) -> int:
    """KV bytes per token of the model in ``model_dir`` (its config.json only) served in ``dtype``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return kv_bytes_per_token(*kv_shape_from_config(config), DTYPE_BYTES[dtype])
