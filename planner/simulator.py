"""A discrete-event simulation (simpy) of one pdserve cluster serving a trace: what ``pdserve plan`` sizes pools with.

It runs the real code in simulated time: the router's own ``RouterCore``, and per worker the real role
(``PrefillRole``, ``DecodeRole``, ``ColocatedRole``) over a real ``LLMEngine`` (scheduler, block manager, prefix cache,
KV connector, sampler) whose forward computes nothing (planner/sim_engine.py), with KV transfers between the roles in
simulated time (planner/sim_transfer.py). So a reservation is made, refused (``max_num_seqs``, ``kv_full``) or
prefilled locally, a transfer expected, imported and joined, exactly as in a live cluster. Router and workers talk in
the protocol's typed messages, each delayed ``hop_s``. What the planner models itself is time: a step lasts what the
``Profile`` says for its chunks (its tensor-parallel degree's profile: a ``ProfileSet`` holds one per degree), a
prefill worker's link carries one KV transfer at a time for the profile's transfer time of the real model's bytes,
and requests arrive as the trace says. The roles' clocks are the simulation's (``env.now``), so nothing depends on
how fast the box runs, and a run is a pure function of (profile, trace, layout, settings, seed). Not modelled:
failures, stops other than the length (each request generates exactly its trace's output tokens), and the text.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Literal

import simpy

from cluster.config import ClusterConfig, parse_config
from cluster.routing.admission import Admission
from cluster.routing.core import RouterCore
from cluster.routing.flow import Flow, FlowStatus
from cluster.routing.membership import Membership
from cluster.routing.metrics import RouterMetrics
from cluster.routing.policies import make_policy
from decode.worker import EXPIRY_CHECK_INTERVAL_S, DecodeRole, kv_sink
from engine.config import check_parallel
from engine.request import SamplingParams
from engine.scheduler import ScheduledChunk
from planner.profile_model import Degree, Profile, ProfileSet
from planner.sim_engine import SimRunner, sim_engine
from planner.sim_transfer import SimReceiver, SimSender
from planner.trace import TraceRequest
from prefill.worker import PrefillRole
from transfer.wire import ModelFingerprint
from worker.colocated import ColocatedRole
from worker.messages import (
    Command,
    Drain,
    Event,
    KvEvents,
    Ping,
    Role,
    Stats,
    Undrain,
    WorkerLoad,
    decode_command,
    encode,
)
from worker.spec import FailurePolicy


@dataclass(frozen=True, slots=True)
class Layout:
    mode: Literal["colocated", "disaggregated"]
    prefill: int  # colocated: 0
    decode: int  # colocated: every worker
    prefill_tp: int = 1  # ranks per prefill worker (pools.prefill.tensor_parallel_size)
    decode_tp: int = 1  # ranks per decode worker, or per colocated one
    prefill_ep: int = 1  # ways a prefill worker's routed experts are split over its ranks (expert_parallel_size)
    decode_ep: int = 1

    def __post_init__(self) -> None:
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError(f"a layout's tensor-parallel degrees are at least 1, got {self}")
        try:
            check_parallel(self.prefill_tp, self.prefill_ep)
            check_parallel(self.decode_tp, self.decode_ep)
        except ValueError as exc:
            raise ValueError(f"a layout's degrees: {exc}, got {self}") from None
        if self.mode == "colocated" and (self.prefill != 0 or self.decode < 1):
            raise ValueError(f"a colocated layout has decode >= 1 workers and prefill 0, got {self}")
        if self.mode == "disaggregated" and (self.prefill < 1 or self.decode < 1):
            raise ValueError(f"a disaggregated layout needs a prefill and a decode worker, got {self}")

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    @property
    def devices(self) -> int:
        """Ranks in all (GPUs on a GPU cluster): a worker takes one per rank (``Degree.ranks``)."""
        return self.prefill * self.prefill_degree.ranks + self.decode * self.decode_degree.ranks

    @property
    def prefill_degree(self) -> Degree:
        return Degree(self.prefill_tp, self.prefill_ep)

    @property
    def decode_degree(self) -> Degree:
        return Degree(self.decode_tp, self.decode_ep)

    @property
    def label(self) -> str:
        def tp(degree: Degree) -> str:
            return f"({degree.label})" if self.prefill_degree.ranks > 1 or self.decode_degree.ranks > 1 else ""

        if self.mode == "colocated":
            return f"colocated {self.decode}{tp(self.decode_degree)}"
        return f"{self.prefill}P{tp(self.prefill_degree)}:{self.decode}D{tp(self.decode_degree)}"


@dataclass(slots=True)
class SimSettings:
    block_size: int = 16
    prefill_max_batch_tokens: int = 2048
    prefill_max_num_seqs: int = 64
    prefill_kv_blocks: int = 4096
    decode_max_batch_tokens: int = 2048  # decode and colocated workers (colocated mode uses the decode pool's)
    decode_max_num_seqs: int = 64
    decode_kv_blocks: int = 4096
    reserve_headroom_tokens: int = 0
    kv_deadline_s: float = 30.0  # transfer.deadline_s: a decode reservation's wait for its first token and its KV
    failure_policy: FailurePolicy = "fail"  # transfer.failure_policy: what a failed transfer does to its request
    max_model_len: int | None = None
    prefill_policy: str = "least_loaded"
    decode_policy: str = "least_loaded"
    prefix_weight: float = 2.0
    load_weight: float = 1.0
    prefix_caching: bool = True
    local_prefill_max_tokens: int = 0  # conditional disaggregation (router.local_prefill_max_tokens)
    queue_size: int = 256  # requests waiting for decode KV before rejection
    hop_s: float = 0.0005  # one router <-> worker message
    request_timeout_s: float = 300.0  # the simulation ends this long after the last arrival
    seed: int = 0  # the policies' tie-breaking

    @classmethod
    def from_config(cls, config: ClusterConfig, profile: Profile | ProfileSet) -> SimSettings:
        """KV blocks per worker by the engine's rule at each pool's tensor-parallel degree, over the profile's KV
        bytes per block; a GPU pool (sized from free memory at start) takes what the profile's engine got."""
        profiles = as_profile_set(profile)
        block_size = config.transfer.block_size
        bytes_per_block = max(1, profiles.first.kv_bytes_per_token * block_size)
        num_kv_heads = profiles.first.num_kv_heads or None

        def blocks(pool) -> int:
            count = config.pool_kv_blocks(pool, bytes_per_block, num_kv_heads)
            measured = profiles.by_degree.get(Degree(pool.tensor_parallel_size, pool.expert_parallel_size))
            if count is None and measured is not None and measured.kv_blocks > 0:
                count = measured.kv_blocks
            if count is None:
                raise ValueError(
                    "pools: a GPU pool sizes its KV from free memory at start; set kv_memory_mb or kv_blocks to plan "
                    f"it, or use a profile of tensor_parallel_size {pool.tensor_parallel_size}, expert_parallel_size "
                    f"{pool.expert_parallel_size} that records its blocks"
                )
            return count

        pools, router = config.pools, config.router
        return cls(
            block_size=block_size,
            prefill_max_batch_tokens=pools.prefill.max_batch_tokens,
            prefill_max_num_seqs=pools.prefill.max_num_seqs,
            prefill_kv_blocks=blocks(pools.prefill),
            decode_max_batch_tokens=pools.decode.max_batch_tokens,
            decode_max_num_seqs=pools.decode.max_num_seqs,
            decode_kv_blocks=blocks(pools.decode),
            reserve_headroom_tokens=pools.decode.reserve_headroom_tokens,
            kv_deadline_s=config.transfer.deadline_s,
            failure_policy=config.transfer.failure_policy,
            max_model_len=config.model.max_model_len,
            prefill_policy=router.prefill_policy,
            decode_policy=router.decode_policy,
            prefix_weight=router.kv_aware.prefix_weight,
            load_weight=router.kv_aware.load_weight,
            prefix_caching=pools.prefill.enable_prefix_caching and pools.decode.enable_prefix_caching,
            local_prefill_max_tokens=router.local_prefill_max_tokens,
            queue_size=router.queue_size,
            request_timeout_s=router.request_timeout_s,
        )

    def cluster_config(self, mode: str) -> ClusterConfig:
        """The config the router core runs with (the model is never loaded: only its limits are read)."""
        pool = {"enable_prefix_caching": self.prefix_caching}
        return parse_config(
            {
                "model": {"name": "simulated", "max_model_len": self.max_model_len},
                "mode": mode,
                "pools": {"prefill": pool, "decode": {**pool, "reserve_headroom_tokens": self.reserve_headroom_tokens}},
                "transfer": {"block_size": self.block_size},
                "router": {
                    "prefill_policy": self.prefill_policy,
                    "decode_policy": self.decode_policy,
                    "kv_aware": {"prefix_weight": self.prefix_weight, "load_weight": self.load_weight},
                    "local_prefill_max_tokens": self.local_prefill_max_tokens,
                    "queue_size": self.queue_size,
                    "request_timeout_s": self.request_timeout_s,
                },
            }
        )


