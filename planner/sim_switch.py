"""A cluster that moves workers between its pools by role switches, in simulated time: what ``pdserve plan shift``
runs to say what switching attains on a trace whose mix shifts, beside the fixed split.

The simulator (planner/simulator.py) serves the trace; beside it the autoscaler's own ``Policy``
(cluster/run/autoscale.py) reads the simulated router's own ``/metrics`` text every ``interval_s`` of simulated time,
with ``max_workers`` the layout's workers, so a pool that must grow takes a worker from the other. Each such move is
the switch the live cluster makes (cluster/run/role_switch.py), in the router core's own terms: the worker drains
(``RouterCore.drain`` with ``switch_to``: a decode worker's requests move away), then costs ``switch_s`` of simulated
time (the rebuild; ``pdserve bench role-switch`` measures it) and rejoins as a worker of the new pool
(``SimCluster.start_worker``); past ``drain_deadline_s`` it is called off. What is modelled is the policy and the
switch's cost; the worker's rebuild itself is not run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.config import AutoscalePoolBounds, AutoscaleSection, SLOSection
from cluster.run.autoscale import MetricsWindow, Policy, move
from planner.profile_model import Profile, ProfileSet
from planner.simulator import Layout, SimCluster, SimRecord, SimSettings, simulate
from planner.trace import TraceRequest

DRAIN_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class SwitchSettings:
    switch_s: float = 2.0  # a switch's rebuild (bench role-switch, SmolLM2 on 2 CPU cores: 0.4-3.6 s)
    interval_s: float = 5.0  # the autoscaler's
    breaches: int = 2
    cooldown_s: float = 15.0
    drain_deadline_s: float = 60.0


@dataclass(slots=True)
class SimSwitch:
    worker: str
    to: str
    at_s: float  # simulated time it began
    drained_s: float | None = None  # how long its drain took
    phase: str = "draining"  # draining, reconfiguring, done, called_off


@dataclass(slots=True)
class SwitchingRun:
    records: list[SimRecord]
    switches: list[SimSwitch] = field(default_factory=list)


class Switcher:
    """The autoscaler's policy over one simulated cluster, its moves made as role switches."""

    def __init__(self, cluster: SimCluster, slo: SLOSection, settings: SwitchSettings) -> None:
        self.cluster, self.settings = cluster, settings
        layout = cluster.layout
        bounds = AutoscalePoolBounds(min_replicas=1, max_replicas=layout.prefill + layout.decode - 1)
        section = AutoscaleSection(
            enabled=True,
            interval_s=settings.interval_s,
            breaches=settings.breaches,
            cooldown_s=settings.cooldown_s,
            max_workers=layout.prefill + layout.decode,
            prefill=bounds,
            decode=bounds,
        )
        self.policy = Policy(section, slo, "disaggregated")
        env = cluster.env
        self.metrics = MetricsWindow(cluster.core.metrics.render, clock=lambda: env.now)
        self.switches: list[SimSwitch] = []

    def pools(self) -> dict[str, list[str]]:
        """Each pool's workers, oldest first, as the router core knows them (a switching one in its old pool)."""
        members = self.cluster.core.members.workers
        return {role: [name for name, w in members.items() if w.role == role] for role in ("prefill", "decode")}

    def run(self):
        env = self.cluster.env
        self.metrics.read()  # the baseline
        while True:
            yield env.timeout(self.settings.interval_s)
            pools = self.pools()
            replicas = {pool: len(names) for pool, names in pools.items()}
            pair = move(self.policy.decide(env.now, self.metrics.read(), replicas), replicas)
            under_way = any(s.phase in ("draining", "reconfiguring") for s in self.switches)
            if pair is not None and not under_way:
                source, to = pair
                env.process(self.switch(pools[source][-1], to))

    def switch(self, name: str, to: str):
        cluster, env, settings = self.cluster, self.cluster.env, self.settings
        record = SimSwitch(name, to, env.now)
        self.switches.append(record)
        cluster.core.drain(name, settings.drain_deadline_s, env.now, to)
        cluster.flush()
        worker = cluster.workers[name]
        while worker.role.holds_requests():
            if env.now - record.at_s > settings.drain_deadline_s:
                record.phase = "called_off"
                cluster.core.switch_phase(name, "called_off", env.now)
                cluster.flush()
                return
            yield env.timeout(DRAIN_POLL_S)
        record.drained_s, record.phase = env.now - record.at_s, "reconfiguring"
        cluster.core.switch_phase(name, "reconfiguring", env.now)
        yield env.timeout(settings.switch_s)
        cluster.start_worker(name, "prefill" if to == "prefill" else "decode", "done")
        record.phase = "done"
        cluster.flush()


def simulate_switching(
    profile: Profile | ProfileSet,
    trace: Sequence[TraceRequest],
    layout: Layout,
    settings: SimSettings,
    slo: SLOSection,
    switching: SwitchSettings,
) -> SwitchingRun:
    """``trace`` served on ``layout`` with the autoscaler moving workers by role switches; one record per request,
    in arrival order, and the switches made. Deterministic for one seed."""
    if layout.mode != "disaggregated":
        raise ValueError("role switches move workers between a prefill and a decode pool: a disaggregated layout")
    switchers: list[Switcher] = []

    def autoscaler(cluster: SimCluster):
        switchers.append(Switcher(cluster, slo, switching))
        return switchers[0].run()

    records = simulate(profile, trace, layout, settings, beside=autoscaler)
    return SwitchingRun(records, switchers[0].switches if switchers else [])
