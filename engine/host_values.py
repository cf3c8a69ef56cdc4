"""Small host values (block ids, row indices, per-row sampling parameters) made into device tensors without a stall.

``torch.tensor(values, device="cuda")`` copies from pageable memory and blocks the thread until the stream reaches the
copy, so inside the forward (the per-layer KV export hook) Python could no longer run ahead of the GPU. ``to_device``
builds the tensor in pinned memory from torch's caching host allocator (which keeps it until the copy is done) and
copies it ``non_blocking`` on the current stream, which orders the kernels that use it. On the CPU: ``torch.tensor``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def long_tensor(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    return to_device(values, torch.long, device)
