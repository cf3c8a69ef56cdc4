"""For a budget of N devices: every layout (colocated, and each P:D split, at each profiled tensor-parallel degree of
each pool), its goodput, the one to run, and its config.

A worker of degree d takes d devices (GPUs, or CPU shares on a CPU pool); with degree-1 profiles only, N devices
are N workers. The best has the highest goodput; on a tie (within the bisection's tolerance) colocated wins (no KV
moves, one pool), then fewer devices, fewer prefill workers, lower degrees. Each layout is simulated with the
settings its own config gives (KV blocks per worker at its degrees). Its config is the base config with mode,
replicas and degrees changed, validated as a loaded file; colocated puts every worker in the decode pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from cluster.config import ClusterConfig, parse_config
from planner.goodput import SLO, GoodputResult, layout_goodput
from planner.profile_model import Degree, ProfileSet
from planner.simulator import Layout, SimSettings
from planner.trace import Workload


@dataclass(slots=True)
class LayoutResult:
    layout: Layout
    goodput: GoodputResult

    @property
    def per_device(self) -> float:
        return self.goodput.rate / self.layout.devices


def layouts(devices: int, split_step: int = 1, degrees: Sequence[Degree] = (Degree(),)) -> list[Layout]:
    """Per worker degree d (tensor, expert): colocated with devices // d.ranks workers. Per (prefill degree, decode
    degree): 1, 1 + step, ... prefill workers (and the most that leave room for one decode worker), the rest of the
    devices in decode workers (a larger step keeps a 64-device sweep affordable). A worker takes one device per rank."""
    if devices < 1:
        raise ValueError(f"--workers / --gpus must be at least 1, got {devices}")
    if split_step < 1:
        raise ValueError(f"--split-step must be at least 1, got {split_step}")
    found = [
        Layout("colocated", 0, devices // d.ranks, decode_tp=d.tensor, decode_ep=d.expert)
        for d in degrees
        if devices // d.ranks >= 1
    ]
    for p in degrees:
        for d in degrees:
            most = (devices - d.ranks) // p.ranks
            for prefill in sorted(set(range(1, most + 1, split_step)) | ({most} if most >= 1 else set())):
                decode = (devices - prefill * p.ranks) // d.ranks
                found.append(Layout("disaggregated", prefill, decode, p.tensor, d.tensor, p.expert, d.expert))
    if not found:
        labels = [d.label for d in degrees]
        raise ValueError(f"{devices} devices hold no worker of the profiled degrees {labels}")
    return found


def layout_settings(base: ClusterConfig, layout: Layout, profiles: ProfileSet, seed: int = 0) -> SimSettings:
    settings = SimSettings.from_config(plan_config(base, layout), profiles)
    settings.seed = seed
    return settings


def evaluate(
    profiles: ProfileSet,
    workload: Workload,
    devices: int,
    base: ClusterConfig,
    slo: SLO,
    rel_tol: float = 0.02,
    progress: Callable[[LayoutResult], None] | None = None,
    min_duration_s: float = 0.0,
    split_step: int = 1,
    seed: int = 0,
) -> list[LayoutResult]:
    """Each search starts at the previous layout's answer when only the split changed (neighbouring splits have
    similar goodput)."""
    results: list[LayoutResult] = []
    start, degrees = None, None
    for layout in layouts(devices, split_step, profiles.degrees):
        if (layout.mode, layout.prefill_degree, layout.decode_degree) != degrees:
            start, degrees = None, (layout.mode, layout.prefill_degree, layout.decode_degree)
        settings = layout_settings(base, layout, profiles, seed)
        goodput = layout_goodput(profiles, workload, layout, settings, slo, rel_tol, start, min_duration_s)
        result = LayoutResult(layout, goodput)
        if result.goodput.rate > 0:
            start = result.goodput.rate
        results.append(result)
        if progress is not None:
            progress(result)
    return results


def best(results: list[LayoutResult], rel_tol: float = 0.02) -> LayoutResult:
    """Rates within ``rel_tol`` of the best tie: colocated first, then fewer devices, fewer prefill workers, lower
    degrees."""
    top = max(r.goodput.rate for r in results)
    tied = [r for r in results if r.goodput.rate >= top * (1 - rel_tol)]
    return min(
        tied,
        key=lambda r: (
            r.layout.mode != "colocated",
            r.layout.devices,
            r.layout.prefill,
            r.layout.prefill_tp,
            r.layout.decode_tp,
            r.layout.prefill_ep,
            r.layout.decode_ep,
        ),
    )


def best_disaggregated(results: list[LayoutResult]) -> LayoutResult | None:
    split = [r for r in results if r.layout.mode == "disaggregated"]
    return max(split, key=lambda r: (r.goodput.rate, -r.layout.prefill)) if split else None


def plan_config(base: ClusterConfig, layout: Layout) -> ClusterConfig:
    data = base.model_dump(mode="json")
    data["mode"] = layout.mode
    data["pools"]["prefill"]["replicas"] = layout.prefill
    data["pools"]["decode"]["replicas"] = layout.decode
    # colocated: the prefill pool (0 replicas) takes the decode pool's degrees, which have a profile
    prefill = layout.prefill_degree if layout.mode == "disaggregated" else layout.decode_degree
    for pool, degree in (("prefill", prefill), ("decode", layout.decode_degree)):
        data["pools"][pool]["tensor_parallel_size"] = degree.tensor
        data["pools"][pool]["expert_parallel_size"] = degree.expert
    return parse_config(data, f"<plan: {layout.label}>")


def write_config(config: ClusterConfig, path: str | Path, header: str) -> None:
    """YAML that ``load_config`` reads back to the same config, under ``header`` as comments."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    Path(path).write_text(comment + yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
