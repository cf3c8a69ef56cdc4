"""A worker in the simulation (cluster/sim/world.py): one incarnation of the real role over a real engine, with its
router book, sealed sockets and the loop the runtime runs (worker/runtime.py); and its KV receiver, the local
backend's, with the run's KV faults applied as pieces arrive.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from cluster.config import ClusterConfig
from cluster.sim.faults import FaultAction, FaultKind
from decode.worker import DecodeRole, kv_sink
from engine.llm_engine import LLMEngine
from prefill.worker import PrefillRole
from transfer.errors import AuthError
from transfer.local_backend import Delivery, LocalHub, LocalReceiver, LocalSender
from transfer.wire import ModelFingerprint, PieceHeader
from worker.messages import Command, Drain, ErrorCode, Event, KvEvents, Ping, Stats, Undrain
from worker.protocol import Channel, Signer, Verifier
from worker.role import Role
from worker.routers import RouterBook
from worker.spec import WorkerSpec

SECRET = "pdserve-simulation"
ROUTER_ADDRESS = "sim://router"


class World(Protocol):
    """What a simulated worker needs of its world (cluster/sim/world.py's ``World``)."""

    now: float
    config: ClusterConfig
    specs: dict[str, WorkerSpec]
    hub: LocalHub
    late_violation: str | None

    def clock(self) -> float: ...
    def at(self, when: float, label: str, action: Callable[[], None]) -> None: ...
    def to_router(self, worker: SimWorker, event: Event) -> None: ...
    def next_kv_seq(self, name: str) -> int: ...
    def remove_drained(self, worker: SimWorker) -> None: ...
    def kv_fault(self, piece: PieceHeader) -> FaultAction | None: ...
    def cut_off_address(self, kv_address: str) -> bool: ...


class Violation(AssertionError):
    """An invariant broke: the message names it; the run's seed, schedule and last events say how."""


class SimWorker:
    """One worker incarnation: the real role over a real engine, its router book, and the loop the runtime runs
    (worker/runtime.py): take commands, turn the role, free orphans, drain, report."""

    def __init__(self, world: World, name: str, role: str, incarnation: int) -> None:
        self.world, self.name, self.kind, self.incarnation = world, name, role, incarnation
        self.address = f"sim://{name}#{incarnation}"
        spec = world.specs[name]
        # the control plane's real sealing: a duplicate or an overtaken message is refused as a replay, as live
        self.verifier = Verifier(SECRET, Channel.COMMANDS, self.address)
        self.signer = Signer(SECRET, Channel.EVENTS, ROUTER_ADDRESS)
        self.router_signer = Signer(SECRET, Channel.COMMANDS, self.address)  # the router's, to this incarnation
        self.beat_signer = Signer(SECRET, Channel.EVENTS, ROUTER_ADDRESS)  # heartbeats: a socket of their own
        self.engine = LLMEngine(spec.engine)
        self.engine.set_clock(world.clock)
        self.book = RouterBook(name, 1, world.config.router.orphan_timeout_s, clock=world.clock)
        self.alive = True
        self.slow_until = 0.0
        self.sender: LocalSender | None = None
        self.receiver: LocalReceiver | None = None
        self.kv_address: str | None = None
        fingerprint = ModelFingerprint.from_spec(self.engine.kv_spec)
        self.role: Role
        if role == "prefill":
            self.sender = LocalSender(fingerprint, spec.transfer, world.hub, world.clock)
            self.role = PrefillRole(name, self.engine, self.sender, self.emit, stream_kv=spec.stream_layers)
        else:
            self.kv_address = f"local://{name}-{incarnation}"
            self.receiver = FaultyReceiver(
                world, fingerprint, kv_sink(self.engine), self.kv_address, spec.transfer, world.hub, world.clock
            )
            self.engine.kv_importer.write = self._checked_write  # type: ignore[method-assign]
            self.role = DecodeRole(
                name,
                self.engine,
                self.receiver,
                self.emit,
                failure_policy=spec.failure_policy,
                headroom_tokens=spec.reserve_headroom_tokens,
                start_deadline_s=spec.transfer.deadline_s,
                make_migration_sender=lambda: LocalSender(fingerprint, spec.transfer, world.hub, world.clock),
                clock=world.clock,
            )

    def _checked_write(self, request_id: str, layer: int, block_ids: list[int], k, v, heads=None) -> None:
        """The receiver's writes into the cache, watched: a piece may land only in blocks of the request it belongs
        to while that request waits for its KV (never in freed blocks, nor in another request's). A violation is
        noted here (the receiver would swallow an exception as the engine's) and raised after the event."""
        importer = self.engine.kv_importer
        request = self.engine.requests.get(request_id)
        owned = set(importer.expected_blocks(request)) if request is not None and request.kv_import else set()
        type(importer).write(importer, request_id, layer, block_ids, k, v, heads)  # may refuse: nothing written
        if not set(block_ids) <= owned:
            self.world.late_violation = (
                f"{self.name}: KV of {request_id!r} written into blocks {sorted(set(block_ids) - owned)} it does not "
                "hold (freed, or another request's)"
            )

    # ---- in ------------------------------------------------------------------------------------------------------

    def take(self, data: bytes) -> Command | None:
        """A sealed command as the runtime takes it (None: refused unread, as a replay or forgery)."""
        try:
            command: Command = self.verifier.open(data)  # type: ignore[assignment]
        except AuthError:
            self.role.counters.control_rejected += 1
            return None
        now = self.world.now
        self.book.heard(0, now)
        if isinstance(command, Ping):
            return command
        if isinstance(command, Drain):
            self.book.begin_drain(0, command.deadline_s, command.fail_at_deadline)
            return command
        if isinstance(command, Undrain):
            self.book.end_drain()
            return command
        self.book.claim(command.rid, 0, now)
        self.role.take(command, now)
        return command

    # ---- the loop ------------------------------------------------------------------------------------------------

    def turn(self) -> None:
        now = self.world.now
        self.role.tick()
        for rid in list(self.book.orphans(now, self.engine.requests)):
            self.role.abort(rid)
            self.role.emit_error(rid, "router unreachable", ErrorCode.WORKER_ERROR)
        self.book.prune(now, self.engine.requests)
        if self.book.draining:
            self.book.drain_turn(now, self.role.holds_requests, self.role.fail_all)
            if self.book.drained:
                self.world.remove_drained(self)
                return
        self._report()

    def busy(self) -> bool:
        return self.alive and self.role.holds_requests()

    # ---- out -----------------------------------------------------------------------------------------------------

    def emit(self, event: Event) -> None:
        if self.alive:
            self.world.to_router(self, event)

    def _report(self) -> None:
        for tier, batch in self.engine.drain_kv_events():
            self.world.to_router(
                self,
                KvEvents(
                    worker=self.name,
                    address=self.address,
                    seq=self.world.next_kv_seq(self.name),
                    stored=list(batch.stored),
                    removed=list(batch.removed),
                    reset=batch.reset,
                    tier=tier,
                ),
            )

    def stats(self) -> Stats:
        return Stats(
            worker=self.name,
            role=self.kind,  # type: ignore[arg-type]
            address=self.address,
            load=self.role.load(),
            counters=self.role.totals(),
            draining=self.book.draining,
        )

    def check_no_leaks(self) -> None:
        try:
            self.engine.check_no_leaks()
        except AssertionError as exc:
            raise Violation(f"{self.name}: {exc}") from None
        if self.sender is not None and self.sender.active_transfers():
            raise Violation(f"{self.name}: leases held: {self.sender.active_transfers()}")
        if self.receiver is not None and self.receiver.pending_transfers():
            raise Violation(f"{self.name}: transfers expected: {self.receiver.pending_transfers()}")
        load = self.role.load()
        if load.requests or load.awaiting_kv or load.leased_transfers:
            raise Violation(f"{self.name}: still holds {load}")
        exports = getattr(self.role, "_exports", {})
        if exports:
            raise Violation(f"{self.name}: moves still exporting: {sorted(exports)}")

    def crash(self) -> None:
        """Gone, as a killed process is: nothing it held is freed or told; its KV receiver disappears."""
        self.alive = False
        if self.receiver is not None:
            self.world.hub.unregister(self.receiver.address[len("local://") :])


class FaultyReceiver(LocalReceiver):
    """The local KV receiver, with the simulation's KV faults applied as pieces arrive."""

    def __init__(self, world: World, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.world = world

    def deliver(self, delivery: Delivery) -> None:
        if self.world.cut_off_address(self.address):
            return  # a partition cuts the KV plane too
        if not isinstance(delivery.message, PieceHeader):
            super().deliver(delivery)
            return
        action = self.world.kv_fault(delivery.message)
        if action is None:
            super().deliver(delivery)
        elif action.kind is FaultKind.KV_LOSS:
            return
        elif action.kind is FaultKind.KV_TRUNCATE:  # the first frame's payload cut to half its bytes
            tensors = list(delivery.tensors)
            flat = tensors[0].reshape(-1)
            tensors[0] = flat[: flat.numel() // 2].clone()
            super().deliver(Delivery(delivery.session, delivery.message, tensors))
        elif action.kind is FaultKind.KV_CORRUPT:
            tensors = [t.clone() for t in delivery.tensors]
            flat = tensors[0].view(-1)
            flat[0] = flat[0] + 1 if flat.dtype.is_floating_point else flat[0] ^ 1
            super().deliver(Delivery(delivery.session, delivery.message, tensors))
        else:  # KV_LATE
            self.world.at(self.world.now + action.amount, "kv_late", lambda: LocalReceiver.deliver(self, delivery))

    def _reply(self, session, reply) -> None:  # type: ignore[no-untyped-def]
        if not self.world.cut_off_address(self.address):
            super()._reply(session, reply)
