"""CPU linears for a few rows: the weight-left form gives linear's result up to float rounding, contiguous, and the
load-time choice swaps only plain ``nn.Linear`` layers, keeping their parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import small_batch_linear
from engine.small_batch_linear import LeftWeightLinear, tune_small_batch_linears


@pytest.mark.parametrize("rows", [1, 2, 5, 32, 40])
def test_the_weight_left_form_equals_linear(rows):
    torch.manual_seed(0)
    layer = nn.Linear(96, 200)
    x = torch.randn(1, rows, 96)
    want = layer(x)
    layer.__class__ = LeftWeightLinear
    got = layer(x)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)  # a different summation order: float rounding only


def test_tuning_swaps_plain_linears_only(monkeypatch):
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64, bias=False), Custom(64, 8))
    x = torch.randn(3, 64)
    want = model(x)
    monkeypatch.setattr(small_batch_linear, "MIN_GAIN", 0.0)  # take the weight-left form wherever it is timed
    chosen = tune_small_batch_linears(model)
    assert chosen == {(128, 64): True, (64, 128): True}
    assert [type(m) for m in model] == [LeftWeightLinear, nn.ReLU, LeftWeightLinear, Custom]
    assert torch.allclose(model(x), want, atol=1e-5)
    monkeypatch.setattr(small_batch_linear, "MIN_GAIN", float("inf"))  # never
    fresh = nn.Sequential(nn.Linear(64, 128))
    assert tune_small_batch_linears(fresh) == {(128, 64): False} and type(fresh[0]) is nn.Linear
