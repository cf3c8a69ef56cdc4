"""The attention backend interface, and the rule that picks one for a device.

Every backend reads and writes the same paged KV layout (``engine/kv_cache.py``), so KV transfers, prefix caching
and the block manager never know which one runs. ``engine.attention.paged_attention_forward`` writes the new K/V and
calls the layer hook before ``forward``; a backend only attends. A step calls ``prepare`` once, then ``forward`` once
per layer: per-step work (a block mask, FlashInfer's plan) belongs in ``prepare`` or in ``batch.plan``.
"""

from __future__ import annotations

import abc
import importlib.util
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from engine.attention.batch import AttentionBatch, LayerFeatures

BACKEND_NAMES = ("sdpa", "flex", "flashinfer")
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)  # its paged kernels have no float32 variant


class AttentionBackend(abc.ABC):
    name: ClassVar[str]
    # the runner builds PrefillSeq/DecodeGroup and SeqLayout only for backends that read them: each costs per step
    needs_groups: ClassVar[bool] = False
    needs_layout: ClassVar[bool] = False
    # runs sliding windows, soft-capping and sinks (``LayerFeatures``); a model that uses them needs such a backend
    supports_features: ClassVar[bool] = False

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
        features: LayerFeatures,
    ) -> torch.Tensor:
        """The attention output ``[1, T, heads, head_dim]``, as transformers' attention functions return it."""

    def workspace_bytes(self) -> int:
        """Device memory held for the backend's whole life (FlashInfer's workspace), counted in the KV budget;
        per-step scratch (the SDPA gather buffer) is the runner's to bound."""
        return 0


def flashinfer_importable() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def resolve_backend_name(
    name: str, device: torch.device | str, dtype: torch.dtype | None = None, model_features: list[str] | None = None
) -> str:
    """The concrete backend ``name`` means (``auto`` resolved), or ValueError. ``dtype`` None: assumed half.
    ``model_features``: what the model's attention needs beyond plain causal attention (``engine.model_probe``);
    only gather + SDPA runs those."""
    device = torch.device(device)
    half = dtype is None or dtype in FLASHINFER_DTYPES
    if name == "auto":
        if model_features:
            return "sdpa"
        return "flashinfer" if device.type == "cuda" and half and flashinfer_importable() else "sdpa"
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {['auto', *BACKEND_NAMES]}, got {name!r}")
    if model_features and name != "sdpa":
        raise ValueError(
            f"attention_backend {name!r} cannot run this model's {', '.join(model_features)}; use 'sdpa' or 'auto'"
        )
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


def select_backend(
    name: str, device: torch.device | str, dtype: torch.dtype | None = None, model_features: list[str] | None = None
) -> AttentionBackend:
    """The backend ``attention_backend`` names. ``auto``: FlashInfer on CUDA when importable and the model is
    float16/bfloat16 (its kernels read the cache in place), else gather + SDPA (so float32 on a GPU, the exactness
    check, stays on SDPA). Flex is opt-in: eager on the CPU it materialises the whole score matrix, on CUDA it
    recompiles for new shapes, and it has not measured faster. FlashInfer where it cannot run is an error, not a
    fallback, so a misconfigured GPU pool fails at start."""
    device = torch.device(device)
    name = resolve_backend_name(name, device, dtype, model_features)
    if name == "sdpa":
        from engine.attention.sdpa import SdpaBackend

        return SdpaBackend()
    if name == "flex":
        from engine.attention.flex import FlexBackend

        return FlexBackend(device)
    from engine.attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(device)
