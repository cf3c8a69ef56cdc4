"""``pdserve bench role-switch``: a worker switching role in place against replacing it (stop one, start one).

On a served cluster of the config (its decode pool made 2 replicas, so one can leave), each round moves one worker
from decode to prefill and back, twice over:
- by switching (``POST /admin/role``'s call, cluster/run/role_switch.py): the worker drains, rebuilds its engine for
  the other pool with the weights it holds, and rejoins;
- by replacing (``POST /admin/scale``'s): the decode pool shrinks by one (the worker drains and stops), then the
  prefill pool grows by one (a new worker starts and loads the model), and the same back.
Idle cluster, so the figures are the mechanism's: a drain under load adds the time its requests take to move (bench
migrate measures that). Each figure is a median over ``--repeats`` rounds, with every sample; the ratio is switch /
replace. Goal: a switch takes at most 0.2 x replacing. A request is served after each move, and no KV block
is held at the end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

import httpx

from benchmarks.options import add_role_switch_bench_arguments as add_arguments
from benchmarks.served_cluster import bench_config, local_ray, serving

if TYPE_CHECKING:
    from cluster.config import ClusterConfig
    from cluster.run.launch import ServeHandle

__all__ = ["add_arguments", "run"]

GOAL_RATIO = 0.2


def config_for(args: argparse.Namespace) -> ClusterConfig:
    config = bench_config(args)
    config.pools.decode.replicas = max(2, config.pools.decode.replicas)  # one can leave it
    return config


def _served(handle: ServeHandle) -> bool:
    body = {"model": handle.config.served_model_name, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
    response = httpx.post(f"{handle.base_url}/v1/completions", json=body, headers=handle.admin_headers, timeout=120)
    return response.status_code == 200 and len(response.json()["choices"][0]["text"]) > 0


def _switch(handle: ServeHandle, worker: str, to: str) -> dict[str, Any]:
    assert handle.scaler is not None
    started = time.monotonic()
    record = handle.scaler.switch_role(worker, to, wait=True)["switch"]
    if record["phase"] != "done":
        raise RuntimeError(f"the switch of {worker} to {to} ended {record['phase']}: {record['error']}")
    return {
        "to": to,
        "seconds": round(time.monotonic() - started, 3),
        "drain_s": record["drain_s"],
        "rebuild_s": record["reconfigure_s"],
    }


def _replace(handle: ServeHandle, leave: str, join: str) -> dict[str, Any]:
    """One worker out of ``leave`` (drained and stopped), one new into ``join`` (started, loaded, serving)."""
    scaler = handle.scaler
    assert scaler is not None
    started = time.monotonic()
    scaler.scale(leave, len(scaler.pools.active(leave)) - 1, drain_timeout_s=60)
    if not scaler.wait_idle(120):
        raise RuntimeError(f"the removed {leave} worker did not stop in 120 s")
    stopped = time.monotonic()
    scaler.scale(join, len(scaler.pools.active(join)) + 1)
    if scaler.pools.pending:
        raise RuntimeError(f"the new {join} worker is not placed: {[r.name for r in scaler.pools.pending]}")
    return {
        "to": join,
        "seconds": round(time.monotonic() - started, 3),
        "stop_s": round(stopped - started, 3),
        "start_s": round(time.monotonic() - stopped, 3),
    }


def _median(samples: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(s[key] for s in samples), 3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.routing_figures import settle
    from engine.cpu_info import cpu_model

    config = config_for(args)
    out: dict[str, Any] = {
        "cpu": cpu_model(),
        "model": config.model.name,
        "workers": "threads of this process" if args.in_process else "Ray actors",
        "repeats": args.repeats,
    }
    switches: list[dict[str, Any]] = []
    replacements: list[dict[str, Any]] = []
    served: list[bool] = []
    # replacing starts a worker in the growing pool's own placement group while the bundle the stopped one held stays
    # in the shrinking pool's group (cluster/run/pools.py): one CPU more than the pools, or it is never placed
    spare = max(config.pools.prefill.cpus_per_replica, config.pools.decode.cpus_per_replica)
    with local_ray(config, args.in_process, spare), serving(config, "role-switch", args.in_process) as handle:
        assert handle.scaler is not None
        for round_ in range(args.repeats):
            worker = handle.scaler.pools.active("decode")[-1].name
            print(f"round {round_ + 1}: switching {worker} to prefill and back", file=sys.stderr)
            for to in ("prefill", "decode"):
                switches.append(_switch(handle, worker, to))
                served.append(_served(handle))
            print(f"round {round_ + 1}: replacing a decode worker by a prefill worker and back", file=sys.stderr)
            for leave, join in (("decode", "prefill"), ("prefill", "decode")):
                replacements.append(_replace(handle, leave, join))
                served.append(_served(handle))
        status = settle(handle.base_url)
    switch_s, replace_s = _median(switches, "seconds"), _median(replacements, "seconds")
    ratio = round(switch_s / replace_s, 3) if replace_s else None
    out |= {
        "switch": {"median_s": switch_s, "median_rebuild_s": _median(switches, "rebuild_s"), "samples": switches},
        "replace": {
            "median_s": replace_s,
            "median_stop_s": _median(replacements, "stop_s"),
            "median_start_s": _median(replacements, "start_s"),
            "samples": replacements,
        },
        "switch_over_replace": ratio,
        "served_after_every_move": all(served),
        "kv_free_after": bool(status["settled"]),
        "goals": {
            "switch_over_replace_at_most": GOAL_RATIO,
            "all_met": ratio is not None and ratio <= GOAL_RATIO and all(served) and bool(status["settled"]),
        },
    }
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.loadtest.cli import run_main

    return run_main("python -m benchmarks.role_switch_bench", (__doc__ or "").splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
