"""Paged attention plugged into transformers' attention interface.

transformers keeps the model code (projections, rotary embedding, MLP); we replace only the attention call. The
runner packs every scheduled sequence into one row of ``T`` tokens (ragged, no padding) and passes an
``AttentionBatch`` through the model's ``**kwargs``. For each layer this function:

1. writes the new tokens' K/V into their cache slots (so the KV is in the paged store the moment the layer runs),
2. tells the layer hook, if one is installed (the prefill worker streams that layer's KV out while the forward goes
   on),
3. attends: decode sequences (one query token each) together in one SDPA over their gathered, padded context;
   prefill chunks one by one, with a causal mask offset by the tokens already cached.

Registered under the name ``pdserve_paged``; there is no mask function for it, so transformers builds no mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.kv_cache import KVCache

ATTENTION_NAME = "pdserve_paged"

# layer_hook(layer_index, batch): called after a layer's new KV is in the cache.
LayerHook = Callable[[int, "AttentionBatch"], None]


@dataclass(slots=True)
class PrefillSeq:
    q_start: int  # offset of this chunk's first token in the packed row
    q_len: int
    context_len: int  # tokens of KV this chunk attends to, its own included
    context_slots: torch.Tensor | None  # [context_len] slot ids; None when the chunk is its whole context


@dataclass(slots=True)
class DecodeGroup:
    token_index: torch.Tensor | None  # [B] positions of the decode tokens in the packed row; None: the whole row
    block_table: torch.Tensor  # [B, max_blocks] physical block ids (padding points at block 0 and is masked)
    max_context: int
    gather_buffer: torch.Tensor  # [2, B * max_blocks, block_size, kvH, d], reused by every layer of the step
    mask: torch.Tensor | None  # [B, 1, 1, max_context] True where a key is attended; None: equal lengths


@dataclass(slots=True)
class AttentionBatch:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    prefills: list[PrefillSeq] = field(default_factory=list)
    decode: DecodeGroup | None = None
    layer_hook: LayerHook | None = None
    chunks: list = field(default_factory=list)  # the scheduled chunks, for the layer hook


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    pd_batch: AttentionBatch | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    if pd_batch is None:
        raise RuntimeError("pdserve_paged attention called without an AttentionBatch (pd_batch)")
    layer = cast(int, module.layer_idx)  # set by transformers on every attention module
    new_k = key[0].transpose(0, 1)  # [T, kv_heads, d]
    new_v = value[0].transpose(0, 1)
    pd_batch.kv_cache.write_slots(layer, pd_batch.slot_mapping, new_k, new_v)
    if pd_batch.layer_hook is not None:
        pd_batch.layer_hook(layer, pd_batch)

    num_heads, num_tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
    kv_flat = pd_batch.kv_cache.flat(layer)  # [2, slots, kv_heads, d]
    gqa = num_heads != key.shape[1]

    group = pd_batch.decode
    if group is not None:
        # gather whole blocks (a few KiB each, not one slot at a time), then view them as each request's context
        # (index_select over a flat id list is ~2.5x faster than advanced indexing with a 2-D table on CPU)
        # into one buffer reused by every layer: a fresh multi-MiB tensor per layer costs page faults on CPU
        cache = pd_batch.kv_cache.kv[layer]  # [2, num_blocks, block_size, kvH, d]
        torch.index_select(cache, 1, group.block_table.flatten(), out=group.gather_buffer)
        blocks = group.gather_buffer.view(2, *group.block_table.shape, *cache.shape[2:])
        kv = blocks.flatten(2, 3)[:, :, : group.max_context].permute(0, 1, 3, 2, 4).to(query.dtype)  # [2,B,kvH,C,d]
        if group.token_index is None:  # a decode-only step: the packed row is the batch, in order
            q = query[0].transpose(0, 1).unsqueeze(2)  # [B, H, 1, d]
            o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=group.mask, scale=scaling, enable_gqa=gqa)
            return o.transpose(1, 2), None  # [B, 1, H, d]: the layer reshapes it to [B, 1, H*d] == [1, T, H*d]

    out = query.new_empty(num_tokens, num_heads, head_dim)
    if group is not None:
        q = query[0, :, group.token_index].transpose(0, 1).unsqueeze(2)  # [B, H, 1, d]
        o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=group.mask, scale=scaling, enable_gqa=gqa)
        out[group.token_index] = o[:, :, 0]

    for seq in pd_batch.prefills:
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

    return out.unsqueeze(0), None


def register_paged_attention() -> str:
    """Make ``pdserve_paged`` a valid ``attn_implementation``; idempotent."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
