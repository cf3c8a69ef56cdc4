"""CPU linears: each form of the product (``linear``, oneDNN on packed weights, the weight-left form on padded rows)
gives linear's result up to float rounding, for a decode row, a few rows, odd counts and a prefill; the load-time
choice takes the fastest form per row bucket, converts only plain float32 ``nn.Linear`` layers, keeps the dense
weights for whoever reads them and drops the packed copy when no bucket uses it. Inside a compiled step a few rows
take the per-row reduction, which equals linear up to float rounding too and never runs eagerly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import cpu_linear
from engine.cpu_linear import BUCKETS, REDUCE_MAX_ROWS, CpuLinear, Form, FormTable, packed_copy, tune_cpu_linears

FORMS = [Form.LINEAR, Form.LEFT] + ([Form.PACKED] if torch.backends.mkldnn.is_available() else [])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 32, 300])
def test_every_form_equals_linear(form, rows):
    torch.manual_seed(0)
    layer = nn.Linear(96, 200)
    x = torch.randn(1, rows, 96)
    want = layer(x)
    tune_cpu_linears(layer)
    layer.table = FormTable(tuple(form for _ in BUCKETS), {})
    got = layer(x)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)  # a different summation order: float rounding only


def test_each_bucket_takes_its_fastest_form(monkeypatch):
    """The timing is replaced by a fixed one: LEFT is fastest for 2-8 rows, PACKED for 1 and 16-32."""
    fastest = {1: Form.PACKED, 2: Form.LEFT, 4: Form.LEFT, 8: Form.LEFT, 16: Form.PACKED, 32: Form.PACKED}
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")

    def timed(linears, table, rows):
        return 1.0 if table.forms[0] is fastest[rows] else 2.0

    monkeypatch.setattr(cpu_linear, "_pass_s", timed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32, bias=False))
    x = torch.randn(1, 5, 32)
    want = model(x)
    table = tune_cpu_linears(model)
    assert table is not None and table.forms == tuple(fastest[rows] for rows in BUCKETS)
    assert table.form_for(5) == (Form.LEFT, 8) and table.form_for(9) == (Form.PACKED, 16)
    assert FormTable((Form.LEFT,) * len(BUCKETS), {}).form_for(1) == (Form.LEFT, 2)  # one row runs as a GEMM of two
    assert table.form_for(33) == (Form.LINEAR, 33)  # past the buckets: a prefill's rows
    assert [type(m) for m in model] == [CpuLinear, nn.ReLU, CpuLinear]
    assert all(m.packed and packed_copy(m.weight) is not None for m in (model[0], model[2]))
    assert torch.allclose(model(x), want, atol=1e-5)


def test_no_packed_copy_without_a_bucket_for_it_and_shared_weights_stay(monkeypatch):
    class Custom(nn.Linear):
        pass

    monkeypatch.setattr(cpu_linear, "_pass_s", lambda linears, table, rows: 1.0 if table.forms[0] is Form.LEFT else 2.0)
    embed = nn.Embedding(50, 16)
    head = nn.Linear(16, 50, bias=False)
    head.weight = embed.weight  # tied, as SmolLM2's lm_head
    model = nn.ModuleDict(
        {"embed": embed, "head": head, "custom": Custom(16, 8), "bf16": nn.Linear(16, 8).to(torch.bfloat16)}
    )
    table = tune_cpu_linears(model)
    assert table is not None and set(table.forms) == {Form.LEFT}
    assert type(model["head"]) is CpuLinear and type(model["custom"]) is Custom and type(model["bf16"]) is nn.Linear
    assert not model["head"].packed and packed_copy(model["head"].weight) is None  # no bucket reads it
    assert model["head"].weight is embed.weight  # the embedding still reads it
    assert tune_cpu_linears(nn.Sequential(nn.ReLU())) is None  # nothing to tune


def test_packing_can_be_turned_off():
    model = nn.Sequential(nn.Linear(32, 64))
    table = tune_cpu_linears(model, pack=False)
    assert table is not None and Form.PACKED not in table.forms and "packed" not in table.pass_ms
    assert not model[0].packed and packed_copy(model[0].weight) is None


def test_a_compiled_step_takes_the_reduction_for_a_few_rows_only():
    table = FormTable((Form.PACKED,) * len(BUCKETS), {})
    for rows in range(1, REDUCE_MAX_ROWS + 1):
        assert table.form_for(rows, compiled=True) == (Form.REDUCE, rows)
        assert table.form_for(rows) == (Form.PACKED, next(b for b in BUCKETS if b >= rows))  # eagerly: never
    assert table.form_for(REDUCE_MAX_ROWS + 1, compiled=True) == (Form.PACKED, 8)


@pytest.mark.parametrize("bias", [True, False])
def test_the_compiled_reduction_equals_linear(bias):
    """Rows 1 and 3 take the reduction inside the compiled function, 6 the table's form; all three equal linear up to
    float rounding (a different summation order)."""
    torch.manual_seed(0)
    layer = nn.Linear(96, 200, bias=bias)
    inputs = {rows: torch.randn(1, rows, 96) for rows in (1, 3, 6)}
    want = {rows: layer(x) for rows, x in inputs.items()}
    tune_cpu_linears(layer)
    compiled = torch.compile(layer, dynamic=False)
    for rows, x in inputs.items():
        got = compiled(x)
        assert got.shape == want[rows].shape
        assert torch.allclose(got, want[rows], atol=1e-5, rtol=1e-5), rows


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_a_step_on_packed_weights_is_compiled_ahead_of_time_saved_and_loaded(tmp_path):
    """A compiled step kept on disk serializes its guards' view of what it reaches: the packed copies stay out of it
    (an ``mkldnn`` tensor has no meta form), and the loaded step runs oneDNN's product on the live weights' copies."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 200), nn.ReLU(), nn.Linear(200, 96, bias=False)).requires_grad_(False)
    x = torch.randn(1, 8, 96)  # 8 rows: the packed form inside a compiled step
    want = model(x)
    tune_cpu_linears(model, kept=(Form.PACKED,) * len(BUCKETS))
    assert all(m.packed and packed_copy(m.weight) is not None for m in (model[0], model[2]))
    reached = [*model.parameters(), *(v for m in model.modules() for v in vars(m).values() if torch.is_tensor(v))]
    assert all(t.layout is torch.strided for t in reached)

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    options = {"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe}
    compiled = torch.compile(step, fullgraph=True, dynamic=False, options=options).aot_compile(((model, x), {}))
    path = tmp_path / "step.bin"
    compiled.save_compiled_function(str(path))
    with path.open("rb") as f:
        loaded = torch.compiler.load_compiled_function(f)
    got = loaded(model, x)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
