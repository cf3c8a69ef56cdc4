"""Which models pdserve can serve, decided from what the model does rather than from a list of families.

Two checks. ``config_refusal`` reads config.json alone (no torch): encoder–decoder models, multimodal configs and
layers that are not attention (recurrent, state-space, convolution) are refused with the reason. ``probe_model``
runs one short forward of the loaded model with every attention call recorded instead of computed: each layer must
call transformers' attention interface exactly once, and what it passes (KV heads, key and value widths, sliding
window, soft-cap, sinks) becomes the KV layout and the attention's per-layer features. The same forward checks that
the model's own logits equal what the engine computes from its hidden states (the model's own head over them,
``engine.model_head``: Gemma's soft-cap, Granite's and Cohere's scales come with it), so a family whose logits need
more than its hidden states is refused, not served wrongly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# config keys that only multimodal models carry
_MULTIMODAL_KEYS = ("vision_config", "audio_config", "speech_config", "image_token_index", "image_token_id")
PROBE_TOKENS = 12  # the probe reads shapes and the head's arithmetic, not attention values
LOGITS_TOLERANCE = 1e-4  # the head check compares float32 logits computed two ways (same ops, maybe reordered)


def config_refusal(config: Mapping[str, Any]) -> str | None:
    """Why a model with this config.json cannot be served, or None. Torch-free: the router and planner call it."""
    model_type = str(config.get("model_type", "")) or "(none)"
    if config.get("is_encoder_decoder"):
        return f"model type {model_type!r} is an encoder-decoder model; pdserve serves decoder-only causal LMs"
    if any(key in config for key in _MULTIMODAL_KEYS) or "text_config" in config:
        return f"model type {model_type!r} takes multimodal inputs; pdserve serves text-only decoder LMs"
    if config.get("add_cross_attention"):
        return f"model type {model_type!r} has cross-attention layers; pdserve serves decoder-only causal LMs"
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        other = sorted({str(t) for t in layer_types} - ATTENTION_LAYER_TYPES)
        if other:
            return (
                f"model type {model_type!r} has {', '.join(other)} layers; pdserve's KV cache serves only "
                f"attention layers ({', '.join(sorted(ATTENTION_LAYER_TYPES))})"
            )
    return None


def class_refusal(config: Any) -> str | None:
    """Why transformers' class for this config cannot run on pdserve's paged attention, or None."""
    from transformers import AutoModelForCausalLM

    model_type = config.model_type
    try:
        model_class: Any = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return f"model type {model_type!r} has no causal-LM class in transformers"
    if not getattr(model_class, "_supports_attention_backend", False):
        return (
            f"model type {model_type!r} ({model_class.__name__}) does not run its attention through transformers' "
            "attention interface (recurrent or state-space layers, or custom attention code)"
        )
    return None


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What one layer passes to the attention interface."""

    query_heads: int
    kv_heads: int
    key_dim: int
    value_dim: int
    sliding_window: int | None
    softcap: float | None
    has_sinks: bool
    latent_width: int | None = None  # latent attention: the cached latent's width (kv_lora_rank + rotary key)

    @property
    def plain(self) -> bool:
        return self.sliding_window is None and self.softcap is None and not self.has_sinks


