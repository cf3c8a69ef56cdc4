"""``pdserve bench migrate``: moving running requests between decode workers, measured on a served cluster.

Drain (``--parts drain``). N greedy streams (``--streams`` of ``--max-tokens``, ignore_eos) are sent while the decode
pool has one worker, so every one of them runs there. Once each has ``--tokens-before-move`` tokens a second decode
worker is added (``pdserve scale``'s own path) and, ``--window-s`` after it serves, the first is drained
(``drain_worker_threadsafe``: what a scale-down does). Two runs, each on a fresh cluster: ``migrate``
(``router.migrate_on_drain: true``: the streams move to the new worker) and ``wait`` (false: the drained worker
finishes them). Figures: the drain time (the drain's start until the worker says it holds nothing) and the ratio of
the two (goal <= 0.1); the moved streams' p99 inter-token latency from the drain's start to ``--window-s`` after its
end, against their own p99 in the ``--window-s`` before it (goal <= 3x); tokens lost and duplicated, each stream's
tokens aligned with those of a non-streamed greedy run of its prompt on the undisturbed worker before the streams
(goal: 0 and 0). ``logprobs: 0`` makes every chunk name its tokens; a token's time is its chunk's, on the client.

Rebalance (``--parts rebalance``). A skewed load on 2 decode workers of ``--rebalance-kv-blocks`` each: long and short
generations alternate, sent in order ``--send-gap-s`` apart under ``decode_policy: round_robin`` (after one warm-up
request per worker), so every long one lands on one worker, whose KV holds their prompts but not their ends, while the
other's short ones soon finish. Two runs, each on a fresh cluster: ``off`` (that worker preempts: a preempted request
waits, then is recomputed) and ``on`` (``router.rebalance``: it moves its longest-to-go request to the other worker
instead). Figures: goodput (requests within the SLO on TTFT and TPOT, per second from the first send to the last
token; also at looser TPOT bounds), TPOT p50/p99, each request's longest gap between tokens, preemptions (worker
counter), migrations (/metrics), and whether every request's tokens equal the other run's.

Workers are Ray actors (a local Ray sized for 1 prefill + 2 decode workers), or threads of this process with
``--in-process``.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from benchmarks.options import add_migration_bench_arguments as add_arguments
from benchmarks.routing_figures import Samples, ratio, router_samples, sample, settle, worker_total
from benchmarks.served_cluster import local_ray, serving
from benchmarks.stream_client import Client, Stream

if TYPE_CHECKING:
    from cluster.config import ClusterConfig
    from cluster.run.launch import ServeHandle

GOAL_DRAIN_TIME_RATIO = 0.1
GOAL_ITL_P99_RATIO = 3.0
ISSUE_SETTINGS = {"streams": 16, "max_tokens": 1000}  # the issue's drain benchmark
KV_MARGIN = 1.1  # the drain part's default decode KV over what every stream needs to its end on one worker
MIGRATION_RESULTS = ("moved", "recomputed", "resumed", "refused", "failed")
POLL_S = 0.02
# where a request's TTFT goes, by the router's timing: waiting for a decode reservation, in the prefill worker's
# queue, and its compute
TTFT_PARTS = ("router_queue", "prefill_queue", "prefill_compute")
TPOT_SLO_SCALES = (1.0, 1.25, 1.5, 2.0)  # the rebalance runs' goodput at these multiples of the TPOT bound too
START_TIMEOUT_S = 600.0  # for the streams' first tokens, and for the added worker
LOG = "migrate bench"


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll until ``predicate`` holds: ``time.perf_counter()`` then (RuntimeError naming ``what`` after the timeout)."""
    deadline = time.perf_counter() + timeout_s
    while not predicate():
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    return time.perf_counter()


# ---- figures ---------------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def gaps_in(arrivals: Sequence[float], start: float, end: float) -> list[float]:
    """The inter-token gaps of the tokens that arrived in [start, end), each since the token before it (a chunk's
    later tokens: 0)."""
    return [arrivals[i] - arrivals[i - 1] for i in range(1, len(arrivals)) if start <= arrivals[i] < end]


