"""A session's payload path: what every path implements, all it may ask of its endpoint, and the record of the
session each end keeps it in (the sender's `Peer`, the receiver's `Session`).

The handshake (transfer/handshake.py) picks one path per session from the welcome's offer. Then:

    sender    I/O thread -> path.send(host, peer, outs): one piece, or several small ones (batch_bytes); raises
              zmq.Again when it cannot leave now; every few ms path.collect() -> (why it broke, failed transfers)
    receiver  poll() admits a header -> path.on_piece(host, sess, piece, frames) -> host.complete(...) / land(...);
              a refused piece -> path.on_bad_piece(...); every poll() -> path.poll(host, sess)

A path sees its endpoint only through `SendHost` / `ReceiveHost` and imports neither transfer/sender.py nor
transfer/receiver.py (tests/transfer/test_structure.py). The paths: inline frames (inline_path.py), the receiver's shm
ring (ring_path.py), a torch.distributed pair (pair_path.py), the receiver's cache itself (direct_path.py).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import zmq

from transfer.auth import seal
from transfer.errors import FrameTooLarge, TransferError
from transfer.outbox import Outbox, Outgoing, PieceRefused
from transfer.wire import Header, Named, PieceHeader, pack_header


class PeerState(enum.Enum):
    CONNECTING = "connecting"  # socket made, hello not sent yet
    HELLO_SENT = "hello_sent"
    READY = "ready"  # welcomed: session key and payload path known


@dataclass(slots=True)
class Peer:
    """The sender's end of a session with one receiver (its I/O thread's)."""

    address: str
    sock: zmq.Socket
    created: float
    outbox: Outbox
    path: SendPath  # inline until the welcome names the session's
    nonce: bytes = b""  # ours, in the hello; the welcome must echo it
    state: PeerState = PeerState.CONNECTING
    session: bytes = b""
    key: bytes = b""  # the session key (transfer/auth.py), known once welcomed
    max_frame_bytes: int = 0
    stuck_since: float | None = None
    last_sent: float = 0.0  # the welcome, then our latest message: a peer idle too long is closed
    seq_out: int = 0  # last sequence number we sealed
    seq_in: int = 0  # last one we accepted from the receiver
    # ZeroMQ's own events of the connection: a handshake the receiver refused (another cluster's password) shows here
    monitor: zmq.Socket | None = None

    def seal(self, header: Header) -> bytes:
        """A header of this session: MAC under the session key, the next sequence number."""
        self.seq_out += 1
        return seal(self.key, self.session, self.seq_out, pack_header(header))

    def check_frame_bound(self, piece: PieceHeader) -> None:
        biggest = max(f.nbytes for f in piece.frames)
        if self.max_frame_bytes and biggest > self.max_frame_bytes:
            raise PieceRefused(
                FrameTooLarge(f"{biggest}-byte frame > receiver {self.address} max_frame_bytes={self.max_frame_bytes}")
            )


@dataclass(slots=True)
class Session:
    """The receiver's end of a session with one sender (the thread that polls)."""

    identity: bytes
    path: ReceivePath
    key: bytes = b""  # the session key both ends derived at the handshake
    token: bytes = b""  # the session token (the key of this entry in the receiver's table)
    seq_in: int = 0  # last sequence number accepted from the sender
    last_seen: float = field(default_factory=time.monotonic)  # the welcome, then the sender's latest message


class SendHost(Protocol):
    """What a sender-side path may ask of the sender whose I/O thread runs it."""

    def fail_transfer(self, peer: Peer, transfer_id: str, error: TransferError) -> None:
        """One piece cannot go: fail its transfer only (an abort tells the receiver)."""

    def count_pieces(self, path: str, pieces: int) -> None:
        """`pieces` left by `path` (its name): `Sender.shm_pieces`, `direct_pieces`."""


class SendPath(Protocol):
    name: str  # as KVSender.paths() names it: inline, shm-ring, shm-direct, cuda-ipc, pair
    device_kv: bool  # takes device tensors as they are (an NCCL pair, a GPU cache); the others get host copies
    batch_piece_bytes: int  # pieces up to this size may share a message (with batch_bytes 0: one piece a message)
    batch_bytes: int  # ... up to this many payload bytes in all
    command_budget: int  # commands the sender's I/O loop takes a turn while a session uses this path

    def send(self, host: SendHost, peer: Peer, outs: Sequence[Outgoing]) -> None:
        """One message: a piece, or several. Raises zmq.Again when it cannot leave now."""

    def collect(self) -> tuple[TransferError | None, list[tuple[str, TransferError]]]:
        """(why the path broke, or None; the transfers whose sends failed since the last call)."""

    def close(self) -> None: ...


class ReceiveHost(Protocol):
    """What a receiver-side path may ask of the receiver whose poll() runs it."""

    def complete(self, piece: PieceHeader, frames: Sequence[Any]) -> None:
        """An admitted piece's payload: lengths and xxh3 checked, then the sink. Raises TransferError."""

    def land(self, piece: PieceHeader) -> None:
        """An admitted piece its sender wrote into the reserved blocks itself (the path checked them)."""

    def arrived(
        self, sess: Session, piece: PieceHeader, tensors: list[torch.Tensor], error: TransferError | None
    ) -> None:
        """A piece whose tensors came after its header (a pair link): complete it, or fail its transfer with
        `error`; the transfer it ends is acked."""

    def drop_session(self, sess: Session, error: TransferError) -> None:
        """The session cannot go on: drop it and fail its transfers."""

    def count_pieces(self, path: str, pieces: int) -> None:
        """`pieces` came by `path` (its name): `Receiver.shm_pieces`, `direct_pieces`."""


class ReceivePath(Protocol):
    def on_piece(self, host: ReceiveHost, sess: Session, piece: PieceHeader, frames: list[Any]) -> None:
        """An admitted piece: its payload is in `frames` (inline), or where the header says (ring, pair, cache)."""

    def on_bad_piece(self, host: ReceiveHost, sess: Session, h: PieceHeader | Named, error: TransferError) -> None:
        """A refused piece: free or drain what it holds."""

    def poll(self, host: ReceiveHost, sess: Session) -> None:
        """Every poll(): payloads that completed off the socket."""

    def alive(self) -> bool:
        """A thread of its own still runs (the receiver keeps a closed path until it ends)."""

    def close(self, join_s: float = 0.0) -> None: ...
