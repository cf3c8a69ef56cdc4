"""Gather + SDPA: the paged context gathered into a contiguous buffer, then torch's scaled_dot_product_attention.

The CPU path, and CUDA's fallback without FlashInfer. Decode rows attend together in one SDPA over their gathered,
padded context; prefill chunks attend one by one, causally, aligned to the end of their context.

No fused kernel takes GQA (``enable_gqa``) together with a mask tensor (the math kernel would run: float32 upcast, K/V
repeated per head), so every call is shaped for a fused one: decode folds the query heads that share a KV head into
the query-length axis (``[B, kv_heads, heads / kv_heads, d]``: no GQA, and the ``[B, 1, 1, C]`` padding mask
broadcasts); a prefill chunk with cached context uses ``causal_lower_right`` (flash with GQA, no mask tensor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from engine.attention.backend import AttentionBackend
from engine.attention.batch import AttentionBatch


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    """``q [B, H, d]`` against ``k, v [B, kvH, C, d]`` (``mask [B, 1, 1, C]`` or None) -> ``[B, H, d]``; query head
    ``h`` reads KV head ``h // (H / kvH)``, as transformers' ``repeat_kv``."""
    rows, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    folded = q.reshape(rows, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
    return out.reshape(rows, heads, head_dim)


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    needs_groups = True

    def forward(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch: AttentionBatch,
        scaling: float | None,
    ) -> torch.Tensor:
        num_heads, num_tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
        kv_flat = batch.kv_cache.flat(layer)  # [2, slots, kv_heads, d]
        gqa = num_heads != key.shape[1]

        group = batch.decode
        if group is not None:
            # gather whole blocks into one buffer reused by every layer (a fresh multi-MiB tensor per layer costs
            # page faults on CPU); index_select over a flat id list is ~2.5x faster than 2-D advanced indexing
            cache = batch.kv_cache.kv[layer]  # [2, num_blocks, block_size, kvH, d]
            torch.index_select(cache, 1, group.block_table.flatten(), out=group.gather_buffer)
            blocks = group.gather_buffer.view(2, *group.block_table.shape, *cache.shape[2:])
            kv = blocks.flatten(2, 3)[:, :, : group.max_context].permute(0, 1, 3, 2, 4).to(query.dtype)  # [2,B,kvH,C,d]
            if group.token_index is None:  # a decode-only step: the packed row is the batch, in order
                o = decode_attention(query[0].transpose(0, 1), kv[0], kv[1], group.mask, scaling)  # [B, H, d]
                return o.unsqueeze(1)  # [B, 1, H, d]: the layer reshapes it to [B, 1, H*d] == [1, T, H*d]

        out = query.new_empty(num_tokens, num_heads, head_dim)
        if group is not None:
            q = query[0, :, group.token_index].transpose(0, 1)  # [B, H, d]
            out[group.token_index] = decode_attention(q, kv[0], kv[1], group.mask, scaling)

        for seq in batch.prefills:
            q = query[:, :, seq.q_start : seq.q_start + seq.q_len]
            if seq.context_slots is None:
                k = key[:, :, seq.q_start : seq.q_start + seq.q_len]
                v = value[:, :, seq.q_start : seq.q_start + seq.q_len]
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
            else:
                kv = (
                    kv_flat.index_select(1, seq.context_slots).transpose(1, 2).unsqueeze(1).to(query.dtype)
                )  # [2,1,kvH,C,d]
                causal = causal_lower_right(seq.q_len, seq.context_len)
                o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=causal, scale=scaling, enable_gqa=gqa)
            out[seq.q_start : seq.q_start + seq.q_len] = o[0].transpose(0, 1)

        return out.unsqueeze(0)
