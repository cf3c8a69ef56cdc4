"""A deterministic simulation of the whole cluster protocol under seeded faults: one run is a pure function of
(seed, faults enabled, code).

The real code runs: the router's ``RouterCore`` (placement, admission, retries, deadlines, moves), and per worker the
real role (``PrefillRole``, ``DecodeRole``) over a real ``LLMEngine`` on a tiny random-weight float32 model, its
``RouterBook`` (orphans, drains), and the KV hand-off through the local transfer backend's real endpoints (leases,
expectations, acks, nacks, checksums). One seeded scheduler (a heap of timed actions) decides every delivery, loop
turn, arrival and fault, and every clock those parts read is the simulation's. Control messages cross encoded, as on
the wire (each worker decodes its own copy). No sockets, no threads, no Ray, no sleeps.

After every action the invariants that can be checked at any time are (no text a client got that is not its
reference's prefix, no request past its deadline, no token past its budget); at quiescence the rest (every request
ended once, finished ones exactly as the same engine alone makes them, nothing held anywhere: blocks, requests,
leases, expectations, flows). docs/simulation.md says what is simulated and what is not.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import itertools
import logging
import multiprocessing
import random
import shutil
import tempfile
from collections.abc import Callable, Generator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from cluster.config import ClusterConfig, parse_config
from cluster.routing.admission import Admission
from cluster.routing.core import RouterCore
from cluster.routing.flow import Flow, FlowStatus
from cluster.routing.membership import Membership
from cluster.routing.metrics import RouterMetrics
from cluster.routing.policies import make_policy
from cluster.sim.faults import TIER_FAULTS, FaultAction, FaultKind, draw_schedule
from cluster.sim.worker import ROUTER_ADDRESS, SECRET, SimWorker, Violation
from engine.config import EngineConfig
from engine.kv_tiers import PAGE_SUFFIX
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from transfer.errors import AuthError
from transfer.local_backend import LocalHub
from transfer.wire import PieceHeader
from worker.messages import (
    Command,
    Event,
    KvEvents,
    Ping,
    Stats,
    kind,
)
from worker.protocol import Channel, Verifier
from worker.spec import WorkerSpec

HOP_S = 0.0005  # a control message's base latency (plus up to as much again, from the seed)
BUSY_TURN_S = 0.004  # a worker's loop turn while it has work (a tiny model's step)
IDLE_TURN_S = 0.05  # ... while it has none
STATS_S = 0.2  # heartbeat period (RuntimeOptions.stats_interval_s)
ROUTER_TICK_S = 0.1  # the live router's tick (router.TICK_S)
PING_S = 1.0  # router.PING_INTERVAL_S
SETTLE_S = 8.0  # after the last request ended: leases, deadlines and orphan timeouts all pass within this
MAX_SIM_S = 120.0  # a run that has not settled by then is a violation (something waits forever)
MODEL_ARCH = "llama"


@functools.cache
def tiny_model() -> str:
    """The simulation's model: the tiny random-weight Llama, built once per process."""
    from engine.tiny_model import build_tiny_model

    return str(build_tiny_model(Path(tempfile.mkdtemp(prefix="pdserve-sim-")) / "tiny", arch=MODEL_ARCH))


@functools.cache
def _reference_engine(model: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype="float32", kv_blocks=128, block_size=4, max_model_len=256))


def reference(model: str, prompt: list[int], params: SamplingParams) -> tuple[str, int]:
    """What the same engine alone makes of the request: its text and token count."""
    return _reference(model, tuple(prompt), msgspec.msgpack.encode(params))


@functools.cache
def _reference(model: str, prompt: tuple[int, ...], params: bytes) -> tuple[str, int]:
    sampling = msgspec.msgpack.decode(params, type=SamplingParams)
    [result] = _reference_engine(model).generate([list(prompt)], sampling)
    return result.text, len(result.token_ids)


@dataclass(slots=True)
class SimRequest:
    index: int
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrival_s: float
    flow: Flow | None = None
    text: str = ""
    tokens: int = 0
    outcome: str | None = None  # finished, error:<code>, aborted
    expected: tuple[str, int] = ("", 0)


