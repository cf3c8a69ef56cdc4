"""Command-line options of the experiments whose modules are heavy to import (torch, the transfer layer, the cluster).

``pdserve bench NAME`` declares them through cli/main.py's experiments registry, so this module imports the standard
library and the product's light option modules only (light experiments such as ``detok_bench`` declare their
own); each experiment imports its function as ``add_arguments``, and ``main`` runs one as ``python -m``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.loadtest.options import PDSERVE_DEFAULT_MODEL
from bench.options import (
    COMPARE_MODES,
    SPECULATIVE_DEFAULTS,
    add_engine_run_arguments,
    add_reps_argument,
    add_speculative_arguments,
    add_tp_handoff_arguments,
)

LOCAL_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local.yaml"


def add_speculative_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench speculative`` (``benchmarks/speculative_bench.py``): the engine with n-gram speculation
    against the same engine without it, transformers' prompt lookup and plain generate, on grounded and random
    prompts. The options are the product's (bench/options.py), declared once for this and for ``pdserve bench engine
    --speculative ngram``."""
    add_engine_run_arguments(parser, SPECULATIVE_DEFAULTS)
    add_speculative_arguments(parser)


def add_tp_handoff_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench tp-handoff`` (``benchmarks/tp_handoff_bench.py``); declared once in bench/options.py for this
    and for ``pdserve bench transfer --degrees``."""
    add_tp_handoff_arguments(parser)
    add_reps_argument(parser)


def add_chaos_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench chaos`` (``benchmarks/chaos.py``)."""
    parser.add_argument("--config", default=str(LOCAL_CONFIG))
    parser.add_argument("--model", default=None, help="override model.name")
    parser.add_argument("--prefill-replicas", type=int, default=None, help="override pools.prefill.replicas")
    parser.add_argument("--decode-replicas", type=int, default=None, help="override pools.decode.replicas")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="workers as threads of this process (no Ray); a kill stops one dead, nothing restarts it",
    )
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--request-timeout-s", type=float, default=60.0, help="the router's per-request deadline")
    parser.add_argument("--kill-decode-at", type=float, default=0.25, help="fraction of requests done")
    parser.add_argument("--kill-prefill-at", type=float, default=0.6, help="fraction of requests done")
    parser.add_argument("--settle-timeout-s", type=float, default=90.0)
    parser.add_argument("--json", action="store_true")


