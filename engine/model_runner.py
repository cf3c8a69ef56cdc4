"""Turns a scheduled step into one forward pass and the logits that need sampling.

Every ``ScheduledChunk`` of the step (prefill chunks, continued chunks of a long prompt, single decode tokens) packs
into one ragged row, with positions, cache slots and context lengths in an ``AttentionBatch``. Only the last token of
a chunk that reaches its request's end goes through the lm_head, except for prompt logprobs: ``score_prompts``
projects every position of such chunks, in slices, from the hidden states the last forward kept.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from engine.attention import (
    AttentionBackend,
    AttentionBatch,
    DecodeGroup,
    LatentCache,
    LayerHook,
    PrefillSeq,
    SdpaBackend,
)
from engine.attention.latent import cache_kwarg, is_latent_model
from engine.attention.metadata import DecodeSpans, MetadataPacker, build_layout, slot_list
from engine.attention.metadata import layout_spans as layout_spans_for
from engine.blocks import blocks_for_tokens
from engine.host_values import long_tensor
from engine.kv_cache import KVCache
from engine.model_head import ModelHead
from engine.sampler import PromptScores, logprob_summary
from engine.scheduler import ScheduledChunk
from engine.tensor_parallel import ExportSpan, HeadSplit, StepChannel, StepKind, StepMessage, TPGroup

PROMPT_SCORE_ROWS = 256  # positions projected to the vocabulary at a time: bounds the [rows, vocab] float32 logits


@dataclass(slots=True)
class StepStats:
    num_tokens: int
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    duration_s: float


class StaticDecode(Protocol):
    """A faster way to run some decode-only steps, given to the runner (``engine.decode_graphs.DecodeGraphs``: CUDA
    graphs, or a compiled step on the CPU); its counters go into the worker's stats."""

    steps: Counter[tuple[int, int]]  # static steps run per (batch, context blocks) key
    compile_s: dict[int, float]  # batch size -> seconds its compile took

    def can_run(self, chunks: list[ScheduledChunk]) -> bool: ...

    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, StepStats]: ...


class EngineRunner(Protocol):
    """What ``LLMEngine`` drives each step: a ``ModelRunner``, or a stand-in whose forward costs nothing (the
    planner's simulated workers, planner/sim_engine.py). ``layer_hook`` runs after each layer's KV write (the KV
    connector's streamed export); ``exports`` are the blocks it reads, for the other ranks."""

    kv_cache: KVCache
    layer_hook: LayerHook | None
    exports: list[ExportSpan]
    head_split: HeadSplit | None
    step_channel: StepChannel | None
    decode_graphs: StaticDecode | None

    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, StepStats]: ...

    def score_prompts(self, chunks: list[ScheduledChunk]) -> list[PromptScores]: ...