def itl_figures(streams: Sequence[Sequence[float]], start: float, end: float) -> dict[str, Any]:
    """Inter-token latency of every stream's tokens that arrived in [start, end), pooled."""
    pooled = [gap for arrivals in streams for gap in gaps_in(arrivals, start, end)]
    return {
        "window_s": round(end - start, 2),
        "gaps": len(pooled),
        "p50_ms": _ms(percentile(pooled, 50)),
        "p99_ms": _ms(percentile(pooled, 99)),
        "max_ms": _ms(max(pooled) if pooled else None),
    }


def token_check(reference: Sequence[str], received: Sequence[str]) -> dict[str, Any]:
    """``received`` aligned with ``reference``: tokens missing from it (lost), tokens it has twice or more
    (duplicated), and from the first token that differs on, the rest (different: a greedy run that went another way,
    so lost and duplicated are counted before it only)."""
    lost = duplicated = 0
    different, first_difference = 0, None
    matcher = difflib.SequenceMatcher(None, list(reference), list(received), autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "delete":
            lost += i2 - i1
        elif tag == "insert":
            duplicated += j2 - j1
        elif tag == "replace":
            first_difference, different = j1, len(received) - j1
            break
    return {
        "identical": list(reference) == list(received),
        "lost": lost,
        "duplicated": duplicated,
        "different": different,
        "first_difference": first_difference,
    }


def checks_against(references: Sequence[Stream], streams: Sequence[Stream]) -> dict[str, Any]:
    """Every stream against its reference: the sums of ``token_check``, and where the tokens first differ."""
    checks = [token_check(ref.tokens, s.tokens) for ref, s in zip(references, streams)]
    return {
        "streams": len(streams),
        "identical": sum(c["identical"] for c in checks),
        "tokens_lost": sum(c["lost"] for c in checks),
        "tokens_duplicated": sum(c["duplicated"] for c in checks),
        "tokens_different": sum(c["different"] for c in checks),
        "first_differences": {s.index: c["first_difference"] for s, c in zip(streams, checks) if c["different"]},
        # what the client counted against what the server said it sent
        "counts_agree": all(len(s.tokens) == s.completion_tokens for s in streams),
    }


def errors_of(streams: Sequence[Stream]) -> dict[int, str]:
    return {s.index: s.error for s in streams if s.error is not None}


def drain_figures(
    streams: Sequence[Stream], references: Sequence[Stream], drain_s: float, drained_s: float, window_s: float
) -> dict[str, Any]:
    """One drain run: its time, the moved streams' ITL before and around the move (all streams' where none moved),
    each moved stream's longest stall there, and the tokens against the references."""
    moved = [s for s in streams if (s.timing.get("migrations") or 0) > 0]
    measured = moved or list(streams)
    around = (drain_s, drained_s + window_s)
    stalls = [max(gaps_in(s.arrivals, *around), default=0.0) for s in moved]
    server_stalls = [s.timing.get("migration_s") or 0.0 for s in moved]
    arrivals = [s.arrivals for s in measured]
    before, during = itl_figures(arrivals, drain_s - window_s, drain_s), itl_figures(arrivals, *around)
    return {
        "drain_time_s": round(drained_s - drain_s, 3),
        "moved_streams": len(moved),
        "itl_of": "moved streams" if moved else "all streams (none moved)",
        "tokens_at_drain": {
            "min": min(sum(a < drain_s for a in s.arrivals) for s in streams),
            "max": max(sum(a < drain_s for a in s.arrivals) for s in streams),
        },
        "itl_before": before,
        "itl_during": during,
        "itl_p99_ratio": ratio(during["p99_ms"], before["p99_ms"]),
        "stall_ms": {
            "client_p50": _ms(percentile(stalls, 50)),
            "client_max": _ms(max(stalls, default=None)),
            "server_p50": _ms(percentile(server_stalls, 50)),
            "server_max": _ms(max(server_stalls, default=None)),
        },
        "coalesced_tokens": sum(len(s.tokens) - s.chunks for s in streams),
        "tokens": checks_against(references, streams),
        "errors": errors_of(streams),
    }


MIGRATION_FLAGS = ("all_streams_moved", "tokens_lost_0_duplicated_0")  # goals that are flags, not thresholds


def compare_drains(migrate: dict[str, Any], wait: dict[str, Any], streams: int) -> dict[str, Any]:
    drain_ratio = ratio(migrate["drain_time_s"], wait["drain_time_s"])
    itl_ratio = migrate["itl_p99_ratio"]
    exact = all(
        run["tokens"]["tokens_lost"] == run["tokens"]["tokens_duplicated"] == 0 and not run["errors"]
        for run in (migrate, wait)
    )
    out: dict[str, Any] = {
        "drain_time_ratio": drain_ratio,
        "itl_p99_ratio": itl_ratio,
        "goals": {
            "drain_time_ratio_at_most": GOAL_DRAIN_TIME_RATIO,
            "drain_time_ratio_met": drain_ratio is not None and drain_ratio <= GOAL_DRAIN_TIME_RATIO,
            "itl_p99_ratio_at_most": GOAL_ITL_P99_RATIO,
            "itl_p99_ratio_met": itl_ratio is not None and itl_ratio <= GOAL_ITL_P99_RATIO,
            "all_streams_moved": migrate["moved_streams"] == streams,
            "tokens_lost_0_duplicated_0": exact,
        },
    }
    goals = out["goals"]
    goals["all_met"] = all(goals[k] for k in goals if k.endswith("_met") or k in MIGRATION_FLAGS)
    return out


def request_figures(stream: Stream) -> dict[str, float | None]:
    """TTFT, TPOT (first to last token over the tokens after the first) and the longest gap between two tokens, as
    the client saw them; None for a failed request."""
    arrivals = stream.arrivals
    if stream.error is not None or not arrivals or stream.sent_s is None:
        return {"ttft_s": None, "tpot_s": None, "longest_gap_s": None}
    tpot = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else 0.0
    return {
        "ttft_s": arrivals[0] - stream.sent_s,
        "tpot_s": tpot,
        "longest_gap_s": max(gaps_in(arrivals, -math.inf, math.inf), default=0.0),
    }


def load_figures(streams: Sequence[Stream], long_ones: Sequence[bool], slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """A rebalance run's goodput and latency, from the client's times, and a row per request. Goodput is also given
    at looser TPOT bounds (``TPOT_SLO_SCALES``), the TTFT bound kept."""
    figures = [request_figures(s) for s in streams]

    def within(tpot_s: float) -> list[bool]:
        return [
            f["ttft_s"] is not None and f["ttft_s"] <= slo_ttft_s and f["tpot_s"] is not None and f["tpot_s"] <= tpot_s
            for f in figures
        ]

    start = min(s.sent_s for s in streams if s.sent_s is not None)
    end = max((s.arrivals[-1] for s in streams if s.arrivals), default=start)
    wall = end - start
    ok = within(slo_tpot_s)

    def described(key: str, only_long: bool = False) -> dict[str, float | None]:
        values = [f[key] for f, long in zip(figures, long_ones) if f[key] is not None and (long or not only_long)]
        return {"p50": _ms(percentile(values, 50)), "p99": _ms(percentile(values, 99))}

    itls = [gap for s in streams for gap in gaps_in(s.arrivals, -math.inf, math.inf)]
    return {
        "requests": len(streams),
        "completed": sum(s.finish_reason is not None and s.error is None for s in streams),
        "within_slo": sum(ok),
        "wall_s": round(wall, 2),
        "goodput_rps": round(sum(ok) / wall, 4) if wall > 0 else None,
        "goodput_rps_by_tpot_slo_ms": {
            f"{1000 * scale * slo_tpot_s:g}": round(sum(within(scale * slo_tpot_s)) / wall, 4) if wall > 0 else None
            for scale in TPOT_SLO_SCALES
        },
        "ttft_ms": described("ttft_s"),
        "tpot_ms": described("tpot_s"),
        "long_tpot_ms": described("tpot_s", only_long=True),
        "longest_gap_ms": described("longest_gap_s") | {"max": _ms(max(itls, default=None))},
        "itl_ms": {"p50": _ms(percentile(itls, 50)), "p99": _ms(percentile(itls, 99))},
        "ttft_parts_ms_p50": {
            part: _ms(percentile([s.timing[f"{part}_s"] for s in streams if f"{part}_s" in s.timing], 50))
            for part in TTFT_PARTS
        },
        "per_request": [
            {
                "long": long,
                "ttft_ms": _ms(f["ttft_s"]),
                "tpot_ms": _ms(f["tpot_s"]),
                "longest_gap_ms": _ms(f["longest_gap_s"]),
                "migrations": int(s.timing.get("migrations") or 0),
                "within_slo": met,
            }
            for s, f, long, met in zip(streams, figures, long_ones, ok)
        ],
        "errors": errors_of(streams),
    }


def compare_rebalance(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """on / off: goodput, p99 TPOT (all requests, and the long ones, which are the ones preempted or moved), and
    the longest gap any request saw."""
    return {
        "goodput_ratio": ratio(on["goodput_rps"], off["goodput_rps"]),
        "tpot_p99_ratio": ratio(on["tpot_ms"]["p99"], off["tpot_ms"]["p99"]),
        "long_tpot_p99_ratio": ratio(on["long_tpot_ms"]["p99"], off["long_tpot_ms"]["p99"]),
        "longest_gap_ms": {"off": off["longest_gap_ms"]["max"], "on": on["longest_gap_ms"]["max"]},
        "preemptions": {"off": off["preemptions"], "on": on["preemptions"]},
        "moves": {"off": off["migrations"].get("moved", 0), "on": on["migrations"].get("moved", 0)},
    }


def migration_counts(before: Samples, after: Samples, reason: str) -> dict[str, int]:
    """``pdserve_migrations_total{reason}`` by result, over a run."""
    deltas = {
        result: sample(after, "pdserve_migrations_total", reason=reason, result=result)
        - sample(before, "pdserve_migrations_total", reason=reason, result=result)
        for result in MIGRATION_RESULTS
    }
    return {result: int(n) for result, n in deltas.items() if n}


def migration_seconds(before: Samples, after: Samples) -> dict[str, float | None]:
    """``pdserve_migration_seconds`` over a run: moves and their mean stall."""
    count = sample(after, "pdserve_migration_seconds_count") - sample(before, "pdserve_migration_seconds_count")
    total = sample(after, "pdserve_migration_seconds_sum") - sample(before, "pdserve_migration_seconds_sum")
    return {"moves": int(count), "mean_ms": _ms(total / count) if count else None}


def worker_deltas(before: dict, after: dict, keys: Sequence[str]) -> dict[str, int]:
    return {key: worker_total(after, "decode", key) - worker_total(before, "decode", key) for key in keys}


# ---- sizing and configs ----------------------------------------------------------------------------------------


def check_options(args: argparse.Namespace) -> None:
    positive = ("streams", "max_tokens", "prompt_len", "long_requests", "long_tokens", "short_tokens")
    positive += ("rebalance_prompt_len", "rebalance_kv_blocks", "max_moves_per_worker")
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if not 1 <= args.tokens_before_move < args.max_tokens:
        raise ValueError("--tokens-before-move must be at least 1 and less than --max-tokens")
    for name in ("window_s", "request_timeout_s"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if args.send_gap_s < 0:
        raise ValueError("--send-gap-s cannot be negative")
    if args.kv_blocks is not None and args.kv_blocks < 1:
        raise ValueError("--kv-blocks must be at least 1")
    for name in ("slo_ttft_s", "slo_tpot_ms"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if args.long_tokens <= args.short_tokens:
        raise ValueError("--long-tokens must be more than --short-tokens")


def blocks(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def drain_sizing(args: argparse.Namespace, block_size: int, max_model_len: int | None) -> dict[str, Any]:
    """The drain part's decode KV: by default every stream to its end on one worker (the wait run's, and the target's
    in the migrate run), so neither run preempts."""
    context = args.prompt_len + args.max_tokens
    if max_model_len is not None and context > max_model_len:
        raise ValueError(f"--prompt-len + --max-tokens ({context}) exceeds the model's max_model_len {max_model_len}")
    needed = args.streams * blocks(context, block_size)
    kv_blocks = args.kv_blocks or math.ceil(KV_MARGIN * needed)
    if kv_blocks < needed:
        print(
            f"{LOG}: warning: --kv-blocks {kv_blocks} < the {needed} the streams reach: they preempt", file=sys.stderr
        )
    return {"decode_kv_blocks": kv_blocks, "blocks_the_streams_reach": needed}


def rebalance_sizing(args: argparse.Namespace, block_size: int) -> dict[str, Any]:
    """The long generations' KV against one decode worker's: their prompts must fit it (each reservation is granted
    where round_robin sends it), their ends must not (else nothing preempts), one must fit whole."""
    prompt = blocks(args.rebalance_prompt_len + 1, block_size)
    long_end = blocks(args.rebalance_prompt_len + args.long_tokens, block_size)
    kv = args.rebalance_kv_blocks
    if args.long_requests * prompt > kv:
        raise ValueError(f"--rebalance-kv-blocks {kv} cannot hold {args.long_requests} prompts of {prompt} blocks")
    if long_end > kv:
        raise ValueError(f"--rebalance-kv-blocks {kv}: one long generation reaches {long_end} blocks")
    all_long = args.long_requests * long_end
    if all_long <= kv:
        print(
            f"{LOG}: warning: the long generations ({all_long} blocks) fit one worker: nothing preempts",
            file=sys.stderr,
        )
    return {
        "decode_kv_blocks": kv,
        "long_prompt_blocks": prompt,
        "long_end_blocks": long_end,
        "long_ends_over_one_worker": round(all_long / kv, 2),
        "long_ends_fit_two_workers": all_long <= 2 * kv,
    }


def base_config(args: argparse.Namespace) -> ClusterConfig:
    from cluster.config import load_config

    given = getattr(args, "cluster_config", None)  # a ClusterConfig object (tests) instead of a file
    config = (given if given is not None else load_config(args.config)).model_copy(deep=True)
    if args.model:
        config.model.name = args.model
    config.mode = "disaggregated"
    config.router.port = 0
    config.router.request_timeout_s = args.request_timeout_s
    config.router.rebalance.enabled = False
    config.pools.prefill.replicas = 1
    return config


def drain_config(base: ClusterConfig, migrate: bool, kv_blocks: int) -> ClusterConfig:
    """One decode worker to start with (the second joins once the streams run there)."""
    config = base.model_copy(deep=True)
    config.pools.decode.replicas = 1
    config.pools.decode.kv_blocks = kv_blocks
    config.router.migrate_on_drain = migrate
    return config


def rebalance_config(base: ClusterConfig, args: argparse.Namespace, enabled: bool) -> ClusterConfig:
    config = base.model_copy(deep=True)
    config.pools.decode.replicas = 2
    config.pools.decode.kv_blocks = args.rebalance_kv_blocks
    config.router.decode_policy = "round_robin"
    config.router.rebalance.enabled = enabled
    config.router.rebalance.max_moves_per_worker = args.max_moves_per_worker
    return config


def make_prompts(tokenizer_path: str, n: int, tokens: int, seed: int) -> list[str]:
    """``n`` prompts of exactly ``tokens`` tokens each (the load tester's builder)."""
    from transformers import AutoTokenizer

    from bench.loadtest.workloads import PromptBuilder

    builder = PromptBuilder(AutoTokenizer.from_pretrained(tokenizer_path), seed=seed)
    return [builder.build(tokens) for _ in range(n)]


# ---- the drain runs --------------------------------------------------------------------------------------------


def _decode_names(handle: ServeHandle) -> list[str]:
    return [w.name for w in handle.workers if w.role == "decode"]


def _placements(handle: ServeHandle, streams: Sequence[Stream]) -> list[Any]:
    """Where the router placed each request (its ``Placements`` record, or None)."""
    router: Any = handle.router  # one router process: the Router itself
    return [router.core.placements.get(s.request_id or "") for s in streams]


def _serving_decode(base_url: str, name: str) -> bool:
    """The router has a heartbeat from ``name``."""
    status = httpx.get(f"{base_url}/status", timeout=10).json()
    return any(w["name"] == name and w["alive"] and w.get("stats_age_s") is not None for w in status["workers"])


def _reference_run(handle: ServeHandle, model: str, prompts: list[str], args: argparse.Namespace) -> list[Stream]:
    """Each prompt's greedy tokens, not streamed, all at once on the one decode worker (as the streams will run)."""
    references = [Stream(i, p, args.max_tokens) for i, p in enumerate(prompts)]
    client = Client(handle.base_url, model, args.request_timeout_s)
    client.start(references, streamed=False)
    client.join(args.request_timeout_s)
    if errors_of(references):
        raise RuntimeError(f"the reference run failed: {errors_of(references)}")
    return references


def _drain_run(
    config: ClusterConfig,
    name: str,
    prompts: list[str],
    references: list[Stream] | None,
    args: argparse.Namespace,
) -> tuple[dict[str, Any], list[Stream], list[Stream]]:
    """One drain (module docstring); returns its figures, its streams and the references (made here if None)."""
    model = config.served_model_name
    with serving(config, f"{LOG}: drain {name}", args.in_process) as handle:
        url = handle.base_url
        if references is None:
            print(f"{LOG}: drain {name}: the reference run ({len(prompts)} prompts, not streamed)", file=sys.stderr)
            references = _reference_run(handle, model, prompts, args)
        [source] = _decode_names(handle)
        record = next(w for w in handle.workers if w.name == source)
        samples0, status0 = router_samples(url), settle(url)
        streams = [Stream(i, p, args.max_tokens) for i, p in enumerate(prompts)]
        client = Client(url, model, args.request_timeout_s)
        client.start(streams)
        wait_for(
            lambda: all(len(s.tokens) >= args.tokens_before_move or s.ended for s in streams),
            START_TIMEOUT_S,
            f"every stream's first {args.tokens_before_move} tokens",
        )
        placements = _placements(handle, streams)
        on_source = sum(p is not None and p.decode == source for p in placements)
        print(
            f"{LOG}: drain {name}: {on_source}/{len(streams)} streams on {source}; adding a decode worker",
            file=sys.stderr,
        )
        added_s = time.perf_counter()
        assert handle.scaler is not None
        handle.scaler.scale("decode", 2)  # Ray: returns with the worker still pending if it is not placed in 30 s

        def target_serves() -> bool:
            added = [n for n in _decode_names(handle) if n != source]
            return bool(added) and _serving_decode(url, added[0])

        serving_s = wait_for(target_serves, START_TIMEOUT_S, "the added decode worker's first heartbeat")
        [target] = [n for n in _decode_names(handle) if n != source]
        time.sleep(args.window_s)  # the window before the drain
        drain_s = time.perf_counter()
        running = sum(not s.ended for s in streams)
        router: Any = handle.router  # one router process: the Router itself
        router.drain_worker_threadsafe(source, args.request_timeout_s)
        drained_s = wait_for(lambda: handle.pools.drained(record), args.request_timeout_s, f"{source}'s drain")
        print(f"{LOG}: drain {name}: {source} drained in {drained_s - drain_s:.2f} s", file=sys.stderr)
        client.join(args.request_timeout_s)
        samples1, status1 = router_samples(url), settle(url)
    figures = {
        "source": source,
        "target": target,
        "streams_on_source": on_source,
        "streams_running_at_drain": running,
        "second_worker_serving_after_s": round(serving_s - added_s, 2),
    }
    figures |= drain_figures(streams, references, drain_s, drained_s, args.window_s)
    figures["migrations"] = migration_counts(samples0, samples1, "drain")
    figures["migration_seconds"] = migration_seconds(samples0, samples1)
    figures["workers"] = worker_deltas(status0, status1, ("migrations_out", "migrations_in", "migration_bytes"))
    figures["held_after"] = {"settled": status1["settled"], "inflight": status1.get("inflight")}
    return figures, streams, references


def drain_part(base: ClusterConfig, args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    size = drain_sizing(args, base.transfer.block_size, base.model.max_model_len)
    prompts = make_prompts(model_path, args.streams, args.prompt_len, args.seed)
    runs: dict[str, Any] = {}
    streams: dict[str, list[Stream]] = {}
    references = None
    for name, migrate in (("migrate", True), ("wait", False)):
        config = drain_config(base, migrate, size["decode_kv_blocks"])
        runs[name], streams[name], references = _drain_run(config, name, prompts, references, args)
        runs[name]["migrate_on_drain"] = migrate
    # where a stream differs from its reference, the same tokens in the other run say the reference is what differs
    runs["migrate"]["same_tokens_as_wait_run"] = sum(
        m.tokens == w.tokens for m, w in zip(streams["migrate"], streams["wait"])
    )
    return {
        "workload": {
            "streams": args.streams,
            "max_tokens": args.max_tokens,
            "prompt_len": args.prompt_len,
            "issue_settings": ISSUE_SETTINGS,
            "at_issue_settings": args.streams == ISSUE_SETTINGS["streams"]
            and args.max_tokens == ISSUE_SETTINGS["max_tokens"],
            "tokens_before_move": args.tokens_before_move,
            "window_s": args.window_s,
            "placement": "sent while the decode pool has one worker; the second added (scaler.scale) once every "
            "stream has its first tokens, the first drained --window-s after the second serves",
            "reference": "each prompt's greedy tokens, not streamed, all at once on the first run's one decode worker "
            "before its streams",
        },
        "sizing": size,
        "runs": runs,
        "comparison": compare_drains(runs["migrate"], runs["wait"], args.streams),
    }


# ---- the rebalance runs ----------------------------------------------------------------------------------------


def _warm_up(client: Client, decode_workers: int, timeout_s: float) -> None:
    """One short request per decode worker (round_robin gives each one), not measured: every worker's first forward
    is behind it, and the policy's turn is where it was."""
    warm = [Stream(-1 - i, "Hello", 2) for i in range(decode_workers)]
    client.start(warm, streamed=False)
    client.join(timeout_s)
    if errors_of(warm):
        raise RuntimeError(f"the warm-up failed: {errors_of(warm)}")


def _rebalance_run(
    config: ClusterConfig, name: str, prompts: list[str], args: argparse.Namespace, slo: tuple[float, float]
) -> tuple[dict[str, Any], list[Stream]]:
    long_ones = [i % 2 == 0 for i in range(len(prompts))]
    streams = [
        Stream(i, p, args.long_tokens if long else args.short_tokens)
        for i, (p, long) in enumerate(zip(prompts, long_ones))
    ]
    with serving(config, f"{LOG}: rebalance {name}", args.in_process) as handle:
        url = handle.base_url
        wait_for(lambda: all(_serving_decode(url, n) for n in _decode_names(handle)), START_TIMEOUT_S, "heartbeats")
        client = Client(url, config.served_model_name, args.request_timeout_s)
        _warm_up(client, len(_decode_names(handle)), args.request_timeout_s)
        samples0, status0 = router_samples(url), settle(url)
        client.start(streams, gap_s=args.send_gap_s)
        client.join(args.request_timeout_s)
        placements = _placements(handle, streams)
        samples1, status1 = router_samples(url), settle(url)
    long_on = sorted({p.decode for p, long in zip(placements, long_ones) if long and p is not None and p.decode})
    figures = {"long_requests_placed_on": long_on} | load_figures(streams, long_ones, *slo)
    for row, placement in zip(figures["per_request"], placements):
        row["placed_on"] = None if placement is None else placement.decode
    figures["preemptions"] = worker_deltas(status0, status1, ("preemptions",))["preemptions"]
    figures["migrations"] = migration_counts(samples0, samples1, "rebalance")
    figures["migration_seconds"] = migration_seconds(samples0, samples1)
    figures["workers"] = worker_deltas(status0, status1, ("migrations_out", "migrations_in"))
    figures["held_after"] = {"settled": status1["settled"], "inflight": status1.get("inflight")}
    print(
        f"{LOG}: rebalance {name}: goodput {figures['goodput_rps']} req/s, TPOT p99 {figures['tpot_ms']['p99']} ms, "
        f"{figures['preemptions']} preemptions, moves {figures['migrations']}",
        file=sys.stderr,
    )
    return figures, streams


def rebalance_part(base: ClusterConfig, args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    size = rebalance_sizing(args, base.transfer.block_size)
    slo_ttft_s = args.slo_ttft_s or base.slo.ttft_s
    slo_tpot_s = args.slo_tpot_ms / 1000 if args.slo_tpot_ms else base.slo.tpot_s
    prompts = make_prompts(model_path, 2 * args.long_requests, args.rebalance_prompt_len, args.seed + 1)
    runs: dict[str, Any] = {}
    streams: dict[str, list[Stream]] = {}
    for name, enabled in (("off", False), ("on", True)):
        config = rebalance_config(base, args, enabled)
        runs[name], streams[name] = _rebalance_run(config, name, prompts, args, (slo_ttft_s, slo_tpot_s))
        runs[name]["rebalance"] = {"enabled": enabled, "max_moves_per_worker": args.max_moves_per_worker}
    runs["on"]["same_tokens_as_off_run"] = sum(a.tokens == b.tokens for a, b in zip(streams["on"], streams["off"]))
    return {
        "workload": {
            "long_requests": args.long_requests,
            "short_requests": args.long_requests,
            "long_tokens": args.long_tokens,
            "short_tokens": args.short_tokens,
            "prompt_len": args.rebalance_prompt_len,
            "order": "long and short alternate, sent --send-gap-s apart; decode_policy round_robin",
            "warm_up": "one short request per decode worker before the measured ones (not measured)",
            "send_gap_s": args.send_gap_s,
            "slo": {"ttft_s": slo_ttft_s, "tpot_ms": round(1000 * slo_tpot_s, 1)},
            "goodput": "requests within both SLO bounds (client's TTFT and TPOT) per second, first send to last token",
        },
        "sizing": size,
        "runs": runs,
        "comparison": compare_rebalance(runs["off"], runs["on"]),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.model_loader import resolve_model_path

    check_options(args)
    base = base_config(args)
    model_path = str(resolve_model_path(base.model.name))
    pools = base.pools
    out: dict[str, Any] = {
        "configuration": {
            "model": base.model.name,
            "dtype": base.served_dtype,
            "block_size": base.transfer.block_size,
            "transfer_backend": base.transfer.backend,
            "torch_threads": {"prefill": pools.prefill.torch_threads, "decode": pools.decode.torch_threads},
            "workers": "threads of this process (in-process)" if args.in_process else "Ray actors (processes)",
            "in_process": args.in_process,
            "cpu_count": os.cpu_count(),
            "seed": args.seed,
        }
    }
    started = time.monotonic()
    ray_sizing = base.model_copy(deep=True)
    ray_sizing.pools.decode.replicas = 2  # the most decode workers any run has
    with local_ray(ray_sizing, args.in_process):
        if args.parts in ("drain", "both"):
            out["drain"] = drain_part(base, args, model_path)
        if args.parts in ("rebalance", "both"):
            out["rebalance"] = rebalance_part(base, args, model_path)
    out["wall_s"] = round(time.monotonic() - started, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.loadtest.cli import run_main

    return run_main("python -m benchmarks.migration_bench", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