@dataclass(frozen=True, slots=True)
class ModelAttention:
    """Every layer's attention, the model's final logit soft-cap (applied by its head), and whether its head is its
    ``lm_head`` alone (then the engine calls that, without the model's forward around it)."""

    model_type: str
    layers: tuple[LayerAttention, ...]
    final_logit_softcap: float | None
    plain_head: bool = True

    @property
    def latent_width(self) -> int | None:
        return self.layers[0].latent_width

    @property
    def num_kv_heads(self) -> int:
        """The cache's heads: the layers' KV heads, or one for a latent split over the K and V planes."""
        return 1 if self.latent_width else self.layers[0].kv_heads

    @property
    def head_dim(self) -> int:
        """The cache's head width: half a latent row (``engine.attention.latent``), or the widest key or value of
        any layer (narrower ones are zero-padded into it, which changes no dot product and no weighted sum)."""
        if self.latent_width:
            return -(-self.latent_width // 2)
        return max(max(layer.key_dim, layer.value_dim) for layer in self.layers)

    @property
    def features(self) -> list[str]:
        """What beyond plain causal attention the layers use, for errors and ``/status``."""
        found = []
        if any(layer.sliding_window for layer in self.layers):
            found.append("sliding windows")
        if any(layer.softcap for layer in self.layers):
            found.append("logit soft-capping")
        if any(layer.has_sinks for layer in self.layers):
            found.append("attention sinks")
        if self.latent_width:
            found.append("latent attention")
        elif any(layer.key_dim != layer.value_dim for layer in self.layers):
            found.append("value heads narrower than key heads")
        return found


class AttentionProbe:
    """Passed to the forward as ``pd_probe``: ``engine.attention.paged_attention_forward`` records each call here
    and returns zeros instead of attending."""

    def __init__(self, latent_cache: Any = None) -> None:
        self.calls: dict[int, LayerAttention] = {}
        self.repeated: list[int] = []
        self.latent_cache = latent_cache  # engine.attention.batch.LatentCache, for latent-attention models

    def record(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
        latent: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if layer in self.calls:
            self.repeated.append(layer)
        self.calls[layer] = LayerAttention(
            query_heads=int(query.shape[1]),
            kv_heads=int(key.shape[1]),
            key_dim=int(key.shape[-1]),
            value_dim=int(value.shape[-1]),
            sliding_window=int(sliding_window) if sliding_window else None,
            softcap=float(softcap) if softcap else None,
            has_sinks=sinks is not None,
            latent_width=None if latent is None else int(latent[0].shape[-1] + latent[1].shape[-1]),
        )


def probe_model(model: Any, num_layers: int) -> ModelAttention:
    """Run one short forward with every attention call recorded; ValueError naming the model type when a layer does
    not call the attention interface exactly once, layers disagree on their KV heads, or the model's logits are not
    ``lm_head`` (then the final soft-cap) of its hidden states."""
    import torch

    model_type = model.config.model_type
    device = next(model.parameters()).device
    ids = torch.arange(PROBE_TOKENS, device=device).view(1, -1) % int(model.config.vocab_size)
    from engine.attention.batch import LatentCache
    from engine.attention.latent import cache_kwarg, is_latent_model

    positions = torch.arange(PROBE_TOKENS, device=device).view(1, -1)
    decoder = getattr(model, model.base_model_prefix)
    latent = is_latent_model(model)
    probe = AttentionProbe(LatentCache() if latent else None)
    decoder_probe = AttentionProbe(LatentCache() if latent else None)
    with torch.inference_mode():
        extra = {cache_kwarg(model): probe.latent_cache} if latent else {}
        out = model(input_ids=ids, position_ids=positions, use_cache=False, pd_probe=probe, **extra)
        # the engine's path: the decoder's last hidden state, projected by the runner (engine.model_runner)
        extra = {cache_kwarg(decoder): decoder_probe.latent_cache} if latent else {}
        hidden = decoder(input_ids=ids, position_ids=positions, use_cache=False, pd_probe=decoder_probe, **extra)
    missing = sorted(set(range(num_layers)) - set(probe.calls))
    if missing or probe.repeated or len(probe.calls) != num_layers:
        raise ValueError(
            f"model: model type {model_type!r} does not call the attention interface once per layer "
            f"(layers not called: {missing[:4]}, called twice: {probe.repeated[:4]}); pdserve cannot page its KV"
        )
    layers = tuple(probe.calls[i] for i in range(num_layers))
    if len({layer.latent_width for layer in layers}) > 1 or (
        layers[0].latent_width and any(not layer.plain for layer in layers)
    ):
        raise ValueError(f"model: model type {model_type!r} mixes latent and other attention layers; not supported")
    if len({(layer.kv_heads, layer.query_heads) for layer in layers}) > 1:
        raise ValueError(f"model: model type {model_type!r} has layers with different head counts; not supported")
    softcap = getattr(model.config, "final_logit_softcapping", None) or None
    softcap = float(softcap) if softcap else None
    from engine.model_head import ModelHead

    try:
        with torch.inference_mode():
            ours = ModelHead(model)(hidden.last_hidden_state[0])
            plain = model.get_output_embeddings()(hidden.last_hidden_state[0]).float()
    except (AttributeError, TypeError) as exc:  # its head reads more of the decoder than its hidden states
        raise ValueError(
            f"model: model type {model_type!r} computes its logits from more than its hidden states ({exc}); "
            "not supported"
        ) from None
    gap = (ours - out.logits[0].float()).abs().max().item()
    if not gap <= LOGITS_TOLERANCE * max(1.0, out.logits.abs().max().item()):
        raise ValueError(
            f"model: model type {model_type!r} computes its logits in a way pdserve does not reproduce (its head "
            f"over the engine's hidden states differs from its own forward by {gap:.3g}); not supported"
        )
    return ModelAttention(model_type, layers, softcap, plain_head=bool(torch.equal(plain, ours)))
