"""Host staging of device KV for the ZeroMQ and shared-memory paths (docs/transfer.md, "Device KV on the zmq and shm
paths"): bounded pools of pinned buffers and side streams, so that the compute stream never waits on a transfer.

Sender (`Stager.stage`, in the caller's thread): an event on the caller's stream; the copy stream waits on it and
copies each CUDA tensor `non_blocking` into a pinned buffer (`PinnedPool`), and the I/O thread waits on the copy's
event (`StagedTensors.wait`, bounded) before it reads the bytes. Receiver (`SideStreamSink`): the sink runs on a side
stream, host pieces go up through pinned buffers, and `fence()` orders the consumer's stream after the writes.
A loan ends when the last view of its buffer is gone (a finaliser), so whoever holds the bytes keeps them. Without
CUDA nothing is pinned and host tensors pass through; the pool works the same on ordinary memory.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from transfer.errors import TransferTimeout

MIN_BUFFER_BYTES = 64 << 10  # buffers are sized in powers of two from here, so a few sizes serve every piece


def _round_up(nbytes: int) -> int:
    size = MIN_BUFFER_BYTES
    while size < nbytes:
        size *= 2
    return size


@dataclass(slots=True)
class _Buffer:
    data: torch.Tensor  # uint8, pinned when the pool pins
    array: Any  # data.numpy(): what each loan views
    in_use: bool = False


class PinnedPool:
    """Bounded, reused host buffers (pinned when `pin`); thread-safe: loans end in whatever thread drops them."""

    def __init__(self, max_bytes: int, *, pin: bool | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be > 0")
        self.max_bytes = max_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin  # pinning needs a CUDA runtime
        self._lock = threading.Lock()
        self._buffers: list[_Buffer] = []
        self.held_bytes = 0  # host memory the pool holds now (free or lent)
        self.allocations = 0  # buffers ever allocated (pinning is slow: reuse keeps this small)
        self.reuses = 0  # loans served by a buffer allocated earlier
        self.fallbacks = 0  # requests refused at the bound (the caller copied without the pool)

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 host tensor of `nbytes` over a pool buffer, lent until every view of it is gone; None at the bound."""
        with self._lock:
            buf = self._take(nbytes)
            if buf is None:
                self.fallbacks += 1
                return None
            buf.in_use = True
        view = buf.array[:nbytes]  # a fresh object per loan: its death ends the loan
        weakref.finalize(view, self._give_back, buf)
        return torch.frombuffer(view, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)

    def _take(self, nbytes: int) -> _Buffer | None:
        free = [b for b in self._buffers if not b.in_use and b.data.numel() >= nbytes]
        if free:
            self.reuses += 1
            return min(free, key=lambda b: b.data.numel())
        size = _round_up(nbytes)
        if size > self.max_bytes:
            return None
        while self.held_bytes + size > self.max_bytes:  # make room: drop idle buffers, largest first
            idle = [b for b in self._buffers if not b.in_use]
            if not idle:
                return None
            victim = max(idle, key=lambda b: b.data.numel())
            self._buffers.remove(victim)
            self.held_bytes -= victim.data.numel()
        data = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        buf = _Buffer(data, data.numpy())
        self._buffers.append(buf)
        self.held_bytes += size
        self.allocations += 1
        return buf

    def _give_back(self, buf: _Buffer) -> None:
        with self._lock:
            buf.in_use = False

    @property
    def lent(self) -> int:
        """Buffers lent out now (0 once every staged piece has been sent or dropped)."""
        with self._lock:
            return sum(b.in_use for b in self._buffers)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "held_bytes": self.held_bytes,
                "buffers": len(self._buffers),
                "lent": sum(b.in_use for b in self._buffers),
                "allocations": self.allocations,
                "reuses": self.reuses,
                "fallbacks": self.fallbacks,
            }


@dataclass(slots=True)
class StagedTensors:
    """Host copies of device tensors, valid once `done` (an event on the copy stream) has completed."""

    host: list[torch.Tensor]
    done: Any = None  # torch.cuda.Event, or None: the host tensors are ready now
    sources: list[torch.Tensor] = field(default_factory=list)  # kept until the copy is known done
    ready: Any = None  # nccl: event recorded on the compute stream at hand-over (the tensors stay on the device)

    def wait(self, timeout_s: float) -> list[torch.Tensor]:
        """Block the calling thread (the sender's I/O thread, never the compute one) until the copy is done."""
        if self.done is not None:
            end = time.monotonic() + timeout_s
            nap = 2e-5
            while not self.done.query():
                if time.monotonic() > end:
                    raise TransferTimeout(f"device->host staging copy not done within {timeout_s}s")
                time.sleep(nap)
                nap = min(2 * nap, 1e-3)
            self.done = None
            self.sources = []
        return self.host