def add_routing_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench routing`` (``benchmarks/routing_bench.py``)."""
    parser.add_argument("--config", default="local", help="cluster config the runs start from: a path or a name")
    parser.add_argument("--model", default=None, help="override model.name (a folder, or the built-in default)")
    parser.add_argument("--workload", choices=("shared-prefix", "multi-turn", "both"), default="both")
    parser.add_argument(
        "--in-process", action="store_true", help="workers as threads of this process (no Ray): quick, for tests"
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=2,
        help="closed loop: requests (multi-turn: conversations) in flight; default: one per prefill worker",
    )
    parser.add_argument("--seed", type=int, default=0, help="the same requests, in the same order, in both runs")
    group = parser.add_argument_group("shared-prefix workload")
    group.add_argument("--prefix-groups", type=int, default=4, help="groups, each with its own shared prefix")
    group.add_argument("--prefix-len", type=int, default=768, help="tokens of each group's prefix")
    group.add_argument("--question-len", type=int, default=32, help="tokens each request adds to its prefix")
    group.add_argument("--num-prompts", type=int, default=32)
    group.add_argument("--output-len", type=int, default=8, help="output tokens per request (ignore_eos)")
    group.add_argument(
        "--prefill-kv-blocks",
        type=int,
        default=None,
        help="KV blocks per prefill worker; default: the prefixes of half the groups plus room for the requests "
        "in flight (so all the prefixes do not fit one worker, half of them do)",
    )
    group = parser.add_argument_group("multi-turn workload")
    group.add_argument("--num-conversations", type=int, default=8)
    group.add_argument("--num-turns", type=int, default=4)
    group.add_argument(
        "--system-len",
        type=int,
        default=256,
        help="tokens of a system prompt every conversation starts with (0: none)",
    )
    group.add_argument("--user-len", type=int, default=32, help="tokens of each user message on its own")
    group.add_argument("--turn-output-len", type=int, default=96, help="max_tokens of each answer")
    group.add_argument(
        "--think-time-s",
        type=float,
        default=1.0,
        help="mean seconds between an answer and the next turn (exponential: users out of step, as in life)",
    )
    parser.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=None,
        help="router.local_prefill_max_tokens of the kv_aware run (conditional disaggregation); default: 128 for "
        "multi-turn, 0 for shared-prefix (so that its prefill routing is what is measured); the baseline has 0",
    )
    parser.add_argument(
        "--prefix-weight", type=float, default=None, help="router.kv_aware.prefix_weight of the kv_aware run"
    )
    parser.add_argument(
        "--load-weight", type=float, default=None, help="router.kv_aware.load_weight of the kv_aware run"
    )
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--result-dir", default=None, help="per-request records; default: results/<timestamp>")
    parser.add_argument("--json", action="store_true", help="print the JSON object on one line")


def add_model_families_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench models`` (``benchmarks/model_families_bench.py``)."""
    parser.add_argument(
        "--families",
        default=None,
        metavar="A,B,...",
        help="tiny-model families (engine/tiny_model.py's TINY_ARCHITECTURES); default: all of them",
    )
    parser.add_argument(
        "--model-types",
        default="",
        metavar="T1,T2,...",
        help="also any other transformers model_type, built with the tiny models' sizes (refusals are rows too)",
    )
    parser.add_argument("--prompts", type=int, default=3, help="prompts compared token by token with transformers")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt, both parts")
    parser.add_argument("--batch", type=int, default=8, help="equal-length prompts of the decode-speed batch")
    parser.add_argument("--input-len", type=int, default=32, help="tokens of each prompt of the speed batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median reported)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads while it runs: a tiny model gains nothing from more, and on a busy machine threads "
        "that wait for a core slow every step by orders of magnitude",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="also run each family at N ranks (processes) against 1: same greedy tokens, the logprob gap, step time "
        "with the same total threads (a correctness feature on a CPU, not a speed claim), or the refusal",
    )
    parser.add_argument(
        "--expert-parallel-size",
        type=int,
        default=1,
        metavar="E",
        help="at N ranks, split a mixture of experts' routed experts E ways over them (1 or N; a family without "
        "routed experts runs at N alone): the bytes the experts' exchange moves per token, the load imbalance",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON object on one line")


def add_kv_cache_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench kv-cache`` (``benchmarks/kv_quant_bench.py``)."""
    parser.add_argument("--model", default=PDSERVE_DEFAULT_MODEL)
    parser.add_argument("--dtypes", default="int8,fp8_e4m3", help="quantized cache dtypes, compared with auto")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="decode batch of the speed figure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")


def add_kv_tiers_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench kv-tiers`` (``benchmarks/kv_tiers_bench.py``)."""
    parser.add_argument("--config", default="local", help="cluster config the runs start from: a path or a name")
    parser.add_argument("--model", default=None, help="override model.name (a folder, or the built-in default)")
    parser.add_argument(
        "--mode",
        choices=COMPARE_MODES,
        default="disaggregated",
        help="disaggregated: 1 prefill + 1 decode worker; colocated: 1 worker",
    )
    parser.add_argument(
        "--in-process", action="store_true", help="workers as threads of this process (no Ray): quick, for tests"
    )
    parser.add_argument("--max-concurrency", type=int, default=1, help="closed loop: requests in flight")
    parser.add_argument("--seed", type=int, default=0, help="the same requests, in the same order, in every run")
    parser.add_argument("--tenants", type=int, default=8, help="tenants, each with its own system prompt")
    parser.add_argument("--prefix-len", type=int, default=512, help="tokens of each tenant's system prompt")
    parser.add_argument("--question-len", type=int, default=32, help="tokens each request adds to its prefix")
    parser.add_argument("--output-len", type=int, default=4, help="output tokens per request (ignore_eos)")
    parser.add_argument(
        "--num-prompts", type=int, default=24, help="measured requests per run, tenants in turn (after the warm-up)"
    )
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=64,
        help="device KV blocks per worker; the tenants' prompts should take at least 4x that",
    )
    parser.add_argument(
        "--host-memory-mb",
        type=int,
        default=None,
        help="the with-tiers run's host tier; default: every tenant's prefix and every request's own blocks, +25%%",
    )
    parser.add_argument("--disk-mb", type=int, default=None, help="each disk tier's bound; default: as the host tier")
    parser.add_argument(
        "--restart-requests",
        type=int,
        default=4,
        help="requests measured after the restart, on the tenants whose prefixes left the device first (0: no "
        "restart measurement)",
    )
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--result-dir", default=None, help="per-request records; default: results/<timestamp>")
    parser.add_argument("--json", action="store_true", help="print the JSON object on one line")


