"""Expert parallelism inside one engine: each rank of a tensor-parallel worker holds 1/N of every mixture-of-experts
layer's routed experts, and the tokens go to the ranks of their experts and come back weighted.

What to split is the model's own plan (transformers' ``base_model_ep_plan``): ``grouped_gemm`` expert weights are cut
on the expert axis as the shard loads (``engine.tp_shard``), and the ``ep_dispatch_experts`` module is reached through
``ExpertParallel``. The ranks are the worker's tensor-parallel group (vLLM's ``--enable-expert-parallel``: the expert
degree is the tensor degree), or at tensor degree 1 ranks of their own, each with the whole attention (and every KV
head) and the whole of any dense layer; either way they hold the same tokens. An eager forward gives each rank its
own slice of them and exchanges (token, expert) pairs: an all-to-all to the experts' ranks, the experts, an
all-to-all back, weighted and summed per token, then one all-gather of the slices (transformers' ``AllToAllEP``). A
compiled or captured step cannot read the exchange's sizes back to the host, so it masks the other ranks' experts and
sums over the ranks instead (transformers' ``AllReduceEP``). The routers and shared experts are whole, or cut by the
tensor plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed._functional_collectives as _functional

from engine.blocks import routed_experts
from engine.config import check_parallel
from engine.tensor_parallel import TPGroup

EP_STYLES = ("grouped_gemm", "ep_dispatch_experts")  # the plan's styles ExpertParallel runs


def degree_field(exc: Exception) -> str:
    """The degree a split's error is about: each names its field first (``expert_parallel_size ...``, else a
    ``tensor_parallel_size`` one), so a pool's config or a command's flag can say which."""
    return "expert_parallel_size" if str(exc).startswith("expert_parallel_size") else "tensor_parallel_size"


def expert_plan(hf_config: Any) -> dict[str, str]:
    """The model's own expert-parallel plan, {} when it has none or no routed experts to split (a dense model)."""
    plan = dict(getattr(hf_config, "base_model_ep_plan", None) or {})
    return plan if plan and routed_experts(hf_config.to_dict()) else {}


def ep_plan(hf_config: Any, tensor_size: int, expert_size: int) -> dict[str, str]:
    """The model's expert-parallel plan (module or weight pattern -> style) at ``expert_size`` ranks, {} at 1; else a
    ValueError naming ``expert_parallel_size``: a layout the ranks cannot take (``engine.config.check_parallel``), a
    dense model, a style pdserve does not run, or experts that do not divide."""
    if expert_size == 1:
        return {}
    where = f"expert_parallel_size {expert_size}: model type {hf_config.model_type!r}"
    check_parallel(tensor_size, expert_size)
    plan = expert_plan(hf_config)
    if not plan:
        raise ValueError(f"{where}: the model has no routed experts to split (no expert-parallel plan); leave it 1")
    for pattern, style in plan.items():
        if style not in EP_STYLES:
            raise ValueError(
                f"{where}: its expert-parallel plan's entry {pattern!r}: {style!r} is not one pdserve runs "
                f"({', '.join(EP_STYLES)})"
            )
    experts = routed_experts(hf_config.to_dict())
    if experts % expert_size:
        raise ValueError(f"{where}: expert_parallel_size {expert_size} does not divide the model's {experts} experts")
    return plan


@dataclass(frozen=True, slots=True)
class ExpertSplit:
    """The routed experts one of ``size`` ranks holds: ``[start, start + count)`` of ``total``."""

    rank: int
    size: int
    total: int

    @property
    def count(self) -> int:
        return self.total // self.size

    @property
    def start(self) -> int:
        return self.rank * self.count

    def owner(self, expert_ids: torch.Tensor) -> torch.Tensor:
        return torch.div(expert_ids, self.count, rounding_mode="floor")


@dataclass
class ExpertTraffic:
    """What this rank's mixture-of-experts layers moved, summed over its eager forwards (a compiled step's masked
    path is in none of them): routed (token, expert) pairs per rank of the group (every rank sees every token's
    routes, so each can count the whole group's), tokens per layer forward, and the bytes this rank sent."""

    size: int
    moe_layers: int
    layer_forwards: int = 0
    layer_tokens: int = 0  # tokens summed over layer forwards
    pairs_per_rank: list[int] = field(default_factory=list)
    bytes_sent: int = 0

    def __post_init__(self) -> None:
        self.pairs_per_rank = self.pairs_per_rank or [0] * self.size

    def count(self, tokens: int, pairs: list[int], sent_bytes: int) -> None:
        self.layer_forwards += 1
        self.layer_tokens += tokens
        self.pairs_per_rank = [a + b for a, b in zip(self.pairs_per_rank, pairs, strict=True)]
        self.bytes_sent += sent_bytes

    @property
    def tokens(self) -> int:
        """Tokens through the model's mixture-of-experts layers (each layer sees every one)."""
        return self.layer_tokens // self.moe_layers if self.moe_layers else 0

    def summary(self) -> dict[str, Any]:
        """Tokens each rank's experts computed per model token, bytes this rank sent per token (every MoE layer),
        and the imbalance: the busiest rank's pairs over the mean (1.0: even)."""
        tokens = self.tokens
        pairs = self.pairs_per_rank
        mean = sum(pairs) / len(pairs)
        return {
            "expert_parallel_size": self.size,
            "moe_layers": self.moe_layers,
            "tokens": tokens,
            "pairs_per_rank": pairs,
            "bytes_sent_per_token": round(self.bytes_sent / tokens) if tokens else 0,
            "load_imbalance": round(max(pairs) / mean, 3) if mean else 1.0,
        }


