"""Optional int8 wire compression of KV (`kv_wire_dtype="int8"`), off by default.

Sender: k [n, block_size, heads, head_dim] -> (q int8, same shape; scale float32 [n, heads]) with one
symmetric scale per block and head (amax / 127). Receiver: q * scale -> destination dtype. This halves
bf16/fp16 bytes (quarter of fp32) at the cost of ~0.4% relative error per element; whether greedy tokens
change must be measured per model (see docs/transfer.md).
"""

from __future__ import annotations

import torch

_QMAX = 127.0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-(block, head) int8 quantization; returns contiguous (q, scale)."""
    xf = x.float()
    amax = xf.abs().amax(dim=(1, 3))  # [n, heads]
    scale = (amax / _QMAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(xf / scale[:, None, :, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_int8, straight into the destination KV dtype."""
    return (q.float() * scale[:, None, :, None]).to(dtype)
