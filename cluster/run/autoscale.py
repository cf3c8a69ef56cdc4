"""The optional autoscaling policy (``autoscale: {enabled: true}``): resize pools from live metrics.

Every ``interval_s`` it reads the router's own ``/metrics`` and takes the interval's queue depth and TTFT / TPOT p90
(bucket deltas, as ``histogram_quantile``); each pool votes too small or too big against ``slo:`` (the rules:
docs/planner.md, "Autoscaling"), or the planner's ``CapacityModel`` votes where ``autoscale.profile`` gives one. A
pool changes by one replica after ``breaches`` like votes, within its bounds and ``cooldown_s``, through the same
``Scaler.scale`` as ``pdserve scale``; when one pool is to grow and the other to shrink in the same interval, a worker
switches role instead (``autoscale.switch_roles``; ``Scaler.switch_pool``), and where it cannot (one switch per pool
at a time, pools that differ in placement) the pools are resized.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from cluster.config import AutoscaleSection, ClusterConfig, SLOSection
from cluster.routing.errors import ScaleError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Window:
    queue_depth: float
    requests: int  # requests that finished in the interval
    ttft_p90_s: float | None  # None: no request finished
    tpot_p90_s: float | None
    elapsed_s: float | None = None  # since the previous reading (None: the first one)
    arrivals: float = 0.0  # requests that came in: ended ones (any outcome) plus the change in those in flight
    finished: float = 0.0  # requests that finished normally (the ones the token counters count)
    prompt_tokens: float = 0.0  # of the finished ones
    output_tokens: float = 0.0
    inflight: float = 0.0  # at the end of the interval


@dataclass(frozen=True)
class LiveLoad:
    """What a ``CapacityModel`` is asked about: one interval's load, as the router saw it."""

    interval_s: float
    arrival_rate: float  # requests/s that arrived in the interval
    mean_prompt_tokens: float | None  # None: no request has finished yet, so the token mix is unknown
    mean_output_tokens: float | None
    queue_depth: float  # requests waiting for decode KV at the end of the interval
    inflight: float
    replicas: dict[str, int]  # active replicas per pool now
    ttft_p90_s: float | None
    tpot_p90_s: float | None


class CapacityModel(Protocol):
    """Replicas per pool a live load needs (planner/autoscale_model.py); a pool left out gets the threshold vote."""

    def replicas_needed(self, load: LiveLoad) -> dict[str, int]: ...


Buckets = dict[float, float]  # upper bound -> cumulative count, from a Prometheus histogram


SUMMED = ("pdserve_requests_total",)  # labelled counters read as their sum over every label (all outcomes)


def read_histograms(text: str | bytes, names: tuple[str, ...]) -> tuple[dict[str, Buckets], dict[str, float]]:
    """Each named histogram's cumulative buckets, and every unlabelled sample's value (``SUMMED``: also the sum)."""
    from prometheus_client.parser import text_string_to_metric_families

    if isinstance(text, bytes):
        text = text.decode()

    buckets: dict[str, Buckets] = {name: {} for name in names}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            base = sample.name.removesuffix("_bucket")
            if sample.name.endswith("_bucket") and base in buckets:
                bound = float(sample.labels["le"])
                buckets[base][bound] = buckets[base].get(bound, 0.0) + sample.value
            elif not sample.labels:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
            elif sample.name in SUMMED:  # the sum, and each label set by itself (``name:outcome=finished``)
                labelled = sample.name + ":" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                for key in (sample.name, labelled):
                    values[key] = values.get(key, 0.0) + sample.value
    return buckets, values


