"""How many KV blocks a request needs: the one rule the engine and the router share.

The router decides which decode worker can take a request by the blocks it will reserve there, and the decode
worker's engine allocates exactly that many; if the two computed it apart, the router would send work a worker then
refuses (or leave blocks idle). So both call these functions. Pure integer arithmetic: this module imports nothing
heavy (no torch), because the router imports it.

A reservation for a request whose KV arrives from a prefill worker covers the prompt, the first generated token (the
prefill worker samples it; its KV is computed by the first decode step here) and ``headroom_tokens`` more, capped at
what the request can still generate (``max_tokens - 1`` after the first token, and the room left under
``max_model_len``). Within the reservation, decoding never has to ask for a block.

The prefix cache's block hash lives here for the same reason: the router predicts which worker holds a prompt's
leading blocks from the hashes workers report (``cluster/routing/prefix_index.py``), so it must hash a prompt exactly as the
engine does. ``chain_hash`` is the engine's own function, not a copy; ``prompt_block_hashes`` chains it over a
prompt's full blocks.

What a token's KV costs in bytes, and how many blocks a worker's KV memory holds, live here too: the planner
(``pdserve plan kv``), the router's /status and the benchmarks size KV from a model's config.json with the formula
the engine allocates by, without importing torch.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens' KV (the last one may be partial)."""
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
    num_prompt_tokens: int,
    max_tokens: int,
    headroom_tokens: int,
    block_size: int,
    max_model_len: int | None = None,
) -> int:
    """Blocks a decode worker's engine reserves for a request (``LLMEngine.reserve_remote`` allocates exactly these)."""
    return blocks_for_tokens(reserved_tokens(num_prompt_tokens, max_tokens, headroom_tokens, max_model_len), block_size)


def reusable_prefix_tokens(num_cached_blocks: int, num_prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens whose KV a prefix cache holding its first ``num_cached_blocks`` full blocks spares computing: at
    least one prompt token is always computed, because its logits are needed (a prompt cached whole recomputes its
    last block). The block manager's ``allocate`` and the router's hit-rate estimate both use this."""
    usable = min(num_cached_blocks, (num_prompt_tokens - 1) // block_size)
    return max(0, usable) * block_size


def complete_prompt_blocks(num_computed_tokens: int, num_prompt_tokens: int, block_size: int) -> int:
    """Leading blocks of a prompt whose KV is final once ``num_computed_tokens`` positions are computed: the full
    blocks, and the partial last block as soon as the whole prompt is (the KV export's rule)."""
    if num_computed_tokens >= num_prompt_tokens:
        return blocks_for_tokens(num_prompt_tokens, block_size)
    return num_computed_tokens // block_size


def chain_hash(prev_hash: int | None, token_ids: Sequence[int]) -> int:
    """A full block's prefix-cache key: xxh3_64 of the previous block's key (0 for the first block, 8 bytes little
    endian) and the block's token ids as native int64. Chained, so one key names the whole prefix up to its block:
    two sequences share a key only if they share every token before it (collisions are ruled out by the engine,
    which compares the tokens too)."""
    prefix = (prev_hash if prev_hash is not None else 0).to_bytes(8, "little")
    return xxhash.xxh3_64_intdigest(prefix + array("q", token_ids).tobytes())


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained keys of a sequence's full blocks, in order (a partial last block has none): what the engine
    registers for them once they are computed."""
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


# bytes per K/V value of each dtype name the engine serves in (engine.model_loader.DTYPES); a name, not a
# torch.dtype, so that sizing (``pdserve plan kv``, the router's /status) needs no model and no tensor
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes per value: the one formula for what a token's KV costs.

    Torch-free on purpose: the planner and the router size KV from a model's config.json, and ``KVSpec`` (the
    engine's live cache) calls this too, so the figure they print is the one the engine allocates by."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_shape_from_config(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) from a model's config.json fields, read the way ``LLMEngine`` reads them from
    the loaded model's config: KV heads default to the attention heads (no GQA), head dim to hidden / heads."""
    try:
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        return int(config["num_hidden_layers"]), kv_heads, head_dim
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"model config lacks a usable attention shape field: {exc!r}") from exc


def kv_blocks_for(memory_bytes: int, bytes_per_block: int, explicit_blocks: int | None = None) -> int:
    """How many KV blocks a worker allocates: an explicit count, else as many whole blocks as its memory holds
    (at least one); the rule ``LLMEngine`` applies to ``kv_blocks`` / ``kv_cache_memory_bytes``."""
    return explicit_blocks or max(1, memory_bytes // bytes_per_block)


def model_kv_bytes_per_token(model_dir: str | Path, dtype: str) -> int:
    """KV bytes per token of the model in ``model_dir`` (its config.json only) served in ``dtype``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return kv_bytes_per_token(*kv_shape_from_config(config), DTYPE_BYTES[dtype])
