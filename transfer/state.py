"""Per-transfer state on each side: the receiver's state machine and the sender's lease table.

Receiver: WAITING --first piece--> TRANSFERRING --every (layer, block) arrived and checked--> DONE, or FAILED (error,
deadline, abort). Sender: a `Lease` per transfer holds the source blocks until the receiver ACKs (DONE), NACKs or the
lease expires without word (FAILED); the receiver renews it while it waits. Either end reports each outcome once, by
`poll()`: the one place a worker admits or frees a request's blocks.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from transfer.errors import TransferError, TransferTimeout


class TransferState(enum.IntEnum):
    WAITING = 0
    TRANSFERRING = 1
    DONE = 2
    FAILED = 3


@dataclass(slots=True)
class TransferEvent:
    """Terminal outcome of one transfer on one side: free (or admit) its blocks now."""

    transfer_id: str
    state: TransferState
    error: TransferError | None = None
    nbytes: int = 0
    elapsed_s: float = 0.0
    num_blocks: int = 0  # receiver, DONE: the blocks every layer filled (a ``leading_run`` transfer's own count)

    @property
    def ok(self) -> bool:
        return self.state == TransferState.DONE


@dataclass(slots=True)
class Lease:
    transfer_id: str
    peer: str
    started: float
    expires: float
    nbytes: int = 0
    last_keepalive: float = 0.0


class LeaseTable:
    """Thread-safe sender-side leases: the API thread begins them, the I/O thread acks/renews them."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: what leases expire by (a simulation passes its own)."""
        self.lease_s = lease_s
        self.clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._events: deque[TransferEvent] = deque()

    def begin(self, transfer_id: str, peer: str) -> None:
        now = self.clock()
        with self._lock:
            if transfer_id in self._leases:
                raise ValueError(f"transfer {transfer_id!r} already in flight")
            self._leases[transfer_id] = Lease(transfer_id, peer, now, now + self.lease_s)

    def get(self, transfer_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(transfer_id)

    def __len__(self) -> int:
        return len(self._leases)  # (one read of a dict's size: atomic under the GIL)

    def note_sent(self, transfer_id: str, nbytes: int) -> None:
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is not None:
                lease.nbytes += nbytes

    def renew(self, transfer_id: str) -> None:
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is not None:
                lease.expires = max(lease.expires, self.clock() + self.lease_s)

    def release(self, transfer_id: str, error: TransferError | None = None) -> bool:
        """End a lease (ACK when error is None); queue its event. False if it was already gone."""
        with self._lock:
            lease = self._leases.pop(transfer_id, None)
            if lease is None:
                return False
            state = TransferState.DONE if error is None else TransferState.FAILED
            self._events.append(TransferEvent(transfer_id, state, error, lease.nbytes, self.clock() - lease.started))
            return True

    def release_peer(self, peer: str, error: TransferError) -> list[str]:
        with self._lock:
            ids = [t for t, lease in self._leases.items() if lease.peer == peer]
        return [t for t in ids if self.release(t, error)]

    def expire(self) -> list[tuple[str, str]]:
        """Release every lease past its expiry; returns (id, peer) pairs (to tell the receivers)."""
        now = self.clock()
        with self._lock:
            dead = [(t, lease.peer) for t, lease in self._leases.items() if lease.expires < now]
        return [
            (t, p)
            for t, p in dead
            if self.release(
                t,
                TransferTimeout(f"lease of {self.lease_s}s expired without word from the receiver for transfer {t!r}"),
            )
        ]

    def fail_all(self, error: TransferError) -> None:
        with self._lock:
            ids = list(self._leases)
        for t in ids:
            self.release(t, error)

    def drain(self) -> list[TransferEvent]:
        with self._lock:
            out = list(self._events)
            self._events.clear()
            return out

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._leases)

    def peers(self) -> set[str]:
        """Addresses of the receivers that some live lease is with."""
        with self._lock:
            return {lease.peer for lease in self._leases.values()}

    def due_keepalives(self, every_s: float) -> list[tuple[str, str]]:
        """(id, peer) of leases whose receiver should hear from us again (sender liveness)."""
        now = self.clock()
        out = []
        with self._lock:
            for lease in self._leases.values():
                if now - lease.last_keepalive >= every_s:
                    lease.last_keepalive = now
                    out.append((lease.transfer_id, lease.peer))
        return out


@dataclass(slots=True)
class Inbound:
    """Receiver-side record of one expected transfer."""

    transfer_id: str
    num_layers: int
    deadline: float
    started: float
    missing: list[set[int]] = field(default_factory=list)  # per layer: block ids not yet arrived
    remaining: int = 0
    state: TransferState = TransferState.WAITING
    session: bytes | None = None  # the sender session this transfer is bound to on first piece
    headers_seen: int = 0
    pieces_done: int = 0
    finish_pieces: int | None = None
    nbytes: int = 0
    last_renew: float = 0.0  # last lease renewal we sent to the sender
    last_heard: float = 0.0  # last message from the sender about this transfer
    in_order: tuple[int, ...] = ()  # the blocks as expect() named them: a piece of all of them is checked at once
    leading_run: bool = False  # the sender fills the first of ``in_order`` only, and its finish ends the transfer
    heads: tuple[int, int] | None = None  # every piece carries these of the receiver's heads only (None: all)
