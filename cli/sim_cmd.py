"""``pdserve sim``: run the protocol's simulation (cluster/sim/world.py) over seeds, or replay one (imports nothing of
the cluster until it runs).

``--seeds N --start S`` runs seeds S..S+N-1 (on ``--jobs`` processes) and exits 1 at the first violation, printing its
seed, faults, the invariant and the last events, and the shortest fault schedule that still fails; ``--seed S``
replays one seed and ends with its summary line (events, requests, faults, digest), the same on every replay. The
interpreter runs with ``PYTHONHASHSEED=0`` (re-executed if it is not), so that a run is the same across processes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=None, help="replay this seed alone (its full trace with -v)")
    parser.add_argument("--seeds", type=int, default=100, help="how many seeds to run (default 100)")
    parser.add_argument("--start", type=int, default=0, help="the first seed")
    parser.add_argument(
        "--faults",
        default="all",
        help="comma-separated fault kinds to inject (drop, duplicate, delay, reorder, kv_loss, kv_corrupt, kv_late, "
        "kv_truncate, crash, partition, slow, client_abort, drain, scale_up, tier_loss, tier_corrupt), 'all' or 'none'",
    )
    parser.add_argument("--jobs", type=int, default=1, help="processes (make sim: every core)")
    parser.add_argument("--no-shrink", action="store_true", help="report a failing seed without shrinking it")
    parser.add_argument("--json", action="store_true", help="print the totals as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="with --seed: print every event of the run")


def parse_faults(text: str):
    from cluster.sim.faults import ALL_FAULTS, FaultKind

    if text == "all":
        return ALL_FAULTS
    if text == "none":
        return frozenset()
    names = [x.strip() for x in text.split(",") if x.strip()]
    known = {k.value: k for k in FaultKind}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--faults: unknown kind(s) {unknown}; one of {sorted(known)}, 'all' or 'none'")
    return frozenset(known[n] for n in names)


def run(args: argparse.Namespace) -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":  # set iteration order decides message order: fixed for replays
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "cli.main", *sys.argv[1:]])
    faults = parse_faults(args.faults)
    from transformers.utils import logging as transformers_logging

    from cluster.sim.world import World, run_seeds

    transformers_logging.disable_progress_bar()  # a model load per worker incarnation: no bar each time
    logging.disable(logging.WARNING)
    if args.seed is not None:
        world = World(args.seed, faults)
        result = world.run()
        if args.verbose:
            print("\n".join(world.trace))
        if result.violation:
            _report(result, faults, not args.no_shrink)
        print(result.summary())
        return 1 if result.violation else 0
    seeds = range(args.start, args.start + args.seeds)
    started = time.perf_counter()
    done, coverage, events, tier_tokens = 0, set(), 0, 0
    failed = None
    results = run_seeds(seeds, faults, args.jobs)  # a generator: closing it lets the pool's other seeds go
    try:
        for result in results:
            done += 1
            events += result.events
            coverage |= result.coverage
            tier_tokens += result.tier_loaded_tokens
            if result.violation:
                failed = result
                break
    finally:
        results.close()
    elapsed = time.perf_counter() - started
    totals = {
        "seeds": done,
        "first_seed": args.start,
        "faults": sorted(k.value for k in faults),
        "events": events,
        "seconds": round(elapsed, 2),
        "seeds_per_s": round(done / elapsed, 2) if elapsed else None,
        "coverage": len(coverage),  # (command kind, flow status, faults applied so far) reached
        "tier_loaded_tokens": tier_tokens,  # prompt tokens loaded back from the KV disk tier, all seeds together
        "violation": None if failed is None else {"seed": failed.seed, "invariant": failed.violation},
    }
    if failed is not None:
        _report(failed, faults, not args.no_shrink)
    print(json.dumps(totals) if args.json else " ".join(f"{k}={v}" for k, v in totals.items()))
    return 1 if failed is not None else 0


def _report(result, faults, shrinking: bool) -> None:
    from cluster.sim.world import shrink

    print(f"VIOLATION at seed {result.seed}: {result.violation}", file=sys.stderr)
    print(f"faults: {[str(a) for a in result.faults]}", file=sys.stderr)
    print("last events:\n  " + "\n  ".join(result.trace_tail), file=sys.stderr)
    if shrinking and result.faults:
        shortest = shrink(result.seed, faults, result.schedule)
        print(f"shortest failing schedule: {[str(a) for a in shortest]}", file=sys.stderr)
