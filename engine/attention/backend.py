"""Which attention backend an engine runs, by name: the rule that resolves ``auto`` for a device, and the registry
that imports the chosen backend's module only then (FlashInfer is optional). The interface every backend implements
is ``batch.AttentionBackend``.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.attention.batch import AttentionBackend

BACKEND_NAMES = ("sdpa", "flex", "flashinfer")
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)  # its paged kernels have no float32 variant


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
