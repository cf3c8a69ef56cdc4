"""Gather + SDPA: the paged context gathered into a contiguous buffer, then torch's scaled_dot_product_attention.

The CPU path, and the fallback on CUDA when FlashInfer is not installed. Decode sequences (one query token each)
attend together in one SDPA over their gathered, padded context; prefill chunks attend one by one, with a causal mask
offset by the tokens already cached (a chunk that is its whole context attends to its own new K/V, no gather).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend
from engine.attention.batch import AttentionBatch


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
            # gather whole blocks (a few KiB each, not one slot at a time), then view them as each request's context
            # (index_select over a flat id list is ~2.5x faster than advanced indexing with a 2-D table on CPU)
            # into one buffer reused by every layer: a fresh multi-MiB tensor per layer costs page faults on CPU
            cache = batch.kv_cache.kv[layer]  # [2, num_blocks, block_size, kvH, d]
            torch.index_select(cache, 1, group.block_table.flatten(), out=group.gather_buffer)
            blocks = group.gather_buffer.view(2, *group.block_table.shape, *cache.shape[2:])
            kv = blocks.flatten(2, 3)[:, :, : group.max_context].permute(0, 1, 3, 2, 4).to(query.dtype)  # [2,B,kvH,C,d]
            if group.token_index is None:  # a decode-only step: the packed row is the batch, in order
                q = query[0].transpose(0, 1).unsqueeze(2)  # [B, H, 1, d]
                o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=group.mask, scale=scaling, enable_gqa=gqa)
                return o.transpose(1, 2)  # [B, 1, H, d]: the layer reshapes it to [B, 1, H*d] == [1, T, H*d]

        out = query.new_empty(num_tokens, num_heads, head_dim)
        if group is not None:
            q = query[0, :, group.token_index].transpose(0, 1).unsqueeze(2)  # [B, H, 1, d]
            o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=group.mask, scale=scaling, enable_gqa=gqa)
            out[group.token_index] = o[:, :, 0]

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
                k, v = kv[0], kv[1]
                offset = seq.context_len - seq.q_len
                rows = torch.arange(seq.q_len, device=query.device).unsqueeze(1) + offset
                mask = torch.arange(seq.context_len, device=query.device).unsqueeze(0) <= rows
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
            out[seq.q_start : seq.q_start + seq.q_len] = o[0].transpose(0, 1)

        return out.unsqueeze(0)
