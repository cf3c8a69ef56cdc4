"""The load tester's command-line options, declared with ``argparse`` alone.

Every parser embedding them must not pay for numpy, httpx or a tokenizer, and the load tester imports no pdserve
cluster or engine code, so the two pdserve defaults it needs are plain values here (and where pdserve keeps its
built-in model, in ``workloads.pdserve_model_folder``), checked against pdserve's own by
``tests/bench/loadtest/test_imports.py``.
"""

from __future__ import annotations

import argparse
import math

from bench.loadtest.traces import TRACE_FORMATS

LENGTH_DISTS = ("fixed", "uniform", "normal", "lognormal")
DATASETS = ("random", "jsonl", "sharegpt", "shared-prefix", "multi-turn", *TRACE_FORMATS)
THINK_TIME_DISTS = ("fixed", "exponential")

PDSERVE_DEFAULT_MODEL = "smollm2-135m-instruct"  # the name of pdserve's built-in model (engine.model_loader)
PDSERVE_DEFAULT_SLOS_MS = {"ttft": 2000.0, "tpot": 200.0}  # pdserve's default SLOs (cluster.config.SLOSection)
DEFAULT_SLOS_NOTE = "cluster.config SLOSection defaults (no --goodput given)"


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Everything but the target: shared by ``bench serve`` and ``bench compare``."""
    p = parser
    p.add_argument(
        "--endpoint-type",
        choices=["completions", "chat"],
        default=None,
        help="default: chat for --dataset-name multi-turn, else completions",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer folder (default: the --model folder, else the tokenizer of pdserve's built-in model, "
        "as pdserve converted it into $PDSERVE_CACHE)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s, open loop (default inf: all at once, or a closed loop with --max-concurrency)",
    )
    p.add_argument("--rates", default=None, help="sweep: comma-separated rates, e.g. 0.25,0.5,1,2")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=100, help="requests per rate (0: only --duration bounds)")
    p.add_argument("--duration", type=float, default=None, help="seconds per rate; outstanding requests are cancelled")
    p.add_argument("--ramp-up-s", type=float, default=0.0)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument(
        "--dataset-name",
        choices=DATASETS,
        default="random",
        help=f"{', '.join(TRACE_FORMATS)}: replay the trace file --dataset-path, each row at its own time",
    )
    p.add_argument("--dataset-path", default=None)
    add_trace_arguments(p)
    p.add_argument(
        "--random-input-len",
        type=int,
        default=256,
        help="prompt tokens as the server counts them (templated for chat); shared-prefix: question tokens; "
        "multi-turn: each user message's own tokens",
    )
    p.add_argument("--random-output-len", type=int, default=64, help="output tokens (multi-turn: per turn)")
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="uniform lengths within ±ratio")
    p.add_argument(
        "--length-dist",
        choices=LENGTH_DISTS,
        default=None,
        help="default: uniform if --random-range-ratio > 0, else fixed",
    )
    p.add_argument("--length-cv", type=float, default=0.25, help="std/mean for normal and lognormal lengths")
    p.add_argument("--shared-prefix-groups", type=int, default=4)
    p.add_argument("--shared-prefix-len", type=int, default=512)
    p.add_argument(
        "--num-conversations",
        type=int,
        default=16,
        help="multi-turn: conversations per rate (0: only --duration bounds); --request-rate is then their "
        "arrival rate and --max-concurrency the most conversations open at once",
    )
    p.add_argument(
        "--num-turns",
        type=int,
        default=None,
        help="multi-turn: user turns per conversation (default 3; with --dataset-path: the file's, cut to this)",
    )
    p.add_argument(
        "--num-turns-range-ratio", type=float, default=0.0, help="multi-turn: turns drawn uniformly within ±ratio"
    )
    p.add_argument(
        "--think-time-s", type=float, default=0.0, help="multi-turn: mean seconds between an answer and the next turn"
    )
    p.add_argument("--think-time-dist", choices=THINK_TIME_DISTS, default="fixed")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true so outputs run to max_tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50")
    p.add_argument("--slo-target-pct", type=float, default=90.0, help="sweep: attainment a rate must reach")
    p.add_argument("--num-workers", type=int, default=None, help="sweep: report the max rate per worker")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--result-dir", default=None, help="default: results/<timestamp>")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--disable-tqdm", action="store_true")
    if not any(a.dest == "json" for a in p._actions):
        p.add_argument("--json", action="store_true", help="print only the summary JSON")


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """How a trace is fitted to the cluster (a trace dataset only; bench/loadtest/traces.py)."""
    p = parser
    p.add_argument(
        "--trace-speedup",
        type=float,
        default=None,
        help="trace time divided by this (2: twice as fast; default 1)",
    )
    p.add_argument(
        "--trace-speedups",
        default=None,
        metavar="F,F,...",
        help="sweep: replay the trace at each speed-up in turn (its rate: rows per second of each), e.g. 0.5,1,2",
    )
    p.add_argument(
        "--trace-token-scale",
        type=float,
        default=None,
        help="prompt and output lengths and the hash-block size times this (1/32: 512-token blocks become 16)",
    )
    p.add_argument(
        "--trace-window", default=None, metavar="START:END", help="only the rows in [START, END) seconds of trace time"
    )
    p.add_argument("--max-rows", type=int, default=None, help="only the first N rows (of the window)")
    p.add_argument(
        "--max-context-tokens",
        type=int,
        default=None,
        help="rows whose scaled prompt + output exceed this are counted and not sent (default: the server's "
        "max_model_len from /v1/models)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench serve`` / ``python -m bench.loadtest``: a target server and a workload."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--model", default=PDSERVE_DEFAULT_MODEL, help="the served model name (and tokenizer folder if a path)"
    )
    add_workload_arguments(parser)
