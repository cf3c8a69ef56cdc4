"""Gather + SDPA: the paged context gathered into a contiguous buffer, then torch's scaled_dot_product_attention.

The CPU path, and CUDA's fallback without FlashInfer. Decode rows attend together in one SDPA over their gathered,
padded context (a verified request's row holds its last token and its proposal, each query masked to its own
position), the query heads that share a KV head folded into the query axis; prefill chunks attend one by one: a
first chunk ``is_causal``, a later one of a model without GQA with ``causal_lower_right``, every other (GQA, or a
window) with a mask and its query heads folded. So no call pairs GQA with a mask tensor, which only the unfused math
kernel takes (docs/gpu.md, "SDPA and its CUDA kernels"); tests/engine/test_model_families.py checks every call. A layer's sliding window joins the mask; soft-capping and sinks have no SDPA form, so
those layers attend in ``math_attention``, the operations of transformers' eager attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from engine.attention.batch import AttentionBackend, AttentionBatch, DecodeGroup, LayerFeatures


def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    features: LayerFeatures,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``softmax(softcap(q k^T * scale) + mask [, sink]) v`` as transformers' eager attention computes it; ``q``
    ``[B, h, Tq, d]`` against ``k, v [B, h, C, d]`` (same head count), ``allowed`` broadcastable to ``[B, h, Tq, C]``,
    ``sinks`` to ``[B, h, Tq, 1]``."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * features.scaling
    if features.softcap is not None:
        scores = torch.tanh(scores / features.softcap) * features.softcap
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:  # the sink joins the softmax as one more column, then is dropped (gpt-oss)
        combined = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(q.dtype)
    return torch.matmul(probs, v)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, features: LayerFeatures
) -> torch.Tensor:
    """``q [B, H, Q, d]`` against ``k, v [B, kvH, C, d]`` (``mask [B, 1, Q, C]`` or None) -> ``[B, H, Q, d]``; query
    head ``h`` reads KV head ``h // (H / kvH)``, as transformers' ``repeat_kv``."""
    rows, heads, queries, head_dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    folded = q.reshape(rows, kv_heads, groups * queries, head_dim)  # query axis: (head in group, query)
    if mask is not None and queries > 1:
        mask = mask.unsqueeze(2).expand(rows, 1, groups, queries, mask.shape[-1]).reshape(rows, 1, groups * queries, -1)
    if features.softcap is None and features.sinks is None:
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=features.scaling)
    else:
        sinks = None
        if features.sinks is not None:
            sinks = features.sinks.view(1, kv_heads, groups, 1).repeat_interleave(queries, dim=2)
        out = math_attention(folded, k, v, mask, features, sinks)
    return out.reshape(rows, heads, queries, head_dim)


