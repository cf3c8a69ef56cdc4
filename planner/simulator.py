"""A discrete-event simulation (simpy) of one pdserve cluster serving a trace: what ``pdserve plan`` sizes pools with.

It runs the router's own ``RouterCore`` and, per worker, the engine's own ``Scheduler`` and ``BlockManager`` in
simulated time, talking in the protocol's typed messages delayed ``hop_s`` each. A step lasts what the ``Profile``
says (its tensor-parallel degree's profile: a ``ProfileSet`` holds one per degree); a prefill worker ships one KV
transfer at a time. Not modelled: failures, stops other than the length (each
request generates exactly its trace's output tokens), and the text.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Sequence
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
from engine.block_manager import BlockManager
from engine.blocks import blocks_for_tokens, reserved_tokens
from engine.request import FinishReason, ImportState, KVImport, Request, RequestStatus, RequestTiming, SamplingParams
from engine.scheduler import ScheduledChunk, Scheduler
from planner.profile_model import Profile, ProfileSet
from planner.trace import TraceRequest
from worker.messages import (
    Abort,
    Command,
    ErrorCode,
    ErrorEvent,
    Event,
    Generate,
    KvEvents,
    Prefill,
    RefusalReason,
    Reserve,
    Reserved,
    Role,
    Start,
    Stats,
    TokenItem,
    Tokens,
    WorkerCounters,
    WorkerLoad,
)


@dataclass(frozen=True, slots=True)
class Layout:
    mode: Literal["colocated", "disaggregated"]
    prefill: int  # colocated: 0
    decode: int  # colocated: every worker
    prefill_tp: int = 1  # ranks per prefill worker (pools.prefill.tensor_parallel_size)
    decode_tp: int = 1  # ranks per decode worker, or per colocated one

    def __post_init__(self) -> None:
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError(f"a layout's tensor-parallel degrees are at least 1, got {self}")
        if self.mode == "colocated" and (self.prefill != 0 or self.decode < 1):
            raise ValueError(f"a colocated layout has decode >= 1 workers and prefill 0, got {self}")
        if self.mode == "disaggregated" and (self.prefill < 1 or self.decode < 1):
            raise ValueError(f"a disaggregated layout needs a prefill and a decode worker, got {self}")

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    @property
    def devices(self) -> int:
        """Ranks in all (GPUs on a GPU cluster): a worker of degree N takes N."""
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    @property
    def label(self) -> str:
        def tp(degree: int) -> str:
            return f"(tp{degree})" if self.prefill_tp > 1 or self.decode_tp > 1 else ""

        if self.mode == "colocated":
            return f"colocated {self.decode}{tp(self.decode_tp)}"
        return f"{self.prefill}P{tp(self.prefill_tp)}:{self.decode}D{tp(self.decode_tp)}"


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
            measured = profiles.by_degree.get(pool.tensor_parallel_size)
            if count is None and measured is not None and measured.kv_blocks > 0:
                count = measured.kv_blocks
            if count is None:
                raise ValueError(
                    "pools: a GPU pool sizes its KV from free memory at start; set kv_memory_mb or kv_blocks to plan "
                    f"it, or use a profile of tensor_parallel_size {pool.tensor_parallel_size} that records its blocks"
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

    def meets(self, ttft_s: float, tpot_s: float) -> bool:
        """Both SLOs met (an unfinished or rejected request meets neither)."""
        if self.rejected or not math.isfinite(self.e2e_s) or self.ttft_s > ttft_s:
            return False
        return self.tpot_s is None or self.tpot_s <= tpot_s


SHARED_BASE, OWN_BASE, SPAN = 1 << 40, 1 << 50, 1 << 24  # token ids of shared prefixes and of each request's own part


def synthetic_prompt(index: int, trace: TraceRequest) -> list[int]:
    """Token ids that share exactly a trace's shared prefix: equal for one ``prefix_id``, distinct otherwise."""
    shared = trace.prefix_tokens if trace.prefix_id is not None else 0
    head = [SHARED_BASE + trace.prefix_id * SPAN + i for i in range(shared)] if shared else []  # type: ignore[operator]
    return head + [OWN_BASE + index * SPAN + i for i in range(trace.input_tokens - shared)]