@dataclass(slots=True)
class SimRecord:
    arrival_s: float
    ttft_s: float  # inf: no first token (rejected, or not before the simulation ended)
    tpot_s: float | None  # None: one output token, or unfinished
    e2e_s: float  # inf: unfinished
    input_tokens: int
    output_tokens: int
    rejected: bool = False  # the router refused it (its queue was full, or no worker's KV cache can hold it)
    cached_tokens: int | None = None  # prompt tokens its first token's worker found in its prefix cache (usage's)

    def meets(self, ttft_s: float, tpot_s: float) -> bool:
        """Both SLOs met (an unfinished or rejected request meets neither)."""
        if self.rejected or not math.isfinite(self.e2e_s) or self.ttft_s > ttft_s:
            return False
        return self.tpot_s is None or self.tpot_s <= tpot_s


# token ids of shared prefixes, of each request's own part, and of hash blocks (id * SPAN + position in the block)
SHARED_BASE, OWN_BASE, HASH_BASE, SPAN = 1 << 40, 1 << 50, 1 << 60, 1 << 24


def synthetic_prompt(index: int, trace: TraceRequest) -> list[int]:
    """Token ids that share exactly what the trace says is shared: the first ``prefix_tokens`` of one ``prefix_id``,
    or hash block by hash block (one id, one block of ids, whatever the request); the rest is the request's own."""
    if trace.hash_ids is not None:
        block = trace.hash_block_tokens
        head = [HASH_BASE + h * SPAN + i for h in trace.hash_ids for i in range(block)][: trace.input_tokens]
    elif trace.prefix_id is not None:
        head = [SHARED_BASE + trace.prefix_id * SPAN + i for i in range(trace.prefix_tokens)]
    else:
        head = []
    return head + [OWN_BASE + index * SPAN + i for i in range(trace.input_tokens - len(head))]


