"""CPU linear layers: for each row count of a decode batch or a verified proposal, the fastest of three equal
products (torch's ``linear``, oneDNN on weights packed at load, the weight-left ``(W @ x.T).T``), chosen by timing
the model's own linears at load (measurements: docs/speculative.md, "CPU linears"). A compiled decode step takes a
fourth for a few rows: each row's multiply-and-sum over the weight, which inductor fuses into one vectorised pass
that reads the weight once at the memory's rate (oneDNN's and MKL's matrix-vector kernels read it at two thirds of
that here).

Each row bucket (1, 2, 4, 8, 16, 32) takes its fastest form, timed over at most ``TIMED_BYTES`` of weights; a row
count runs with the form of the bucket at or above it, the weight-left form on rows zero-padded to the bucket (its
BLAS kernels are up to 2x slower for odd counts). Results differ from ``linear`` by float rounding only. The packed
copy is kept only if some bucket uses it; the dense weight always stays (a tied embedding and latent attention's
absorbed weights read it). ``cpu_linear_tuning: false`` leaves torch's ``linear`` everywhere.

The packed copies live in this module's table (``packed_copy``), keyed by their dense weight, not on the modules: a
compiled step kept on disk serializes its guards' view of everything the step reaches, and an ``mkldnn`` tensor has
no such view (``Unsupported device type for mkldnn layout: meta``). The step passes the dense weight to one opaque
operator, which finds its packed copy when it runs.
"""

from __future__ import annotations

import enum
import time
import weakref
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

BUCKETS = (1, 2, 4, 8, 16, 32)  # row counts timed; more rows than the last take ``linear``
# the weight-left form runs at least 2 rows: one row padded to 2 is a GEMM, which read the weights faster than MKL's
# one-row GEMV on this box (a pass over SmolLM2's linears: 18 against 21 ms); the timing takes it only where faster
LEFT_MIN_ROWS = 2
TIMED_ROUNDS = 2  # each (form, bucket) time is its best round
TIMED_BYTES = 128 * 1024 * 1024  # the weights a timed pass reads at most: past the CPU caches, bounded time at load
# a compiled step's rows up to this many take REDUCE (a pass over SmolLM2's linears, compiled against oneDNN's packed
# product: 17 against 27 ms at 1 row, 18 against 31 at 2, 22 against 35 at 4, 36 against 42 at 8; the decode step at
# 8 rows gained nothing end to end, and compiled 40 % longer)
REDUCE_MAX_ROWS = 4


class Form(enum.Enum):
    LINEAR = "linear"  # torch's linear (MKL on x86)
    PACKED = "packed"  # oneDNN's inner product on the weight reordered into its blocked layout at load
    LEFT = "left"  # (W @ x.T).T on rows padded to the bucket
    REDUCE = "reduce"  # compiled steps only: per row, (W * x).sum(-1); eagerly it would build the whole product


@dataclass(frozen=True, slots=True)
class FormTable:
    forms: tuple[Form, ...]  # per bucket of ``BUCKETS``
    pass_ms: dict[str, dict[int, float]]  # form -> bucket -> one timed pass over the linears

    def form_for(self, rows: int, compiled: bool = False) -> tuple[Form, int]:
        """The form and padded row count for ``rows`` rows (a loop, not bisect: torch.compile traces it);
        ``compiled``: inside a compiled step, where a few rows take REDUCE."""
        if compiled and rows <= REDUCE_MAX_ROWS:
            return Form.REDUCE, rows
        for bucket, form in zip(BUCKETS, self.forms):
            if rows <= bucket:
                return form, max(bucket, LEFT_MIN_ROWS) if form is Form.LEFT else bucket
        return Form.LINEAR, rows


ALL_LINEAR = FormTable(tuple(Form.LINEAR for _ in BUCKETS), {})

_PackedKey = tuple[int, tuple[int, ...]]
_PACKED: dict[_PackedKey, torch.Tensor] = {}  # dense weight (storage address, shape) -> its oneDNN-packed copy


def _packed_key(weight: torch.Tensor) -> _PackedKey:
    return weight.data_ptr(), tuple(weight.shape)


def pack_weight(weight: torch.Tensor) -> None:
    """Keep ``weight``'s packed copy until the weight itself is freed (tied weights share one)."""
    key = _packed_key(weight)
    if key not in _PACKED:
        # the layout oneDNN picks for a batch of 1; prefill-sized inputs run about as fast on it
        _PACKED[key] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        weakref.finalize(weight, _PACKED.pop, key, None)