def add_migration_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench migrate`` (``benchmarks/migration_bench.py``)."""
    parser.add_argument("--config", default="local", help="cluster config the runs start from: a path or a name")
    parser.add_argument("--model", default=None, help="override model.name (a folder, or the built-in default)")
    parser.add_argument(
        "--in-process", action="store_true", help="workers as threads of this process (no Ray): quick, for tests"
    )
    parser.add_argument("--parts", choices=("drain", "rebalance", "both"), default="both")
    parser.add_argument("--seed", type=int, default=0, help="the same prompts in every run")
    parser.add_argument("--request-timeout-s", type=float, default=3600.0, help="the router's per-request deadline")
    group = parser.add_argument_group("drain: one decode worker's streams, drained by migration vs by waiting")
    group.add_argument("--streams", type=int, default=16, help="running generations on the drained worker")
    group.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="tokens each stream generates (greedy, ignore_eos; the issue asks 1000: minutes per run on 2 cores)",
    )
    group.add_argument("--prompt-len", type=int, default=64, help="tokens of each stream's prompt")
    group.add_argument(
        "--tokens-before-move",
        type=int,
        default=8,
        help="every stream has this many tokens before the second decode worker is added",
    )
    group.add_argument(
        "--window-s",
        type=float,
        default=10.0,
        help="ITL windows: the streams' last seconds before the drain, and the drain plus as long after it",
    )
    group.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV blocks per decode worker; default: every stream to its end on one worker, +10%%",
    )
    group = parser.add_argument_group("rebalance: a skewed load, rebalancing off vs on")
    group.add_argument(
        "--long-requests",
        type=int,
        default=8,
        help="long generations, each followed by a short one: round_robin puts every long one on one decode worker",
    )
    group.add_argument("--long-tokens", type=int, default=256, help="tokens of each long generation")
    group.add_argument("--short-tokens", type=int, default=16, help="tokens of each short generation")
    group.add_argument("--rebalance-prompt-len", type=int, default=16, help="tokens of every prompt")
    group.add_argument(
        "--rebalance-kv-blocks",
        type=int,
        default=96,
        help="KV blocks per decode worker: the long ones' prompts fit one worker, their ends do not",
    )
    group.add_argument("--max-moves-per-worker", type=int, default=1, help="router.rebalance.max_moves_per_worker")
    group.add_argument(
        "--send-gap-s",
        type=float,
        default=0.5,
        help="between two requests' sends, in order (time for the prefill worker to keep up: TTFT is not the point)",
    )
    group.add_argument("--slo-ttft-s", type=float, default=None, help="goodput's TTFT bound; default: config's slo")
    group.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput's TPOT bound; default: config's slo")
    parser.add_argument("--json", action="store_true", help="print the JSON object on one line")


def main(prog: str, add_arguments: Callable[[argparse.ArgumentParser], None], run: Callable[..., Any]) -> int:
    """``python -m benchmarks.NAME`` from the repository's root: what ``pdserve bench NAME`` does (parse, run, print
    the result as JSON, on one line with ``--json``)."""
    parser = argparse.ArgumentParser(prog=prog)
    add_arguments(parser)
    if not any(action.dest == "json" for action in parser._actions):
        parser.add_argument("--json", action="store_true", help="print the JSON object on one line")
    args = parser.parse_args()
    try:
        result = run(args)
    except ValueError as exc:  # bad input: a clear message, not a traceback
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def add_stranger_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench stranger`` (``benchmarks/stranger_bench.py``)."""
    parser.add_argument("--config", default="local", help="cluster config to serve: a path or a name")
    parser.add_argument("--model", default=None, help="override model.name (a folder, or the built-in default)")
    parser.add_argument(
        "--in-process", action="store_true", help="workers as threads of this process (no Ray): quick, for tests"
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="how long each attack lasts")
    parser.add_argument(
        "--attacks",
        default="flood,big_frame,routing_ids,held,wrong_keys",
        help="comma-separated: flood, big_frame, routing_ids, held, wrong_keys",
    )


def add_role_switch_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench role-switch`` (``benchmarks/role_switch_bench.py``)."""
    parser.add_argument("--config", default="local", help="cluster config to serve: a path or a name")
    parser.add_argument("--model", default=None, help="override model.name (a folder, or the built-in default)")
    parser.add_argument(
        "--in-process", action="store_true", help="workers as threads of this process (no Ray): quick, for tests"
    )
    parser.add_argument("--repeats", type=int, default=2, help="rounds of each (a round moves a worker and back)")


def add_role_shift_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench role-shift`` (``benchmarks/role_shift_bench.py``)."""
    parser.add_argument("--config", default="local", help="cluster config the runs start from: a path or a name")
    parser.add_argument("--model", default=None, help="override model.name (a folder, or the built-in default)")
    parser.add_argument("--tokenizer", default=None, help="the load tester's tokenizer (default: the model's)")
    parser.add_argument(
        "--in-process", action="store_true", help="workers as threads of this process (no Ray): quick, for tests"
    )
    parser.add_argument("--traces", default="../shared/traces", help="folder of the public traces (its README)")
    parser.add_argument("--workers", type=int, default=3, help="workers in every run (the autoscaler's budget)")
    parser.add_argument("--fixed-prefill", type=int, default=2, help="prefill workers of the fixed split (and start)")
    parser.add_argument("--window-s", type=float, default=90.0, help="seconds of each window on the replay's clock")
    parser.add_argument("--code-rate", type=float, default=0.5, help="requests per second in the code window")
    parser.add_argument("--chat-rate", type=float, default=0.8, help="requests per second in the conversation window")
    parser.add_argument("--code-input-scale", type=float, default=0.125, help="the code window's prompt lengths x")
    parser.add_argument("--chat-input-scale", type=float, default=0.005, help="the conversation window's prompts x")
    parser.add_argument("--chat-output-scale", type=float, default=0.5, help="the conversation window's answers x")
    parser.add_argument("--interval-s", type=float, default=5.0, help="the autoscaler's interval")
    parser.add_argument("--cooldown-s", type=float, default=15.0, help="the autoscaler's cool-down per pool")
    parser.add_argument("--ways", default=None, help="comma-separated subset of fixed,restarts,switches")
    parser.add_argument("--max-concurrency", type=int, default=512, help="requests in flight at most (the trace's)")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0, help="the same prompts in every run")
