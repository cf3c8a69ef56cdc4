"""The one interface every KV transfer backend implements, and the registry that makes a sender or receiver by name.

Prefill worker (producer):                       Decode worker (consumer):
    s = make_sender("zmq", fp, cfg)                  r = make_receiver("zmq", fp, sink, "tcp://0.0.0.0:0", cfg)
    s.begin(tid, r_address)                          r.expect(tid, dst_block_ids)      # before prefill runs
    s.send_layer(tid, layer, dst_ids, k, v)  x L     ... each step: for ev in r.poll(): admit or free
    s.finish(tid)
    ... each step: for ev in s.poll(): free src blocks of ev.transfer_id (DONE = acked, FAILED = lost)
Either side may `abort(tid)`; the outcome still comes out of that side's `poll()` exactly once, so each
worker has a single cleanup path.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from transfer.config import TransferConfig
from transfer.inbound import InboundTable, Sink
from transfer.kv_segment import KVSegment
from transfer.state import LeaseTable, TransferEvent
from transfer.wire import ModelFingerprint


def check_layer_args(
    fp: ModelFingerprint,
    layer: int,
    dst_block_ids: Sequence[int],
    k: torch.Tensor,
    v: torch.Tensor,
    heads: tuple[int, int] | None = None,
) -> None:
    """Caller-side validation: a wrong shape here is a programming error, not a transfer failure."""
    num_heads = fp.num_kv_heads if heads is None else heads[1]
    if heads is not None and not (num_heads > 0 and 0 <= heads[0] and heads[0] + num_heads <= fp.num_kv_heads):
        raise ValueError(f"heads {heads} are not within the receiver's {fp.num_kv_heads}")
    want = (len(dst_block_ids), fp.block_size, num_heads, fp.head_dim)
    if not 0 <= layer < fp.num_layers:
        raise ValueError(f"layer {layer} out of range [0, {fp.num_layers})")
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != want or t.dtype != fp.torch_dtype:
            raise ValueError(f"{name} is {t.dtype}{list(t.shape)}, expected {fp.torch_dtype}{list(want)}")


class KVSender(ABC):
    """Producer side: streams layer pieces of transfers to receivers, holds a lease per transfer."""

    _leases: LeaseTable  # every backend's leases and the events they end in

    @abstractmethod
    def begin(self, transfer_id: str, peer: str) -> None:
        """Start a transfer to the receiver at `peer` (its `address`); starts the lease."""

    @abstractmethod
    def send_layer(
        self,
        transfer_id: str,
        layer: int,
        dst_block_ids: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        heads: tuple[int, int] | None = None,
    ) -> bool:
        """Queue K/V [n, block_size, kv_heads, head_dim] of one layer for the receiver's blocks
        `dst_block_ids` (``heads``: of the receiver's heads [first, first + count) only, as the transfer expects).
        The sender keeps a reference: do not modify k/v afterwards (hand a gathered copy). Returns False (and drops
        the piece) if the transfer already failed or the queue stayed full."""

    @abstractmethod
    def finish(self, transfer_id: str) -> None:
        """No more pieces for this transfer: lets the receiver fail fast if some never arrived."""

    @abstractmethod
    def abort(self, transfer_id: str, reason: str = "aborted by sender") -> None:
        """Drop queued pieces, tell the receiver, release the lease (reported by poll() as FAILED)."""

    @abstractmethod
    def poll(self) -> list[TransferEvent]:
        """Non-blocking: leases that ended since the last call (DONE = acked, FAILED = free anyway)."""

    def active_transfers(self) -> list[str]:
        """Transfer ids whose source blocks are still leased."""
        return self._leases.ids()

    def paths(self) -> dict[str, str]:
        """The payload path to each receiver this sender has a session with (address -> ``inline``: frames in the
        ZeroMQ message, over TCP or IPC as the address says; ``shm-ring``: a shared-memory ring on this node;
        ``pair``: a torch.distributed pair), for ``/status``."""
        return {}

    def io_problem(self) -> str:
        """Why this sender can no longer move KV ("" while it can): an I/O thread of its own died. The prefill
        worker reports it as its reason to be degraded (no new work; restarted under Ray)."""
        return ""

    @abstractmethod
    def close(self) -> None:
        """Stop I/O; outstanding leases are released as FAILED (visible to a final poll())."""


class KVReceiver(ABC):
    """Consumer side: accepts pieces for announced transfers into a sink, polled without blocking."""

    address: str
    dropped: int = 0  # messages refused before they could be attributed to a transfer (backends that count them)
    rejected: int = 0  # of which unauthenticated: bad or missing MAC, replayed, or too many frames
    _table: InboundTable  # every backend's expected transfers, checks and events

    @property
    def handshake_refused(self) -> int:
        """Peers without the cluster's password, dropped in ZeroMQ's handshake (zmq backends; 0 for the others)."""
        return 0

    def expect(
        self,
        transfer_id: str,
        dst_block_ids: Sequence[int],
        *,
        num_layers: int | None = None,
        deadline_s: float | None = None,
        leading_run: bool = False,
        heads: tuple[int, int] | None = None,
    ) -> None:
        """Announce a transfer (state WAITING) before its producer starts sending (``heads``: every piece carries
        these of our heads only, [first, first + count): one tensor-parallel sender's share)."""
        self._table.expect(transfer_id, dst_block_ids, num_layers, deadline_s, leading_run, heads)

    @abstractmethod
    def poll(self, max_messages: int = 256) -> list[TransferEvent]:
        """Non-blocking: process up to max_messages arrivals, renew leases, expire deadlines; return
        transfers that reached DONE (KV complete, admit the request) or FAILED (free its blocks)."""

    @abstractmethod
    def abort(self, transfer_id: str, reason: str = "aborted by receiver") -> None:
        """Fail the transfer now (reported by poll()) and tell its sender to release its lease."""

    def wait(self, timeout_s: float) -> bool:
        """Sleep until something may have arrived (or timeout_s): for an idle decode loop, so that it
        does not spin on poll() and steal the CPU from the transport's I/O threads. Never required."""
        time.sleep(min(timeout_s, 0.001))
        return True

    def pending_transfers(self) -> list[str]:
        """Transfer ids that are expected and not yet DONE or FAILED."""
        return self._table.ids()

    def io_problem(self) -> str:
        """Why this receiver can no longer take KV ("" while it can): an I/O thread of its own died. The decode
        worker reports it as its reason to be degraded."""
        return ""

    @abstractmethod
    def close(self) -> None:
        """Stop I/O; pending transfers are failed (visible to a final poll())."""


# backend -> what its hellos say ("dist": a torch.distributed pair; gloo is the nccl code on CPU tensors); "local" is
# the in-process hand-off. Every socket backend is one Sender and one Receiver, whose payload path per peer (inline,
# shm ring, pair) the handshake picks.
_TRANSPORTS = {"zmq": "zmq", "shm": "shm", "auto": "shm", "nccl": "dist", "gloo": "dist"}
BACKENDS = (*_TRANSPORTS, "local")


def _backend_config(backend: str, config: TransferConfig | None) -> TransferConfig:
    if backend not in BACKENDS:
        raise ValueError(f"unknown transfer backend {backend!r}; choose one of {sorted(BACKENDS)}")
    cfg = config or TransferConfig()
    if backend == "gloo" and cfg.device != "cpu":
        raise ValueError("backend 'gloo' runs on device 'cpu'")
    return cfg


def make_sender(backend: str, fingerprint: ModelFingerprint, config: TransferConfig | None = None) -> KVSender:
    """Create the producer side of `backend` ("zmq", "shm", "auto", "nccl", "gloo" = nccl code on CPU, "local")."""
    cfg = _backend_config(backend, config)
    if backend == "local":
        from transfer.local_backend import LocalSender

        return LocalSender(fingerprint, cfg)
    from transfer.sender import Sender

    return Sender(fingerprint, cfg, _TRANSPORTS[backend])


def make_receiver(
    backend: str,
    fingerprint: ModelFingerprint,
    sink: Sink,
    address: str,
    config: TransferConfig | None = None,
    segment: KVSegment | None = None,
) -> KVReceiver:
    """Create the consumer side bound at `address` (tcp://host:0 picks a free port, ipc://path, shm+ either,
    local://name); the actual address to hand to senders is `receiver.address`. ``segment`` (shm, auto): the cache in
    shared memory that same-node senders write in place (transfer/kv_segment.py)."""
    cfg = _backend_config(backend, config)
    if backend == "local":
        from transfer.local_backend import LocalReceiver

        return LocalReceiver(fingerprint, sink, address, cfg)
    from transfer.receiver import Receiver

    return Receiver(fingerprint, sink, address, cfg, _TRANSPORTS[backend], segment=segment)
