"""ZeroMQ socket setup shared by the zmq and nccl backends: every socket is bounded in time and memory.

Why: a send to a dead peer must fail, not block forever (SGLang #16903), and a closed socket must not
keep the process alive (linger 0). All sends and receives in transfer/ are additionally NOBLOCK, so the
timeouts below are a second line of defence.
"""

from __future__ import annotations

import zmq

from transfer.config import TransferConfig


def configure(sock: zmq.Socket, cfg: TransferConfig, max_msg_bytes: int | None = None) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, cfg.socket_timeout_ms)
    sock.setsockopt(zmq.RCVTIMEO, cfg.socket_timeout_ms)
    sock.setsockopt(zmq.SNDHWM, cfg.hwm)
    sock.setsockopt(zmq.RCVHWM, cfg.hwm)
    if max_msg_bytes is not None:
        # Transport-level guard: a peer that sends a larger frame is disconnected before it is buffered.
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    return sock


def bind_address(address: str) -> str:
    """Accept "tcp://host:0" for "any free port" (ZeroMQ spells it "*")."""
    if address.startswith("tcp://") and address.endswith(":0"):
        return address[:-2] + ":*"
    if not address.startswith(("tcp://", "ipc://")):
        raise ValueError(f"zmq address must be tcp:// or ipc://, not {address!r}")
    return address
