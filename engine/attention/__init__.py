"""Paged attention plugged into transformers' attention interface, registered as ``pdserve_paged`` (it has no mask
function, so transformers builds no mask).

Per layer ``paged_attention_forward`` writes the new tokens' K/V into their cache slots, calls the layer hook if any
(the prefill worker streams that layer's KV out while the forward goes on), then hands the attention to the step's
backend (``batch.AttentionBackend``, picked by ``backend.py``): gather + SDPA (``sdpa.py``), FlexAttention
(``flex.py``) or FlashInfer (``flashinfer_backend.py``). What the model passes beyond q/k/v (``scaling``,
``sliding_window``, ``softcap``, sinks as ``s_aux``) becomes the layer's ``LayerFeatures``; narrower heads are
zero-padded to the cache's width; a latent attention layer goes to ``latent.py``. With ``pd_probe`` set
(``engine.model_probe``) the call is only recorded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.attention.backend import BACKEND_NAMES, select_backend
from engine.attention.batch import (
    AttentionBackend,
    AttentionBatch,
    DecodeGroup,
    LatentCache,
    LayerFeatures,
    LayerHook,
    PrefillSeq,
    SeqLayout,
)
from engine.attention.latent import latent_attention_forward
from engine.attention.sdpa import SdpaBackend

if TYPE_CHECKING:
    from engine.model_probe import AttentionProbe

__all__ = [
    "ATTENTION_NAME",
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionBatch",
    "DecodeGroup",
    "LayerFeatures",
    "LatentCache",
    "LayerHook",
    "PrefillSeq",
    "SdpaBackend",
    "SeqLayout",
    "paged_attention_forward",
    "register_paged_attention",
    "select_backend",
]

ATTENTION_NAME = "pdserve_paged"
_DEFAULT_BACKEND = SdpaBackend()  # for batches built without one (CUDA-graph decode steps build their own)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    pd_batch: AttentionBatch | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    pd_probe: AttentionProbe | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    layer = cast(int, module.layer_idx)  # set by transformers on every attention module
    if pd_probe is not None:  # engine.model_probe: record what this layer passes, attend to nothing
        latent = None if pd_probe.latent_cache is None else pd_probe.latent_cache.pending.pop(layer, None)
        pd_probe.record(layer, query, key, value, sliding_window, softcap, s_aux, latent)
        return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1]), None
    if pd_batch is None:
        raise RuntimeError("pdserve_paged attention called without an AttentionBatch (pd_batch)")
    features = LayerFeatures(
        scaling=scaling if scaling is not None else query.shape[-1] ** -0.5,  # of the unpadded width
        sliding_window=sliding_window or None,
        softcap=softcap or None,
        sinks=s_aux,
    )
    if pd_batch.latent_cache is not None and layer in pd_batch.latent_cache.pending:
        latent = pd_batch.latent_cache.pending.pop(layer)
        return latent_attention_forward(module, query, key, value, pd_batch, features, layer, latent), None
    value_dim = value.shape[-1]
    width = pd_batch.kv_cache.spec.model_head_dim
    if query.shape[-1] != width or value_dim != width:  # narrower heads zero-padded to the cache's width
        query, key, value = (F.pad(t, (0, width - t.shape[-1])) for t in (query, key, value))
    new_k = key[0].transpose(0, 1)  # [T, kv_heads, d]
    new_v = value[0].transpose(0, 1)
    pd_batch.kv_cache.write_slots(layer, pd_batch.slot_mapping, new_k, new_v)
    if pd_batch.layer_hook is not None:
        pd_batch.layer_hook(layer, pd_batch)
    backend = pd_batch.backend or _DEFAULT_BACKEND
    if not features.plain and not backend.supports_features:
        raise RuntimeError(f"attention backend {backend.name!r} cannot run this layer's {features}")
    out = backend.forward(layer, query, key, value, pd_batch, features)
    return (out if value_dim == width else out[..., :value_dim]), None


def register_paged_attention() -> str:
    """Make ``pdserve_paged`` a valid ``attn_implementation``; idempotent."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
