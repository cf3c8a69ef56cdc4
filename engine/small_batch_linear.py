"""CPU linear layers for a few rows: the faster of two equal GEMM forms, measured per weight shape and row bucket
at load.

``linear(x, W)`` computes ``x @ W.T``; for the 2-32 rows of a decode batch or a verified proposal, the CPU's BLAS
is often much faster at ``(W @ x.T).T`` (on this project's 2-core box, 5 rows through SmolLM2's 49152 x 576 lm_head:
6.5 ms against 20 ms; its 576 x 1536 MLP: 0.19 against 0.26 ms), and one row is a GEMV either way. That form is
fast at some row counts and up to 2x slower at others (odd ones), so it runs on the rows padded with zeros to a
bucket (4, 8, 16, 24, 32). Which form wins depends on the BLAS, the CPU and the bucket, so each distinct weight
shape is timed both ways per bucket at load; results differ from ``linear`` only by float rounding.
"""

from __future__ import annotations

import time
from typing import cast

import torch
from torch import nn

MIN_ROWS, MAX_ROWS = 2, 32  # the row counts the choice covers; one row and long prompts keep linear
BUCKETS = (4, 8, 16, 24, 32)
PROBE_REPEATS = 5
MIN_GAIN = 1.1  # the other form must be this much faster to be taken (timing noise)


def padded_rows(rows: int) -> int:
    """The bucket a left-weight product of ``rows`` rows runs at: 4, or the next multiple of 8."""
    return 4 if rows <= 4 else -(-rows // 8) * 8


class LeftWeightLinear(nn.Linear):
    """An ``nn.Linear`` computing ``(W @ x.T).T`` on rows padded to a bucket, for the buckets in ``left_buckets``
    (the same parameters); other row counts take ``linear``."""

    left_buckets: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        padded = padded_rows(rows)
        if not MIN_ROWS <= rows <= MAX_ROWS or padded not in self.left_buckets:
            return nn.functional.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])
        out = _left(flat, self.weight)[:rows]
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
def tune_small_batch_linears(model: nn.Module) -> dict[tuple[int, int], frozenset[int]]:
    """Give every plain ``nn.Linear`` of a CPU model the faster form per row bucket; returns, per (out, in) shape,
    the buckets that take the weight-left form."""
    layers: dict[tuple[int, int, torch.dtype], list[nn.Linear]] = {}
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu":
            layers.setdefault((module.out_features, module.in_features, module.weight.dtype), []).append(module)
    chosen: dict[tuple[int, int], frozenset[int]] = {}
    for (out_features, in_features, dtype), modules in layers.items():
        weight = modules[0].weight
        buckets = []
        for rows in BUCKETS:
            x = torch.randn(rows, in_features, dtype=dtype)
            if _probe_s(_left, x, weight) * MIN_GAIN < _probe_s(_plain, x, weight):
                buckets.append(rows)
        chosen[(out_features, in_features)] = frozenset(buckets)
        if buckets:
            for module in modules:
                module.__class__ = LeftWeightLinear
                cast(LeftWeightLinear, module).left_buckets = frozenset(buckets)
    return chosen