class ModelRunner:
    def __init__(self, model: PreTrainedModel, kv_cache: KVCache, backend: AttentionBackend | None = None) -> None:
        self.model = model
        self.decoder = getattr(model, model.base_model_prefix)
        self.lm_head = model.get_output_embeddings()
        self.head = ModelHead(model)  # the model's own forward after the decoder: lm_head and its logit transforms
        self.plain_head = False  # the model's logits are its lm_head's alone: called directly (engine_parts sets it)
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.device = next(model.parameters()).device
        self.layer_hook: LayerHook | None = None
        self.backend: AttentionBackend = backend or SdpaBackend()  # engine.attention.select_backend picks it
        self.decode_graphs: StaticDecode | None = None  # decode-only steps on CUDA graphs (engine.decode_graphs)
        # tensor parallelism: rank 0 announces each step to the other ranks, which project nothing to the vocabulary
        self.step_channel: StepChannel | None = None
        self.tp_group: TPGroup | None = None  # every rank: the group whose collectives a step ends by waiting for
        self.projects_logits = True
        self.head_split: HeadSplit | None = None  # the KV heads this rank's cache holds (build_engine_parts)
        self.exports: list[ExportSpan] = []  # rank 0: the blocks whose KV the step's layer hook exports
        self.final_logit_softcap: float | None = None  # the model's (engine.model_probe.ModelAttention)
        self.sliding_windows: frozenset[int] = frozenset()  # the windows of the model's sliding-window layers
        # latent attention (engine.attention.latent): the decoder's cache argument, given a LatentCache each step
        self.latent_cache_kwarg: str | None = cache_kwarg(self.decoder) if is_latent_model(model) else None
        # the last forward's hidden states [tokens, hidden] and chunk start rows, kept for prompt logprobs only
        self._kept_hidden: tuple[torch.Tensor, list[int]] | None = None
        self._gather_storage = torch.empty(0, dtype=kv_cache.spec.dtype, device=self.device)
        self._gather_limit: tuple[int, int, int] | None = None  # (blocks, max_num_seqs, max_model_len): limit_scratch
        spec = kv_cache.spec
        self._block_elems = spec.block_size * spec.num_kv_heads * spec.head_dim  # one block of one layer's K (or V)

    @property
    def verifies_in_decode_group(self) -> bool:
        """Whether a verified request's last token and proposal attend as one decode row of several queries rather
        than as a prefill chunk of its own: the gather + SDPA backend's grouped decode takes them, latent attention
        does not."""
        return isinstance(self.backend, SdpaBackend) and self.latent_cache_kwarg is None

    def scratch_bytes_bound(self, max_num_seqs: int, max_model_len: int) -> int:
        """The most device memory this runner keeps between steps, counted in the KV budget (``engine.memory``): the
        backend's workspace, plus a gather buffer of ``max_num_seqs`` rows of ``max_model_len`` if it gathers."""
        workspace = self.backend.workspace_bytes()
        if not self.backend.needs_groups:
            return workspace
        blocks = max_num_seqs * blocks_for_tokens(max_model_len, self.block_size)
        return workspace + 2 * blocks * self._block_elems * self.kv_cache.spec.dtype.itemsize

    def limit_scratch(self, max_num_seqs: int, max_model_len: int) -> int:
        """Cap the gather buffer at ``scratch_bytes_bound``; returns that bound."""
        blocks = max_num_seqs * blocks_for_tokens(max_model_len, self.block_size)
        self._gather_limit = (blocks, max_num_seqs, max_model_len)
        return self.scratch_bytes_bound(max_num_seqs, max_model_len)

    @property
    def scratch_bytes(self) -> int:
        """Device memory this runner keeps between steps now."""
        return self._gather_storage.numel() * self._gather_storage.element_size() + self.backend.workspace_bytes()

    def _gather_buffer(self, num_blocks: int) -> torch.Tensor:
        """A [2, num_blocks, *block shape] view of storage kept across steps (grown, never shrunk, never past
        ``limit_scratch``'s bound: a batch over it is an error, not an unbudgeted allocation)."""
        spec = self.kv_cache.spec
        shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        numel = 2 * num_blocks * self._block_elems
        if self._gather_storage.numel() < numel:
            grown = numel * 5 // 4
            if self._gather_limit is not None:
                max_blocks, max_num_seqs, max_model_len = self._gather_limit
                if num_blocks > max_blocks:
                    raise RuntimeError(
                        f"a decode batch needs a gather buffer of {num_blocks} blocks, over the bound of {max_blocks} "
                        f"(max_num_seqs={max_num_seqs} x max_model_len={max_model_len}) that the KV budget counts"
                    )
                grown = min(grown, 2 * max_blocks * self._block_elems)
            self._gather_storage = torch.empty(grown, dtype=spec.dtype, device=self.device)
        return self._gather_storage[:numel].view(shape)

    def build_batch(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, torch.Tensor]:
        """The step's inputs, attention metadata and the rows to project to the vocabulary, every integer moved in
        ONE non-blocking copy (``engine.attention.metadata``)."""
        backend = self.backend
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        packed = MetadataPacker()
        prefill_spans: list[tuple[int, int, int, slice | None]] = []  # q_start, q_len, context_len, context slots
        decode_index: list[int] = []
        decode_chunks: list[ScheduledChunk] = []
        offset = 0
        for chunk in chunks:
            req = chunk.request
            token_ids.extend(chunk.token_ids())
            positions.extend(range(chunk.start, chunk.end))
            slots.extend(slot_list(req.block_ids, chunk.start, chunk.end, bs))
            if (chunk.num_tokens == 1 and chunk.start > 0) or (chunk.proposal and self.verifies_in_decode_group):
                decode_index.append(offset)
                decode_chunks.append(chunk)
            elif backend.needs_groups:
                span = None if chunk.start == 0 else packed.add(slot_list(req.block_ids, 0, chunk.end, bs))
                prefill_spans.append((offset, chunk.num_tokens, chunk.end, span))
            offset += chunk.num_tokens
        ids_span, pos_span, slot_span = packed.add(token_ids), packed.add(positions), packed.add(slots)
        rows_span = packed.add(sample_rows(chunks))
        decode_spans = self._decode_spans(packed, decode_index, decode_chunks, offset) if backend.needs_groups else None
        layout_spans = (
            layout_spans_for(
                packed,
                [c.num_tokens for c in chunks],
                [c.end for c in chunks],
                [c.request.block_ids for c in chunks],
                bs,
            )
            if backend.needs_layout
            else None
        )
        host, device = packed.transfer(self.device)

        batch = AttentionBatch(
            kv_cache=self.kv_cache,
            slot_mapping=device[slot_span],
            prefills=[
                PrefillSeq(q_start, q_len, context_len, None if span is None else device[span])
                for q_start, q_len, context_len, span in prefill_spans
            ],
            decode=None if decode_spans is None else self._decode_group(device, decode_spans),
            layer_hook=self.layer_hook,
            chunks=chunks,
            layout=None if layout_spans is None else build_layout(layout_spans, host, device),
            backend=backend,
        )
        backend.prepare(batch)
        input_ids = device[ids_span].view(1, -1)
        position_ids = device[pos_span].view(1, -1)
        return input_ids, position_ids, batch, device[rows_span]

    def _decode_spans(
        self, packed: MetadataPacker, token_index: list[int], chunks: list[ScheduledChunk], num_tokens: int
    ) -> DecodeSpans | None:
        """The decode rows' metadata: ``token_index`` holds each row's first token in the packed row."""
        if not chunks:
            return None
        context_lens = [c.end for c in chunks]
        max_blocks = max(len(c.request.block_ids) for c in chunks)
        table: list[int] = []
        for chunk in chunks:
            ids = chunk.request.block_ids
            table.extend(ids)
            table.extend([0] * (max_blocks - len(ids)))
        query_len = max(c.num_tokens for c in chunks)
        query_index, query_ends = token_index, context_lens
        if query_len > 1:  # verified proposals: each row's queries, padded with its last one
            query_index, query_ends = [], []
            for first, chunk in zip(token_index, chunks):
                pad = [chunk.num_tokens - 1] * (query_len - chunk.num_tokens)
                query_index.extend(first + i for i in [*range(chunk.num_tokens), *pad])
                query_ends.extend(chunk.start + 1 + i for i in [*range(chunk.num_tokens), *pad])
        whole_row = query_len == 1 and len(token_index) == num_tokens  # decode tokens only, in packed-row order
        return DecodeSpans(
            table=packed.add(table),
            rows=len(chunks),
            context_lens=packed.add(context_lens),
            max_context=max(context_lens),
            min_context=min(query_ends),
            equal_lengths=query_len == 1 and min(context_lens) == max(context_lens),  # no mask: SDPA's faster path
            token_index=None if whole_row else packed.add(query_index),
            query_len=query_len,
            query_ends=packed.add(query_ends) if query_len > 1 else None,
        )

    def _decode_group(self, device: torch.Tensor, spans: DecodeSpans) -> DecodeGroup:
        table = device[spans.table].view(spans.rows, -1)
        mask = None
        context_lens = device[spans.context_lens]
        query_ends = None if spans.query_ends is None else device[spans.query_ends].view(spans.rows, -1)
        if not spans.equal_lengths:
            keys = torch.arange(spans.max_context, device=self.device)
            ends = context_lens.unsqueeze(1) if query_ends is None else query_ends  # [B, Q]
            mask = (keys.view(1, 1, -1) < ends.unsqueeze(2)).unsqueeze(1)  # [B, 1, Q, C]
        return DecodeGroup(
            token_index=None if spans.token_index is None else device[spans.token_index],
            block_table=table,
            max_context=spans.max_context,
            gather_buffer=self._gather_buffer(table.numel()),
            mask=mask,
            context_lens=context_lens,
            query_len=spans.query_len,
            query_ends=query_ends,
            window_first_block={
                window: max(0, spans.min_context - window) // self.block_size for window in self.sliding_windows
            },
        )

    def run_decoder(self, input_ids: torch.Tensor, position_ids: torch.Tensor, batch: AttentionBatch) -> Any:
        """The decoder's forward over a step; a latent-attention model also gets the cache its layers hand their
        latents to."""
        extra: dict[str, LatentCache] = {}
        if self.latent_cache_kwarg is not None:
            batch.latent_cache = extra[self.latent_cache_kwarg] = LatentCache()
        return self.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, pd_batch=batch, **extra)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of hidden states, by the model's own head (``engine.model_probe`` checked this); its lm_head
        alone where that is all the head does (the forward around it costs about a millisecond a step)."""
        return self.lm_head(hidden).float() if self.plain_head else self.head(hidden)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, StepStats]:
        """Run one forward; returns float32 logits for the chunks whose ``samples`` is True, ``num_sampled_rows`` of
        each (``[n, vocab]``)."""
        if self.step_channel is not None:  # first: the other ranks run this step as it runs here, static or not
            self.step_channel.send(StepMessage(StepKind.STEP, chunks, self.exports))
        if self.decode_graphs is not None and self.decode_graphs.can_run(chunks):
            self._kept_hidden = None  # can_run refuses steps with prompt-logprob requests
            return self.decode_graphs.execute(chunks)
        started = time.perf_counter()
        input_ids, position_ids, batch, rows = self.build_batch(chunks)
        hidden = self.run_decoder(input_ids, position_ids, batch)
        hidden = hidden.last_hidden_state[0]
        starts, offset = [], 0
        for chunk in chunks:
            starts.append(offset)
            offset += chunk.num_tokens
        wanted = any(chunk.request.wants_prompt_logprobs for chunk in chunks)
        self._kept_hidden = (hidden, starts) if wanted else None
        logits = self.project(hidden[rows]) if self.projects_logits else hidden[:0]
        num_decode = sum(
            chunk.num_tokens for chunk in chunks if chunk.proposal or (chunk.num_tokens == 1 and chunk.start > 0)
        )
        wait_for_compute(self.device, self.tp_group)
        stats = StepStats(
            num_tokens=input_ids.shape[1],
            num_seqs=len(chunks),
            num_prefill_tokens=input_ids.shape[1] - num_decode,
            num_decode_tokens=num_decode,
            duration_s=time.perf_counter() - started,
        )
        return logits, stats

    @torch.inference_mode()
    def score_prompts(self, chunks: list[ScheduledChunk]) -> list[PromptScores]:
        """For each chunk of the last ``execute`` that wants them: the log-softmax of its positions' logits at the
        next prompt token and its top ``prompt_logprobs``, on the device (the sampler brings them to the host)."""
        kept, self._kept_hidden = self._kept_hidden, None
        if kept is None:
            return []
        hidden, starts = kept
        scores: list[PromptScores] = []
        for chunk, start in zip(chunks, starts):
            positions = chunk.prompt_score_positions
            if not positions:
                continue
            request = chunk.request
            k = request.params.prompt_logprobs or 0
            targets = long_tensor(request.prompt_token_ids[positions.start + 1 : positions.stop + 1], self.device)
            first_row = start + positions.start - chunk.start
            parts = []
            for lo in range(0, len(positions), PROMPT_SCORE_ROWS):
                hi = min(lo + PROMPT_SCORE_ROWS, len(positions))
                logits = self.project(hidden[first_row + lo : first_row + hi])
                parts.append(logprob_summary(torch.log_softmax(logits, dim=-1), targets[lo:hi], k))
            chosen, values, ids = (torch.cat(column) for column in zip(*parts))
            scores.append(PromptScores(request, positions.start + 1, chosen, values, ids))
        return scores


def wait_for_compute(device: torch.device, group: TPGroup | None = None) -> None:
    """The end of a step on CUDA: this thread's current stream is done. Only that stream: a device-wide synchronize
    would also wait for NCCL receives and the transfer side streams, so a dead transfer peer would stall every step.
    With a tensor-parallel ``group`` whose collectives are on NCCL, the wait is bounded by the group's timeout."""
    if device.type != "cuda":
        return
    if group is not None and group.device_backend == "nccl":
        group.wait_device()
    else:
        torch.cuda.current_stream(device).synchronize()


def sample_rows(chunks: list[ScheduledChunk]) -> list[int]:
    """The packed rows whose hidden state goes to the lm_head: the last known token of each chunk that samples, and
    its proposed tokens."""
    rows: list[int] = []
    offset = 0
    for chunk in chunks:
        offset += chunk.num_tokens
        rows.extend(range(offset - chunk.num_sampled_rows, offset))
    return rows
