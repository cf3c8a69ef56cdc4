"""CPU linear layers on a copy of their weights packed once at load for oneDNN's inner product.

A decode step on a CPU is bound by reading the weights from memory, and ``linear`` (MKL) reads them at about half
the speed the memory allows for the few rows of a decode batch or a verified proposal. oneDNN on weights reordered
into its blocked layout at load reads them near that speed: on this project's 2-core box, SmolLM2's 211 linears of
one decode row took 31-35 ms instead of 47-50 when run back to back (8 rows: 62 instead of 101), its 49152 x 576
lm_head 3.5 ms instead of 8.2; prefill-sized inputs are within about 10% either way. Results differ from ``linear``
by float rounding only (a different summation order). The dense weight stays: other code reads it (a tied
embedding, latent attention's absorbed weights), so the packed copy costs its size in memory
(``cpu_packed_weights: false`` turns it off).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose product runs on ``packed_weight``, its weight in oneDNN's layout."""

    packed_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def can_pack(module: nn.Module) -> bool:
    if type(module) is not nn.Linear or not torch.backends.mkldnn.is_available():
        return False
    weight = cast(nn.Linear, module).weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32


@torch.inference_mode()
def pack_cpu_linears(model: nn.Module) -> int:
    """Make every plain float32 ``nn.Linear`` of a CPU model a ``PackedLinear``; returns how many became one."""
    linears = [cast(nn.Linear, module) for module in model.modules() if can_pack(module)]
    for module in linears:
        # the layout oneDNN picks for a batch of 1: decode's rows; prefill-sized inputs run about as fast on it
        cast(PackedLinear, module).packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 1)
        module.__class__ = PackedLinear
    return len(linears)