class ExpertParallel(torch.nn.Module):
    """A mixture-of-experts layer's routed experts, this rank's share of them (``experts.num_experts`` is the local
    count), called as the experts are: (rows, top-k expert ids, top-k weights) -> the weighted sum per row."""

    def __init__(self, experts: torch.nn.Module, split: ExpertSplit, group: TPGroup, traffic: ExpertTraffic) -> None:
        super().__init__()
        self.experts = experts
        self.split = split
        self.group = group
        self.traffic = traffic

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or (hidden.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self._masked(hidden, top_k_index, top_k_weights)
        return self._dispatched(hidden, top_k_index, top_k_weights)

    def _masked(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Every row through this rank's experts, other ranks' routes masked (local id ``count``, which the experts
        skip; weight 0), summed over the ranks: no size read back to the host, so a graph holds it."""
        local = top_k_index - self.split.start
        elsewhere = (local < 0) | (local >= self.split.count)
        local = torch.where(elsewhere, self.split.count, local)
        partial = self.experts(hidden, local, top_k_weights.masked_fill(elsewhere, 0.0))
        return _functional.all_reduce(partial, "sum", self.group.device_group_name)

    def _dispatched(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        split, group = self.split, self.group
        tokens, width = hidden.shape
        top_k = top_k_index.shape[-1]
        rows = max(1, -(-tokens // split.size))  # each rank's slice of the shared rows (the last may be short)
        mine = slice(split.rank * rows, min(tokens, (split.rank + 1) * rows))
        index, weights = top_k_index[mine], top_k_weights[mine]
        # pairs sorted by expert are grouped by owner rank, and each receiver learns from the counts which of its
        # experts each row it gets is for
        expert_ids = index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)
        send = hidden[mine][torch.div(order, top_k, rounding_mode="floor")]
        send_counts = torch.bincount(expert_ids, minlength=split.total).view(split.size, split.count)
        recv_counts = torch.empty_like(send_counts)
        group.all_to_all(recv_counts, send_counts, [1] * split.size, [1] * split.size)  # a row of counts per rank
        send_rows, recv_rows = send_counts.sum(dim=1).tolist(), recv_counts.sum(dim=1).tolist()
        received = hidden.new_empty(sum(recv_rows), width)
        group.all_to_all(received, send, recv_rows, send_rows)
        local_ids = torch.arange(split.count, device=hidden.device).repeat(split.size)
        local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1)).unsqueeze(-1)
        # the experts run top-1 with unit weights; the routing weights are applied here, by the rows' owner
        computed = self.experts(received, local_ids, hidden.new_ones(received.shape[0], 1))
        returned = hidden.new_empty(sum(send_rows), width)
        group.all_to_all(returned, computed.contiguous(), send_rows, recv_rows)
        per_pair = torch.empty_like(returned)
        per_pair[order] = returned
        combined = (per_pair.view(-1, top_k, width) * weights.unsqueeze(-1)).sum(dim=1)
        padded = hidden.new_zeros(rows, width)
        padded[: combined.shape[0]] = combined
        out = group.all_gather(padded)[:tokens]
        row_bytes = width * hidden.element_size()
        off_rank = sum(send_rows) - send_rows[split.rank] + sum(recv_rows) - recv_rows[split.rank]
        sent = (off_rank + (split.size - 1) * rows) * row_bytes + (split.size - 1) * split.count * 8
        pairs = torch.bincount(split.owner(top_k_index.reshape(-1)), minlength=split.size).tolist()
        self.traffic.count(tokens, pairs, sent)
        return out.to(hidden.dtype)


def expert_traffic(model: Any) -> ExpertTraffic | None:
    """The traffic counters the model's expert-parallel layers share (None: its experts are whole, or the model is
    the planner's stand-in, which computes nothing)."""
    if not isinstance(model, torch.nn.Module):
        return None
    for module in model.modules():
        if isinstance(module, ExpertParallel):
            return module.traffic
    return None
