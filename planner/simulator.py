"""A discrete-event simulation (simpy) of one pdserve cluster serving a trace: what ``pdserve plan`` sizes pools with.

The parts that decide where work goes and when it runs are the real ones where they can be: the router's routing
policies (``cluster.routing.policies.make_policy``, ordering ``SimWorker``s shaped like the router's ``WorkerHandle``: a name,
``inflight`` and a ``Stats`` heartbeat), its prefix index (``cluster.routing.prefix_index.PrefixIndex``, fed with one hash per
shared-prefix block), its block arithmetic (``engine.blocks``) and ``MAX_WORKERS_TRIED``; the engine's scheduler
rules are mirrored step by step in planner/sim_engine.py. Times come from a measured ``Profile``.

A request's path, as in docs/request-lifecycle.md:

- colocated: the decode policy picks a worker, which prefills it in chunks mixed with its decodes and decodes it;
- disaggregated: decode KV is reserved first (policy order, up to ``MAX_WORKERS_TRIED`` with room; none: the request
  waits in the router's bounded queue until a decode worker frees blocks; full queue: rejected, a 429), then the
  prefill policy picks a prefill worker; at its first token the KV goes to the decode worker (``profile.transfer_s``
  of the prompt's KV bytes; one transfer at a time per prefill worker, overlapping its next prefills) while the token
  goes to the router and on to the decode worker; with both in, the request joins the decode batch.

Every message between router and worker takes ``hop_s``. TTFT: arrival to the first token at the router (prefill end
+ one hop); TPOT: (e2e - TTFT) / (output - 1). Heartbeats are exact (a worker's ``stats`` is its state now, where the
real router's is up to 0.2 s old). Not modelled: conditional disaggregation (``local_prefill_max_tokens``), a decode
worker's own prefix cache, prefix-cache eviction, and failures.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import simpy

from cluster.config import ClusterConfig
from cluster.routing.policies import Policy, PrefixMatch, make_policy
from cluster.routing.prefix_index import PrefixIndex
from cluster.routing.reservations import MAX_WORKERS_TRIED
from engine.blocks import blocks_for_tokens, reserved_blocks, reusable_prefix_tokens
from planner.profile_model import Profile
from planner.sim_engine import SimEngine, SimRequest
from planner.trace import TraceRequest
from worker.messages import Stats, WorkerCounters, WorkerLoad

__all__ = ["Layout", "SimRecord", "SimSettings", "TraceRequest", "simulate"]


@dataclass(frozen=True, slots=True)
class Layout:
    mode: Literal["colocated", "disaggregated"]
    prefill: int  # colocated: 0
    decode: int  # colocated: every worker

    def __post_init__(self) -> None:
        if self.mode == "colocated" and (self.prefill != 0 or self.decode < 1):
            raise ValueError(f"a colocated layout has decode >= 1 workers and prefill 0, got {self}")
        if self.mode == "disaggregated" and (self.prefill < 1 or self.decode < 1):
            raise ValueError(f"a disaggregated layout needs a prefill and a decode worker, got {self}")

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    @property
    def label(self) -> str:
        return f"colocated {self.decode}" if self.mode == "colocated" else f"{self.prefill}P:{self.decode}D"


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
    queue_size: int = 256  # requests waiting for decode KV before rejection
    hop_s: float = 0.0005  # one router <-> worker message
    request_timeout_s: float = 300.0  # the simulation ends this long after the last arrival
    seed: int = 0  # the policies' tie-breaking

    @classmethod
    def from_config(cls, config: ClusterConfig, profile: Profile) -> SimSettings:
        """The settings a cluster with this config would run with; KV blocks per worker from ``kv_blocks`` or
        ``kv_memory_mb`` over the profile's KV bytes per block (the engine's rule, engine/engine_parts.py)."""
        block_size = config.transfer.block_size
        bytes_per_block = max(1, profile.kv_bytes_per_token * block_size)

        def blocks(pool) -> int:
            count = config.pool_kv_blocks(pool, bytes_per_block)
            if count is None:
                raise ValueError(
                    "pools: a GPU pool sizes its KV from free memory at start; set kv_memory_mb or kv_blocks to plan it"
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
            queue_size=router.queue_size,
            request_timeout_s=router.request_timeout_s,
        )


@dataclass(slots=True)
class SimRecord:
    arrival_s: float
    ttft_s: float  # inf: no first token (rejected, or not before the simulation ended)
    tpot_s: float | None  # None: one output token, or unfinished
    e2e_s: float  # inf: unfinished
    input_tokens: int
    output_tokens: int
    rejected: bool = False  # the router's queue was full, or no worker's KV cache can hold it

    def meets(self, ttft_s: float, tpot_s: float) -> bool:
        """Both SLOs met (an unfinished or rejected request meets neither)."""
        if self.rejected or not math.isfinite(self.e2e_s) or self.ttft_s > ttft_s:
            return False
        return self.tpot_s is None or self.tpot_s <= tpot_s


@dataclass(slots=True, eq=False)
class _Flight:
    """One request at the router: where it went and when its tokens came."""

    index: int
    trace: TraceRequest
    first_token_s: float | None = None  # at the worker
    last_token_s: float | None = None
    done: bool = False
    rejected: bool = False
    prefill: SimWorker | None = None
    decode: SimWorker | None = None
    decode_req: SimRequest | None = None


@dataclass(slots=True, eq=False)
class SimWorker:
    """What the routing policies read of a worker (``cluster.routing.policies.Candidate``, as ``WorkerHandle`` has it)."""

    name: str
    role: Literal["prefill", "decode", "colocated"]
    engine: SimEngine
    inflight: int = 0
    link: simpy.Resource | None = None  # prefill: its KV sender, one transfer at a time

    @property
    def stats(self) -> Stats:
        e = self.engine
        load = WorkerLoad(
            waiting=len(e.waiting),
            running=len(e.running),
            requests=len(e.waiting) + len(e.running) + len(e.awaiting),
            free_blocks=e.free_blocks,
            total_blocks=e.total_blocks,
            awaiting_kv=len(e.awaiting),
            leased_transfers=e.leased,
        )
        return Stats(worker=self.name, role=self.role, address=self.name, load=load, counters=WorkerCounters())


class _Cluster:
    def __init__(self, env: simpy.Environment, profile: Profile, layout: Layout, settings: SimSettings) -> None:
        self.env, self.profile, self.layout, self.s = env, profile, layout, settings
        rng = random.Random(settings.seed)
        weights = {"prefix_weight": settings.prefix_weight, "load_weight": settings.load_weight}
        self.policies: dict[str, Policy] = {
            "prefill": make_policy(settings.prefill_policy, random.Random(rng.random()), **weights),
            "decode": make_policy(settings.decode_policy, random.Random(rng.random()), **weights),
        }
        self.index = PrefixIndex()
        self._index_seq: dict[str, int] = {}
        self.capacity = env.event()  # fired (and replaced) whenever a decode worker frees blocks
        self.queued = 0
        self.finished = 0
        self.all_done = env.event()
        self.expected = 0
        s = settings
        if layout.mode == "colocated":
            self.prefill = []
            self.decode = [
                self._worker(
                    f"decode-{i}", "colocated", s.decode_kv_blocks, s.decode_max_batch_tokens, s.decode_max_num_seqs
                )
                for i in range(layout.decode)
            ]
        else:
            self.prefill = [
                self._worker(
                    f"prefill-{i}", "prefill", s.prefill_kv_blocks, s.prefill_max_batch_tokens, s.prefill_max_num_seqs
                )
                for i in range(layout.prefill)
            ]
            self.decode = [
                self._worker(
                    f"decode-{i}", "decode", s.decode_kv_blocks, s.decode_max_batch_tokens, s.decode_max_num_seqs
                )
                for i in range(layout.decode)
            ]

    def _worker(self, name: str, role: str, blocks: int, batch_tokens: int, num_seqs: int) -> SimWorker:
        worker = SimWorker(name, role, None, link=simpy.Resource(self.env, 1) if role == "prefill" else None)  # type: ignore[arg-type]
        worker.engine = SimEngine(
            self.env,
            self.profile,
            role,
            blocks,
            self.s.block_size,
            batch_tokens,
            num_seqs,
            self.s.prefix_caching,
            on_first_token=lambda req, now: self._first_token(worker, req, now),
            on_finished=lambda req, now: self._finished(worker, req, now),
            on_capacity=self._capacity if role == "decode" else _nothing,
            on_prefix_cached=lambda prefix_id, blocks: self._cached(worker, prefix_id, blocks),
        )
        return worker

    # ---- the router --------------------------------------------------------------------------------------------------

    def arrivals(self, flights: Sequence[_Flight]):
        for flight in flights:
            delay = flight.trace.arrival_s - self.env.now
            if delay > 0:
                yield self.env.timeout(delay)
            self.env.process(self._dispatch(flight))

    def _dispatch(self, flight: _Flight):
        trace, s = flight.trace, self.s
        match = self._match(trace)
        if self.layout.mode == "colocated":
            if blocks_for_tokens(trace.input_tokens + 1, s.block_size) > s.decode_kv_blocks:
                self._reject(flight)
                return
            worker = self.policies["decode"].order(self.decode, match)[0]
            flight.decode = worker
            worker.inflight += 1
            yield self.env.timeout(s.hop_s)
            worker.engine.add(_engine_request(flight, trace.input_tokens))
            return
        needed = reserved_blocks(
            trace.input_tokens, trace.output_tokens, s.reserve_headroom_tokens, s.block_size, s.max_model_len
        )
        if needed > s.decode_kv_blocks:
            self._reject(flight)
            return
        decode = None
        while decode is None:
            order = self.policies["decode"].order(self.decode, PrefixMatch(trace.input_tokens))
            for worker in [w for w in order if w.engine.free_blocks >= needed][:MAX_WORKERS_TRIED]:
                req = _engine_request(flight, trace.input_tokens + 1)
                req.generated = 1  # its first token comes from the prefill worker
                if worker.engine.reserve(req, needed):
                    decode, flight.decode_req = worker, req
                    break
            if decode is None:
                if self.queued >= s.queue_size:
                    self._reject(flight)
                    return
                self.queued += 1
                yield self.capacity
                self.queued -= 1
        flight.decode = decode
        decode.inflight += 1
        yield self.env.timeout(2 * s.hop_s)  # reserve and its reply
        prefill = self.policies["prefill"].order(self.prefill, match)[0]
        flight.prefill = prefill
        prefill.inflight += 1
        yield self.env.timeout(s.hop_s)
        prefill.engine.add(_engine_request(flight, trace.input_tokens))

    def _match(self, trace: TraceRequest) -> PrefixMatch:
        """The router's ``Dispatcher.prefix_match``: the prompt's full blocks against the index, cut by the engine's
        at-least-one-token rule. Only shared-prefix blocks can be held by another request, so only they are hashed."""
        if trace.prefix_id is None or not len(self.index):
            return PrefixMatch(trace.input_tokens)
        blocks = self.index.match(_prefix_hashes(trace.prefix_id, trace.prefix_tokens // self.s.block_size))
        tokens = {n: reusable_prefix_tokens(b, trace.input_tokens, self.s.block_size) for n, b in blocks.items()}
        return PrefixMatch(trace.input_tokens, {n: t for n, t in tokens.items() if t > 0})

    def _cached(self, worker: SimWorker, prefix_id: int, blocks: int) -> None:
        """A worker's KV event: it now holds a prefix's blocks."""
        seq = self._index_seq.get(worker.name, 0)
        self._index_seq[worker.name] = seq + 1
        self.index.apply(worker.name, seq, _prefix_hashes(prefix_id, blocks), [])

    def _reject(self, flight: _Flight) -> None:
        flight.rejected = True
        self._count_done()

    def _capacity(self) -> None:
        event, self.capacity = self.capacity, self.env.event()
        event.succeed()

    # ---- the workers' events -----------------------------------------------------------------------------------------

    def _first_token(self, worker: SimWorker, req: SimRequest, now: float) -> None:
        flight: _Flight = req.flight
        flight.first_token_s = flight.last_token_s = now
        if worker.role != "prefill":
            return
        worker.inflight -= 1
        decode = flight.decode
        assert decode is not None and flight.decode_req is not None
        if flight.trace.output_tokens == 1:  # nothing to decode: the reservation is given up, no KV moves
            decode.engine.awaiting.remove(flight.decode_req)
            decode.engine.release(flight.decode_req)
            worker.engine.transfer_done(req)
            decode.inflight -= 1
            flight.done = True
            self._count_done()
            return
        self.env.process(self._start(flight))
        self.env.process(self._transfer(worker, req, flight))

    def _start(self, flight: _Flight):
        yield self.env.timeout(2 * self.s.hop_s)  # first token to the router, Start to the decode worker
        flight.decode_req.token_in = True
        flight.decode.engine.remote_progress(flight.decode_req)

    def _transfer(self, prefill: SimWorker, req: SimRequest, flight: _Flight):
        with prefill.link.request() as turn:
            yield turn
            yield self.env.timeout(self.profile.transfer_s(flight.trace.input_tokens * self.profile.kv_bytes_per_token))
        prefill.engine.transfer_done(req)
        flight.decode_req.kv_in = True
        flight.decode.engine.remote_progress(flight.decode_req)

    def _finished(self, worker: SimWorker, req: SimRequest, now: float) -> None:
        if worker.role == "prefill":
            return  # its lease ends with its transfer
        flight: _Flight = req.flight
        flight.last_token_s, flight.done = now, True
        worker.inflight -= 1
        self._count_done()

    def _count_done(self) -> None:
        self.finished += 1
        if self.finished == self.expected and not self.all_done.triggered:
            self.all_done.succeed()


def _nothing() -> None:
    return None


def _engine_request(flight: _Flight, num_tokens: int) -> SimRequest:
    return SimRequest(flight.index, flight.trace, num_tokens, flight=flight)


def _prefix_hashes(prefix_id: int, blocks: int) -> list[int]:
    """Stand-ins for a shared prefix's chained block hashes: equal for equal (prefix, depth), distinct otherwise."""
    return [hash(("prefix", prefix_id, depth)) for depth in range(blocks)]


