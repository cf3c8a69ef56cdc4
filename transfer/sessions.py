"""The receiver's sender sessions, bounded in number and in idle time (docs/transfer.md, "Bounds and health").

A session without an expected transfer and without a message for `idle_s` (an unfinished handshake included) is
dropped, its pair link closed; past `max_sessions` a hello is refused (SessionLimit), never answered by evicting a
session that may be in use. Single-threaded: the thread that calls the receiver's `poll()`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from transfer.path import Session


class SessionTable(OrderedDict):
    """token -> Session, least recently heard from first (a dict, so the receiver and its subclasses use it as one)."""

    def __init__(self, max_sessions: int, idle_s: float) -> None:
        super().__init__()
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self.expired = 0  # sessions dropped for idleness so far
        self._next_sweep = 0.0

    def full(self) -> bool:
        return len(self) >= self.max_sessions

    def add(self, session: Session) -> None:
        if self.full():
            raise RuntimeError("session table full: check full() first")
        self[session.token] = session

    def touch(self, session: Session) -> None:
        """The sender was heard from (an authenticated message in sequence)."""
        session.last_seen = time.monotonic()
        self.move_to_end(session.token)

    def idle(self, in_use: Callable[[], Iterable[bytes]], force: bool = False) -> list[Session]:
        """Remove and return the sessions idle for idle_s that no transfer is bound to (`in_use()`: the tokens that
        are). Sweeps at most every idle_s / 4 unless `force` (a hello that finds the table full)."""
        now = time.monotonic()
        if not self or (not force and now < self._next_sweep):
            return []
        self._next_sweep = now + min(1.0, self.idle_s / 4)
        busy: set[bytes] | None = None
        out = []
        for token, sess in list(self.items()):
            if now - sess.last_seen <= self.idle_s:
                break  # ordered by last_seen: the rest were heard from later
            if busy is None:
                busy = set(in_use())
            if token not in busy:
                out.append(self.pop(token))
        self.expired += len(out)
        return out