@dataclass(slots=True)
class SimResult:
    seed: int
    events: int
    requests: int
    faults: list[FaultAction]
    outcomes: dict[str, int]
    digest: str
    sim_s: float
    violation: str | None = None
    trace_tail: list[str] = field(default_factory=list)
    coverage: set[tuple[str, str, str]] = field(default_factory=set)
    schedule: list[FaultAction] = field(default_factory=list)  # every fault the seed drew (applied or not)
    tier_loaded_tokens: int = 0  # prompt tokens the workers loaded back from the KV disk tier instead of computing

    def summary(self) -> str:
        outcome = " ".join(f"{k}={v}" for k, v in sorted(self.outcomes.items()))
        verdict = "ok" if self.violation is None else "VIOLATION"
        return (
            f"seed={self.seed} {verdict} events={self.events} requests={self.requests} faults={len(self.faults)} "
            f"{outcome} sim_s={self.sim_s:.3f} digest={self.digest}"
        )


class World:
    """One run: the router core, the workers, the clients, the network between them, and the fault schedule."""

    def __init__(
        self,
        seed: int,
        faults: frozenset[FaultKind],
        schedule: list[FaultAction] | None = None,
        num_requests: int | None = None,
    ) -> None:
        torch.manual_seed(seed)
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = 0.0
        self.model = tiny_model()
        self._heap: list[tuple[float, int, str, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.trace: list[str] = []
        self.coverage: set[tuple[str, str, str]] = set()
        self.events = 0
        self.hub = LocalHub()
        self.tier_dir = Path(tempfile.mkdtemp(prefix="pdserve-sim-tiers-"))  # the disk tier, on seeds that have one
        self.verifier = Verifier(SECRET, Channel.EVENTS, ROUTER_ADDRESS)  # the router's event socket
        self.config = self._config()
        self.specs = {s.name: s for s in self.config.worker_specs(self.model, ["sim://router"], "127.0.0.1")}
        self.spares = self._spares()  # pool -> a worker a scale-up adds
        metrics = RouterMetrics(worker_gauges=False)
        members = Membership(metrics, clock=self.clock)
        policies = {
            pool: make_policy(self.config.router.decode_policy, random.Random(self.rng.random()))
            for pool in ("prefill", "decode", "colocated")
        }
        self.core = RouterCore(self.config, metrics, Admission(self.config.router.queue_size), members, policies)
        self.workers: dict[str, SimWorker] = {}  # the live incarnation of each worker
        self.started: list[SimWorker] = []  # every incarnation, in start order
        self.incarnations: dict[str, int] = {}
        self._kv_seq: dict[str, int] = {}
        self.removed: set[str] = set()
        for spec in self.specs.values():
            self._start_worker(spec.name, spec.role.value)
        count = num_requests if num_requests is not None else self.rng.randint(2, 5)
        self.requests: list[SimRequest] = []
        for index in range(count):
            self.requests.append(self._request(index))
        decode = [n for n, s in self.specs.items() if s.role.value == "decode"]
        arrivals = [r.arrival_s for r in self.requests]
        kinds = faults if self.tiers else faults - TIER_FAULTS  # without a tier, nothing for those to hit
        drawn = draw_schedule(self.rng, kinds, sorted(self.specs), decode, arrivals)  # always: the
        # seed's draws after it stay the same when a shrunk schedule replaces it
        self.schedule = drawn if schedule is None else schedule
        self._message_faults = {
            (a.target, int(a.at)): a for a in self.schedule if a.kind.on_message
        }  # (direction, ordinal) -> action
        self._kv_faults = {int(a.at): a for a in self.schedule if a.kind.on_kv}
        self._ordinals = {"to_worker": 0, "to_router": 0, "kv": 0}
        self._channel_free: dict[str, float] = {}  # per socket: when its last message arrives (FIFO)
        self.applied: list[FaultAction] = []
        self.late_violation: str | None = None  # found inside a callee that must not raise (the KV sink)
        self.partitioned_until: dict[str, float] = {}

    # ---- set-up ------------------------------------------------------------------------------------------------

    def _config(self) -> ClusterConfig:
        rng = self.rng
        pool: dict[str, object] = {
            "replicas": 1,
            "torch_threads": 1,
            "kv_blocks": rng.choice((24, 48, 96)),
            "max_num_seqs": 4,
            "cpu_linear_tuning": False,  # timing kernels at start: slow, and a choice the seed would not make
        }
        # a disk tier under every worker's prefix cache on some seeds, its pages written and read on the engine's
        # thread (inline_io); prefill workers then have few blocks, so that prefixes go down and come back up
        self.tiers = rng.random() < 0.4
        prefill = dict(pool)
        if self.tiers:
            pool["kv_offload"] = {"disk_dir": str(self.tier_dir), "disk_mb": 64, "inline_io": True}
            prefill = dict(pool) | {"kv_blocks": rng.choice((9, 12))}
        decode = dict(pool) | {"replicas": 2}
        # n-gram speculation on the decode workers (verification steps, proposals, rollbacks) on some seeds, whose
        # requests are greedy: its output is then exactly the plain engine's (sampled output keeps only its law)
        self.speculative = rng.random() < 0.3
        if self.speculative:
            decode["speculative"] = {"method": "ngram", "num_tokens": 3}
        return parse_config(
            {
                "model": {"name": self.model, "dtype": "float32", "max_model_len": 256},
                "pools": {"prefill": prefill, "decode": decode},
                "transfer": {
                    "block_size": 4,
                    "deadline_s": 2.0,
                    "lease_s": 2.0,
                    "backend": "local",
                    "failure_policy": rng.choice(("fail", "recompute")),
                    "stream_layers": rng.random() < 0.8,
                },
                "router": {
                    "request_timeout_s": 30.0,
                    "worker_timeout_s": 2.0,
                    "orphan_timeout_s": 3.0,
                    "queue_size": 8,
                    "migrate_on_drain": True,
                    "local_prefill_max_tokens": rng.choice((0, 0, 8)),
                },
            }
        )

    def _spares(self) -> dict[str, WorkerSpec]:
        """One more worker per pool, for scale-ups: the spec the config gives the next replica."""
        bigger = self.config.model_copy(deep=True)
        for pool in (bigger.pools.prefill, bigger.pools.decode):
            assert pool is not None
            pool.replicas += 1
        specs = bigger.worker_specs(self.model, ["sim://router"], "127.0.0.1")
        return {s.role.value: s for s in specs if s.name not in self.specs}

    def _request(self, index: int) -> SimRequest:
        rng = self.rng
        prompt = [rng.randrange(3, 250) for _ in range(rng.randint(3, 30))]
        if rng.random() < 0.3:  # a pattern repeated: n-grams for a speculative worker to propose from
            prompt = (prompt[: rng.randint(2, 6)] * 5)[:30]
        arrival_s = round(rng.uniform(0.0, 0.8), 4)
        if self.requests and rng.random() < 0.4:  # an earlier prompt's prefix again, after every request so far:
            earlier = rng.choice(self.requests)  # prefix caches hit; with a tier, the first request's prefix, which
            if self.tiers and len(self.requests) >= 2:  # the others pushed out of the device cache meanwhile
                earlier = min(self.requests, key=lambda r: r.arrival_s)
            shared = earlier.prompt if rng.random() < 0.5 else earlier.prompt[: rng.randint(1, len(earlier.prompt))]
            prompt = (shared + prompt)[:30]
            arrival_s = round(max(r.arrival_s for r in self.requests) + rng.uniform(0.1, 0.5), 4)
        if self.speculative or rng.random() < 0.5:
            params = SamplingParams(max_tokens=rng.randint(1, 20), temperature=0.0, ignore_eos=True)
        else:
            params = SamplingParams(
                max_tokens=rng.randint(1, 20), temperature=0.8, seed=rng.randrange(1 << 30), ignore_eos=True
            )
        request = SimRequest(index, f"req{index}", prompt, params, arrival_s)
        request.expected = reference(self.model, prompt, params)
        return request

    def _start_worker(self, name: str, role: str) -> SimWorker:
        incarnation = self.incarnations[name] = self.incarnations.get(name, -1) + 1
        worker = self.workers[name] = SimWorker(self, name, role, incarnation)
        self.started.append(worker)
        self.core.add_worker(name, role, worker.address, worker.kv_address, self.now)
        self.core.on_event(worker.stats(), self.now)
        self._flush()
        self.at(self.now + IDLE_TURN_S, f"turn {name}", functools.partial(self._turn, worker))
        self.at(self.now + STATS_S, f"beat {name}", functools.partial(self._beat, worker))
        return worker

    # ---- the scheduler -----------------------------------------------------------------------------------------

    def clock(self) -> float:
        return self.now

    def at(self, when: float, label: str, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), label, action))

    def note(self, line: str) -> None:
        self.trace.append(f"{self.now:.6f} {line}")

    def next_kv_seq(self, name: str) -> int:
        seq = self._kv_seq.get(name, 0)
        self._kv_seq[name] = seq + 1
        return seq

    def run(self) -> SimResult:
        for request in self.requests:
            self.at(request.arrival_s, f"arrive {request.rid}", functools.partial(self._arrive, request))
        for action in self.schedule:
            if not (action.kind.on_message or action.kind.on_kv):
                self.at(action.at, f"fault {action}", functools.partial(self._time_fault, action))
        self.at(ROUTER_TICK_S, "router tick", self._router_tick)
        self.at(PING_S, "router ping", self._ping)
        violation = None
        settled_at: float | None = None
        try:
            while self._heap:
                when, _, _, step = heapq.heappop(self._heap)
                self.now = when
                step()
                self.events += 1
                self._check_always()
                if all(r.outcome is not None for r in self.requests):
                    settled_at = self.now if settled_at is None else settled_at
                    if self.now - settled_at >= SETTLE_S and not self._busy():
                        break
                if self.now > MAX_SIM_S:
                    raise Violation(f"not settled after {MAX_SIM_S:.0f} s of simulated time: {self._holding()}")
            self._check_quiescent()
        except Violation as exc:
            violation = str(exc)
        finally:
            shutil.rmtree(self.tier_dir, ignore_errors=True)
        outcomes: dict[str, int] = {}
        for r in self.requests:
            key = (r.outcome or "none").split(":")[0]
            outcomes[key] = outcomes.get(key, 0) + 1
        digest = hashlib.sha256("\n".join(self.trace).encode()).hexdigest()[:16]
        return SimResult(
            self.seed,
            self.events,
            len(self.requests),
            list(self.applied),
            outcomes,
            digest,
            self.now,
            violation,
            self.trace[-40:],
            self.coverage,
            list(self.schedule),
            sum(
                sum(w.engine.kv_tiers.stats.hit_tokens.values()) for w in self.started if w.engine.kv_tiers is not None
            ),
        )

    def _busy(self) -> bool:
        return any(w.busy() for w in self.workers.values()) or bool(self.core.flows)

    def _holding(self) -> str:
        """What still holds anything: open requests, router flows, and each worker's load."""
        held = [f"open requests {self._open()}"] if self._open() else []
        if self.core.flows:
            held.append(f"router flows {sorted(self.core.flows)}")
        for w in self.workers.values():
            if w.busy():
                held.append(f"{w.name} holds {sorted(w.engine.requests)} ({w.role.load()})")
        return "; ".join(held) or "nothing"

    def _open(self) -> list[str]:
        return [f"{r.rid}:{r.flow.status.value if r.flow else 'unsent'}" for r in self.requests if r.outcome is None]

    # ---- clients -----------------------------------------------------------------------------------------------

    def _arrive(self, request: SimRequest) -> None:
        self.note(f"arrive {request.rid}")
        request.flow = self.core.submit(request.rid, list(request.prompt), request.params.copy(), self.now)
        self._flush()

    def _client_reads(self, flow: Flow) -> None:
        request = next((r for r in self.requests if r.flow is flow), None)
        if request is None or request.outcome is not None:
            return
        while (event := flow.take()) is not None:
            request.text += event.text
            request.tokens += event.num_tokens
            if event.finish_reason is not None:
                if request.outcome is not None:
                    raise Violation(f"{request.rid}: a second finish")
                request.outcome = "finished"
        if request.outcome is None and flow.status is FlowStatus.FAILED and flow.error is not None:
            request.outcome = f"error:{flow.error.code}"
        if request.outcome is not None:
            self.note(f"end {request.rid} {request.outcome} tokens={request.tokens}")
            self.core.release(flow, self.now)
            self._flush()

    # ---- the network -------------------------------------------------------------------------------------------

    def _flush(self) -> None:
        core = self.core
        while core.outbox:
            name, command = core.outbox.popleft()
            self._to_worker(name, command)
        for flow in core.take_updated():
            self._client_reads(flow)

    def _hop(self) -> float:
        return HOP_S + self.rng.random() * HOP_S

    def _message_fault(self, direction: str, counted: bool) -> FaultAction | None:
        if not counted:
            return None
        ordinal = self._ordinals[direction]
        self._ordinals[direction] += 1
        action = self._message_faults.get((direction, ordinal))
        if action is not None:
            self.applied.append(action)
        return action

    def _deliveries(self, direction: str, counted: bool, channel: str) -> list[float]:
        """When a message arrives (none: lost; two: duplicated), by the schedule. One socket's messages arrive in
        the order they were sent (TCP), a delay holding back those behind it; a reordered one is overtaken."""
        action = self._message_fault(direction, counted)
        arrive = max(self.now + self._hop(), self._channel_free.get(channel, 0.0))
        if action is not None:
            self.note(f"fault {action}")
            if action.kind is FaultKind.DROP:
                return []
            if action.kind is FaultKind.REORDER:
                return [arrive + 20 * HOP_S - self.now]  # overtaken by the next few, which keep their places
            if action.kind is FaultKind.DELAY:
                arrive += action.amount
        self._channel_free[channel] = arrive
        times = [arrive, arrive] if action is not None and action.kind is FaultKind.DUPLICATE else [arrive]
        return [t - self.now for t in times]

    def _cut_off(self, name: str) -> bool:
        return self.partitioned_until.get(name, -1.0) > self.now

    def cut_off_address(self, kv_address: str) -> bool:
        """A KV receiver's worker is partitioned: its pieces in and its acks out are lost."""
        return any(w.kv_address == kv_address and self._cut_off(w.name) for w in self.workers.values())

    def _to_worker(self, name: str, command: Command) -> None:
        worker = self.workers.get(name)
        if worker is None or not worker.alive or self._cut_off(name):
            return
        counted = not isinstance(command, Ping)
        data = worker.router_signer.seal(command)
        label = f"{kind(command)}>{name} {getattr(command, 'rid', '')}"
        for delay in self._deliveries("to_worker", counted, f"to {worker.address}"):
            self.at(self.now + delay, label, functools.partial(self._worker_hears, worker, data, label))

    def _worker_hears(self, worker: SimWorker, data: bytes, label: str) -> None:
        if not worker.alive or self._cut_off(worker.name):
            return
        command = worker.take(data)
        self.note(label if command is not None else f"refused {label}")
        if command is not None and not isinstance(command, Ping):
            flow = self.core.flows.get(getattr(command, "rid", ""))
            status = flow.status.value if flow is not None else "gone"
            self.coverage.add((kind(command), status, ",".join(sorted({a.kind.value for a in self.applied}))))

    def to_router(self, worker: SimWorker, event: Event) -> None:
        if self._cut_off(worker.name):
            return
        counted = not isinstance(event, (Stats, KvEvents))
        beat = isinstance(event, Stats)
        data = (worker.beat_signer if beat else worker.signer).seal(event)
        channel = f"{'beats' if beat else 'events'} from {worker.address}"
        rid = getattr(event, "rid", "") or ",".join(getattr(i, "rid", "") for i in getattr(event, "items", []))
        label = f"{kind(event)}<{worker.name} {rid}" if counted else ""
        for delay in self._deliveries("to_router", counted, channel):
            self.at(self.now + delay, label or "beat", functools.partial(self._router_hears, worker, data, label))

    def _router_hears(self, worker: SimWorker, data: bytes, label: str) -> None:
        if self._cut_off(worker.name):
            return
        try:
            event: Event = self.verifier.open(data)  # type: ignore[assignment]
        except AuthError:
            self.note(f"refused {label or 'beat'}")
            return
        if label:
            self.note(label)
        self.core.on_event(event, self.now)
        self._flush()

    def kv_fault(self, piece: PieceHeader) -> FaultAction | None:
        ordinal = self._ordinals["kv"]
        self._ordinals["kv"] += 1
        action = self._kv_faults.get(ordinal)
        if action is not None:
            self.applied.append(action)
            self.note(f"fault {action} on {piece.transfer_id} layer {piece.layer}")
        return action

    # ---- workers' loops and the router's clock -------------------------------------------------------------------

    def _turn(self, worker: SimWorker) -> None:
        if not worker.alive or self.workers.get(worker.name) is not worker:
            return
        worker.turn()
        if not worker.alive:
            return
        interval = BUSY_TURN_S if worker.busy() else IDLE_TURN_S
        if self.now < worker.slow_until:
            interval *= 10
        self.at(self.now + interval, f"turn {worker.name}", functools.partial(self._turn, worker))

    def _beat(self, worker: SimWorker) -> None:
        if not worker.alive or self.workers.get(worker.name) is not worker:
            return
        self.to_router(worker, worker.stats())
        self.at(self.now + STATS_S, f"beat {worker.name}", functools.partial(self._beat, worker))

    def _router_tick(self) -> None:
        core = self.core
        for name, reason in core.members.expired(self.now):
            self.note(f"dead {name}: {reason}")
            core.mark_dead(name, reason, self.now)
        core.on_tick(self.now)
        self._flush()
        self.at(self.now + ROUTER_TICK_S, "router tick", self._router_tick)

    def _ping(self) -> None:
        for worker in self.core.members.live():
            self.core.send(worker.name, Ping())
        self._flush()
        self.at(self.now + PING_S, "router ping", self._ping)

    # ---- time faults ---------------------------------------------------------------------------------------------

    def _time_fault(self, action: FaultAction) -> None:
        self.applied.append(action)
        self.note(f"fault {action}")
        worker = self.workers.get(action.target)
        if action.kind is FaultKind.CLIENT_ABORT:
            request = self.requests[int(action.target)]
            if request.flow is not None and request.outcome is None:
                request.outcome = "aborted"
                self.core.release(request.flow, self.now)
                self._flush()
        elif action.kind is FaultKind.DRAIN:
            if worker is not None and worker.alive and action.target not in self.removed:
                self.core.drain(action.target, 10.0, self.now)
                self._flush()
        elif action.kind is FaultKind.SCALE_UP:
            spare = self.spares.pop(action.target, None)
            if spare is not None:
                self.specs[spare.name] = spare
                self.note(f"scale up {spare.name}")
                self._start_worker(spare.name, spare.role.value)
        elif action.kind in TIER_FAULTS:
            self._tier_fault(action)
        elif worker is None or not worker.alive:
            return
        elif action.kind is FaultKind.CRASH:
            worker.crash()
            self.at(self.now + action.amount, f"restart {worker.name}", functools.partial(self._restart, worker))
        elif action.kind is FaultKind.PARTITION:
            self.partitioned_until[action.target] = self.now + action.amount
        elif action.kind is FaultKind.SLOW:
            worker.slow_until = self.now + action.amount

    def _tier_fault(self, action: FaultAction) -> None:
        """A page of the disk tier goes missing or bad (its reader must find out and compute the prefix instead)."""
        pages = sorted(self.tier_dir.glob(f"*/*{PAGE_SUFFIX}"))
        if not pages:
            return
        page = pages[min(int(action.amount * len(pages)), len(pages) - 1)]
        self.note(f"{action.kind.value} {page.name}")
        if action.kind is FaultKind.TIER_LOSS:
            page.unlink()
            return
        data = bytearray(page.read_bytes())
        data[-1] ^= 0xFF  # the payload's last byte
        page.write_bytes(bytes(data))

    def _restart(self, old: SimWorker) -> None:
        if self.workers.get(old.name) is old and old.name not in self.removed:
            self.note(f"restart {old.name}")
            self._start_worker(old.name, old.kind)

    def remove_drained(self, worker: SimWorker) -> None:
        """The pool stops a drained worker and the router forgets it (cluster/run/scaling.py)."""
        self.note(f"removed {worker.name}")
        self.removed.add(worker.name)
        worker.check_no_leaks()  # drained means nothing held
        worker.alive = False
        self.core.remove_worker(worker.name, self.now)
        self._flush()

    # ---- invariants --------------------------------------------------------------------------------------------

    def _check_always(self) -> None:
        if self.late_violation is not None:
            raise Violation(self.late_violation)
        for r in self.requests:
            text, count = r.expected
            if not text.startswith(r.text) and r.outcome != "finished":
                raise Violation(f"{r.rid}: the client got {r.text!r}, not a prefix of {text!r}")
            if r.tokens > r.params.max_tokens:
                raise Violation(f"{r.rid}: {r.tokens} tokens delivered, max_tokens {r.params.max_tokens}")
            flow = r.flow
            if flow is not None and r.outcome is None and self.now > flow.deadline_s + 2 * ROUTER_TICK_S:
                raise Violation(f"{r.rid}: still {flow.status.value} past its deadline")

    def _check_quiescent(self) -> None:
        for r in self.requests:
            if r.outcome is None:
                raise Violation(f"{r.rid}: never ended ({r.flow.status.value if r.flow else 'not sent'})")
            if r.outcome == "finished":
                text, count = r.expected
                if (r.text, r.tokens) != (text, count):
                    raise Violation(
                        f"{r.rid}: finished with {r.tokens} tokens {r.text!r}; alone the engine makes {count} {text!r}"
                    )
                assert r.flow is not None
                if r.flow.num_output_tokens != r.tokens:
                    raise Violation(f"{r.rid}: usage says {r.flow.num_output_tokens} tokens, {r.tokens} delivered")
        if not self.applied and any(r.outcome != "finished" for r in self.requests):
            raise Violation(f"no fault, yet not every request finished: {[r.outcome for r in self.requests]}")
        if self.core.flows:
            raise Violation(f"router still holds flows: {sorted(self.core.flows)}")
        for handle in self.core.members.workers.values():
            if handle.flows:
                raise Violation(f"router counts flows on {handle.name}: {[f.rid for f in handle.flows]}")
        for worker in self.workers.values():
            if worker.alive:
                worker.check_no_leaks()