class Stager:
    """Copies device tensors to pooled host buffers on a copy stream, ordered after the caller's stream (see module
    docstring). One per sender; `stage` is called from the thread that hands the tensors over."""

    def __init__(self, max_bytes: int) -> None:
        self.pool = PinnedPool(max_bytes)
        self._streams: dict[int, Any] = {}
        self.staged = 0  # tensors copied through the copy stream

    def stage(self, tensors: Sequence[torch.Tensor], after: Any = None) -> StagedTensors:
        """Host versions of `tensors`. CPU tensors pass through (made contiguous). CUDA ones are copied on the copy
        stream, after `after` (an event) if given, else after the caller's current stream."""
        if not any(t.is_cuda for t in tensors):
            return StagedTensors([t.detach().contiguous() for t in tensors])
        device = next(t.device for t in tensors if t.is_cuda)
        stream = self._stream(device)
        if after is None:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(device))
        host: list[torch.Tensor] = []
        with torch.cuda.stream(stream):
            stream.wait_event(after)
            for t in tensors:
                if not t.is_cuda:
                    host.append(t.detach().contiguous())
                    continue
                src = t.detach().contiguous()  # on the copy stream, after the event: a copy only if strided
                dst = self._host_like(src)
                dst.copy_(src, non_blocking=True)
                src.record_stream(stream)
                host.append(dst)
            done = torch.cuda.Event()
            done.record(stream)
        self.staged += len(tensors)
        return StagedTensors(host, done, list(tensors))

    def _host_like(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        raw = self.pool.acquire(nbytes)
        if raw is None:  # at the bound: pageable memory (the copy still runs on the copy stream)
            return torch.empty(t.shape, dtype=t.dtype)
        return raw.view(t.dtype).view(t.shape)

    def _stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream


class SideStreamSink:
    """The receiver's sink, run on a side stream after what the consumer's stream queued (docs/transfer.md): device
    pieces are ``record_stream``ed there, host ones go up through pinned buffers (from pageable memory past the
    bound: ``fallbacks``); ``fence()``, at DONE, makes the consumer's stream wait on every write so far."""

    def __init__(self, sink: Any, device: str, staging_bytes: int = 256 << 20) -> None:
        self.sink = sink
        self.device = torch.device(device)
        self._stream: Any = None
        self._staging_bytes = staging_bytes
        self.pool: PinnedPool | None = None  # made at the first host piece on CUDA
        self._in_flight: deque[tuple[Any, list[torch.Tensor]]] = deque()  # (copy event, pinned buffers it reads)
        self.writes = 0
        self.uploads = 0  # host tensors copied to the device through pinned buffers
        self.fallbacks = 0  # host tensors copied from pageable memory (the pool at its bound)

    @property
    def active(self) -> bool:
        return self.device.type == "cuda"

    def __call__(
        self,
        tid: str,
        layer: int,
        blocks: list[int],
        k: torch.Tensor,
        v: torch.Tensor,
        heads: tuple[int, int] | None = None,
    ) -> None:
        if not self.active:
            self._write(tid, layer, blocks, k, v, heads)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        self._reclaim()
        # after what the consumer's stream has queued: inputs made there (an nccl receive it waited on), and kernels
        # still reading blocks freed before they were reserved for this transfer
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            pinned: list[torch.Tensor] = []
            k, v = (self._on_device(t, pinned) for t in (k, v))
            if pinned:
                done = torch.cuda.Event()
                done.record(self._stream)
                self._in_flight.append((done, pinned))
            self._write(tid, layer, blocks, k, v, heads)
        self.writes += 1

    def _write(
        self, tid: str, layer: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor, heads: tuple[int, int] | None
    ) -> None:
        if heads is None:  # a sink that takes every head only is called as one
            self.sink(tid, layer, blocks, k, v)
        else:
            self.sink(tid, layer, blocks, k, v, heads)

    def _on_device(self, t: torch.Tensor, pinned: list[torch.Tensor]) -> torch.Tensor:
        """``t`` on the device, under the side stream (the caller's ``with``)."""
        if t.is_cuda:
            t.record_stream(self._stream)
            return t
        if self.pool is None:
            self.pool = PinnedPool(self._staging_bytes)
        raw = self.pool.acquire(t.numel() * t.element_size())
        if raw is None:
            self.fallbacks += 1
            return t.to(self.device)
        host = raw.view(t.dtype).view(t.shape)
        host.copy_(t)  # out of the receive buffer (a ring region the sender reuses once this call returns)
        pinned.append(host)
        self.uploads += 1
        return self._upload(host)

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)  # pinned: the copy is queued, the thread goes on

    def _reclaim(self) -> None:
        """Give back the pinned buffers whose copies are done (the oldest first: the side stream runs in order)."""
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.popleft()

    @property
    def in_flight(self) -> int:
        """Pieces whose pinned host->device copy may still run."""
        self._reclaim()
        return len(self._in_flight)

    def fence(self) -> None:
        if self.active and self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            self._reclaim()