class SimWorker:
    """One worker in simulated time: the real role (``PrefillRole``, ``DecodeRole``, ``ColocatedRole``) over a
    simulated engine (planner/sim_engine.py) and KV transfer end (planner/sim_transfer.py), driven as the worker
    runtime drives it (worker/runtime.py): commands as they arrive, then turns of the role's loop. What the planner
    models is the time: a turn that ran a forward lasts the profile's ``_step_s`` of its chunks, and what the turn
    emitted (tokens, errors) and the KV it finished leave when it ends. Heartbeats (``Stats`` of ``role.load()`` and
    ``role.totals()``) and the prefix cache's ``KvEvents`` go out when what the worker holds changed."""

    def __init__(
        self,
        cluster: SimCluster,
        name: str,
        kind: Role,
        profile: Profile,
        blocks: int,
        max_batch_tokens: int,
        max_num_seqs: int,
    ) -> None:
        self.cluster, self.name, self.kind = cluster, name, kind
        env, s = cluster.env, cluster.settings
        self.env, self.profile = env, profile
        engine = sim_engine(
            blocks, s.block_size, max_batch_tokens, max_num_seqs, s.prefix_caching, s.max_model_len, kind == "prefill"
        )
        runner = engine.runner
        assert isinstance(runner, SimRunner)
        self.engine, self.runner = engine, runner
        self.sender: SimSender | None = None
        self.receiver: SimReceiver | None = None
        fingerprint = ModelFingerprint.from_spec(engine.handoff_spec)
        bytes_per_block = profile.kv_bytes_per_token * s.block_size  # the real model's, every layer
        self.role: PrefillRole | DecodeRole | ColocatedRole
        if kind == "prefill":
            transfer_s = functools.partial(cluster.profiles.transfer_s, decode_degree=cluster.layout.decode_tp)
            self.sender = SimSender(env, fingerprint, name, cluster.receivers, bytes_per_block, transfer_s, self.notify)
            self.role = PrefillRole(name, engine, self.sender, self._emit)
        elif kind == "decode":
            self.receiver = SimReceiver(
                env, fingerprint, kv_sink(engine), f"sim://{name}", s.kv_deadline_s, bytes_per_block, self.notify
            )
            cluster.receivers[self.receiver.address] = self.receiver
            engine.kv_importer.clock = cluster.clock
            self.role = DecodeRole(
                name,
                engine,
                self.receiver,
                self._emit,
                failure_policy=s.failure_policy,
                headroom_tokens=s.reserve_headroom_tokens,
                start_deadline_s=s.kv_deadline_s,
                clock=cluster.clock,
            )
        else:
            self.role = ColocatedRole(name, engine, self._emit)
        self._held: list[Event] | None = None  # a turn's events, until its step's time has passed
        self._sent_load: WorkerLoad | None = None  # the load of the last heartbeat
        self._seq = 0
        self._wake: simpy.Event | None = None
        self.env.process(self._loop())

    # ---- commands, as the worker runtime takes them ---------------------------------------------------------------

    def handle(self, command: Command) -> None:
        """``Abort`` frees the request; a command the role refuses (ValueError, KeyError) is answered with an error.
        Taken when it arrives, even during a step (a real worker takes commands between steps: docs/planner.md says
        what that changes); the engine ran the step when it began, so the command sees the state the step leaves.
        A drain's commands (a role switch's: planner/sim_switch.py) are the switch's business, which reads the role."""
        if isinstance(command, Drain | Undrain | Ping):
            return
        self.role.take(command, self.env.now)
        self._report()
        self.notify()

    # ---- the loop ------------------------------------------------------------------------------------------------

    def notify(self) -> None:
        """A command or the transfer layer brought news: an idle loop turns."""
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _loop(self):
        while True:
            self._held = []
            self.role.tick()
            held, self._held = self._held, None
            chunks = self.runner.take()
            if chunks:
                yield self.env.timeout(self._step_s(chunks))
            for event in held:
                self.send(event)
            if self.sender is not None:
                self.sender.ship()
            self._report()
            if not chunks:
                # idle; while it holds requests the loop still turns now and then, as a worker's does, for what the
                # role checks against the clock (a reservation's expiry, a transfer's deadline)
                self._wake = self.env.event()
                if self.role.has_work():
                    yield self._wake | self.env.timeout(EXPIRY_CHECK_INTERVAL_S)
                else:
                    yield self._wake
                self._wake = None

    def _step_s(self, chunks: list[ScheduledChunk]) -> float:
        """One forward's time: each prompt chunk its own ``prefill_s`` (attention is per sequence, so the quadratic
        terms must not see their sum), plus the decodes, less all forwards' fixed cost but one (as a mixed batch
        behaves on a CPU or an unsaturated GPU)."""
        profile = self.profile
        prefill, num_chunks, batch, decode_context = 0.0, 0, 0, 0
        for chunk in chunks:
            if chunk.num_tokens == 1 and chunk.start >= chunk.request.num_prompt_tokens:  # generating
                batch += 1
                decode_context += chunk.start + 1
            else:
                prefill += profile.prefill_s(chunk.num_tokens, chunk.start)
                num_chunks += 1
        if num_chunks == 0:
            return profile.decode_step_s(batch, decode_context)
        prefill -= (num_chunks - 1) * profile.prefill_s(0, 0)
        if batch == 0:
            return prefill
        return prefill + profile.decode_step_s(batch, decode_context) - profile.decode_step_s(0, 0)

    # ---- what it reports -----------------------------------------------------------------------------------------

    def _emit(self, event: Event) -> None:
        """The role's ``emit``: during a turn, held until its step has taken its time; otherwise sent now."""
        if self._held is not None:
            self._held.append(event)
        else:
            self.send(event)

    def send(self, event: Event) -> None:
        self.cluster.to_router(event)

    def _report(self) -> None:
        """The prefix cache's changes, and a heartbeat if what the worker holds changed (so a refused reservation
        does not make a queued request ask again before anything changed)."""
        self._publish_kv_events()
        load = self.role.load()
        if load != self._sent_load:
            self.send(self.stats(load))

    def stats(self, load: WorkerLoad | None = None) -> Stats:
        load = self.role.load() if load is None else load
        self._sent_load = load
        return Stats(worker=self.name, role=self.kind, address=self.name, load=load, counters=self.role.totals())

    def _publish_kv_events(self) -> None:
        batch = self.engine.block_manager.drain_kv_events()
        if batch is None:
            return
        event = KvEvents(
            worker=self.name,
            address=self.name,
            seq=self._seq,
            stored=list(batch.stored),
            removed=list(batch.removed),
            reset=batch.reset,
        )
        self._seq += 1
        self.send(event)


