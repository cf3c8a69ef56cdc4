"""The engine's KV connector: the engine says when a request's KV can leave, and takes KV in for a request.

What is complete, and when, is a fact about the engine's own batches, so it is decided here (vLLM's KV connector
idea); the worker turns each ``KVBlocksReady`` into a send. Export (prefill side): a request with a ``KVSink`` gets
one per layer and block range, streamed from inside the forward as each layer's KV is written (full blocks as chunks
fill them, the partial last one at the prompt's end), so the transfer overlaps the later layers; or, unstreamed, the
whole prompt once it is done. Blocks are reported once, and never those before ``KVExport.first_block`` (the
receiver has them). Import (decode side): ``RemoteKV`` on the request, admitted once first token and KV are in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.blocks import blocks_for_tokens, complete_prompt_blocks
from engine.request import KVExport

if TYPE_CHECKING:  # annotations only
    from engine.attention import AttentionBatch, LayerHook
    from engine.kv_cache import KVCache
    from engine.request import Request
    from engine.scheduler import ScheduledChunk


@dataclass(frozen=True, slots=True)
class KVBlocksReady:
    """Logical blocks ``[first_block, end_block)`` of a request hold their final KV for ``layer``."""

    request_id: str
    layer: int
    first_block: int
    end_block: int
    k: torch.Tensor  # [end_block - first_block, block_size, kv_heads, head_dim], a copy: safe to keep
    v: torch.Tensor


# streamed, it runs inside the forward: what it raises fails every request of that step, as a failing forward does
KVSink = Callable[[KVBlocksReady], None]


@dataclass(slots=True)
class _PlannedExport:
    request: Request
    export: KVExport
    first_block: int
    end_block: int


# tensor parallelism: this rank's heads of some blocks' KV, ``[2, blocks, block_size, heads, head_dim]``, in; every
# head of the model out (on rank 0, gathered from every rank), so the KV that leaves fits any degree on the other side
HeadGather = Callable[[torch.Tensor], torch.Tensor]


class KVExporter:
    """Reports exported requests' completed blocks, inside the forward (streamed) or after it. Per step:
    ``layer_hook_for(chunks)`` plans and returns the runner's hook (None when nothing needs one, so decode-only steps
    pay nothing), then ``commit`` after a forward that succeeded or ``discard`` after one that raised. With
    ``gather_heads`` (tensor parallelism) every layer's planned blocks are gathered from the ranks in one collective,
    the other ranks reading ``planned_block_ids`` in their own forward."""

    def __init__(self, kv_cache: KVCache, gather_heads: HeadGather | None = None) -> None:
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.gather_heads = gather_heads
        self.user_hook: LayerHook | None = None  # ``LLMEngine.set_layer_hook`` (fault injection), after the exports
        self._planned: list[_PlannedExport] = []
        self.planned_block_ids: list[int] = []  # physical ids of every planned export's blocks, in plan order
        self._index: torch.Tensor | None = None  # ... on the cache's device: built once per step, not per layer

    def layer_hook_for(self, chunks: list[ScheduledChunk]) -> LayerHook | None:
        self._planned, self.planned_block_ids = [], []
        for chunk in chunks:
            export = chunk.request.kv_export
            if export is None or not export.stream:
                continue
            end = complete_prompt_blocks(chunk.end, chunk.request.num_prompt_tokens, self.block_size)
            first = export.num_blocks_reported
            if end > first:
                self._planned.append(_PlannedExport(chunk.request, export, first, end))
                self.planned_block_ids += chunk.request.block_ids[first:end]
        if not self._planned:
            return self.user_hook
        self._index = self.kv_cache.block_index(self.planned_block_ids)
        return self._on_layer

    def _on_layer(self, layer: int, batch: AttentionBatch) -> None:
        assert self._index is not None
        k, v = self.kv_cache.read_blocks(layer, self._index)
        if self.gather_heads is not None:
            k, v = self.gather_heads(torch.stack((k, v))).unbind(0)
        offset = 0
        for planned in self._planned:
            n = planned.end_block - planned.first_block
            rid = planned.request.request_id
            ready = KVBlocksReady(
                rid, layer, planned.first_block, planned.end_block, k[offset : offset + n], v[offset : offset + n]
            )
            planned.export.sink(ready)
            offset += n
        if self.user_hook is not None:
            self.user_hook(layer, batch)

    def commit(self) -> None:
        for planned in self._planned:
            planned.export.num_blocks_reported = max(planned.export.num_blocks_reported, planned.end_block)
        self.discard()

    def discard(self) -> None:
        self._planned, self.planned_block_ids, self._index = [], [], None

    def export_whole_prompt(self, request: Request) -> None:
        """Unstreamed: every layer of the prompt's blocks not yet reported, once the prompt is done (one rank only:
        the other ranks take part in a gather inside the forward alone)."""
        export = request.kv_export
        if export is None:
            return
        first, end = export.num_blocks_reported, blocks_for_tokens(request.num_prompt_tokens, self.block_size)
        if end <= first:
            return
        src = self.kv_cache.block_index(request.block_ids[first:end])
        for layer in range(self.kv_cache.spec.num_layers):
            k, v = self.kv_cache.read_blocks(layer, src)
            export.sink(KVBlocksReady(request.request_id, layer, first, end, k, v))
        export.num_blocks_reported = end
