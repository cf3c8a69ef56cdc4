"""A GPU-shaped profile without a GPU: step and transfer times estimated from a model's shape and a GPU's datasheet.

``pdserve profile --roofline GPU --model M --tensor-parallel-size N`` writes a ``Profile`` whose fits are this file's
formulas, not measurements: its device says "roofline estimate" and its notes list every figure used, so each plan
made from it is labelled so. Per rank of a degree-N worker (``ModelShape.rank_shape``), with ``P`` its parameters,
``B`` its weight bytes (every expert's: a batch of a few dozen tokens reaches them all) and ``E`` the efficiencies below
(a mixture of experts' ``P`` is its parameters per token: the experts a token is routed to):
- prefill of ``t`` tokens after ``c`` cached: ``B / HBM + (2 P t + 4 L W (t c + t^2 / 2)) / FLOPS`` (W: its q width);
- decode of ``b`` requests holding ``k`` tokens of KV: ``B / HBM + k · KV bytes per token / HBM + 2 P b / FLOPS``;
- at N > 1, an all-reduce of ``hidden`` values per token (ring: ``2 (N - 1) / N`` of them cross a link) after each
  layer's attention, dense MLP and shared experts (a mixture's routed experts are whole on every rank at expert
  degree 1: the plans leave them uncut);
- at expert degree E = N, each MoE layer's routed experts 1/E per rank: prefill exchanges each token's ``k`` routed
  rows with their ranks and back (all-to-all, ``2 k (E - 1) / E`` rows cross a link) and all-gathers the rows
  (``(E - 1) / E``), four collectives; decode's captured step masks the other ranks' experts and all-reduces once
  (``engine.expert_parallel``);
- a fixed cost per step (launches, sampling, scheduling), and per transfer plus bytes over ``transfer_gb_s``.
Memory and compute terms are added, not overlapped: an upper bound of a well-run step, not a prediction of one.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from planner.kv_sizing import ModelShape, normalize_dtype, size_kv
from planner.profile_model import DECODE_FEATURES, PREFILL_FEATURES, TRANSFER_FEATURES, Fit, Profile


@dataclass(frozen=True, slots=True)
class GPU:
    name: str
    memory_gib: float
    dense_tflops: float  # bf16/fp16 tensor cores, dense (no sparsity)
    hbm_tb_s: float
    link_gb_s: float  # NVLink, one direction
    source: str


GPUS = {
    "h100-sxm": GPU("H100 SXM 80GB", 80, 989.0, 3.35, 450.0, "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    "h200": GPU("H200 141GB", 141, 989.0, 4.8, 450.0, "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    "a100-80gb": GPU("A100 SXM 80GB", 80, 312.0, 2.039, 300.0, "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)"),
}


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Shares of the datasheet's peaks a serving step reaches, and fixed costs; stated, not measured."""

    compute: float = 0.5  # model FLOPs utilisation of a large prefill
    memory: float = 0.75  # of HBM bandwidth, reading weights and KV
    link: float = 0.7  # of NVLink bandwidth, in an all-reduce
    all_reduce_s: float = 15e-6  # latency of one small all-reduce
    step_s: float = 1e-3  # launches, sampling and scheduling per step
    transfer_s: float = 2e-3  # per KV transfer: handshake and completion
    transfer_gb_s: float = 25.0  # KV between a prefill and a decode worker (a 200 Gb/s RDMA link)