class SimWorker:
    """One worker in simulated time: takes the router's commands as its role does, steps the engine's scheduler for
    its degree's profiled step time, and sends back what a worker would."""

    def __init__(
        self,
        cluster: SimCluster,
        name: str,
        role: Role,
        profile: Profile,
        blocks: int,
        max_batch_tokens: int,
        max_num_seqs: int,
    ) -> None:
        self.cluster, self.name, self.role = cluster, name, role
        self.env, self.profile = cluster.env, profile
        self.blocks = BlockManager(blocks, cluster.settings.block_size, cluster.settings.prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_batch_tokens, max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, Request] = {}
        self.transfers: dict[str, tuple[str, int]] = {}  # prefill: rid -> (decode worker, tokens to send)
        self.link = simpy.Resource(self.env, 1)  # prefill: its KV sender, one transfer at a time
        self.leased = 0  # prefill: finished prompts whose blocks wait for their transfer
        self._seq = 0
        self._wake: simpy.Event | None = None
        self.env.process(self._loop())

    # ---- commands ------------------------------------------------------------------------------------------------

    def handle(self, command: Command) -> None:
        """A heartbeat follows when the command changed what the worker holds, never after a refusal (so a queued
        request does not ask again until something changed)."""
        if isinstance(command, Reserve):
            if not self._reserve(command):
                return
        elif isinstance(command, Prefill):
            request = self._request(command.rid, command.prompt, command.params, prefill_only=True)
            # a simulated worker's KV address is its name
            self.transfers[command.rid] = (command.kv_address, command.cached_tokens)
            self.scheduler.add(request)
        elif isinstance(command, Generate):
            self.scheduler.add(self._request(command.rid, command.prompt, command.params))
        elif isinstance(command, Start):
            held = self.requests.get(command.rid)
            if held is not None and held.kv_import is not None:
                handoff = held.kv_import
                handoff.tokens = list(command.tokens)
                handoff.state = ImportState.READY if handoff.state is ImportState.KV_IN else ImportState.TOKENS_IN
                self.scheduler.import_progress(held)
        elif isinstance(command, Abort):
            self._end(command.rid)
        self.heartbeat()
        self.notify()

    def _request(self, rid: str, prompt: list[int], params: SamplingParams, prefill_only: bool = False) -> Request:
        request = Request(rid, prompt, params, RequestTiming(self.env.now), prefill_only=prefill_only)
        self.requests[rid] = request
        return request

    def _reserve(self, command: Reserve) -> bool:
        """The decode role's reservation (decode/worker.py) on the engine's scheduler; False when it refused."""
        settings = self.cluster.settings
        if blocks_for_tokens(len(command.prompt) + 1, settings.block_size) > self.blocks.num_blocks:
            message = "the prompt needs more than the whole KV cache"
            self.send(ErrorEvent(rid=command.rid, worker=self.name, message=message, code=ErrorCode.INVALID_REQUEST))
            return False
        request = Request(command.rid, command.prompt, command.params, RequestTiming(self.env.now))
        max_len = settings.max_model_len or (1 << 30)
        num_tokens = reserved_tokens(
            len(command.prompt), command.params.max_tokens, settings.reserve_headroom_tokens, max_len
        )
        request.kv_import = KVImport(expected_s=self.env.now)
        if len(self.requests) >= self.max_num_seqs or not self.scheduler.reserve_remote(request, num_tokens, True):
            reason: RefusalReason = "max_num_seqs" if len(self.requests) >= self.max_num_seqs else "kv_full"
            self.send(Reserved(rid=command.rid, worker=self.name, ok=False, reason=reason))
            return False
        self.requests[command.rid] = request
        local = 0 < len(command.prompt) - request.num_cached_tokens <= command.local_prefill_max_tokens
        first = request.num_cached_tokens // settings.block_size
        reply = Reserved(
            rid=command.rid,
            worker=self.name,
            ok=True,
            blocks=request.block_ids[first:],
            kv_address=self.name,
            cached_tokens=request.num_cached_tokens,
            prefill_local=local,
        )
        self.send(reply)
        if local:
            self.scheduler.prefill_here(request)
        return True

    def kv_arrived(self, rid: str) -> None:
        """A transfer into this (decode) worker is complete."""
        request = self.requests.get(rid)
        if request is not None and request.status is RequestStatus.WAITING_FOR_REMOTE_KV and request.kv_import:
            handoff = request.kv_import
            handoff.kv_done_s = self.env.now
            handoff.state = ImportState.READY if handoff.state is ImportState.TOKENS_IN else ImportState.KV_IN
            self.scheduler.import_progress(request)
            self.notify()

    # ---- the loop ------------------------------------------------------------------------------------------------

    def notify(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _loop(self):
        while True:
            items = [self._admitted(r) for r in self.scheduler.admit_remote()]
            chunks = self.scheduler.schedule()
            if chunks:
                yield self.env.timeout(self._step_s(chunks))
                items += [item for chunk in chunks if (item := self._computed(chunk)) is not None]
            if items:
                self.send(Tokens(worker=self.name, items=items))
                self._publish_kv_events()
                self.heartbeat()
            if not chunks:
                self._wake = self.env.event()
                yield self._wake
                self._wake = None

    def _admitted(self, request: Request) -> TokenItem:
        """A remote request joins the batch with its first token (the prefill worker's): no token of its own."""
        assert request.kv_import is not None and request.kv_import.tokens
        self.scheduler.register_full_blocks(request)
        return self._append(request, request.kv_import.tokens[0], own=False)

    def _computed(self, chunk: ScheduledChunk) -> TokenItem | None:
        request = chunk.request
        request.num_computed_tokens = chunk.end
        self.scheduler.register_full_blocks(request)
        return self._append(request, 1) if chunk.samples else None

    def _append(self, request: Request, token_id: int, own: bool = True) -> TokenItem:
        request.output_token_ids.append(token_id)
        finish = None  # a prefilled request goes on at the decode worker
        if request.prefill_only:
            self.scheduler.remove(request)
            request.status = RequestStatus.PREFILLED  # its blocks are leased until the transfer ends
            self.leased += 1
            self.env.process(self._transfer(request))
        elif len(request.output_token_ids) >= request.params.max_tokens:
            finish = FinishReason.LENGTH
            self._end(request.request_id)
        return TokenItem(request.request_id, [token_id] if own else [], "", finish)

    def _transfer(self, request: Request):
        decode, cached_tokens = self.transfers.pop(request.request_id, ("", 0))
        num_bytes = (request.num_prompt_tokens - cached_tokens) * self.profile.kv_bytes_per_token
        with self.link.request() as turn:
            yield turn
            yield self.env.timeout(self.cluster.profiles.transfer_s(num_bytes, self.cluster.layout.decode_tp))
        self.leased -= 1
        self._end(request.request_id)
        target = self.cluster.workers.get(decode)
        if target is not None:
            target.kv_arrived(request.request_id)
        self.heartbeat()

    def _end(self, rid: str) -> None:
        request = self.requests.pop(rid, None)
        if request is None:
            return
        self.scheduler.remove(request)
        self.blocks.free(request.block_ids)
        request.status = RequestStatus.FINISHED

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

    def send(self, event: Event) -> None:
        self.cluster.to_router(event)

    def heartbeat(self) -> None:
        self.send(self.stats())

    def stats(self) -> Stats:
        scheduler = self.scheduler
        awaiting = sum(r.status is RequestStatus.WAITING_FOR_REMOTE_KV for r in self.requests.values())
        load = WorkerLoad(
            waiting=len(scheduler.waiting),
            running=len(scheduler.running),
            requests=len(self.requests),
            max_requests=self.max_num_seqs,
            free_blocks=self.blocks.num_free_blocks,
            total_blocks=self.blocks.num_blocks,
            awaiting_kv=awaiting,
            leased_transfers=self.leased,
        )
        return Stats(worker=self.name, role=self.role, address=self.name, load=load, counters=WorkerCounters())

    def _publish_kv_events(self) -> None:
        batch = self.blocks.drain_kv_events()
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
    """The router core and the workers, joined by messages that each take ``hop_s``."""

    def __init__(self, env: simpy.Environment, profiles: ProfileSet, layout: Layout, settings: SimSettings) -> None:
        self.env, self.profiles, self.layout, self.settings = env, profiles, layout, settings
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
        s = settings
        decode = profiles.at(layout.decode_tp), s.decode_kv_blocks, s.decode_max_batch_tokens, s.decode_max_num_seqs
        pools: list[tuple[Role, int, Profile, int, int, int]]
        if layout.mode == "colocated":
            pools = [("colocated", layout.decode, *decode)]
        else:
            prefill = profiles.at(layout.prefill_tp), s.prefill_kv_blocks, s.prefill_max_batch_tokens
            pools = [("prefill", layout.prefill, *prefill, s.prefill_max_num_seqs), ("decode", layout.decode, *decode)]
        for role, count, profile, blocks, batch_tokens, num_seqs in pools:
            for i in range(count):
                name = f"{role}-{i}"
                worker = self.workers[name] = SimWorker(self, name, role, profile, blocks, batch_tokens, num_seqs)
                self.core.add_worker(name, role, name, name, env.now)
                self.core.on_event(worker.stats(), env.now)  # its first heartbeat, before any request
        self.records: list[SimRecord] = []  # by trace index
        self._open: dict[Flow, SimRecord] = {}
        self._arrived = False
        self.all_done = env.event()

    def submit(self, index: int, trace: TraceRequest) -> None:
        params = SamplingParams(max_tokens=trace.output_tokens, temperature=0.0, ignore_eos=True)
        record = SimRecord(trace.arrival_s, math.inf, None, math.inf, trace.input_tokens, trace.output_tokens)
        self.records.append(record)
        flow = self.core.submit(f"r{index}", synthetic_prompt(index, trace), params, self.env.now)
        self._open[flow] = record
        self._flush()

    def to_router(self, event: Event) -> None:
        self._later(lambda: self._router_hears(event))

    def _router_hears(self, event: Event) -> None:
        self.core.on_event(event, self.env.now)
        self._flush()

    def _later(self, action: Callable[[], None]) -> None:
        timeout = self.env.timeout(self.settings.hop_s)
        timeout.callbacks.append(lambda _: action())

    def _flush(self) -> None:
        core = self.core
        while core.outbox:
            name, command = core.outbox.popleft()
            worker = self.workers.get(name)
            if worker is not None:
                self._later(functools.partial(worker.handle, command))
        for flow in core.take_updated():
            while flow.take() is not None:  # the client reads at once
                pass
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
    profile: Profile | ProfileSet, trace: Sequence[TraceRequest], layout: Layout, settings: SimSettings
) -> list[SimRecord]:
    """Serve ``trace`` on ``layout`` (each pool's degree needs its profile); one record per request, in arrival
    order. Deterministic for one seed."""
    ordered = sorted(trace, key=lambda t: t.arrival_s)
    if not ordered:
        return []
    env = simpy.Environment()
    cluster = SimCluster(env, as_profile_set(profile), layout, settings)
    env.process(cluster.arrivals(ordered))
    horizon = ordered[-1].arrival_s + settings.request_timeout_s
    env.run(until=env.any_of([cluster.all_done, env.timeout(horizon)]))
    unfinished = [SimRecord(t.arrival_s, math.inf, None, math.inf, t.input_tokens, t.output_tokens) for t in ordered]
    return cluster.records + unfinished[len(cluster.records) :]
