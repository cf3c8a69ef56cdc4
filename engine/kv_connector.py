"""The engine's KV hand-off: what leaves a request's blocks for another worker, and what comes into them.

One hand-off for prefill -> decode and decode -> decode (a move): the receiver reserves blocks, the sender streams
the blocks it holds, and the receiver joins on "KV in + tokens in".

Export (``KVExporter``). What is complete, and when, is a fact about the engine's own batches, so it is decided here
(vLLM's KV connector idea); the worker turns each ``KVBlocksReady`` into a send. A prefill-only request with a
``KVSink`` gets one per layer and block range, streamed from inside the forward as each layer's KV is written (full
blocks as chunks fill them, the partial last one at the prompt's end), or, unstreamed, the whole prompt once done;
blocks are reported once, never those before ``KVExport.first_block`` (the receiver has them). ``export_held`` reads
blocks a decoding request already holds (a move: its full blocks while it decodes on, then, frozen, the rest).

Import (``KVImporter``). A reservation (``reserve``) holds blocks for a request whose KV comes from elsewhere: a
prompt's (prefix-cached blocks shared) or a running request's whole context (``context_tokens``). The transfer layer
writes the expected blocks (``write``) and says when it is done or failed; the router brings the tokens
(``tokens_in``: the prefill worker's first token, or every token a moved request generated). The request's
``KVImport.state`` follows; once KV and tokens are in, the scheduler admits it from its next token (or, after a failed
transfer, computes it here).

At a tensor-parallel degree above 1 every rank sends and receives its own heads (``engine.tensor_parallel.
handoff_parts``: who sends which heads to whom); this is each rank's part of it, rank 0's with the requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.blocks import blocks_for_tokens, complete_prompt_blocks, reserved_tokens
from engine.request import FinishReason, ImportState, KVExport, KVImport, RequestStatus
from engine.tensor_parallel import ExportSpan, export_slot

if TYPE_CHECKING:  # annotations only
    from engine.attention import AttentionBatch, LayerHook
    from engine.kv_cache import KVCache
    from engine.kv_tiers import TierLoad
    from engine.request import Request, SamplingParams
    from engine.scheduler import ScheduledChunk, Scheduler


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


class KVExporter:
    """Reports exported requests' completed blocks, inside the forward (streamed) or after it: this rank's KV heads
    of them (each rank of a tensor-parallel worker sends its own: ``spans`` tells the other ranks which blocks). Per step: ``layer_hook_for(chunks)`` plans and returns the runner's hook (None when
    nothing needs one, so decode-only steps pay nothing), then ``commit`` after a forward that succeeded or
    ``discard`` after one that raised. Between steps, ``export_held`` reads a decoding request's blocks."""

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.user_hook: LayerHook | None = None  # ``LLMEngine.set_layer_hook`` (fault injection), after the exports
        self._planned: list[_PlannedExport] = []
        self.spans: list[ExportSpan] = []  # the planned exports, for the other ranks (the step message)
        self._index: torch.Tensor | None = None  # every planned block on the cache's device: built once per step

    def layer_hook_for(self, chunks: list[ScheduledChunk]) -> LayerHook | None:
        self._planned, self.spans = [], []
        for chunk in chunks:
            export = chunk.request.kv_export
            if export is None or not export.stream:
                continue
            end = complete_prompt_blocks(chunk.end, chunk.request.num_prompt_tokens, self.block_size)
            first = export.num_blocks_reported
            if end > first:
                self._planned.append(_PlannedExport(chunk.request, export, first, end))
                slot = export_slot(chunk.request.request_id)
                self.spans.append(ExportSpan(slot, first, end, chunk.request.block_ids[first:end]))
        if not self._planned:
            return self.user_hook
        self._index = self.kv_cache.block_index([block for span in self.spans for block in span.block_ids])
        return self._on_layer

    def _on_layer(self, layer: int, batch: AttentionBatch) -> None:
        assert self._index is not None
        k, v = self.kv_cache.read_blocks(layer, self._index)
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
        self._planned, self.spans, self._index = [], [], None

    def export_whole_prompt(self, request: Request) -> None:
        """Unstreamed: every layer of the prompt's blocks not yet reported, once the prompt is done (a worker of one
        rank: at degree N the export streams, every rank sending its heads inside the forward)."""
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

    def export_held(self, request: Request, sink: KVSink, first_block: int, end_block: int, layers: range) -> None:
        """``layers`` of a request's logical blocks ``[first_block, end_block)``, this rank's heads, to ``sink``: full
        blocks of a RUNNING decoding request (their KV no longer changes while it decodes on) or any of a FROZEN one or
        of a PREFILLED one held for export (up to its last computed token: its KV is complete; sent again, as to
        another decode worker). ValueError when it is none of these or has not filled those blocks."""
        running = request.status is RequestStatus.RUNNING and not request.prefill_only
        if not running and request.status not in (RequestStatus.FROZEN, RequestStatus.PREFILLED):
            raise ValueError(f"request {request.request_id!r} is {request.status.name}: its KV is not held for export")
        filled = request.num_computed_tokens
        end = filled // self.block_size if running else -(-filled // self.block_size)
        if not 0 <= first_block < end_block <= end:
            raise ValueError(f"request {request.request_id!r} has not filled blocks {first_block} to {end_block}")
        index = self.kv_cache.block_index(request.block_ids[first_block:end_block])
        for layer in layers:
            k, v = self.kv_cache.read_blocks(layer, index)
            sink(KVBlocksReady(request.request_id, layer, first_block, end_block, k, v))


