"""The sender's queue of messages waiting to leave for one receiver (`Outbox`), byte-counted.

Commands wait in outboxes for the handshake, ZeroMQ's high-water mark or a stalled receiver, so every outbox counts
its bytes (payload, or `HEADER_COST` for a message without) into the sender's one `Meter`; at
`TransferConfig.max_outbox_bytes` the I/O thread takes no command and `send_layer` fails after `enqueue_timeout_s`.
Single-threaded (the sender's I/O thread); `Meter.nbytes` / `Meter.peak` may be read from any thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from transfer.errors import TransferError
from transfer.wire import Header, PieceHeader

HEADER_COST = 512  # what a message without payload counts against the bound (its header, roughly)


@dataclass(slots=True)
class Outgoing:
    """One queued message: header fields (session added at send time) plus payload tensors."""

    transfer_id: str
    message: Header  # a PieceHeader (its tensors follow) or a control message
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    ready: Any = None  # NCCL: the torch.cuda.Event recorded on the compute stream when the tensors were handed over

    @property
    def piece(self) -> PieceHeader | None:
        return self.message if isinstance(self.message, PieceHeader) else None

    @property
    def cost(self) -> int:
        return self.nbytes + HEADER_COST


class Meter:
    """Bytes queued in all outboxes of one sender, and the most there ever were."""

    __slots__ = ("nbytes", "peak")

    def __init__(self) -> None:
        self.nbytes = 0
        self.peak = 0

    def add(self, n: int) -> None:
        self.nbytes += n
        self.peak = max(self.peak, self.nbytes)


class Outbox:
    """One peer's messages in send order, counted into the sender's meter."""

    def __init__(self, meter: Meter) -> None:
        self._q: deque[Outgoing] = deque()
        self._meter = meter
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Outgoing]:
        return iter(self._q)

    def append(self, out: Outgoing) -> None:
        self._q.append(out)
        self._count(out.cost)

    def peek(self) -> Outgoing:
        return self._q[0]

    def popleft(self) -> Outgoing:
        out = self._q.popleft()
        self._count(-out.cost)
        return out

    def discard(self, drop: Callable[[Outgoing], bool]) -> int:
        """Remove every message for which drop(message) is true; returns how many."""
        keep = deque(o for o in self._q if not drop(o))
        gone = len(self._q) - len(keep)
        if gone:
            self._count(sum(o.cost for o in keep) - self.nbytes)
            self._q = keep
        return gone

    def clear(self) -> None:
        self._q.clear()
        self._count(-self.nbytes)

    def _count(self, n: int) -> None:
        self.nbytes += n
        self._meter.add(n)


def discard_rest(sock: zmq.Socket, limit: int = 1 << 16) -> None:
    """Drop the remaining frames of a multipart message we will not use (frame by frame, nothing kept)."""
    for _ in range(limit):
        if not sock.getsockopt(zmq.RCVMORE):
            return
        sock.recv(zmq.NOBLOCK, copy=False)


class PieceRefused(Exception):
    """Internal: a piece that cannot go to this peer (larger than its frame bound, or its blocks not reserved in the
    receiver's cache now); fails that transfer only."""

    def __init__(self, error: TransferError) -> None:
        super().__init__(str(error))
        self.error = error