def unpack_weight(weight: torch.Tensor) -> None:
    _PACKED.pop(_packed_key(weight), None)


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    return _PACKED.get(_packed_key(weight))


class CpuLinear(nn.Linear):
    """An ``nn.Linear`` whose product takes its model's ``table`` form for the input's row count."""

    table: FormTable = ALL_LINEAR
    packed: bool = False  # its weight has a packed copy (``packed_copy``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        form, padded = self.table.form_for(rows, torch.compiler.is_compiling())
        if form is Form.REDUCE:
            flat = x.reshape(rows, self.in_features)
            # one reduction per row over the same weight: inductor runs them as one loop over the weight's rows
            out = torch.stack([(self.weight * flat[row]).sum(-1) for row in range(rows)])
            if self.bias is not None:
                out = out + self.bias
            return out.reshape(*x.shape[:-1], self.out_features)
        if form is Form.PACKED and self.packed:
            if torch.compiler.is_compiling():  # inductor lowers oneDNN's op only on frozen weights: call it opaque
                return packed_linear(x, self.weight, self.bias, self.out_features)
            packed = packed_copy(self.weight)
            if packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        if form is not Form.LEFT:
            return nn.functional.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])
        # contiguous like linear's: a collective (a tensor-parallel all-reduce) reads the storage as laid out
        out = (self.weight @ flat.T).T[:rows].contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


@torch.library.custom_op("pdserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """oneDNN's product on ``weight``'s packed copy (``linear`` on the weight if it has none)."""
    packed = packed_copy(weight)
    if packed is None:
        return nn.functional.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def can_convert(module: nn.Module) -> bool:
    if type(module) is not nn.Linear:
        return False
    weight = cast(nn.Linear, module).weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32


@torch.inference_mode()
def tune_cpu_linears(model: nn.Module, pack: bool = True, kept: tuple[Form, ...] | None = None) -> FormTable | None:
    """Make every plain float32 ``nn.Linear`` of a CPU model a ``CpuLinear`` on the fastest form per row bucket,
    timed here (``pack``: oneDNN on packed weights is one of the forms, where torch has oneDNN), or on ``kept``, the
    forms an earlier start timed (a compiled decode step's graphs were traced with them); None: nothing to tune."""
    linears = [cast(CpuLinear, module) for module in model.modules() if can_convert(module)]
    if not linears:
        return None
    forms = [Form.LINEAR, Form.LEFT]
    if pack and torch.backends.mkldnn.is_available() and (kept is None or Form.PACKED in kept):
        forms.append(Form.PACKED)
        for module in linears:
            pack_weight(module.weight)
            module.packed = True
    for module in linears:
        module.__class__ = CpuLinear
    if kept is not None and len(kept) == len(BUCKETS) and set(kept) <= set(forms):
        table = FormTable(kept, {})
        for module in linears:
            module.table = table
        return table
    timed = _timed_subset(linears)
    best: dict[tuple[Form, int], float] = {}
    for _ in range(TIMED_ROUNDS):
        for rows in BUCKETS:
            for form in forms:
                seconds = _pass_s(timed, FormTable(tuple(form for _ in BUCKETS), {}), rows)
                best[(form, rows)] = min(best.get((form, rows), float("inf")), seconds)
    table = FormTable(
        tuple(min(forms, key=lambda form: best[(form, rows)]) for rows in BUCKETS),
        {form.value: {rows: round(best[(form, rows)] * 1000, 2) for rows in BUCKETS} for form in forms},
    )
    keep_packed = Form.PACKED in table.forms
    for module in linears:
        module.table = table
        if not keep_packed:
            unpack_weight(module.weight)  # no bucket reads it: free the copy
            module.packed = False
    return table


def _timed_subset(linears: list[CpuLinear]) -> list[CpuLinear]:
    """The model's linears in order, up to ``TIMED_BYTES`` of weights."""
    subset: list[CpuLinear] = []
    total = 0
    for module in linears:
        if subset and total >= TIMED_BYTES:
            break
        subset.append(module)
        total += module.weight.numel() * module.weight.element_size()
    return subset


def _pass_s(linears: list[CpuLinear], table: FormTable, rows: int) -> float:
    """Seconds for ``rows`` rows through every linear in turn, all on ``table``."""
    inputs = {n: torch.randn(1, rows, n) for n in {module.in_features for module in linears}}
    for module in linears:
        module.table = table
    started = time.perf_counter()
    for module in linears:
        module(inputs[module.in_features])
    return time.perf_counter() - started
