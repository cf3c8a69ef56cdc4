"""FlexAttention over the step's gathered context: one call per layer for the whole packed row.

``prepare`` lists every sequence's context slots one after another (``S`` in all) and builds one block mask: query
``q`` sees key ``k`` when both are in the same sequence and the key is not after the query; ``forward`` gathers those
slots' K/V and attends every chunk in one call. Block sparsity skips other sequences' keys on a GPU, where both
kernels are compiled once per process (``dynamic=True``: new shapes do not each recompile; not yet run on a GPU).
Eager on the CPU, flex materialises the ``T x S`` scores (hence opt-in), and torch's warning about it is silenced.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from engine.attention.batch import AttentionBackend, AttentionBatch, LayerFeatures, SeqLayout

_EAGER_WARNING = "flex_attention called without torch.compile"


@dataclass(slots=True)
class FlexPlan:
    kv_slots: torch.Tensor  # [S] cache slots of every sequence's context, sequence after sequence
    block_mask: BlockMask


def context_index(layout: SeqLayout, block_size: int, num_tokens: int) -> tuple[torch.Tensor, ...]:
    """For the concatenated contexts: each key's sequence, position and cache slot; for the packed row: each query's
    sequence and position. Pure tensor arithmetic on the layout's device tensors (no host sync)."""
    device = layout.block_table.device
    context_lens = layout.seq_context_lens
    q_lens = layout.query_start_loc[1:] - layout.query_start_loc[:-1]
    total = sum(layout.context_lens)
    seq_ids = torch.arange(layout.num_seqs, device=device)
    kv_seq = torch.repeat_interleave(seq_ids, context_lens, output_size=total)
    kv_start = torch.cumsum(context_lens, 0) - context_lens
    kv_pos = torch.arange(total, device=device) - kv_start[kv_seq]
    kv_slots = layout.block_table[kv_seq, kv_pos // block_size] * block_size + kv_pos % block_size
    q_seq = torch.repeat_interleave(seq_ids, q_lens, output_size=num_tokens)
    first_pos = context_lens - q_lens  # position of each sequence's first query token
    q_pos = first_pos[q_seq] + torch.arange(num_tokens, device=device) - layout.query_start_loc[:-1][q_seq]
    return kv_seq, kv_pos, kv_slots, q_seq, q_pos


def _same_sequence_causal(q_seq: torch.Tensor, q_pos: torch.Tensor, kv_seq: torch.Tensor, kv_pos: torch.Tensor):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_seq[q_idx] == kv_seq[kv_idx]) & (kv_pos[kv_idx] <= q_pos[q_idx])

    return mask_mod


@functools.cache
def compiled_kernels() -> tuple[Callable[..., torch.Tensor], Callable[..., BlockMask]]:
    """``flex_attention`` and ``create_block_mask`` compiled, once per process (CUDA)."""
    return (
        torch.compile(flex_attention, dynamic=True),  # type: ignore[return-value]
        torch.compile(create_block_mask, dynamic=True),  # type: ignore[return-value]
    )


class FlexBackend(AttentionBackend):
    name = "flex"
    needs_layout = True

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._flex: Callable[..., torch.Tensor] = flex_attention
        self._block_mask: Callable[..., BlockMask] = create_block_mask
        if self.device.type == "cuda":
            self._flex, self._block_mask = compiled_kernels()

    def prepare(self, batch: AttentionBatch) -> None:
        layout = batch.layout
        if layout is None:
            raise RuntimeError("the flex attention backend needs the batch's SeqLayout")
        num_tokens = int(batch.slot_mapping.shape[0])
        kv_seq, kv_pos, kv_slots, q_seq, q_pos = context_index(layout, batch.kv_cache.spec.block_size, num_tokens)
        mask_mod = _same_sequence_causal(q_seq, q_pos, kv_seq, kv_pos)
        block_mask = self._block_mask(
            mask_mod, None, None, num_tokens, int(kv_slots.shape[0]), device=layout.block_table.device
        )
        batch.plan = FlexPlan(kv_slots, block_mask)

    def forward(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch: AttentionBatch,
        features: LayerFeatures,
    ) -> torch.Tensor:
        plan = batch.plan
        if not isinstance(plan, FlexPlan):
            raise RuntimeError("flex attention called before FlexBackend.prepare")
        kv = batch.kv_cache.flat(layer).index_select(1, plan.kv_slots)  # [2, S, kvH, d]
        kv = batch.kv_cache.dequantize(kv.transpose(1, 2).unsqueeze(1), query.dtype)  # [2, 1, kvH, S, d]
        gqa = query.shape[1] != key.shape[1]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_EAGER_WARNING)
            out = self._flex(query, kv[0], kv[1], block_mask=plan.block_mask, scale=features.scaling, enable_gqa=gqa)
        return out.transpose(1, 2)  # [1, T, H, d]