class RequestTable(Protocol):
    """What the importer needs of the engine that owns the requests (``LLMEngine``): it makes, holds and ends them."""

    requests: dict[str, Request]
    vocab_size: int
    max_model_len: int
    length_limit: int  # tokens a request may reach in all (``LLMEngine.length_limit``)

    def new_request(
        self, prompt: str | list[int], params: SamplingParams | None, request_id: str | None, prefill_only: bool
    ) -> Request: ...

    def at_seq_limit(self) -> bool: ...

    def finish_request(self, request: Request, reason: FinishReason) -> None: ...

    def free_blocks(self, request: Request) -> None: ...

    def save_evicted(self) -> None: ...


class KVImporter:
    """The decode side of every hand-off: reservations, their expected blocks, arrivals and failures, the join."""

    def __init__(
        self, engine: RequestTable, scheduler: Scheduler, kv_cache: KVCache, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.kv_cache = kv_cache
        self.block_size = scheduler.block_size
        # the hand-off's stamps, and the time ``expire`` goes by (the planner's simulation gives its own)
        self.clock = clock

    def reserve(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        headroom_tokens: int = 0,
        prefix_cache: bool = False,
        context_tokens: int | None = None,
    ) -> list[int] | None:
        """Reserve blocks for a request whose KV arrives from elsewhere; None if they are not free now or the engine
        is ``at_seq_limit``. It then waits (WAITING_FOR_REMOTE_KV) for its KV and ``tokens_in``.

        The reservation (``engine.blocks.reserved_blocks``, as the router plans) covers the context, the next token
        and ``headroom_tokens``, so decoding needs no block for that long. ``context_tokens`` (a running request moved
        here): its prompt and the tokens generated so far but the last (its ``headroom_tokens`` hold those it makes
        until its source stops it); its KV fills a leading run of its blocks, as many as its context has then. ``prefix_cache`` (a prompt only): leading full prompt blocks
        held here are shared (``num_cached_tokens``), never the whole prompt, and only later blocks are expected; off
        by default, for callers that send every block (the tests)."""
        engine = self.engine
        request = engine.new_request(prompt, params, request_id, False)
        prompt_len, max_tokens = request.num_prompt_tokens, request.params.max_tokens
        context = prompt_len if context_tokens is None else context_tokens
        if context_tokens is not None and not 0 <= context - prompt_len < max_tokens - 1:  # one token to go, at least
            raise ValueError(f"context_tokens {context_tokens} is no running request's: {prompt_len} prompt tokens")
        if engine.at_seq_limit():
            return None
        generated_before = context - prompt_len  # a moved request's tokens before its last one (its KV is here)
        num_tokens = reserved_tokens(context, max_tokens - generated_before, headroom_tokens, engine.max_model_len)
        # prompt logprobs: prefill_here must compute the whole prompt (the prefill worker exports every block anyway)
        use_cache = prefix_cache and context_tokens is None and request.params.prompt_logprobs is None
        request.kv_import = KVImport(expected_s=self.clock(), moved=context_tokens is not None)
        if not self.scheduler.reserve_remote(request, num_tokens, use_cache):
            return None
        engine.save_evicted()
        engine.requests[request.request_id] = request
        return list(request.block_ids)

    def expected_blocks(self, request: Request) -> list[int]:
        """The physical blocks a reservation's imported KV goes into: its prompt's, after those shared from the
        prefix cache; a moved request's: any of its own, from the first (the sender fills a leading run)."""
        if _import(request).moved:
            return list(request.block_ids)
        first = request.num_cached_tokens // self.block_size
        return request.block_ids[first : blocks_for_tokens(request.num_prompt_tokens, self.block_size)]

    def prefill_here(self, request_id: str) -> None:
        """Compute a reservation's prompt here instead of importing it (conditional disaggregation: the router sends
        short uncached parts to no prefill worker): an ordinary running request on its reserved blocks from now on.
        KeyError for an unknown request, ValueError unless it is an untouched prompt reservation."""
        request, handoff = self._waiting(request_id)
        if handoff.state is not ImportState.RESERVED or handoff.moved:
            raise ValueError(f"request {request_id!r} is already taking its KV from another worker")
        self.scheduler.prefill_here(request)

    def tokens_in(self, request_id: str, tokens: list[int]) -> None:
        """The tokens the source made reached this worker (their text is sent): a prefill worker's first token, or
        every token a moved request generated. They are appended at admission. KeyError for an unknown request;
        ValueError if it is not waiting for them, or they are out of range, or more than its KV can hold."""
        request, handoff = self._waiting(request_id)
        if not handoff.state.awaits_tokens:
            raise ValueError(f"request {request_id!r} already has its tokens")
        vocab = self.engine.vocab_size
        if not tokens or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
            raise ValueError(f"tokens must be a non-empty list of integers in [0, {vocab})")
        if not handoff.moved and len(tokens) != 1:
            raise ValueError(f"a prompt's hand-off brings its first token only, got {len(tokens)}")
        ends = (
            len(tokens) >= request.params.max_tokens
            or request.num_prompt_tokens + len(tokens) >= self.engine.length_limit
        )
        if len(tokens) > 1 and ends:  # a running request's source would have ended it there
            raise ValueError(f"request {request_id!r} would end here after its generated tokens (length)")
        context = request.num_prompt_tokens + len(tokens) - 1
        if handoff.state.awaits_kv and blocks_for_tokens(context, self.block_size) > len(request.block_ids):
            raise ValueError(f"the KV of {context} tokens does not fit request {request_id!r}'s reserved blocks")
        handoff.tokens, handoff.tokens_in_s = list(tokens), self.clock()
        if handoff.state is ImportState.KV_IN:
            self._join(request, handoff)
        else:
            handoff.state = ImportState.RECOMPUTE if handoff.state is ImportState.KV_FAILED else ImportState.TOKENS_IN
        self.scheduler.import_progress(request)

    def write(
        self,
        request_id: str,
        layer: int,
        block_ids: list[int],
        k: torch.Tensor,
        v: torch.Tensor,
        heads: tuple[int, int] | None = None,
    ) -> None:
        """Write one layer of a request's imported KV (the KV receiver's sink; the transfer id is the request id;
        ``heads``: some of this rank's heads only, one tensor-parallel sender's share). Raises, writing nothing, unless
        the request waits for its KV and ``block_ids`` are among its expected blocks, so a late or stray piece never
        lands in another request's blocks nor in shared prefix-cached ones."""
        request, handoff = self._waiting(request_id)
        if not handoff.state.awaits_kv:
            raise ValueError(f"the KV transfer of request {request_id!r} has already ended")
        if not set(block_ids) <= set(self.expected_blocks(request)):
            raise ValueError(f"blocks {block_ids} are not reserved for the KV of request {request_id!r}")
        self.kv_cache.write_blocks(layer, block_ids, k, v, heads)

    def kv_done(self, request_id: str, num_blocks: int | None = None) -> bool:
        """Every layer of the request's KV is in (``num_blocks``: how many blocks the sender filled, for a moved
        request; all expected by default). False if the request is gone (aborted or expired: its blocks are free);
        ValueError if its transfer had already ended."""
        if request_id not in self.engine.requests:
            return False
        request, handoff = self._waiting(request_id)
        if not handoff.state.awaits_kv:
            raise ValueError(f"the KV transfer of request {request_id!r} has already ended")
        handoff.kv_done_s = self.clock()
        handoff.kv_blocks = len(self.expected_blocks(request)) if num_blocks is None else num_blocks
        if handoff.state is ImportState.TOKENS_IN:
            self._join(request, handoff)
        else:
            handoff.state = ImportState.KV_IN
        self.scheduler.import_progress(request)
        return True

    def kv_failed(self, request_id: str, recompute: bool) -> bool:
        """The request's KV transfer failed; its reserved (partly written) blocks are freed now. ``recompute=False``:
        it ends with ABORT and no output (the caller knows the cause and reports it). ``recompute=True``: once its
        tokens are in, it is computed here (``num_recomputes``) and decodes on. False if the request is gone;
        ValueError if its transfer had already ended."""
        if request_id not in self.engine.requests:
            return False
        request, handoff = self._waiting(request_id)
        if not handoff.state.awaits_kv:
            raise ValueError(f"the KV transfer of request {request_id!r} has already ended")
        if not recompute:
            handoff.kv_failed_s = self.clock()
            self.engine.finish_request(request, FinishReason.ABORT)
            return True
        self._recompute(request, handoff)
        self.scheduler.import_progress(request)
        return True

    def expire(self, max_wait_s: float) -> list[str]:
        """End, with ABORT and no output, the reservations whose tokens have not come ``max_wait_s`` after they were
        made (the router lost them or died); returns their ids, for the caller to report."""
        now = self.clock()
        expired = [
            request
            for request in self.engine.requests.values()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KV
            and (handoff := request.kv_import) is not None
            and handoff.state.awaits_tokens
            and now - handoff.expected_s > max_wait_s
        ]
        for request in expired:
            self.engine.finish_request(request, FinishReason.ABORT)
        return [request.request_id for request in expired]

    def tier_load_done(self, request: Request, load: TierLoad, loaded: int) -> None:
        """A reservation's prefix came back from a KV tier (``loaded`` of its pages; the rest is computed here)."""
        handoff = _import(request)
        if loaded < len(load.block_ids):  # some pages went or failed their check: that part is computed here
            handoff.valid_prompt_tokens = (load.first_block + loaded) * self.block_size
        request.num_loading_blocks = 0
        self.scheduler.import_progress(request)

    def _join(self, request: Request, handoff: KVImport) -> None:
        """KV and tokens in: READY, unless the KV that came does not cover the context the tokens make."""
        needed = blocks_for_tokens(handoff.context_tokens(request.num_prompt_tokens), self.block_size)
        if handoff.moved and handoff.kv_blocks < needed:  # computed here instead of attending what never came
            self._recompute(request, handoff)
        else:
            handoff.state = ImportState.READY

    def _recompute(self, request: Request, handoff: KVImport) -> None:
        handoff.kv_failed_s = self.clock()
        self.engine.free_blocks(request)  # the computation here allocates afresh (prefix cache included)
        handoff.state = ImportState.RECOMPUTE if handoff.tokens else ImportState.KV_FAILED

    def _waiting(self, request_id: str) -> tuple[Request, KVImport]:
        """A reservation still waiting for its KV or tokens; KeyError, or ValueError naming what it is instead."""
        request = self.engine.requests.get(request_id)
        if request is None:
            raise KeyError(f"request {request_id!r} has no reservation here")
        if request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request_id!r} is {request.status.name}, expected WAITING_FOR_REMOTE_KV")
        return request, _import(request)


def _import(request: Request) -> KVImport:
    handoff = request.kv_import
    if handoff is None:
        raise ValueError(f"request {request.request_id!r} imports no KV")
    return handoff