class SimCluster:
    """The router core and the workers, joined by messages that each take ``hop_s`` (each worker gets its own copy of
    a command, as decoded from the wire), and the decode workers' KV receivers, by address."""

    def __init__(self, env: simpy.Environment, profiles: ProfileSet, layout: Layout, settings: SimSettings) -> None:
        self.env, self.profiles, self.layout, self.settings = env, profiles, layout, settings
        self.receivers: dict[str, SimReceiver] = {}
        config = settings.cluster_config(layout.mode)
        rng = random.Random(settings.seed)
        weights = {"prefix_weight": settings.prefix_weight, "load_weight": settings.load_weight}
        policies = {
            "prefill": make_policy(settings.prefill_policy, random.Random(rng.random()), **weights),
            "decode": make_policy(settings.decode_policy, random.Random(rng.random()), **weights),
        }
        policies["colocated"] = policies["decode"]
        metrics = RouterMetrics(worker_gauges=False)
        members = Membership(metrics, clock=lambda: env.now)
        self.core = RouterCore(config, metrics, Admission(settings.queue_size), members, policies)
        self.workers: dict[str, SimWorker] = {}
        pools: list[tuple[Role, int]] = [("colocated", layout.decode)]
        if layout.mode != "colocated":
            pools = [("prefill", layout.prefill), ("decode", layout.decode)]
        for role, count in pools:
            for i in range(count):
                self.start_worker(f"{role}-{i}", role)
        self.records: list[SimRecord] = []  # by trace index
        self._open: dict[Flow, SimRecord] = {}
        self._arrived = False
        self.all_done = env.event()

    def start_worker(self, name: str, role: Role, switch_result: str | None = None) -> SimWorker:
        """A worker of ``role``'s pool (its profile, KV blocks and batch limits), registered with the router core
        (``switch_result``: in its new pool after a role switch, planner/sim_switch.py) and heard from once."""
        s, layout = self.settings, self.layout
        if role == "prefill":
            profile, blocks = self.profiles.at(layout.prefill_degree), s.prefill_kv_blocks
            batch_tokens, num_seqs = s.prefill_max_batch_tokens, s.prefill_max_num_seqs
        else:
            profile, blocks = self.profiles.at(layout.decode_degree), s.decode_kv_blocks
            batch_tokens, num_seqs = s.decode_max_batch_tokens, s.decode_max_num_seqs
        old = self.workers.get(name)
        if old is not None and old.receiver is not None:
            self.receivers.pop(old.receiver.address, None)
        worker = self.workers[name] = SimWorker(self, name, role, profile, blocks, batch_tokens, num_seqs)
        kv_address = worker.receiver.address if worker.receiver is not None else None
        self.core.add_worker(name, role, name, kv_address, self.env.now, switch_result)
        self.core.on_event(worker.stats(), self.env.now)  # its first heartbeat, before any request
        return worker

    def clock(self) -> float:
        """The simulated time: what the decode roles' reservation expiry goes by."""
        return self.env.now

    def submit(self, index: int, trace: TraceRequest) -> None:
        params = SamplingParams(max_tokens=trace.output_tokens, temperature=0.0, ignore_eos=True)
        record = SimRecord(trace.arrival_s, math.inf, None, math.inf, trace.input_tokens, trace.output_tokens)
        self.records.append(record)
        flow = self.core.submit(f"r{index}", synthetic_prompt(index, trace), params, self.env.now)
        self._open[flow] = record
        self.flush()

    def to_router(self, event: Event) -> None:
        self._later(lambda: self._router_hears(event))

    def _router_hears(self, event: Event) -> None:
        self.core.on_event(event, self.env.now)
        self.flush()

    def _later(self, action: Callable[[], None]) -> None:
        timeout = self.env.timeout(self.settings.hop_s)
        timeout.callbacks.append(lambda _: action())

    def flush(self) -> None:
        core = self.core
        while core.outbox:
            name, command = core.outbox.popleft()
            worker = self.workers.get(name)
            if worker is not None:
                self._later(functools.partial(worker.handle, decode_command(encode(command))))
        for flow in core.take_updated():
            while (event := flow.take()) is not None:  # the client reads at once
                if event.cached_tokens is not None and flow in self._open:
                    self._open[flow].cached_tokens = event.cached_tokens
            if flow.status.ended and flow in self._open:
                self._record(flow, self._open.pop(flow))
                core.release(flow, self.env.now)
        self._check_done()

    def _record(self, flow: Flow, record: SimRecord) -> None:
        if flow.status is FlowStatus.FAILED:
            record.rejected = flow.error is not None and flow.error.status in (400, 429, 503)
            return
        timing = flow.timing
        record.ttft_s = timing.ttft_s if timing.ttft_s is not None else math.inf
        record.e2e_s = timing.e2e_s if timing.e2e_s is not None else math.inf
        if record.output_tokens > 1:
            record.tpot_s = (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)

    def _check_done(self) -> None:
        if self._arrived and not self._open and not self.all_done.triggered:
            self.all_done.succeed()

    def arrivals(self, trace: Sequence[TraceRequest]):
        for index, request in enumerate(trace):
            delay = request.arrival_s - self.env.now
            if delay > 0:
                yield self.env.timeout(delay)
            self.submit(index, request)
        self._arrived = True
        self._check_done()


