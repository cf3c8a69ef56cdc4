"""CPU linears on packed weights: the same product as ``linear`` up to float rounding, for a decode row, a few rows
and a prefill; only plain float32 ``nn.Linear`` layers change, their dense weights stay for whoever reads them, and
the packing stays only where a timed pass over the model's linears says it is faster."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import cpu_linear
from engine.cpu_linear import PackedLinear, pack_cpu_linears, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 8, 33, 300])
def test_a_packed_linear_equals_linear(rows):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 200), nn.Linear(200, 64, bias=False))
    x = torch.randn(1, rows, 96)
    want = model(x)
    assert len(pack_linears(model)) == 2
    got = model(x)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)  # a different summation order: float rounding only


def test_only_plain_float32_linears_are_packed_and_weights_stay():
    class Custom(nn.Linear):
        pass

    torch.manual_seed(0)
    embed = nn.Embedding(50, 16)
    head = nn.Linear(16, 50, bias=False)
    head.weight = embed.weight  # tied, as SmolLM2's lm_head
    model = nn.ModuleDict(
        {"embed": embed, "head": head, "custom": Custom(16, 8), "bf16": nn.Linear(16, 8).to(torch.bfloat16)}
    )
    x = torch.randn(2, 16)
    want = head(x)
    assert len(pack_linears(model)) == 1
    assert type(model["head"]) is PackedLinear and type(model["custom"]) is Custom and type(model["bf16"]) is nn.Linear
    assert model["head"].weight is embed.weight and embed.weight.shape == (50, 16)  # the embedding still reads it
    assert torch.allclose(model["head"](x), want, atol=1e-5)


@pytest.mark.parametrize("faster", [True, False])
def test_packing_stays_only_where_it_was_measured_faster(monkeypatch, faster):
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    x = torch.randn(1, 3, 32)
    want = model(x)
    monkeypatch.setattr(cpu_linear, "MIN_GAIN", 0.0 if faster else float("inf"))  # packed always / never faster
    choice = pack_cpu_linears(model)
    assert choice is not None and choice.packed is faster and choice.plain_ms > 0 and choice.packed_ms > 0
    kinds = {type(m) for m in model}
    assert kinds == ({PackedLinear} if faster else {nn.Linear})
    assert all(hasattr(m, "packed_weight") is faster for m in model)  # an unused packed copy is not kept
    assert torch.allclose(model(x), want, atol=1e-5)
    assert pack_cpu_linears(nn.Sequential(nn.ReLU())) is None  # nothing to pack