def window_quantile(before: Buckets, after: Buckets, q: float) -> tuple[float | None, int]:
    """The q-quantile between two readings of a histogram, and the observation count; as ``histogram_quantile``
    (the last finite bound when it falls in +Inf)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None, 0
    rank, lower, below = q * total, 0.0, 0.0
    for bound, cumulative in zip(bounds, counts):
        if cumulative >= rank:
            if bound == float("inf"):
                return lower, int(total)
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0), int(total)
        lower, below = bound, cumulative
    return lower, int(total)


class MetricsWindow:
    """Turns successive /metrics texts into ``Window``s (the deltas since the previous reading)."""

    HISTOGRAMS = ("pdserve_ttft_seconds", "pdserve_tpot_seconds")

    FINISHED = "pdserve_requests_total:outcome=finished"
    COUNTERS = (
        "pdserve_requests_total",
        FINISHED,
        "pdserve_prompt_tokens_total",
        "pdserve_generated_tokens_total",
        "pdserve_router_inflight",
    )

    def __init__(self, fetch: Callable[[], str | bytes], clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self._clock = clock
        self._last: dict[str, Buckets] = {name: {} for name in self.HISTOGRAMS}
        self._last_values: dict[str, float] = {}
        self._last_time: float | None = None

    def read(self) -> Window:
        buckets, values = read_histograms(self._fetch(), self.HISTOGRAMS)
        now = self._clock()
        ttft, requests = window_quantile(self._last["pdserve_ttft_seconds"], buckets["pdserve_ttft_seconds"], 0.9)
        tpot, _ = window_quantile(self._last["pdserve_tpot_seconds"], buckets["pdserve_tpot_seconds"], 0.9)
        delta = {name: values.get(name, 0.0) - self._last_values.get(name, 0.0) for name in self.COUNTERS}
        elapsed = None if self._last_time is None else now - self._last_time
        self._last, self._last_values, self._last_time = buckets, values, now
        return Window(
            values.get("pdserve_router_queue_depth", 0.0),
            requests,
            ttft,
            tpot,
            elapsed_s=elapsed,
            # every request that came in either ended (finished, failed, aborted: all counted) or is still in flight
            arrivals=max(0.0, delta["pdserve_requests_total"] + delta["pdserve_router_inflight"]),
            finished=delta[self.FINISHED],
            prompt_tokens=delta["pdserve_prompt_tokens_total"],
            output_tokens=delta["pdserve_generated_tokens_total"],
            inflight=values.get("pdserve_router_inflight", 0.0),
        )


def http_metrics(base_url: str, api_key: str | None, timeout_s: float = 5.0) -> Callable[[], str]:
    """A fetch of the router's own /metrics (every router process's figures, merged)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def fetch() -> str:
        request = urllib.request.Request(f"{base_url.rstrip('/')}/metrics", headers=headers)
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read().decode()

    return fetch


@dataclass
class _PoolState:
    up: int = 0  # consecutive intervals that said "too small"
    down: int = 0
    last_change: float | None = None


