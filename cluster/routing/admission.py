"""The router's admission bound: how many requests may wait for decode KV (``router.queue_size``) before a 429.

Several router processes share one limit: each writes only its own slot of a ``multiprocessing.Array``, and a request
is admitted while the slots sum to less than the limit. A slot per process lets the main process zero a dead router
process's slot (``release_slot``) instead of losing that share of the limit for good.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 2.0  # a router process killed inside the lock must not stop the others for ever


class Admission:
    def __init__(self, limit: int, slots=None, index: int = 0) -> None:
        """``slots``: a ``multiprocessing.Array('i', N)`` shared by N router processes (None: this process only)."""
        self.limit = limit
        self._slots = slots
        self._index = index
        self._local = 0

    def enter(self) -> bool:
        """Take a place in the queue; False when the queue is full (across every router process)."""
        if self._slots is None:
            if self._local >= self.limit:
                return False
            self._local += 1
            return True
        lock = self._slots.get_lock()
        if not lock.acquire(timeout=LOCK_TIMEOUT_S):
            logger.error("router: the shared admission counter stayed locked for %.0f s; refusing", LOCK_TIMEOUT_S)
            return False
        try:
            counts = self._slots.get_obj()
            if sum(counts) >= self.limit:
                return False
            counts[self._index] += 1
        finally:
            lock.release()
        self._local += 1
        return True

    def leave(self) -> None:
        self._local -= 1
        if self._slots is None:
            return
        lock = self._slots.get_lock()
        if not lock.acquire(timeout=LOCK_TIMEOUT_S):
            logger.error(
                "router: the shared admission counter stayed locked for %.0f s; a queue place is lost", LOCK_TIMEOUT_S
            )
            return
        try:
            counts = self._slots.get_obj()
            counts[self._index] = max(0, counts[self._index] - 1)
        finally:
            lock.release()

    @property
    def total(self) -> int:
        """Requests queued across every router process (this one's alone when not shared)."""
        return self._local if self._slots is None else sum(self._slots.get_obj())  # a snapshot, for /status


def release_slot(slots, index: int) -> None:
    """Give back every place a dead router process had taken (the main process calls it)."""
    lock = slots.get_lock()
    if lock.acquire(timeout=LOCK_TIMEOUT_S):
        try:
            slots.get_obj()[index] = 0
        finally:
            lock.release()