def run_seed(seed: int, faults: frozenset[FaultKind], schedule: list[FaultAction] | None = None) -> SimResult:
    return World(seed, faults, schedule).run()


def _run_quietly(args: tuple[int, frozenset[FaultKind]]) -> SimResult:
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a model load per worker incarnation: no bar each time
    logging.disable(logging.WARNING)  # the faults make the roles log what they handle; the result says it all
    return run_seed(*args)


def run_seeds(seeds: range, faults: frozenset[FaultKind], jobs: int = 1) -> Generator[SimResult]:
    """Each seed's result, in seed order, on ``jobs`` processes (fresh interpreters: nothing inherited from a parent
    that has run threads); lazily, so that a caller can stop at the first violation."""
    if jobs <= 1:
        yield from (_run_quietly((seed, faults)) for seed in seeds)
        return
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
    try:
        yield from pool.map(_run_quietly, [(seed, faults) for seed in seeds])
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # stopped early: the seeds not begun are dropped


def shrink(
    seed: int, faults: frozenset[FaultKind], schedule: list[FaultAction], budget: int = 200
) -> list[FaultAction]:
    """The shortest sub-schedule of a failing run's faults that still fails (delta debugging, one action out at a
    time until none can go; at most ``budget`` runs)."""
    current = list(schedule)
    runs = 0
    changed = True
    while changed and runs < budget:
        changed = False
        for i in range(len(current)):
            candidate = current[:i] + current[i + 1 :]
            runs += 1
            if run_seed(seed, faults, candidate).violation is not None:
                current, changed = candidate, True
                break
            if runs >= budget:
                break
    return current
