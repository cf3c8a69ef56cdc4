"""The model's own forward after its decoder, over hidden states the engine computed: its ``lm_head`` and whatever its
family does to the logits (Gemma's final soft-cap, Granite's ``logits_scaling``, Cohere's ``logit_scale``), so no
family needs a line of engine code for its head.

The engine runs the decoder itself (paged attention, only the rows that sample kept: ``engine.model_runner``); the
rows then go through the model's ``forward`` with a stand-in for its decoder that hands them back, as transformers'
``logits_to_keep`` would have selected them. ``engine.model_probe`` checks at load that this equals the model's own
logits of a whole forward, so a family whose head reads more than its hidden states is refused, not served wrongly.
"""

from __future__ import annotations

import copy

import torch
from transformers.modeling_outputs import MoeModelOutputWithPast


class _HiddenStates(torch.nn.Module):
    """Stands in for the decoder: returns the hidden states it was given (MoE forwards read ``router_logits`` too)."""

    def __init__(self) -> None:
        super().__init__()
        self.states: torch.Tensor | None = None

    def forward(self, *args: object, **kwargs: object) -> MoeModelOutputWithPast:
        return MoeModelOutputWithPast(last_hidden_state=self.states)


class ModelHead:
    """``head(hidden [n, hidden_size]) -> float32 logits [n, vocab]``, by the model's own forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._stand_in = _HiddenStates()
        # a shallow copy whose decoder is the stand-in: the same lm_head and config, the model itself untouched
        self._model = copy.copy(model)
        self._model._modules = dict(model._modules)
        self._model._modules[str(model.base_model_prefix)] = self._stand_in

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        self._stand_in.states = hidden.unsqueeze(0)
        try:
            ids = torch.zeros((1, rows), dtype=torch.long, device=hidden.device)
            out = self._model(input_ids=ids, use_cache=False, logits_to_keep=0)
        finally:
            self._stand_in.states = None
        return out.logits[0].float()
