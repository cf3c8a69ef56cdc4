"""The reference copy every row of ``pdserve bench transfer`` is divided by: bench/transfer_bench.py's backend rows
and bench/ring_ceiling.py's no-protocol ceiling time the same one, rep by rep."""

from __future__ import annotations

import time

import numpy as np
import torch


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Single-threaded memcpy (numpy's, GIL released)."""
    np.copyto(dst.view(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())


class Memcpy:
    """The reference copy of one size: the faster of torch's copy_ (both cores when free) and one single-threaded
    memcpy (torch's parallel copy loses most under load)."""

    def __init__(self, nbytes: int) -> None:
        self.src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)

    def once(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        t1 = time.perf_counter()
        copy_bytes(self.dst, self.src)
        return min(t1 - t0, time.perf_counter() - t1)