@dataclass
class Policy:
    section: AutoscaleSection
    slo: SLOSection
    mode: str
    model: CapacityModel | None = None  # None: the threshold rule alone
    state: dict[str, _PoolState] = field(default_factory=dict)
    mix: tuple[float, float] | None = None  # mean (prompt, output) tokens of the last interval that finished any
    last_needed: dict[str, int] = field(default_factory=dict)  # the model's last answer (for the log line)

    def live_load(self, window: Window, replicas: dict[str, int]) -> LiveLoad:
        """The interval as the model reads it; the token mix is the last one seen when none finished in it."""
        if window.finished > 0:
            self.mix = (window.prompt_tokens / window.finished, window.output_tokens / window.finished)
        interval = window.elapsed_s if window.elapsed_s else self.section.interval_s
        prompt, output = self.mix if self.mix is not None else (None, None)
        return LiveLoad(
            interval_s=interval,
            arrival_rate=window.arrivals / interval,
            mean_prompt_tokens=prompt,
            mean_output_tokens=output,
            queue_depth=window.queue_depth,
            inflight=window.inflight,
            replicas=dict(replicas),
            ttft_p90_s=window.ttft_p90_s,
            tpot_p90_s=window.tpot_p90_s,
        )

    def votes(self, window: Window, replicas: dict[str, int]) -> dict[str, int]:
        """Per pool: +1 too small, -1 too big, 0 no opinion, for this interval alone."""
        votes = self.threshold_votes(window, replicas)
        if self.model is None:
            return votes
        self.last_needed = needed = self.model.replicas_needed(self.live_load(window, replicas))
        for pool, threshold in votes.items():
            if pool not in needed:
                continue
            bounds = getattr(self.section, pool)
            target = min(max(needed[pool], bounds.min_replicas), bounds.max_replicas)
            current = replicas.get(pool, 0)
            if target > current or threshold == 1:  # a breach the model did not foresee still counts
                votes[pool] = 1
            elif target < current and window.queue_depth == 0 and not self._latency_high(pool, window):
                votes[pool] = -1
            else:
                votes[pool] = 0
        return votes

    def _latency_high(self, pool: str, window: Window) -> bool:
        """The pool's p90 (colocated: either) is at least ``scale_down_fraction`` of its SLO: no shrinking then."""
        if window.requests < self.section.min_requests:
            return False
        pairs = {"prefill": [(window.ttft_p90_s, self.slo.ttft_s)], "decode": [(window.tpot_p90_s, self.slo.tpot_s)]}
        if self.mode == "colocated":
            pairs["decode"].append((window.ttft_p90_s, self.slo.ttft_s))
        limit = self.section.scale_down_fraction
        return any(p90 is not None and p90 >= limit * slo for p90, slo in pairs[pool])

    def threshold_votes(self, window: Window, replicas: dict[str, int]) -> dict[str, int]:
        s, slo = self.section, self.slo
        queued = window.queue_depth > s.queue_per_replica * max(1, replicas.get("decode", 1))
        known = window.requests >= s.min_requests
        # nothing finished, queued or in flight: long answers that finish in no interval are not idleness
        idle = window.requests == 0 and window.queue_depth == 0 and window.inflight == 0

        def vote(p90: float | None, limit: float) -> int:
            if not known or p90 is None:
                return -1 if idle else 0
            if p90 > limit:
                return 1
            return -1 if window.queue_depth == 0 and p90 < s.scale_down_fraction * limit else 0

        tpot, ttft = vote(window.tpot_p90_s, slo.tpot_s), vote(window.ttft_p90_s, slo.ttft_s)
        if self.mode == "colocated":
            return {"decode": 1 if queued or tpot == 1 or ttft == 1 else -1 if tpot == ttft == -1 else 0}
        return {"decode": 1 if queued else tpot, "prefill": 0 if queued else ttft}

    def decide(self, now: float, window: Window, replicas: dict[str, int]) -> dict[str, int]:
        """The pools to resize now and their new sizes (within ``max_workers``: ``_within_budget``)."""
        changes = {}
        for pool, vote in self.votes(window, replicas).items():
            state = self.state.setdefault(pool, _PoolState())
            state.up, state.down = (state.up + 1, 0) if vote > 0 else (0, state.down + 1) if vote < 0 else (0, 0)
            bounds = getattr(self.section, pool)
            current = replicas.get(pool, 0)
            target = current
            if state.up >= self.section.breaches and current < bounds.max_replicas:
                target = current + 1
            elif state.down >= self.section.breaches and current > bounds.min_replicas:
                target = current - 1
            if target != current and not self._cooling(pool, now):
                changes[pool] = target
        changes = self._within_budget(now, changes, replicas)
        for pool in changes:
            state = self.state[pool]
            state.up = state.down = 0
            state.last_change = now
        return changes

    def _cooling(self, pool: str, now: float) -> bool:
        state = self.state.get(pool)
        return state is not None and state.last_change is not None and now - state.last_change < self.section.cooldown_s

    def _within_budget(self, now: float, changes: dict[str, int], replicas: dict[str, int]) -> dict[str, int]:
        """With ``max_workers`` (a device budget: both pools together), a pool that grows past it takes its worker from
        the other pool, if that one is above its minimum, not cooling down and not growing itself; else it waits. A
        pool does not shrink alone: its worker stays until the other pool needs it (a move, cheap as a switch)."""
        budget = self.section.max_workers
        if budget is None or self.mode != "disaggregated":
            return changes
        grows = any(target > replicas.get(pool, 0) for pool, target in changes.items())
        if not grows:
            return {}  # a budget's workers are held: a pool gives one up only to the other (below), never alone
        sizes = {pool: changes.get(pool, replicas.get(pool, 0)) for pool in ("prefill", "decode")}
        for pool in [p for p, target in changes.items() if target > replicas.get(p, 0)]:
            if sum(sizes.values()) <= budget:
                break
            other = "decode" if pool == "prefill" else "prefill"
            minimum = getattr(self.section, other).min_replicas
            if other not in changes and sizes[other] > minimum and not self._cooling(other, now):
                sizes[other] -= 1  # a move: a switch where the autoscaler can (``Autoscaler._switched``)
            else:
                sizes[pool] = replicas.get(pool, 0)  # no room: it grows once the other pool can give
        return {pool: size for pool, size in sizes.items() if size != replicas.get(pool, 0)}