def simulate(profile: Profile, trace: Sequence[TraceRequest], layout: Layout, settings: SimSettings) -> list[SimRecord]:
    """Serve ``trace`` on ``layout``; one record per request, in arrival order. Deterministic for one seed."""
    env = simpy.Environment()
    cluster = _Cluster(env, profile, layout, settings)
    flights = [_Flight(i, t) for i, t in enumerate(sorted(trace, key=lambda t: t.arrival_s))]
    cluster.expected = len(flights)
    if not flights:
        return []
    env.process(cluster.arrivals(flights))
    horizon = flights[-1].trace.arrival_s + settings.request_timeout_s
    env.run(until=env.any_of([cluster.all_done, env.timeout(horizon)]))
    return [_record(f, settings.hop_s) for f in flights]


def _record(flight: _Flight, hop_s: float) -> SimRecord:
    trace = flight.trace
    ttft = e2e = math.inf
    tpot = None
    if flight.first_token_s is not None:
        ttft = flight.first_token_s + hop_s - trace.arrival_s
    if flight.done:
        e2e = flight.last_token_s + hop_s - trace.arrival_s
        if trace.output_tokens > 1:
            tpot = (e2e - ttft) / (trace.output_tokens - 1)
    return SimRecord(trace.arrival_s, ttft, tpot, e2e, trace.input_tokens, trace.output_tokens, flight.rejected)
