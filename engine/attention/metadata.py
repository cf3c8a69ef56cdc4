"""A step's integer metadata, packed on the host and moved to the device in one copy.

A forward needs a dozen small integer tensors (token ids, positions, slots, block tables, context lengths); copied one
by one, each is its own launch and, from pageable memory, its own sync. Here they go into one int64 tensor (pinned on
CUDA, from torch's caching host allocator, so the copy is asynchronous and reused across steps), moved with one
``.to(device, non_blocking=True)`` and handed out as views. On the CPU the move is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.batch import SeqLayout


def slot_list(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions ``[start, end)`` of a request whose KV lives in ``block_ids`` (a range per block)."""
    slots: list[int] = []
    pos = start
    while pos < end:
        block, offset = divmod(pos, block_size)
        stop = min(end, (block + 1) * block_size)
        base = block_ids[block] * block_size + offset
        slots.extend(range(base, base + stop - pos))
        pos = stop
    return slots


class MetadataPacker:
    """Collects int lists, returns their spans; ``transfer`` makes the one host tensor and its device copy."""

    def __init__(self) -> None:
        self._values: list[int] = []

    def add(self, values: list[int]) -> slice:
        start = len(self._values)
        self._values.extend(values)
        return slice(start, len(self._values))

    def transfer(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed values on the host and on ``device`` (the same tensor on the CPU)."""
        if device.type == "cpu":
            host = torch.tensor(self._values, dtype=torch.long)
            return host, host
        host = torch.tensor(self._values, dtype=torch.long, pin_memory=device.type == "cuda")
        return host, host.to(device, non_blocking=True)


@dataclass(slots=True)
class LayoutSpans:
    q_lens: list[int]
    context_lens: list[int]
    max_blocks: int
    query_start_loc: slice
    context: slice
    table: slice


def layout_spans(
    packer: MetadataPacker, q_lens: list[int], context_lens: list[int], block_ids: list[list[int]], block_size: int
) -> LayoutSpans:
    """Add a ``SeqLayout``'s tensors: each block table row holds the blocks its context uses (not those allocated
    ahead), padded with 0 to the longest row."""
    used = [-(-context // block_size) for context in context_lens]
    max_blocks = max(used)
    table: list[int] = []
    for ids, n in zip(block_ids, used):
        table.extend(ids[:n])
        table.extend([0] * (max_blocks - n))
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    return LayoutSpans(
        q_lens, context_lens, max_blocks, packer.add(starts), packer.add(context_lens), packer.add(table)
    )


def build_layout(spans: LayoutSpans, host: torch.Tensor, device: torch.Tensor) -> SeqLayout:
    rows = len(spans.q_lens)
    return SeqLayout(
        q_lens=spans.q_lens,
        context_lens=spans.context_lens,
        query_start_loc=device[spans.query_start_loc],
        seq_context_lens=device[spans.context],
        block_table=device[spans.table].view(rows, spans.max_blocks),
        host_block_table=host[spans.table].view(rows, spans.max_blocks),
    )


@dataclass(slots=True)
class DecodeSpans:
    """Where the decode rows' metadata sits in the packed buffer (the gather + SDPA backend's ``DecodeGroup``)."""

    rows: int
    table: slice  # [rows * max_blocks]
    context_lens: slice  # [rows]
    max_context: int
    min_context: int
    equal_lengths: bool
    token_index: slice | None  # [rows * query_len]; None: the decode rows are the whole packed row, in order
    query_len: int = 1  # queries per row: a verification row has its last token and its proposal (padded)
    query_ends: slice | None = None  # [rows * query_len] keys each query attends, when query_len > 1