def decode_mask(group: DecodeGroup, features: LayerFeatures, first_key: int = 0) -> torch.Tensor | None:
    """The decode rows' mask with the layer's window: a query attending ``E`` keys (its position + 1) attends keys
    ``[E - W, E)``, of those gathered from position ``first_key`` on."""
    if features.sliding_window is None or group.context_lens is None:
        return group.mask
    ends = group.context_lens.unsqueeze(1) if group.query_ends is None else group.query_ends  # [B, Q]
    keys = torch.arange(first_key, group.max_context, device=group.block_table.device).view(1, 1, -1)
    ends = ends.unsqueeze(2)
    allowed = (keys < ends) & (keys >= ends - features.sliding_window)
    return allowed.unsqueeze(1)  # [B, 1, Q, C]


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, features: LayerFeatures
) -> torch.Tensor:
    """A chunk of ``q [1, H, Tq, d]`` at the end of its ``context_len`` keys ``k, v [1, kvH, C, d]``, causal, with
    the layer's window, soft-cap and sinks."""
    heads, q_len = q.shape[1], q.shape[2]
    query_pos = torch.arange(context_len - q_len, context_len, device=q.device).unsqueeze(1)
    key_pos = torch.arange(context_len, device=q.device).unsqueeze(0)
    allowed = key_pos <= query_pos
    if features.sliding_window is not None:
        allowed &= key_pos > query_pos - features.sliding_window
    groups = heads // k.shape[1]
    if features.softcap is None and features.sinks is None:
        # the query heads that share a KV head folded into the query axis, the mask repeated for each: no GQA beside
        # a mask tensor (on CUDA only the math kernel takes both, repeating K and V per query head)
        folded = q.reshape(1, k.shape[1], groups * q_len, q.shape[-1])
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=allowed.repeat(groups, 1), scale=features.scaling)
        return out.view(1, heads, q_len, -1)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    sinks = None if features.sinks is None else features.sinks.view(1, heads, 1, 1)
    return math_attention(q, k, v, allowed, features, sinks)


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    needs_groups = True
    supports_features = True

    def forward(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch: AttentionBatch,
        features: LayerFeatures,
    ) -> torch.Tensor:
        num_heads, num_tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
        kv_flat = batch.kv_cache.flat(layer)  # [2, slots, kv_heads, d]
        gqa = num_heads != key.shape[1]

        group = batch.decode
        if group is not None:
            # gather whole blocks into one buffer reused by every layer (a fresh multi-MiB tensor per layer costs
            # page faults on CPU); index_select over a flat id list is ~2.5x faster than 2-D advanced indexing
            cache = batch.kv_cache.kv[layer]  # [2, num_blocks, block_size, kvH, d]
            # a sliding-window layer gathers only the blocks some row's window still reaches
            first = group.window_first_block.get(features.sliding_window or 0, 0)
            table = group.block_table[:, first:] if first else group.block_table
            if group.gather_buffer is None:
                buffer = cache.index_select(1, table.flatten())
            else:
                buffer = group.gather_buffer.view(-1)[: 2 * table.numel() * cache[0, 0].numel()]
                buffer = buffer.view(2, table.numel(), *cache.shape[2:])
                torch.index_select(cache, 1, table.flatten(), out=buffer)
            blocks = buffer.view(2, *table.shape, *cache.shape[2:])
            first_key = first * cache.shape[2]
            stored = blocks.flatten(2, 3)[:, :, : group.max_context - first_key].permute(0, 1, 3, 2, 4)
            kv = batch.kv_cache.dequantize(stored, query.dtype)  # [2, B, kvH, C, d]
            mask = group.mask if features.plain else decode_mask(group, features, first_key)
            if group.token_index is None:  # a decode-only step: the packed row is the batch, in order
                o = decode_attention(query[0].transpose(0, 1).unsqueeze(2), kv[0], kv[1], mask, features)
                return o[:, :, 0].unsqueeze(0)  # [1, T, H, d], T = B: a view, no copy

        out = query.new_empty(num_tokens, num_heads, head_dim)
        if group is not None:
            rows, queries = group.block_table.shape[0], group.query_len
            q = query[0, :, group.token_index].view(num_heads, rows, queries, head_dim).transpose(0, 1)  # [B, H, Q, d]
            o = decode_attention(q, kv[0], kv[1], mask, features).transpose(1, 2)  # [B, Q, H, d]
            out[group.token_index] = o.reshape(rows * queries, num_heads, head_dim)

        for seq in batch.prefills:
            q = query[:, :, seq.q_start : seq.q_start + seq.q_len]
            if seq.context_slots is None:
                k = key[:, :, seq.q_start : seq.q_start + seq.q_len]
                v = value[:, :, seq.q_start : seq.q_start + seq.q_len]
            else:
                stored = kv_flat.index_select(1, seq.context_slots).transpose(1, 2).unsqueeze(1)
                kv = batch.kv_cache.dequantize(stored, query.dtype)  # [2, 1, kvH, C, d]
                k, v = kv[0], kv[1]
            if not features.plain or (seq.context_slots is not None and gqa):
                # a causal bias beside GQA is materialized into a mask where no flash kernel runs (a CPU, float32
                # on CUDA): the query heads folded instead, as windowed chunks are
                o = prefill_attention(q, k, v, seq.context_len, features)
            elif seq.context_slots is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=features.scaling, enable_gqa=gqa)
            else:
                causal = causal_lower_right(seq.q_len, seq.context_len)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=features.scaling)
            out[seq.q_start : seq.q_start + seq.q_len] = o[0].transpose(0, 1)

        return out.unsqueeze(0)
