"""The attention backend interface, and the rule that picks one for a device.

Every backend reads and writes the same paged KV layout (``engine/kv_cache.py``: per layer
``[2, num_blocks, block_size, kv_heads, head_dim]``), so KV transfers, prefix caching and the block manager never
know which one runs. The shared part of a layer's attention (writing the new tokens' K/V into their slots, then the
layer hook) happens before ``forward`` in ``engine.attention.paged_attention_forward``; a backend only attends.

A step calls ``prepare`` once (after the runner built the batch), then ``forward`` once per layer: per-step work
that does not depend on the layer (a block mask, FlashInfer's plan) belongs in ``prepare`` or is cached in
``batch.plan`` by the first layer.
"""

from __future__ import annotations

import abc
import importlib.util
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from engine.attention.batch import AttentionBatch

BACKEND_NAMES = ("sdpa", "flex", "flashinfer")
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)  # its paged kernels have no float32 variant


class AttentionBackend(abc.ABC):
    name: ClassVar[str]
    # the runner builds PrefillSeq/DecodeGroup (context slot ids, the decode gather buffer) only for backends that
    # read them, and the SeqLayout only for those that read it: each costs host work and device memory per step
    needs_groups: ClassVar[bool] = False
    needs_layout: ClassVar[bool] = False

    def prepare(self, batch: AttentionBatch) -> None:  # noqa: B027 (optional hook: most backends need no plan)
        """Per-step work shared by every layer, stored in ``batch.plan``; called once after the batch is built."""

    @abc.abstractmethod
    def forward(
        self,
        layer: int,
        query: torch.Tensor,  # [1, heads, T, head_dim]
        key: torch.Tensor,  # [1, kv_heads, T, head_dim] (already written into the cache)
        value: torch.Tensor,
        batch: AttentionBatch,
        scaling: float | None,
    ) -> torch.Tensor:
        """The attention output ``[1, T, heads, head_dim]`` (the shape transformers' attention functions return)."""

    def workspace_bytes(self) -> int:
        """Device memory the backend holds for its whole life (FlashInfer's workspace), to count in the KV budget.
        Per-step scratch that scales with the batch (the SDPA decode gather buffer) is the runner's to bound."""
        return 0


def flashinfer_importable() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def resolve_backend_name(name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """The concrete backend ``name`` means on ``device`` for a model in ``dtype`` (``auto`` resolved), or ValueError
    naming the field. ``dtype`` None: not known yet, assumed half precision."""
    device = torch.device(device)
    half = dtype is None or dtype in FLASHINFER_DTYPES
    if name == "auto":
        return "flashinfer" if device.type == "cuda" and half and flashinfer_importable() else "sdpa"
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {['auto', *BACKEND_NAMES]}, got {name!r}")
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"attention_backend 'flashinfer' needs a CUDA device, the engine runs on {device}")
        if not flashinfer_importable():
            raise ValueError(
                "attention_backend 'flashinfer' needs the flashinfer-python package, which is not installed "
                "(pip install flashinfer-python, or set attention_backend to 'auto' or 'sdpa')"
            )
        if not half:
            raise ValueError(f"attention_backend 'flashinfer' needs float16 or bfloat16, the model runs in {dtype}")
    return name


def select_backend(name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> AttentionBackend:
    """The backend ``attention_backend`` names, on this device.

    ``auto``: FlashInfer on CUDA when it is importable (its paged kernels read the cache in place: no per-layer
    gather) and the model runs in float16/bfloat16, else the gather + SDPA path (float32 on a GPU, the exactness
    check, stays on SDPA). Flex is opt-in: eager on the CPU it materialises the whole score matrix, and
    on CUDA it recompiles for new shapes; it has not been measured faster than either. Asking for FlashInfer where it
    cannot run is an error, not a silent fallback, so a misconfigured GPU pool fails at start.
    """
    device = torch.device(device)
    name = resolve_backend_name(name, device, dtype)
    if name == "sdpa":
        from engine.attention.sdpa import SdpaBackend

        return SdpaBackend()
    if name == "flex":
        from engine.attention.flex import FlexBackend

        return FlexBackend(device)
    from engine.attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(device)
