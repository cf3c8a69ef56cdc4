"""CPU linear layers for a few rows: the faster of two equal GEMM forms, measured once per weight shape at load.

``linear(x, W)`` computes ``x @ W.T``; for the 2-32 rows of a decode batch or a verified proposal, the CPU's BLAS
is often much faster at ``(W @ x.T).T`` (on this project's 2-core box, 5 rows through SmolLM2's 49152 x 576 lm_head:
6.5 ms against 20 ms; its 576 x 1536 MLP: 0.19 against 0.26 ms), and one row is a GEMV either way. Which form wins
depends on the BLAS and the CPU, so each distinct weight shape is timed both ways at load and its layers take the
faster; results differ from ``linear`` only by float rounding (a different summation order).
"""

from __future__ import annotations

import time

import torch
from torch import nn

MIN_ROWS, MAX_ROWS = 2, 32  # the row counts the choice covers; one row and long prompts keep linear
PROBE_ROWS = 4
PROBE_REPEATS = 5
MIN_GAIN = 1.1  # the other form must be this much faster to be taken (timing noise)


class LeftWeightLinear(nn.Linear):
    """An ``nn.Linear`` computing ``(W @ x.T).T`` for ``MIN_ROWS``..``MAX_ROWS`` rows (the same parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not MIN_ROWS <= rows <= MAX_ROWS:
            return nn.functional.linear(x, self.weight, self.bias)
        out = _left(x.reshape(rows, self.in_features), self.weight)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def _plain(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x, weight)


def _left(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # contiguous like linear's: a collective (a tensor-parallel all-reduce) reads the storage as laid out
    return (weight @ x.T).T.contiguous()


def _probe_s(fn, x: torch.Tensor, weight: torch.Tensor) -> float:
    """The best of a few timed calls, after one untimed."""
    fn(x, weight)
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        started = time.perf_counter()
        fn(x, weight)
        best = min(best, time.perf_counter() - started)
    return best


@torch.inference_mode()
def tune_small_batch_linears(model: nn.Module) -> dict[tuple[int, int], bool]:
    """Give every plain ``nn.Linear`` of a CPU model the faster form for a few rows; returns, per (out, in) shape,
    whether the weight-left form was taken."""
    layers: dict[tuple[int, int, torch.dtype], list[nn.Linear]] = {}
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu":
            layers.setdefault((module.out_features, module.in_features, module.weight.dtype), []).append(module)
    chosen: dict[tuple[int, int], bool] = {}
    for (out_features, in_features, dtype), modules in layers.items():
        weight = modules[0].weight
        x = torch.randn(PROBE_ROWS, in_features, dtype=dtype)
        take = _probe_s(_left, x, weight) * MIN_GAIN < _probe_s(_plain, x, weight)
        chosen[(out_features, in_features)] = take
        if take:
            for module in modules:
                module.__class__ = LeftWeightLinear
    return chosen
