"""For N workers: every layout (colocated N, and each P:D split), its goodput, the one to run, and its config.

The best has the highest goodput; on a tie (within the bisection's tolerance) colocated wins (no KV moves, one
pool), then fewer prefill workers. Its config is the base config with mode and replicas changed, validated as a
loaded file; colocated puts every worker in the decode pool (the split does not matter there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from cluster.config import ClusterConfig, parse_config
from planner.goodput import SLO, GoodputResult, layout_goodput
from planner.profile_model import Profile
from planner.simulator import Layout, SimSettings
from planner.trace import Workload


@dataclass(slots=True)
class LayoutResult:
    layout: Layout
    goodput: GoodputResult

    @property
    def per_worker(self) -> float:
        return self.goodput.rate / self.layout.workers


def layouts(workers: int, split_step: int = 1) -> list[Layout]:
    """Colocated, then the splits with 1, 1 + step, ... and N - 1 prefill workers (a larger step keeps a 64-worker
    sweep affordable)."""
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if split_step < 1:
        raise ValueError(f"--split-step must be at least 1, got {split_step}")
    prefill = sorted(set(range(1, workers, split_step)) | ({workers - 1} if workers > 1 else set()))
    return [Layout("colocated", 0, workers)] + [Layout("disaggregated", p, workers - p) for p in prefill]


def evaluate(
    profile: Profile,
    workload: Workload,
    workers: int,
    settings: SimSettings,
    slo: SLO,
    rel_tol: float = 0.02,
    progress: Callable[[LayoutResult], None] | None = None,
    min_duration_s: float = 0.0,
    split_step: int = 1,
) -> list[LayoutResult]:
    """Each search starts at the previous layout's answer (neighbouring splits have similar goodput)."""
    results: list[LayoutResult] = []
    start = None
    for layout in layouts(workers, split_step):
        result = LayoutResult(
            layout, layout_goodput(profile, workload, layout, settings, slo, rel_tol, start, min_duration_s)
        )
        if result.goodput.rate > 0:
            start = result.goodput.rate
        results.append(result)
        if progress is not None:
            progress(result)
    return results


def best(results: list[LayoutResult], rel_tol: float = 0.02) -> LayoutResult:
    """Rates within ``rel_tol`` of the best tie: colocated first, then fewer prefill."""
    top = max(r.goodput.rate for r in results)
    tied = [r for r in results if r.goodput.rate >= top * (1 - rel_tol)]
    return min(tied, key=lambda r: (r.layout.mode != "colocated", r.layout.prefill))


def best_disaggregated(results: list[LayoutResult]) -> LayoutResult | None:
    split = [r for r in results if r.layout.mode == "disaggregated"]
    return max(split, key=lambda r: (r.goodput.rate, -r.layout.prefill)) if split else None


def plan_config(base: ClusterConfig, layout: Layout) -> ClusterConfig:
    data = base.model_dump(mode="json")
    data["mode"] = layout.mode
    data["pools"]["prefill"]["replicas"] = layout.prefill
    data["pools"]["decode"]["replicas"] = layout.decode
    return parse_config(data, f"<plan: {layout.label}>")


def write_config(config: ClusterConfig, path: str | Path, header: str) -> None:
    """YAML that ``load_config`` reads back to the same config, under ``header`` as comments."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    Path(path).write_text(comment + yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
