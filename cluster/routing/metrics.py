"""Prometheus metrics of one router, in a registry of its own (several routers can live in one test process).

Latency histograms come from the router's view of each request; per-worker gauges and transfer counters from the
workers' heartbeats. Several router processes use prometheus_client's multiprocess mode (the launcher sets
``PROMETHEUS_MULTIPROC_DIR`` first): ``/metrics`` on any renders all, counters and the router's own gauges summed,
gauges copied from heartbeats (which every process hears) as the most recent value.
"""

from __future__ import annotations

import os
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cluster.routing.errors import Overloaded
from worker.messages import Stats, WorkerCounters, WorkerLoad
from worker.protocol import Rejection

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# heartbeat fields under their own names: load as ``pdserve_worker{key}``, counters as ``pdserve_worker_total{key}``
GAUGE_KEYS: tuple[str, ...] = WorkerLoad.__struct_fields__
TOTAL_KEYS: tuple[str, ...] = WorkerCounters.__struct_fields__
# ``pdserve_ttft_stage_seconds{stage}``: the Timing fields (worker/messages.py) that add up to a request's TTFT
TTFT_STAGES: tuple[str, ...] = ("router_queue", "prefill_queue", "prefill_compute", "first_token_delivery")


class RouterMetrics:
    def __init__(self, multiprocess: bool = False, worker_gauges: bool = True) -> None:
        """``worker_gauges``: copy every heartbeat into gauges (off in the planner's simulator: nobody scrapes it)."""
        # only where the launcher set the folder up before prometheus_client was imported (cluster/run/frontend.py)
        self.multiprocess = multiprocess and bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = CollectorRegistry()
        self._worker_children: dict[tuple[str, str], tuple] = {}
        self.worker_gauges = worker_gauges
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple = LATENCY_BUCKETS, labels: tuple = ()) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def gauge(name: str, doc: str, *labels: str, mode: Literal["livesum", "mostrecent"] = "mostrecent") -> Gauge:
            """``mostrecent``: copied from heartbeats, which every router process hears."""
            return Gauge(name, doc, labels, registry=r, multiprocess_mode=mode)

        self.ttft = histogram("pdserve_ttft_seconds", "Time to first token at the router")
        self.tpot = histogram("pdserve_tpot_seconds", "Time per output token after the first")
        self.e2e = histogram("pdserve_e2e_seconds", "End-to-end request latency")
        self.itl = histogram(
            "pdserve_itl_seconds",
            "Inter-token latency: time between one stream's successive token messages at the router (a message that "
            "brings several tokens, e.g. speculative decoding's, is one gap)",
        )
        self.ttft_stage = histogram(
            "pdserve_ttft_stage_seconds",
            "A finished request's TTFT by stage, which sum to its TTFT: router_queue (arrival to dispatch), "
            "prefill_queue and prefill_compute (on the worker that computed the prompt), first_token_delivery (the "
            "rest: the first token's trip to the router)",
            labels=("stage",),
        )
        for stage in TTFT_STAGES:
            self.ttft_stage.labels(stage)  # every stage shows from the start
        self.kv_transfer = histogram(
            "pdserve_kv_transfer_seconds", "Decode reservation to complete KV (spans the prefill)"
        )
        self.migrations = counter(
            "pdserve_migrations_total",
            "Moves of running requests between decode workers, by how they ended: moved (KV shipped), recomputed "
            "(the KV did not come: the target recomputed), resumed (called off: the source runs it on), refused "
            "(the source could not stop it, or no target had room), finished (it ended on the source before it "
            "stopped), failed (both ends lost, or the target died after it streamed)",
            "reason",
            "result",
        )
        self.role_switches = counter(
            "pdserve_role_switches_total",
            "Workers switching role in place (prefill <-> decode, weights kept), by the role switched to and how it "
            "ended: done, called_off (it did not drain within its deadline: it kept its old role), restarted (it "
            "died mid-switch and came back in the new role)",
            "to",
            "result",
        )
        self.migration_stall = histogram(
            "pdserve_migration_seconds",
            "A moved stream's standstill: its freeze on the source (after the pre-copy) until the move ended",
        )
        self.kv_after_prefill = histogram(
            "pdserve_kv_after_prefill_seconds",
            "KV complete minus first token sampled (<= 0: transfer fully hidden)",
            (-1, -0.1, -0.01, 0, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.requests = counter("pdserve_requests", "Requests by outcome", "outcome")
        self.errors = counter("pdserve_errors", "Failed or aborted requests by reason", "reason")
        self.errors.labels(Overloaded.code)  # the 429s show, at 0, from the start: a rate sees the first one
        self.http_errors = counter(
            "pdserve_http_errors",
            "Error responses of the HTTP API by status and OpenAI error type: refused input (400, 413, 422), auth "
            "(401), unknown routes (404), the router's refusals and failures before a stream began (429, 503, ...)",
            "status",
            "type",
        )
        self.http_errors.labels("400", "invalid_request_error")  # at 0 from the start
        self.queue_depth = gauge("pdserve_router_queue_depth", "Requests waiting for decode KV", mode="livesum")
        self.inflight = gauge("pdserve_router_inflight", "Requests in flight at the router", mode="livesum")
        self.control_rejected = counter(
            "pdserve_control_rejected",
            "Worker events dropped unread by the router: bad or missing MAC, replayed, multipart, malformed; and peers "
            "without the cluster's keys refused in the handshake",
            "reason",
        )
        for reason in Rejection:
            self.control_rejected.labels(reason.value)  # every reason shows, at 0, from the start
        self.task_restarts = counter(
            "pdserve_router_task_restarts", "Router background tasks that crashed and were restarted", "task"
        )
        self.worker_degraded = gauge(
            "pdserve_worker_degraded",
            "1 while a worker reports itself degraded (its loop or a "
            "transfer thread keeps failing); it gets no new requests",
            "worker",
            "pool",
        )
        self.spec_mean_accepted_length = gauge(
            "pdserve_spec_mean_accepted_length",
            "Speculative decoding: tokens a verifying request gained per step (1 + accepted proposed tokens per "
            "verification; the counts are pdserve_worker_total{key=spec_*})",
            "worker",
            "pool",
        )
        self.expert_load_imbalance = gauge(
            "pdserve_expert_load_imbalance",
            "Expert parallelism: the (token, expert) pairs of the busiest rank's experts over a rank's mean, since the "
            "worker started (1.0: even; the counts are pdserve_worker_total{key=expert_*})",
            "worker",
            "pool",
        )
        self.worker_revivals = counter("pdserve_worker_revivals", "Workers marked dead that were heard from again")
        # prefix-aware routing, per pool: the predicted prefix hit rate is matched / routed prompt tokens
        self.routing_decisions = counter(
            "pdserve_routing_decisions",
            "Worker picks by what decided them: prefix (the chosen worker holds more of the prompt than another "
            "candidate), load, or affinity (an earlier request's worker, asked for: n > 1 choices)",
            "pool",
            "reason",
        )
        self.routed_prompt_tokens = counter(
            "pdserve_routed_prompt_tokens", "Prompt tokens routed to prefill/colocated workers", "pool"
        )
        self.prefix_matched_tokens = counter(
            "pdserve_prefix_matched_tokens",
            "Routed prompt tokens the chosen worker held on device in its prefix cache (router's view, engine's "
            "reuse rule)",
            "pool",
        )
        self.tier_matched_tokens = counter(
            "pdserve_tier_matched_tokens",
            "Routed prompt tokens the chosen worker would load back from its host or disk KV tier, after those on "
            "device (router's view)",
            "pool",
            "tier",
        )
        self.kv_events = counter(
            "pdserve_kv_events",
            "Workers' KvEvents messages applied: delta, reset (a snapshot), gap (a missed message: view dropped)",
            "kind",
        )
        self.prefix_index_blocks = gauge(
            "pdserve_prefix_index_blocks",
            "Prefix-cache blocks the router knows a worker holds, per KV tier (device: dispatched ones included)",
            "worker",
            "pool",
            "tier",
        )
        self.workers_alive = gauge("pdserve_workers_alive", "Live workers per pool", "pool")
        self.worker_gauge = gauge("pdserve_worker", "Per-worker load from heartbeats", "worker", "pool", "key")
        self.worker_total = gauge(
            "pdserve_worker_total", "Per-worker counters from heartbeats", "worker", "pool", "key"
        )
        self.prefill_path = counter(
            "pdserve_prefill_path",
            "Disaggregated requests by where their prompt was computed: remote (a prefill worker, KV transferred) or "
            "local (the decode worker itself: router.local_prefill_max_tokens)",
            "path",
        )
        self.decode_cached_tokens = counter(
            "pdserve_decode_cached_prompt_tokens",
            "Prompt tokens the chosen decode worker already held (prefix cache): not reserved anew, not transferred",
        )
        for path in ("remote", "local"):
            self.prefill_path.labels(path)  # both show, at 0, from the start
        self.prompt_tokens = counter("pdserve_prompt_tokens", "Prompt tokens served")
        self.generated_tokens = counter("pdserve_generated_tokens", "Tokens generated")
        # workers send text: kept at 0 so that ``pdserve bench frontend`` shows it
        self.detokenize_seconds = counter(
            "pdserve_router_detokenize_seconds",
            "CPU time the router process spent detokenizing (0: the workers send text)",
        )

    def observe_worker(self, stats: Stats) -> None:
        """A heartbeat's gauges (labelled children looked up once per worker: heartbeats come often)."""
        if not self.worker_gauges:
            return
        children = self._worker_children.get((stats.worker, stats.role))
        if children is None:
            worker, pool = stats.worker, stats.role
            children = self._worker_children[(worker, pool)] = (
                [self.worker_gauge.labels(worker, pool, key) for key in GAUGE_KEYS],
                [self.worker_total.labels(worker, pool, key) for key in TOTAL_KEYS],
                self.worker_degraded.labels(worker, pool),
            )
        gauges, totals, degraded = children
        load, counters = stats.load, stats.counters
        for key, child in zip(GAUGE_KEYS, gauges):
            child.set(getattr(load, key))
        for key, child in zip(TOTAL_KEYS, totals):
            child.set(getattr(counters, key))
        degraded.set(1 if stats.degraded else 0)
        if counters.spec_verify_steps:  # only workers that verified proposals show it (no 0 for "none")
            self.spec_mean_accepted_length.labels(stats.worker, stats.role).set(counters.spec_mean_accepted_length)
        if counters.expert_pairs_mean_rank:  # only workers whose experts are split
            self.expert_load_imbalance.labels(stats.worker, stats.role).set(counters.expert_load_imbalance)

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()  # a fresh one per scrape, as prometheus_client's multiprocess docs do
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)

    def local_value(self, name: str, **labels: str) -> float:
        """One sample of this process alone (with several router processes, /metrics shows their sum)."""
        return self.registry.get_sample_value(name, labels) or 0.0
