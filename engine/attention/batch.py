"""What one forward step tells the attention: where the new tokens go and what each sequence attends to.

The runner packs every scheduled sequence into one ragged row of ``T`` tokens and passes an ``AttentionBatch``
through the model's ``**kwargs``, with two views of the step: ``prefills`` and ``decode`` for gather + SDPA (a
chunked prefill's context slots; the decode rows' block table and reusable gather buffer, or the static
``DecodeGroup`` of a CUDA-graph step), and ``layout``, every sequence in packed-row order, for backends that read the
paged cache directly (FlashInfer) or build one mask for the whole row (flex).

``AttentionBackend`` is what a backend does with the batch. Every backend reads and writes the same paged KV layout
(``engine/kv_cache.py``), so KV transfers, prefix caching and the block manager never know which one runs.
``engine.attention.paged_attention_forward`` writes the new K/V and calls the layer hook before ``forward``; a backend
only attends. A step calls ``prepare`` once, then ``forward`` once per layer: per-step work (a block mask, FlashInfer's
plan) belongs in ``prepare`` or in ``batch.plan``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from engine.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class LayerFeatures:
    """What one layer's attention does beyond plain causal softmax attention, as the model passes it to transformers'
    attention interface: every family's variant is one of these, never a per-family branch."""

    scaling: float  # the softmax scale (the model's ``scaling``, else 1/sqrt of its own head width)
    sliding_window: int | None = None  # a query attends to the last ``sliding_window`` positions, itself included
    softcap: float | None = None  # scores become ``tanh(score / softcap) * softcap`` before the mask
    sinks: torch.Tensor | None = None  # [heads] a per-head logit that joins the softmax's denominator only

    @property
    def plain(self) -> bool:
        return self.sliding_window is None and self.softcap is None and self.sinks is None


# called after the layer's new KV is in the cache
LayerHook = Callable[[int, "AttentionBatch"], None]


@dataclass(slots=True)
class PrefillSeq:
    q_start: int  # offset of this chunk's first token in the packed row
    q_len: int
    context_len: int  # tokens of KV this chunk attends to, its own included
    context_slots: torch.Tensor | None  # [context_len] slot ids; None when the chunk is its whole context


@dataclass(slots=True)
class DecodeGroup:
    """Rows that each attend to their own whole paged context: a decoding request's one new token, or (``query_len``
    > 1, the gather + SDPA backend only) a verified request's last token and proposal, causal among themselves."""

    token_index: torch.Tensor | None  # [B * Q] positions of the queries in the packed row; None: the whole row, Q = 1
    block_table: torch.Tensor  # [B, max_blocks] physical block ids (padding points at block 0 and is masked)
    max_context: int
    # [2, B * max_blocks, block_size, kvH, d], reused by every layer of the step; None: each layer gathers into a
    # tensor of its own (a compiled step: an out= into a kept buffer makes the compiled graph copy the whole buffer)
    gather_buffer: torch.Tensor | None
    mask: torch.Tensor | None  # [B, 1, Q, max_context] True where a key is attended; None: equal lengths, Q = 1
    context_lens: torch.Tensor | None = None  # [B], for sliding-window layers' masks; None: unknown (no windows)
    query_len: int = 1  # Q: queries per row, a shorter row padded with its last query (computed twice, same value)
    query_ends: torch.Tensor | None = None  # [B, Q] keys each query attends (its position + 1), when Q > 1
    # per sliding window: the first block column any row's window reaches; such layers gather from there on
    window_first_block: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class SeqLayout:
    """Device tensors for the kernels; the host copies let a backend plan without waiting on the device."""

    q_lens: list[int]  # query tokens of each sequence in this step
    context_lens: list[int]  # tokens of KV each sequence attends to, this step's included
    query_start_loc: torch.Tensor  # [N + 1] offsets of each sequence's first token in the packed row
    seq_context_lens: torch.Tensor  # [N] context_lens on the device
    block_table: torch.Tensor  # [N, max_blocks] physical block ids, padded with 0 past each sequence's blocks
    host_block_table: torch.Tensor  # the same table on the host

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)


class LatentCache:
    """A latent-attention model's cache argument (``engine.attention.latent``): ``update`` keeps the layer's latent
    for ``paged_attention_forward`` and returns it unchanged."""

    def __init__(self) -> None:
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, latent: torch.Tensor, rotary_key: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        self.pending[layer_idx] = (latent, rotary_key)
        return latent, rotary_key


@dataclass(slots=True)
class AttentionBatch:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    prefills: list[PrefillSeq] = field(default_factory=list)
    decode: DecodeGroup | None = None
    layer_hook: LayerHook | None = None
    chunks: list = field(default_factory=list)  # the scheduled chunks, for the layer hook
    layout: SeqLayout | None = None  # built when the backend asks for it (``AttentionBackend.needs_layout``)
    backend: AttentionBackend | None = None  # None: the gather + SDPA backend
    plan: object | None = None  # the backend's per-step state (a block mask, a FlashInfer plan), from ``prepare``
    latent_cache: LatentCache | None = None  # a latent-attention model's cache argument (engine.attention.latent)


class AttentionBackend(abc.ABC):
    name: ClassVar[str]
    # the runner builds PrefillSeq/DecodeGroup and SeqLayout only for backends that read them: each costs per step
    needs_groups: ClassVar[bool] = False
    needs_layout: ClassVar[bool] = False
    # runs sliding windows, soft-capping and sinks (``LayerFeatures``); a model that uses them needs such a backend
    supports_features: ClassVar[bool] = False

    def prepare(self, batch: AttentionBatch) -> None:  # noqa: B027 (optional hook: most backends need no plan)
        """Per-step work shared by every layer, stored in ``batch.plan``; called once after the batch is built."""

    @abc.abstractmethod
    def forward(
        self,
        layer: int,
        query: torch.Tensor,  # [1, heads, T, head_dim]
        key: torch.Tensor,  # [1, kv_heads, T, head_dim] (already written into the cache)
        value: torch.Tensor,
        batch: AttentionBatch,
        features: LayerFeatures,
    ) -> torch.Tensor:
        """The attention output ``[1, T, heads, head_dim]``, as transformers' attention functions return it."""

    def workspace_bytes(self) -> int:
        """Device memory held for the backend's whole life (FlashInfer's workspace), counted in the KV budget;
        per-step scratch (the SDPA gather buffer) is the runner's to bound."""
        return 0