def move(changes: dict[str, int], replicas: dict[str, int]) -> tuple[str, str] | None:
    """(from pool, to pool) when ``changes`` take a worker from one pool and give one to the other: what a role
    switch does in one step; None otherwise."""
    grow = [pool for pool, target in changes.items() if target > replicas.get(pool, 0)]
    shrink = [pool for pool, target in changes.items() if target < replicas.get(pool, 0)]
    return (shrink[0], grow[0]) if len(changes) == 2 and len(grow) == len(shrink) == 1 else None


class Autoscaler:
    """Runs the policy every ``interval_s`` and applies its decisions through the scaler."""

    def __init__(
        self,
        config: ClusterConfig,
        scaler,
        metrics: MetricsWindow,
        clock: Callable[[], float],
        model: CapacityModel | None = None,
    ) -> None:
        self.section = config.autoscale
        self.policy = Policy(config.autoscale, config.slo, config.mode, model)
        self.scaler = scaler
        self.metrics = metrics
        self.clock = clock
        self.decisions: list[tuple[float, str, int]] = []  # (when, pool, new size): what it did
        self.switches: list[tuple[float, str, str]] = []  # (when, from pool, to pool): the decisions made by a switch
        self.switch_roles = config.autoscale.switch_roles and config.mode == "disaggregated"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def start_if_enabled(
        cls, config: ClusterConfig, scaler, base_url: str, model: CapacityModel | None = None
    ) -> Autoscaler | None:
        """``model``: the planner's, built from ``autoscale.profile`` by the caller (``pdserve serve``)."""
        if not config.autoscale.enabled:
            return None
        if config.autoscale.profile and model is None:
            logger.warning(
                "autoscale.profile is set but no capacity model was passed in (only `pdserve serve` builds it from "
                "the profile): the threshold rule decides"
            )
        fetch = http_metrics(base_url, config.router.api_key)
        autoscaler = cls(config, scaler, MetricsWindow(fetch), time.monotonic, model)
        autoscaler._thread = threading.Thread(target=autoscaler._run, name="pdserve-autoscale", daemon=True)
        autoscaler._thread.start()
        return autoscaler

    def tick(self) -> dict[str, int]:
        """Read one interval's metrics, decide, resize; the changes made."""
        window = self.metrics.read()
        replicas = {pool: len(self.scaler.pools.active(pool)) for pool in ("prefill", "decode")}
        changes = self.policy.decide(self.clock(), window, replicas)
        if self._switched(changes, replicas):
            return changes
        for pool, target in changes.items():
            needed = self.policy.last_needed.get(pool)
            why = f"model: {needed} needed" if needed is not None else "threshold rule"
            logger.warning("autoscale: %s %d -> %d replicas (%s; %s)", pool, replicas[pool], target, why, window)
            self.scaler.scale(pool, target)
            self.decisions.append((self.clock(), pool, target))
        return changes

    def _switched(self, changes: dict[str, int], replicas: dict[str, int]) -> bool:
        """One pool one up, the other one down: a worker of the second switches to the first, if it can."""
        pools = move(changes, replicas) if self.switch_roles else None
        if pools is None:
            return False
        source, to = pools
        try:
            switch = self.scaler.switch_pool(source, to)
        except ScaleError as exc:
            logger.warning("autoscale: no role switch %s -> %s (%s); resizing both", source, to, exc)
            return False
        logger.warning("autoscale: %s switches %s -> %s (%s)", switch["worker"], source, to, changes)
        now = self.clock()
        self.switches.append((now, source, to))
        self.decisions += [(now, pool, target) for pool, target in changes.items()]
        return True

    def _run(self) -> None:
        try:
            self.metrics.read()  # the baseline: the first interval starts now
        except Exception:  # the first interval then counts everything before it; the policy still needs breaches
            logger.exception("autoscale: could not read /metrics")
        while not self._stop.wait(self.section.interval_s):
            try:
                self.tick()
            except Exception:  # a failed read or scale is logged; the next interval tries again
                logger.exception("autoscale: interval failed")

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
