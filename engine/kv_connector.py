"""The engine's KV connector: the engine says when a request's KV can leave, and takes KV in for a request.

Disaggregated serving moves a prompt's KV from the engine that computed it (prefill) to the engine that decodes it.
Which blocks are complete, and when, is a fact about the engine's own batches, so it is decided here, not by the
worker walking the attention batch (vLLM's KV connector idea, in our own code):

- **Export (prefill side).** A request added with a ``KVSink`` gets one callback per layer and block range:
  ``KVBlocksReady(request_id, layer, first_block, end_block, k, v)``, logical blocks ``[first, end)`` of the request
  with their K/V gathered from the cache. Streamed (``stream_kv=True``), it is called inside the forward, right after
  each layer's KV is written, for the blocks that forward completed: full blocks as chunks fill them, and the partial
  last block when the chunk reaches the end of the prompt; every layer of one forward reports the same range, so the
  transfer overlaps the layers still computing. Unstreamed, every layer of the whole prompt is reported once the
  prompt is done, before ``step`` returns the first token. ``KVExport.num_blocks_reported`` (on the Request) is how
  far it got; a preempted and recomputed prompt does not report its blocks twice. When the receiver already holds
  the prompt's leading blocks (its own prefix cache: a multi-turn chat's history it just decoded), the export starts
  at ``KVExport.first_block``: the engine still computes those tokens (the later ones attend to them) unless its own
  prefix cache has them, but never reports them, so only the missing blocks travel.
- **Import (decode side).** ``RemoteKV`` (on the Request, via its timing) is the state of a request whose KV comes
  from elsewhere: blocks reserved, the first token (sampled by the prefill worker), KV complete or failed, and the
  stamps of each. The scheduler admits it once the first token and the KV (or the decision to recompute it) are in.

This module knows blocks and layers, never the transfer layer: the worker turns a ``KVBlocksReady`` into a send.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.blocks import blocks_for_tokens, complete_prompt_blocks
from engine.request import KVExport

if TYPE_CHECKING:  # annotations only: model_runner and attention import request, which imports this module
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


# The one callback of an exported request. Streamed, it runs inside the forward: what it raises fails every request
# of that step (their KV is incomplete), as a failing forward does.
KVSink = Callable[[KVBlocksReady], None]


@dataclass(slots=True)
class _PlannedExport:
    request: Request
    export: KVExport
    first_block: int
    end_block: int
    src_index: torch.Tensor  # physical ids of logical blocks [first_block, end_block), on the cache's device


class KVExporter:
    """Reports exported requests' completed blocks to their sinks: inside the forward (streamed) or after it.

    Per step: ``layer_hook_for(chunks)`` plans what this forward completes and returns the hook the runner installs
    for it (None when nothing needs one, so decode-only steps pay nothing); after a forward that succeeded,
    ``commit`` advances each request's count; after one that raised, ``discard`` drops the plan.
    """

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.user_hook: LayerHook | None = None  # ``LLMEngine.set_layer_hook`` (fault injection): after the exports
        self._planned: list[_PlannedExport] = []

    def layer_hook_for(self, chunks: list[ScheduledChunk]) -> LayerHook | None:
        self._planned = []
        for chunk in chunks:
            export = chunk.request.kv_export
            if export is None or not export.stream:
                continue
            end = complete_prompt_blocks(chunk.end, chunk.request.num_prompt_tokens, self.block_size)
            first = export.num_blocks_reported
            if end > first:
                src = self.kv_cache.block_index(chunk.request.block_ids[first:end])  # once per step, not per layer
                self._planned.append(_PlannedExport(chunk.request, export, first, end, src))
        if not self._planned:
            return self.user_hook
        return self._on_layer

    def _on_layer(self, layer: int, batch: AttentionBatch) -> None:
        for planned in self._planned:
            k, v = self.kv_cache.read_blocks(layer, planned.src_index)
            rid = planned.request.request_id
            planned.export.sink(KVBlocksReady(rid, layer, planned.first_block, planned.end_block, k, v))
        if self.user_hook is not None:
            self.user_hook(layer, batch)

    def commit(self) -> None:
        for planned in self._planned:
            planned.export.num_blocks_reported = max(planned.export.num_blocks_reported, planned.end_block)
        self._planned = []

    def discard(self) -> None:
        self._planned = []

    def export_whole_prompt(self, request: Request) -> None:
        """Unstreamed: every layer of the prompt's blocks not yet reported, once the prompt is done."""
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
