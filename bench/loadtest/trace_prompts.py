"""Prompts for a trace's rows that share exactly what the rows share: a hash id always becomes the same tokens.

Positions count the prompt as the server sees it (``PromptBuilder.ids``: templated for chat, a BOS included). A row
with hash ids ``h_0 .. h_{k-1}`` and (scaled) block size ``B`` spans blocks ``[jB, (j+1)B)``. The template's head
takes the first positions and its tail the last; every other position ``p`` holds token ``p mod B`` of the block of
``h_{p // B}``: ``B`` tokens drawn by a generator seeded with the run's seed and the hash id from the builder's clean
tokens (whole words that concatenate to exactly their ids). So two rows whose first ``m`` hash ids agree agree on
their first ``m * B`` tokens, template included. A row keeps its scaled length, lengthened only where the template's
tail would reach back into a block a longer row may share (to ``(k - 1) B + len(tail)``) or the row would hold no
text; positions past its last block (a template head longer than its blocks) get tokens of its own. Every prompt
is tokenized again and must give the ids it was built from. Rows without hash ids (Azure, BurstGPT) get unshared
prompts of their length (``PromptBuilder.build``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from bench.loadtest.client import RequestSpec
from bench.loadtest.traces import Trace, TraceRow
from bench.loadtest.workloads import PromptBuilder

_BLOCK, _OWN = 0, 1  # the generators' namespaces: a hash id's block, a row's own tokens


@dataclass(frozen=True, slots=True)
class Frame:
    """The request's tokens around the user text: the chat template's head and tail (completions: a BOS, if any)."""

    head: tuple[int, ...]
    tail: tuple[int, ...]


def frame_of(builder: PromptBuilder) -> Frame:
    """The template around one clean token, checked to leave that token as it is."""
    empty = builder.ids("")
    probe = int(builder.vocab[0])
    full = builder.ids(builder.tokenizer.decode([probe]))
    head = next((i for i, (a, b) in enumerate(zip(empty, full)) if a != b), len(empty))
    frame = Frame(tuple(empty[:head]), tuple(empty[head:]))
    if full != [*frame.head, probe, *frame.tail]:
        raise ValueError(
            "the tokenizer's template changes the user text's tokens (it trims or joins them), so prompts cannot "
            "share exactly the trace's blocks: try --endpoint-type completions"
        )
    return frame


class TracePrompts:
    def __init__(self, builder: PromptBuilder, block_tokens: int | None, seed: int) -> None:
        self.builder = builder
        self.block_tokens = block_tokens
        self.seed = seed % 2**63
        self.frame = frame_of(builder)
        self._blocks: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        """The ``block_tokens`` token ids of a hash id: the same for the same seed, whichever row asks."""
        if hash_id not in self._blocks:
            assert self.block_tokens is not None
            rng = np.random.default_rng([self.seed, _BLOCK, hash_id % 2**64])
            self._blocks[hash_id] = rng.choice(self.builder.vocab, size=self.block_tokens)
        return self._blocks[hash_id]

    def sent_length(self, row: TraceRow) -> int:
        """The row's prompt tokens as sent: its scaled length, or longer where the template forces it."""
        head, tail = len(self.frame.head), len(self.frame.tail)
        if row.hash_ids is None or self.block_tokens is None:
            return max(row.input_tokens, head + tail + 1)
        blocks = len(row.hash_ids)
        return max(row.input_tokens, (blocks - 1) * self.block_tokens + tail, head + tail + 1)

    def text_ids(self, row: TraceRow, length: int) -> list[int]:
        """The user text's token ids of a row with hash ids, sent at ``length`` tokens."""
        assert row.hash_ids is not None and self.block_tokens is not None
        start, end = len(self.frame.head), length - len(self.frame.tail)
        spanned = len(row.hash_ids) * self.block_tokens
        ids = np.concatenate([self.block(h) for h in row.hash_ids])[start:end].tolist()
        own = end - max(start, spanned)
        if own > 0:
            rng = np.random.default_rng([self.seed, _OWN, row.line])
            ids += rng.choice(self.builder.vocab, size=own).tolist()
        return ids

    def spec(self, index: int, row: TraceRow, path: str) -> RequestSpec:
        """The request for ``row``, its prompt exactly ``sent_length(row)`` tokens as the server counts them."""
        length = self.sent_length(row)
        if row.hash_ids is None or self.block_tokens is None:
            text = self.builder.build(length)
        else:
            ids = self.text_ids(row, length)
            text = self.builder.tokenizer.decode(ids)
            if self.builder.ids(text) != [*self.frame.head, *ids, *self.frame.tail]:
                raise ValueError(
                    f"{path}:{row.line}: the prompt built from this row's hash ids tokenizes to other ids than it was "
                    "built from (the tokenizer joins tokens across blocks), so its shared prefix would not be exact"
                )
        return RequestSpec(index, text, row.output_tokens, length, trace_line=row.line)


def trace_requests(trace: Trace, builder: PromptBuilder, seed: int) -> tuple[list[RequestSpec], Trace, int]:
    """One request per row, in order; the trace as sent (rows at their sent lengths; a row the template lengthens
    past the context is counted over it and left out); and how many rows were lengthened."""
    prompts = TracePrompts(builder, trace.block_tokens, seed)
    cap = trace.fit.max_context_tokens
    rows: list[TraceRow] = []
    specs: list[RequestSpec] = []
    lengthened = over = 0
    for row in trace.rows:
        length = prompts.sent_length(row)
        if cap is not None and length + row.output_tokens > cap:
            over += 1
            continue
        lengthened += length != row.input_tokens
        sent = replace(row, input_tokens=length)
        specs.append(prompts.spec(len(specs), sent, trace.path))
        rows.append(sent)
    counts = trace.counts | {"over_context": trace.counts.get("over_context", 0) + over}
    return specs, replace(trace, rows=rows, counts=counts), lengthened
