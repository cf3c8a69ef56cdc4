"""The KV cache tensors: per layer, K and V stacked in one tensor, ``[2, num_blocks, block_size, num_kv_heads,
head_dim]``, indexed by physical block id, so writing a forward's new K/V (slot ``block_id * block_size + offset``)
and gathering a decode batch's context are one indexing op each. The transfer layer sees only ``read_blocks`` and
``write_blocks``.

A quantized cache (``kv_cache_dtype: int8 | fp8_e4m3``) stores each (token, head) row as ``head_dim`` 8-bit values
and its float32 scale, all in one ``uint8`` tensor, so blocks stay plain bytes that every transfer backend ships
unchanged; values are written quantized and dequantized where the attention reads them (``dequantize``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.blocks import kv_bytes_per_token
from engine.host_values import long_tensor

SCALE_BYTES = 4  # a float32 scale per (token, head) row
# the largest magnitude each quantized format holds: a row's absolute maximum maps to it
QUANT_MAX = {"int8": 127.0, "fp8_e4m3": 448.0}


@dataclass(frozen=True, slots=True)
class KVSpec:
    """The shape of one model's KV cache: everything two workers must agree on to exchange blocks."""

    architecture: str
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int  # the stored row's width: with ``quantization``, the model's head width plus SCALE_BYTES
    block_size: int
    quantization: str | None = None  # "int8" or "fp8_e4m3": rows of 8-bit values and a scale, in uint8 storage
    kv_layout: str = "heads"  # "heads": per-head K and V; "latent": a latent row split over both (attention.latent)

    @classmethod
    def for_model(
        cls,
        architecture: str,
        model_dtype: torch.dtype,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        kv_cache_dtype: str = "auto",
        kv_layout: str = "heads",
    ) -> KVSpec:
        if kv_cache_dtype == "auto":
            return cls(architecture, model_dtype, num_layers, num_kv_heads, head_dim, block_size, None, kv_layout)
        if kv_cache_dtype not in QUANT_MAX:
            raise ValueError(f"kv_cache_dtype must be one of {['auto', *QUANT_MAX]}, got {kv_cache_dtype!r}")
        return cls(
            architecture,
            torch.uint8,
            num_layers,
            num_kv_heads,
            head_dim + SCALE_BYTES,
            block_size,
            kv_cache_dtype,
            kv_layout,
        )

    @property
    def model_head_dim(self) -> int:
        """The width attention computes in (the stored row without its scale)."""
        return self.head_dim - SCALE_BYTES if self.quantization else self.head_dim

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

    def rehome(self, layers: list[torch.Tensor]) -> None:
        """Move the cache into storage the caller made (the decode worker's shared-memory segment, which same-node
        KV senders write in place), contents kept: per layer a tensor of this cache's shape, dtype and device."""
        if len(layers) != len(self.kv) or any(
            new.shape != old.shape or new.dtype != old.dtype or new.device != old.device
            for new, old in zip(layers, self.kv)
        ):
            raise ValueError(
                f"new KV storage must be {len(self.kv)} tensors like {self.kv[0].dtype}{list(self.kv[0].shape)}"
            )
        for i, new in enumerate(layers):
            new.copy_(self.kv[i])
            self.kv[i] = new  # the old layer is freed here: at most one layer is held twice
        self.k = [kv[0] for kv in self.kv]
        self.v = [kv[1] for kv in self.kv]

    def flat(self, layer: int) -> torch.Tensor:
        """Per-slot view ``[2, num_blocks * block_size, kv_heads, head_dim]`` of one layer (K, V)."""
        return self.kv[layer].view(2, -1, self.spec.num_kv_heads, self.spec.head_dim)

    def write_slots(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V (``[tokens, kv_heads, head_dim]``) at their slots."""
        self.flat(layer).index_copy_(1, slots, self.quantize(torch.stack((k, v))))

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        """Values ``[..., model_head_dim]`` as this cache stores them."""
        kind = self.spec.quantization
        if kind is None:
            return values.to(self.spec.dtype)
        values = values.float()
        scale = values.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / QUANT_MAX[kind]
        scaled = values / scale
        if kind == "int8":
            stored = scaled.round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
        else:
            stored = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.cat((stored, scale.view(torch.uint8)), dim=-1)

    def dequantize(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows as stored ``[..., head_dim]`` back to values ``[..., model_head_dim]`` in ``dtype``."""
        kind = self.spec.quantization
        if kind is None:
            return stored.to(dtype)
        width = self.spec.model_head_dim
        scale = stored[..., width:].contiguous().view(torch.float32)
        values = stored[..., :width].view(torch.int8 if kind == "int8" else torch.float8_e4m3fn)
        return (values.to(torch.float32) * scale).to(dtype)

    def block_index(self, block_ids: list[int]) -> torch.Tensor:
        """Block ids as an index on the cache's device (pinned, non-blocking): build once, use for every layer."""
        return long_tensor(block_ids, self.kv[0].device)

    def read_blocks(self, layer: int, block_ids: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A contiguous copy of whole blocks, ``[len(block_ids), block_size, kv_heads, head_dim]`` for K and V;
        ``block_ids`` may be an index from ``block_index``."""
        index = block_ids if isinstance(block_ids, torch.Tensor) else self.block_index(block_ids)
        return self.k[layer].index_select(0, index), self.v[layer].index_select(0, index)

    def write_blocks(
        self, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor, heads: tuple[int, int] | None = None
    ) -> None:
        """Write whole blocks, or (``heads``: first, count) those heads of them only (a tensor-parallel sender's
        share of this cache's heads)."""
        store_k, store_v = self.k[layer], self.v[layer]
        expected = (len(block_ids), *store_k.shape[1:])
        if heads is not None:
            first, count = heads
            if not (count > 0 and 0 <= first and first + count <= store_k.shape[2]):
                raise ValueError(f"heads {heads} are not within the cache's {store_k.shape[2]}")
            expected = (len(block_ids), store_k.shape[1], count, store_k.shape[3])
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"KV blocks for layer {layer} have shape {tuple(k.shape)}, expected {expected}")
        index = self.block_index(block_ids)
        k, v = k.to(store_k.device, self.spec.dtype), v.to(store_v.device, self.spec.dtype)
        if heads is None:
            store_k.index_copy_(0, index, k)
            store_v.index_copy_(0, index, v)
        else:
            store_k[:, :, heads[0] : heads[0] + heads[1]].index_copy_(0, index, k)
            store_v[:, :, heads[0] : heads[0] + heads[1]].index_copy_(0, index, v)
