"""CPU linears for a few rows: the weight-left form, on rows padded to a bucket, gives linear's result up to float
rounding, contiguous, and the load-time choice per bucket swaps only plain ``nn.Linear`` layers, keeping their
parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import small_batch_linear
from engine.small_batch_linear import LeftWeightLinear, tune_small_batch_linears


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 32, 40])
def test_the_weight_left_form_equals_linear(rows):
    torch.manual_seed(0)
    layer = nn.Linear(96, 200)
    x = torch.randn(1, rows, 96)
    want = layer(x)
    layer.__class__ = LeftWeightLinear
    layer.left_buckets = frozenset(small_batch_linear.BUCKETS)
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
    every = frozenset(small_batch_linear.BUCKETS)
    assert chosen == {(128, 64): every, (64, 128): every}
    assert [type(m) for m in model] == [LeftWeightLinear, nn.ReLU, LeftWeightLinear, Custom]
    assert torch.allclose(model(x), want, atol=1e-5)
    monkeypatch.setattr(small_batch_linear, "MIN_GAIN", float("inf"))  # never
    fresh = nn.Sequential(nn.Linear(64, 128))
    assert tune_small_batch_linears(fresh) == {(128, 64): frozenset()} and type(fresh[0]) is nn.Linear


def test_each_bucket_takes_its_own_form(monkeypatch):
    torch.manual_seed(0)
    layer = nn.Linear(32, 48)
    layer.__class__ = LeftWeightLinear
    layer.left_buckets = frozenset({8})
    calls = []
    real = small_batch_linear._left
    monkeypatch.setattr(small_batch_linear, "_left", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    for rows in (3, 5, 8, 9):
        layer(torch.randn(1, rows, 32))
    assert calls == [8, 8]  # 5 and 8 rows run as 8; 3 (bucket 4) and 9 (bucket 16) take linear
