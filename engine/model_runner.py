"""Turns a scheduled step into one forward pass and the logits that need sampling.

A step is a list of ``ScheduledChunk``: for each request, how many of its next tokens to compute. Prefill chunks,
continued chunks of a long prompt and single decode tokens all pack into one ragged row (no padding): their
positions, cache slots and context lengths go to the paged attention in an ``AttentionBatch``. Only the last token of a
chunk that reaches the end of its request is projected to the vocabulary; that saves the lm_head over the whole prompt.
The exception is a request that asked for prompt logprobs: ``score_prompts`` projects every position of its chunks
(from the hidden states the last forward kept for it, in slices, reduced at once to the logprobs it needs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from engine.attention import AttentionBatch, DecodeGroup, LayerHook, PrefillSeq
from engine.kv_cache import KVCache
from engine.request import Request
from engine.sampler import PromptScores, logprob_summary

PROMPT_SCORE_ROWS = 256  # positions projected to the vocabulary at a time: bounds the [rows, vocab] float32 logits


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    start: int  # first position computed in this step (== request.num_computed_tokens when scheduled)
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk computes the request's last known token, so its logits give the next token."""
        return self.end == self.request.num_tokens

    @property
    def prompt_score_positions(self) -> range:
        """Positions of this chunk whose logits score a prompt token (position p scores token p + 1) that the
        request's ``prompt_logprobs`` still lacks; empty unless it wants them."""
        request = self.request
        if not request.wants_prompt_logprobs:
            return range(0)
        have = len(request.prompt_logprobs) if request.prompt_logprobs is not None else 1  # entry 0 is None
        return range(max(self.start, have - 1), min(self.end, request.num_prompt_tokens - 1))


@dataclass(slots=True)
class StepStats:
    num_tokens: int
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    duration_s: float


class ModelRunner:
    def __init__(self, model: PreTrainedModel, kv_cache: KVCache) -> None:
        self.model = model
        self.decoder = getattr(model, model.base_model_prefix)
        self.lm_head = model.get_output_embeddings()
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.device = next(model.parameters()).device
        self.layer_hook: LayerHook | None = None
        # the last forward's hidden states [tokens, hidden] and each chunk's first row, kept only when some chunk
        # wants prompt logprobs (``score_prompts``); dropped by the next forward
        self._kept_hidden: tuple[torch.Tensor, list[int]] | None = None
        self._gather_storage = torch.empty(0, dtype=kv_cache.spec.dtype, device=self.device)

    def _gather_buffer(self, num_blocks: int) -> torch.Tensor:
        """A contiguous [2, num_blocks, *block shape] view of storage kept across steps (grown, never shrunk)."""
        spec = self.kv_cache.spec
        shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        numel = 2 * num_blocks * spec.block_size * spec.num_kv_heads * spec.head_dim
        if self._gather_storage.numel() < numel:
            self._gather_storage = torch.empty(numel * 5 // 4, dtype=spec.dtype, device=self.device)
        return self._gather_storage[:numel].view(shape)

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        positions = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[positions // bs] * bs + positions % bs

    def build_batch(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_mapping: list[torch.Tensor] = []
        prefills: list[PrefillSeq] = []
        decode_index: list[int] = []
        decode_chunks: list[ScheduledChunk] = []
        offset = 0
        for chunk in chunks:
            req = chunk.request
            token_ids.extend(req.token_slice(chunk.start, chunk.end))
            positions.append(torch.arange(chunk.start, chunk.end))
            slot_mapping.append(self._slots(req.block_ids, chunk.start, chunk.end))
            if chunk.num_tokens == 1 and chunk.start > 0:
                decode_index.append(offset)
                decode_chunks.append(chunk)
            else:
                context_slots = None if chunk.start == 0 else self._slots(req.block_ids, 0, chunk.end)
                prefills.append(PrefillSeq(offset, chunk.num_tokens, chunk.end, _to(context_slots, self.device)))
            offset += chunk.num_tokens
        decode = self._decode_group(decode_index, decode_chunks, offset) if decode_chunks else None
        batch = AttentionBatch(
            kv_cache=self.kv_cache,
            slot_mapping=torch.cat(slot_mapping).to(self.device),
            prefills=prefills,
            decode=decode,
            layer_hook=self.layer_hook,
            chunks=chunks,
        )
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        position_ids = torch.cat(positions).unsqueeze(0).to(self.device)
        return input_ids, position_ids, batch

    def _decode_group(self, token_index: list[int], chunks: list[ScheduledChunk], num_tokens: int) -> DecodeGroup:
        context_lens = torch.tensor([c.end for c in chunks], dtype=torch.long)
        max_blocks = max(len(c.request.block_ids) for c in chunks)
        table = torch.zeros(len(chunks), max_blocks, dtype=torch.long)
        for row, chunk in enumerate(chunks):
            table[row, : len(chunk.request.block_ids)] = torch.tensor(chunk.request.block_ids, dtype=torch.long)
        max_context = int(context_lens.max())
        equal_lengths = bool(context_lens.min() == max_context)  # no padding: SDPA's faster unmasked path
        mask = None
        if not equal_lengths:
            mask = (torch.arange(max_context).unsqueeze(0) < context_lens.unsqueeze(1)).view(len(chunks), 1, 1, -1)
        whole_row = len(token_index) == num_tokens  # decode tokens only, so they fill the packed row in order
        return DecodeGroup(
            token_index=None if whole_row else torch.tensor(token_index, dtype=torch.long, device=self.device),
            block_table=table.to(self.device),
            max_context=max_context,
            gather_buffer=self._gather_buffer(table.numel()),
            mask=None if mask is None else mask.to(self.device),
        )

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, StepStats]:
        """Run one forward; returns float32 logits ``[n, vocab]`` for the chunks whose ``samples`` is True."""
        started = time.perf_counter()
        input_ids, position_ids, batch = self.build_batch(chunks)
        hidden = self.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, pd_batch=batch)
        hidden = hidden.last_hidden_state[0]
        rows, starts, offset = [], [], 0
        for chunk in chunks:
            starts.append(offset)
            offset += chunk.num_tokens
            if chunk.samples:
                rows.append(offset - 1)
        wanted = any(chunk.request.wants_prompt_logprobs for chunk in chunks)
        self._kept_hidden = (hidden, starts) if wanted else None
        logits = self.lm_head(hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)]).float()
        num_decode = 0 if batch.decode is None else len(batch.decode.block_table)
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
        """The prompt logprobs the last ``execute`` (of these chunks) makes computable: for each chunk that wants
        them, the log-softmax of its positions' logits at the next prompt token, and its top ``prompt_logprobs``
        (on the device; the sampler brings them to the host with the step's tokens)."""
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
            targets = torch.tensor(
                request.prompt_token_ids[positions.start + 1 : positions.stop + 1], dtype=torch.long, device=self.device
            )
            first_row = start + positions.start - chunk.start
            parts = []
            for lo in range(0, len(positions), PROMPT_SCORE_ROWS):
                hi = min(lo + PROMPT_SCORE_ROWS, len(positions))
                logits = self.lm_head(hidden[first_row + lo : first_row + hi]).float()
                parts.append(logprob_summary(torch.log_softmax(logits, dim=-1), targets[lo:hi], k))
            chosen, values, ids = (torch.cat(column) for column in zip(*parts))
            scores.append(PromptScores(request, positions.start + 1, chosen, values, ids))
        return scores


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)
