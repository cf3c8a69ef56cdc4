"""CPU linear layers on a copy of their weights packed once at load for oneDNN's inner product, where that is
measured faster.

A decode step on a CPU is bound by reading the weights from memory. With two threads on this project's 2-core box,
``linear`` (MKL) read SmolLM2's 211 linear weights for one row in 46 ms and oneDNN on weights reordered into its
blocked layout in 38 (4 rows: 78 against 56; the 49152 x 576 lm_head alone 8.2 against 3.5 ms); with one thread
MKL was the faster (46 against 49, 4 rows 84 against 97). So after packing, one pass over every linear of the model
at 1 and at 4 rows is timed both ways, and the packing stays only if it is faster on this machine with these
threads. Results differ from ``linear`` by float rounding only (a different summation order). The dense weight
stays: other code reads it (a tied embedding, latent attention's absorbed weights), so the packed copy costs its
size in memory (``cpu_packed_weights: false`` turns it off).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

TIMED_ROWS = (1, 4)  # a decode row and a few (a small batch, a verified proposal)
TIMED_ROUNDS = 3  # each form's time is its best round
MIN_GAIN = 1.05  # packing must be this much faster to stay (timing noise; it costs memory)


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


@dataclass(frozen=True, slots=True)
class PackingChoice:
    packed: bool  # whether the model's linears run on packed weights
    plain_ms: float  # one pass over every linear, at 1 row plus at 4 rows, through ``linear``
    packed_ms: float  # the same through the packed weights


@torch.inference_mode()
def pack_linears(model: nn.Module) -> list[nn.Linear]:
    """Make every plain float32 ``nn.Linear`` of a CPU model a ``PackedLinear``; returns them."""
    linears = [cast(nn.Linear, module) for module in model.modules() if can_pack(module)]
    for module in linears:
        # the layout oneDNN picks for a batch of 1: decode's rows; prefill-sized inputs run about as fast on it
        cast(PackedLinear, module).packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 1)
        module.__class__ = PackedLinear
    return linears


@torch.inference_mode()
def pack_cpu_linears(model: nn.Module) -> PackingChoice | None:
    """Pack the model's linears, and keep them packed if a pass over them all is faster so (``PackingChoice``); None:
    nothing to pack."""
    linears = pack_linears(model)
    if not linears:
        return None
    timings: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(TIMED_ROUNDS):
        for packed in (False, True):
            for module in linears:
                module.__class__ = PackedLinear if packed else nn.Linear
            timings[packed].append(sum(_pass_s(linears, rows) for rows in TIMED_ROWS))
    plain_s, packed_s = min(timings[False]), min(timings[True])
    keep = packed_s * MIN_GAIN < plain_s
    for module in linears:
        module.__class__ = PackedLinear if keep else nn.Linear
        if not keep:
            del module.packed_weight
    return PackingChoice(keep, round(plain_s * 1000, 1), round(packed_s * 1000, 1))


def _pass_s(linears: list[nn.Linear], rows: int) -> float:
    """Seconds for one row batch through every linear in turn (each reads its weight from memory, as a step does)."""
    inputs = {n: torch.randn(1, rows, n) for n in {module.in_features for module in linears}}
    started = time.perf_counter()
    for module in linears:
        module(inputs[module.in_features])
    return time.perf_counter() - started
