"""The transfer layer's settings: limits and timeouts of one sender or receiver. Imports no torch, so that the cluster
config and the worker spec, which carry it, do not either."""

from __future__ import annotations

from dataclasses import dataclass

WIRE_DTYPES = frozenset({"raw", "int8"})


@dataclass(slots=True)
class TransferConfig:
    """Limits and timeouts of the transfer layer (all seconds unless named otherwise)."""

    deadline_s: float = 30.0  # receiver: expect() -> DONE, else FAILED/TransferTimeout
    lease_s: float = 30.0  # sender: hold source blocks this long without word from the receiver
    connect_timeout_s: float = 5.0  # sender: handshake with a receiver
    send_timeout_s: float = 5.0  # a message that cannot leave for this long fails its peer
    socket_timeout_ms: int = 5000  # SNDTIMEO / RCVTIMEO on every socket
    hwm: int = 64  # SNDHWM / RCVHWM (messages) on every socket
    queue_size: int = 256  # sender: bounded hand-off queue between caller and I/O thread
    enqueue_timeout_s: float = 5.0  # sender: send_layer waits this long for queue room, then fails
    max_frame_bytes: int = 1 << 30  # receiver: refuse larger payload frames (also its zmq.MAXMSGSIZE)
    secret: str | None = None  # the cluster secret: proven, never sent, at the handshake (transfer/auth.py)
    kv_wire_dtype: str = "raw"  # "raw" (bit-exact) or "int8" (per block-and-head scales)
    checksum: bool = True  # xxh3_64 per payload frame
    # shm/auto: a decode worker's CPU cache in shared memory, written in place by same-node senders (both ends must
    # allow it; else a ring); transfer/direct_path.py
    direct_write: bool = True
    group_timeout_s: float = 30.0  # nccl/gloo: forming the pair process group, and each p2p wait
    device: str = "cpu"  # nccl backend: "cuda" selects NCCL, "cpu" selects gloo
    idle_session_s: float = 60.0  # a peer session with no transfer and no message this long is dropped
    # (the sender closes its side after half of it, so it never sends into one)
    max_sessions: int = 1024  # receiver: sender sessions held at once; a hello past it is rejected
    max_outbox_bytes: int = 1 << 30  # sender: payload bytes queued towards receivers; full: stop taking commands
    # pinned host buffers, zmq/shm paths with CUDA KV: the sender's device->host staging, the receiver's host->device
    staging_bytes: int = 256 << 20
    kv_device: str = "cpu"  # receiver: where the KV cache lives; "cuda...": the sink writes on a side stream
    gpu_uuid: str | None = None  # nccl: this worker's GPU (None: read from torch.cuda when device is cuda); the
    # handshake compares both ends' and a pair on one GPU takes the same-node path, as NCCL refuses two ranks on one

    def __post_init__(self) -> None:
        if self.kv_wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"kv_wire_dtype must be one of {sorted(WIRE_DTYPES)}, not {self.kv_wire_dtype!r}")
        for name in (
            "deadline_s",
            "lease_s",
            "connect_timeout_s",
            "send_timeout_s",
            "enqueue_timeout_s",
            "group_timeout_s",
            "idle_session_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("hwm", "queue_size", "max_frame_bytes", "max_sessions", "max_outbox_bytes", "staging_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
