"""The worker's book of its routers: which are alive, which owns each request, and which have said ``drain``.

Plain bookkeeping for the loop thread, which acts on it: frees the requests ``orphans`` names, sends each event where
``route`` says (with ``router.processes`` > 1, only to the request's owner), fails what is left at the drain deadline
(the ``Drain`` message says how draining goes). A router silent for ``orphan_timeout_s`` loses only its own requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterable, Iterator

from worker.messages import Event, Tokens

logger = logging.getLogger(__name__)

OWNER_PRUNE_INTERVAL_S = 5.0  # how often the owners of requests no longer held are forgotten
OWNER_GRACE_S = 120.0  # ... at least this long after the owner's last command about them


class RouterBook:
    """Per router: last heard, and whether it said ``drain``; per request: its owner. Loop thread only, except
    ``drained`` and ``draining`` (plain reads, from ``info()``)."""

    def __init__(
        self, name: str, count: int, orphan_timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``clock``: the worker's (a simulation passes its own)."""
        self.name = name  # the worker's, for its log lines
        self.clock = clock
        self.count = count
        self.orphan_timeout_s = orphan_timeout_s
        self._owners: dict[str, tuple[int, float]] = {}  # rid -> (owning router's index, when it last sent a command)
        self._next_owner_prune_s = 0.0
        self._last_router_s = [clock()] * count
        self._drain_from: set[int] = set()
        self._drain_deadline: float | None = None  # monotonic; None: not draining
        self._drained = False  # set by the loop thread (info() reads it from another)
        self._drain_failed = False  # the deadline passed and what was held was failed
        self._fail_at_deadline = True  # false for a role switch's drain: it is called off instead

    # ---- liveness and ownership --------------------------------------------------------------------------------

    def heard(self, router: int, now: float) -> None:
        self._last_router_s[router] = now

    def claim(self, rid: str, router: int, now: float) -> None:
        """Router ``router`` sent a command about ``rid``: it owns the request."""
        if self.count > 1:  # one router owns everything: nothing to remember
            self._owners[rid] = (router, now)

    def owner(self, rid: str | None) -> int:
        """The index of the router that sent this request's commands (0 when unknown: the only router, usually)."""
        entry = self._owners.get(rid) if rid is not None else None
        return 0 if entry is None else entry[0]

    def orphans(self, now: float, held: Iterable[str]) -> Iterator[str]:
        """The ``held`` requests of every router silent for ``orphan_timeout_s`` (died or restarted), lazily; each
        such router's clock starts again."""
        for index, last in enumerate(self._last_router_s):
            if now - last <= self.orphan_timeout_s:
                continue
            self._last_router_s[index] = now
            owned = [rid for rid in held if self.owner(rid) == index]
            if not owned:
                continue
            router = f"router {index}" if self.count > 1 else "the router"
            logger.warning(
                "%s: no word from %s for %.0f s; freeing its %d requests",
                self.name,
                router,
                self.orphan_timeout_s,
                len(owned),
            )
            yield from owned

    def prune(self, now: float, held: Container[str]) -> None:
        """Every ``OWNER_PRUNE_INTERVAL_S``, forget the owners of requests not ``held`` ``OWNER_GRACE_S`` after their
        last command: a request the engine let go may still be reported (on the prefill side, its KV transfer's end)."""
        if now < self._next_owner_prune_s:
            return
        self._next_owner_prune_s = now + OWNER_PRUNE_INTERVAL_S
        stale = [rid for rid, (_, seen) in self._owners.items() if rid not in held and now - seen > OWNER_GRACE_S]
        for rid in stale:
            del self._owners[rid]

    def route(self, event: Event) -> Iterator[tuple[int, Event]]:
        """Where an event goes: the router that owns its request; a ``tokens`` message split per router."""
        if self.count == 1:
            yield 0, event
        elif isinstance(event, Tokens):
            by_router: dict[int, list] = {}
            for item in event.items:
                by_router.setdefault(self.owner(item.rid), []).append(item)
            for index, items in by_router.items():
                yield index, Tokens(worker=event.worker, items=items)
        else:
            yield self.owner(event.rid), event  # type: ignore[union-attr]  # stats go by the heartbeat

    # ---- draining ----------------------------------------------------------------------------------------------

    def begin_drain(self, router: int, deadline_s: float, fail_at_deadline: bool = True) -> None:
        if self._drain_deadline is None:
            logger.info("%s: draining (deadline %.1f s)", self.name, deadline_s)
            self._drain_deadline = self.clock() + deadline_s
            self._fail_at_deadline = fail_at_deadline
        self._drain_from.add(router)

    def end_drain(self) -> None:
        """The drain was called off (``Undrain``): the worker takes work again."""
        if self._drain_deadline is not None:
            logger.info("%s: drain called off", self.name)
        self._drain_from.clear()
        self._drain_deadline = None
        self._drained = self._drain_failed = False

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    @property
    def drained(self) -> bool:
        """Draining, told so by every router (none can still send it work) or past the deadline, and idle."""
        return self._drained

    def drain_turn(self, now: float, holds_requests: Callable[[], bool], fail_all: Callable[[str], None]) -> None:
        """Once per loop turn while draining: fail what is left after the deadline, then say whether it is idle."""
        assert self._drain_deadline is not None
        past = now > self._drain_deadline
        if past and self._fail_at_deadline and not self._drain_failed and holds_requests():
            self._drain_failed = True
            logger.warning("%s: drain deadline passed; failing the requests it still holds", self.name)
            fail_all("worker removed by scale-down: its drain deadline passed before the request finished")
        told = len(self._drain_from) == self.count or (past and self._fail_at_deadline)
        self._drained = told and not holds_requests()