def roofline_profile(
    shape: ModelShape,
    gpu_name: str,
    dtype: str = "bfloat16",
    tensor_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    block_size: int = 16,
    max_batch_tokens: int = 8192,
    max_num_seqs: int = 256,
    gpu_memory_utilization: float = 0.9,
    eff: Efficiency = Efficiency(),
) -> Profile:
    """ValueError naming the flag when the GPU is unknown, the dtype has no tensor-core peak here, or the weights of
    one rank do not fit the GPU."""
    if gpu_name not in GPUS:
        raise ValueError(f"--roofline: one of {', '.join(GPUS)}, got {gpu_name!r}")
    gpu = GPUS[gpu_name]
    dtype = normalize_dtype(dtype)
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"--dtype: a roofline profile is bf16 or fp16 (the tensor-core peak), got {dtype}")
    n, e = tensor_parallel_size, expert_parallel_size
    whole = size_kv(shape, dtype, block_size)
    degree = f"degree {n}" + (f", expert degree {e}" if e > 1 else "")
    rank = size_kv(
        shape, dtype, block_size, gpu.memory_gib, gpu_memory_utilization, tensor_parallel_size=n, expert_parallel_size=e
    )
    if not rank.weights_fit or not rank.kv_budget_blocks:
        raise ValueError(
            f"--tensor-parallel-size: {shape.name} at {degree} leaves no KV room on a {gpu.name}: "
            f"{rank.weight_bytes / 2**30:.1f} GiB of weights per GPU, {(rank.usable_bytes or 0) / 2**30:.1f} GiB usable"
        )
    rank_shape = shape.rank_shape(n, e)
    flops_s = gpu.dense_tflops * 1e12 * eff.compute
    hbm_s = gpu.hbm_tb_s * 1e12 * eff.memory
    link_s = gpu.link_gb_s * 1e9 * eff.link
    row_bytes = shape.hidden_size * whole.dtype_bytes
    weights_s = rank.weight_bytes / hbm_s
    per_token_s = 2 * rank.active_parameters / flops_s  # a mixture of experts computes with the routed ones only
    attention = 4 * shape.num_layers * rank_shape.num_attention_heads * shape.head_dim / flops_s  # per token x key
    dense_layers = shape.num_layers - shape.moe_layers
    shared = shape.moe_layers if shape.shared_intermediate_size else 0
    all_reduces = shape.num_layers + dense_layers + shared if n > 1 else 0
    ring_s = 2 * (n - 1) / n * row_bytes / link_s
    # the routed experts' exchange per token and its collectives, by phase (0 at expert degree 1), over the e ranks
    # that split them (the tensor-parallel ones, or at n = 1 ranks of their own)
    exchange = shape.moe_layers if e > 1 else 0
    prefill_rows = exchange * (2 * shape.experts_per_token + 1) * (e - 1) / e
    expert_ring_s = 2 * (e - 1) / e * row_bytes / link_s
    prefill_comm = [all_reduces + 4 * exchange, all_reduces * ring_s + prefill_rows * row_bytes / link_s]
    decode_comm = [all_reduces + exchange, all_reduces * ring_s + exchange * expert_ring_s]
    fixed_s = eff.step_s + weights_s
    prefill = Fit(
        PREFILL_FEATURES,
        [fixed_s + prefill_comm[0] * eff.all_reduce_s, per_token_s + prefill_comm[1], attention, attention / 2],
    )
    decode = Fit(
        DECODE_FEATURES,
        [fixed_s + decode_comm[0] * eff.all_reduce_s, per_token_s + decode_comm[1], rank.kv_bytes_per_token / hbm_s],
    )
    transfer = Fit(TRANSFER_FEATURES, [eff.transfer_s, 1 / (eff.transfer_gb_s * 1e9)])
    notes = (
        f"NOT MEASURED: roofline estimate (planner/roofline.py) for {gpu.name} from the {gpu.source}: "
        f"{gpu.dense_tflops:g} TFLOPS dense, {gpu.hbm_tb_s:g} TB/s HBM, {gpu.link_gb_s:g} GB/s NVLink per direction, "
        f"{gpu.memory_gib:g} GiB at utilisation {gpu_memory_utilization:g}; efficiencies: compute {eff.compute:g}, "
        f"memory {eff.memory:g}, link {eff.link:g}; {eff.all_reduce_s * 1e6:g} us per all-reduce, "
        f"{eff.step_s * 1e3:g} ms per step, KV transfers {eff.transfer_s * 1e3:g} ms + bytes at "
        f"{eff.transfer_gb_s:g} GB/s; model shape from {shape.source}; tensor_parallel_size {n}"
        + (f", expert_parallel_size {e}" if e > 1 else "")
        + ": "
        f"{rank.weight_bytes / 2**30:.2f} GiB of weights and {rank.kv_budget_blocks} KV blocks per GPU"
    )
    return Profile(
        model=shape.name,
        dtype=dtype,
        device=f"{gpu.name} (roofline estimate)",
        backend="estimate",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        block_size=block_size,
        kv_bytes_per_token=whole.kv_bytes_per_token,
        max_batch_tokens=max_batch_tokens,
        max_num_seqs=max_num_seqs,
        prefill_fit=prefill,
        decode_fit=decode,
        transfer_fit=transfer,
        notes=notes,
        tensor_parallel_size=n,
        expert_parallel_size=e,
        num_kv_heads=shape.num_kv_heads,
        kv_blocks=rank.kv_budget_blocks,
    )
