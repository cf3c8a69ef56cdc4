"""Test helpers: deterministic KV payloads, a dict-backed destination cache (the sink), polling loops.

Shared by the in-process tests and the spawned peer processes in ``transfer_peers.py`` (spawn re-imports this
module by name, so it must stay importable without pytest).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from transfer.errors import ProtocolError
from transfer.kv_segment import DirectPiece, SegmentWriter
from transfer.wire import ModelFingerprint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def fingerprint(
    dtype: str = "bfloat16", layers: int = 4, heads: int = 2, head_dim: int = 8, block_size: int = 4
) -> ModelFingerprint:
    return ModelFingerprint("LlamaForCausalLM", dtype, layers, heads, head_dim, block_size)


def make_kv(
    fp: ModelFingerprint, layer: int, n: int, seed: int, specials: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Source K/V for one layer; with specials, includes inf, -inf, nan and -0.0 so that 'bit-exact'
    means bits (int8 compression has no meaning for non-finite values, so it uses specials=False)."""
    g = torch.Generator().manual_seed(seed * 1000 + layer)
    k, v = (torch.randn((n, *fp.block_shape), generator=g).to(fp.torch_dtype) for _ in range(2))
    if specials:
        flat = k.view(-1)
        flat[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0]).to(fp.torch_dtype)
    return k, v


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.dtype]) if t.dtype in _BITS else t


@dataclass
class Cache:
    """Destination KV store: per layer [num_blocks, block_size, heads, head_dim]; sink() writes it."""

    fp: ModelFingerprint
    num_blocks: int = 32
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)
    writes: int = 0

    def __post_init__(self) -> None:
        shape = (self.num_blocks, *self.fp.block_shape)
        self.k = [torch.zeros(shape, dtype=self.fp.torch_dtype) for _ in range(self.fp.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.fp.torch_dtype) for _ in range(self.fp.num_layers)]

    def sink(self, tid: str, layer: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        idx = torch.tensor(blocks)
        self.k[layer][idx] = k
        self.v[layer][idx] = v
        self.writes += 1

    def assert_holds(self, dst: list[int], seed: int, exact: bool = True, atol: float = 0.0) -> None:
        idx = torch.tensor(dst)
        for layer in range(self.fp.num_layers):
            k, v = make_kv(self.fp, layer, len(dst), seed, specials=exact)
            for got, want in ((self.k[layer][idx], k), (self.v[layer][idx], v)):
                if exact:
                    assert torch.equal(bits(got), bits(want)), f"layer {layer} not bit-exact"
                else:
                    assert torch.allclose(got.float(), want.float(), atol=atol, rtol=0)


def poll_until(pollers: list[Callable[[], list]], done: Callable[[list], bool], timeout_s: float) -> list:
    """Poll every poller (non-blocking) until done(events) or timeout; returns all events."""
    events: list = []
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for p in pollers:
            events.extend(p())
        if done(events):
            return events
        time.sleep(0.001)
    return events


def write_piece(
    writer: SegmentWriter, tid: str, layer: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor, digest: bool
) -> list[int] | None:
    """One piece through a direct writer (``write_all`` of one): its digests, or its ProtocolError raised."""
    (result,) = writer.write_all([DirectPiece(tid, layer, blocks, k, v)], digest)
    if isinstance(result, ProtocolError):
        raise result
    return result
