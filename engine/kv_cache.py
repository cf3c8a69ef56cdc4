"""The KV cache tensors: per layer, K and V indexed by physical block id.

Layout per layer: K and V stacked in one tensor, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, so writing a
forward's new K/V (slot ``block_id * block_size + offset``) and gathering a decode batch's context are one indexing op
each. The transfer layer sees only ``read_blocks`` and ``write_blocks``, with the block ids of each side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.blocks import kv_bytes_per_token
from engine.host_values import long_tensor


@dataclass(frozen=True, slots=True)
class KVSpec:
    """The shape of one model's KV cache: everything two workers must agree on to exchange blocks."""

    architecture: str
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype.itemsize)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


class KVCache:
    """``num_blocks`` blocks that the block manager hands out, plus ``padding_sink_block``, which it never sees: a
    CUDA-graph decode step (``engine.decode_graphs``) pads its batch to a captured size, and the padding rows write
    and attend there without touching any request's blocks. Its contents are garbage and never read for a request."""

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.padding_sink_block = num_blocks
        shape = (2, num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.k = [kv[0] for kv in self.kv]
        self.v = [kv[1] for kv in self.kv]

    def flat(self, layer: int) -> torch.Tensor:
        """Per-slot view ``[2, num_blocks * block_size, kv_heads, head_dim]`` of one layer (K, V)."""
        return self.kv[layer].view(2, -1, self.spec.num_kv_heads, self.spec.head_dim)

    def write_slots(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V (``[tokens, kv_heads, head_dim]``) at their slots."""
        self.flat(layer).index_copy_(1, slots, torch.stack((k, v)).to(self.spec.dtype))

    def block_index(self, block_ids: list[int]) -> torch.Tensor:
        """Block ids as an index on the cache's device (pinned, non-blocking): build once, use for every layer."""
        return long_tensor(block_ids, self.kv[0].device)

    def read_blocks(self, layer: int, block_ids: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A contiguous copy of whole blocks, ``[len(block_ids), block_size, kv_heads, head_dim]`` for K and V;
        ``block_ids`` may be an index from ``block_index``."""
        index = block_ids if isinstance(block_ids, torch.Tensor) else self.block_index(block_ids)
        return self.k[layer].index_select(0, index), self.v[layer].index_select(0, index)

    def write_blocks(self, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        expected = (len(block_ids), *self.k[layer].shape[1:])
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"KV blocks for layer {layer} have shape {tuple(k.shape)}, expected {expected}")
        index = self.block_index(block_ids)
        self.k[layer].index_copy_(0, index, k.to(self.k[layer].device, self.spec.dtype))
        self.v[layer].index_copy_(0, index, v.to(self.v[layer].device, self.spec.dtype))
