"""Latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4-MoE-Lite, MiniCPM3…): the cache holds each token's compressed
latent, not its per-head keys and values (docs/architecture.md, "Latent attention").

transformers' MLA models hand their cache the latent before decompressing it (``cache.update(kv_nope, k_rot,
layer)``); ``LatentCache`` (``batch.py``), the cache the runner passes such a model, keeps each layer's latent for
``paged_attention_forward``, which stores it split over the cache's K and V planes (one head of half the width
each). Prefill chunks with cached context expand the context's latents with the layer's own ``expand_kv``; decode
attends from the latent itself, W_UK absorbed into the query and W_UV applied after (``absorbed_decode``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from engine.attention.batch import AttentionBatch, LayerFeatures


def is_latent_model(model: torch.nn.Module) -> bool:
    """Attention modules that decompress cached latents (transformers' ``expand_kv`` convention)."""
    return any(callable(getattr(module, "expand_kv", None)) for module in model.modules())


def cache_kwarg(decoder: torch.nn.Module) -> str:
    """The decoder's name for its cache argument: ``cache`` or ``past_key_values``, by transformers version."""
    import inspect

    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def _rows(batch: AttentionBatch, stored: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored planes ``[2, ..., 1, half]`` back to latent rows ``[..., width]``."""
    planes = batch.kv_cache.dequantize(stored, dtype)
    return torch.cat((planes[0], planes[1]), dim=-1).squeeze(-2)[..., :width]


def absorbed_weights(module: Any, lora: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``kv_b_proj`` split into W_UK ``[H, nope, lora]`` and W_UV ``[H, dv, lora]`` (DeepSeek's names), or None
    when the module does not name them (or has a bias), so its ``expand_kv`` is used instead."""
    proj = getattr(module, "kv_b_proj", None)
    nope, value_dim = getattr(module, "qk_nope_head_dim", None), getattr(module, "v_head_dim", None)
    if not isinstance(proj, torch.nn.Linear) or proj.bias is not None or not nope or not value_dim:
        return None
    weight = proj.weight.view(-1, nope + value_dim, lora)
    return weight[:, :nope], weight[:, nope:]


def absorbed_decode(
    q: torch.Tensor,  # [B, H, 1, nope + rope]
    context: torch.Tensor,  # [B, C, lora + rope]
    absorbed: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Decode attending from the latent: W_UK folded into the query, so every head reads the one latent row per key
    (multi-query attention over ``lora + rope`` values), and W_UV applied to the attended latent. The same sums as
    expanding every key, in another order (the test bounds the gap)."""
    w_uk, w_uv = absorbed
    nope = w_uk.shape[1]
    q_latent = torch.einsum("bhqd,hdl->bhql", q[..., :nope], w_uk)  # [B, H, 1, lora]
    query = torch.cat((q_latent, q[..., nope:]), dim=-1)  # [B, H, 1, lora + rope]
    lora = w_uk.shape[2]
    keys = context.unsqueeze(1)  # [B, 1, C, lora + rope]: one head that every query head reads
    # the heads folded into the query axis of that one head: no GQA beside the mask (on CUDA only the math kernel
    # takes both, which would copy the latent once per head); ``mask [B, 1, 1, C]`` broadcasts over the heads
    folded = query.transpose(1, 2)  # [B, 1, H, lora + rope]
    out = F.scaled_dot_product_attention(folded, keys, keys[..., :lora], attn_mask=mask, scale=scale)
    return torch.einsum("bhl,hdl->bhd", out[:, 0], w_uv)  # [B, H, dv]


def latent_attention_forward(
    module: Any,
    query: torch.Tensor,  # [1, H, T, dk]
    key: torch.Tensor,  # [1, H, T, dk]: this step's tokens, expanded by the model
    value: torch.Tensor,  # [1, H, T, dv]
    batch: AttentionBatch,
    features: LayerFeatures,
    layer: int,
    latent: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Store this step's latents, then attend: chunks with no cached context over their own expanded keys (as the
    model computed them), every other query over its context's latents expanded by ``module.expand_kv``."""
    nope, rot = latent  # [1, 1, T, lora], [1, 1, T, rope]
    lora = nope.shape[-1]
    width = lora + rot.shape[-1]
    half = batch.kv_cache.spec.model_head_dim
    rows = torch.cat((nope[0, 0], rot[0, 0]), dim=-1)  # [T, width]
    if 2 * half != width:
        rows = F.pad(rows, (0, 2 * half - width))
    batch.kv_cache.write_slots(layer, batch.slot_mapping, rows[:, None, :half], rows[:, None, half:])
    if batch.layer_hook is not None:
        batch.layer_hook(layer, batch)

    def expand(context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [B, C, width] -> [B, H, C, d]
        return module.expand_kv(context[:, None, :, :lora], context[:, None, :, lora:])

    num_tokens, heads, value_dim = query.shape[2], query.shape[1], value.shape[-1]
    out = query.new_empty(num_tokens, heads, value_dim)
    group = batch.decode
    if group is not None:
        cache = batch.kv_cache.kv[layer]  # [2, blocks, block_size, 1, half]
        stored = cache.index_select(1, group.block_table.flatten())
        stored = stored.view(2, group.block_table.shape[0], -1, 1, half)[:, :, : group.max_context]
        context = _rows(batch, stored, width, query.dtype)  # [B, C, width]
        index = group.token_index
        q = (query[0] if index is None else query[0, :, index]).transpose(0, 1).unsqueeze(2)  # [B, H, 1, dk]
        absorbed = absorbed_weights(module, lora)
        if absorbed is not None:
            o = absorbed_decode(q, context, absorbed, group.mask, features.scaling)
        else:
            k, v = expand(context)  # [B, H, C, d]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=features.scaling)[:, :, 0]
        if index is None:
            return o.unsqueeze(0)  # [1, T, H, dv], T = B
        out[index] = o
    for seq in batch.prefills:
        span = slice(seq.q_start, seq.q_start + seq.q_len)
        q = query[:, :, span]
        if seq.context_slots is None:
            o = F.scaled_dot_product_attention(
                q, key[:, :, span], value[:, :, span], is_causal=True, scale=features.scaling
            )
        else:
            stored = batch.kv_cache.flat(layer).index_select(1, seq.context_slots)  # [2, C, 1, half]
            k, v = expand(_rows(batch, stored, width, query.dtype).unsqueeze(0))
            causal = causal_lower_right(seq.q_len, seq.context_len)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=features.scaling)
        out[span] = o[0].transpose(0, 1)
    return out.unsqueeze(0)