def as_profile_set(profile: Profile | ProfileSet) -> ProfileSet:
    return profile if isinstance(profile, ProfileSet) else ProfileSet.of([profile])


def simulate(
    profile: Profile | ProfileSet,
    trace: Sequence[TraceRequest],
    layout: Layout,
    settings: SimSettings,
    beside: Callable[[SimCluster], Generator] | None = None,
) -> list[SimRecord]:
    """Serve ``trace`` on ``layout`` (each pool's degree needs its profile); one record per request, in arrival
    order. ``beside``: a process run with the cluster's (an autoscaler's: planner/sim_switch.py). Deterministic for
    one seed."""
    ordered = sorted(trace, key=lambda t: t.arrival_s)
    if not ordered:
        return []
    env = simpy.Environment()
    cluster = SimCluster(env, as_profile_set(profile), layout, settings)
    env.process(cluster.arrivals(ordered))
    if beside is not None:
        env.process(beside(cluster))
    horizon = ordered[-1].arrival_s + settings.request_timeout_s
    env.run(until=env.any_of([cluster.all_done, env.timeout(horizon)]))
    unfinished = [SimRecord(t.arrival_s, math.inf, None, math.inf, t.input_tokens, t.output_tokens) for t in ordered]
    return cluster.records + unfinished[len(cluster.records) :]
