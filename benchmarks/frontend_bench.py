"""``pdserve bench frontend``: how many streamed tokens the router delivers per CPU-second it spends.

The workers serve a tiny random-weight Llama (``engine.tiny_model``, built once under ``$PDSERVE_CACHE``), faster than
the router can stream, so the router's own cost is what is measured. For each ``--router-processes`` N:
1. write a config (disaggregated, one prefill and one decode worker, KV for every stream at full length) and start
   ``pdserve serve --port 0`` as a subprocess (``benchmarks.serve_process``);
2. low load with the load tester: ``--low-load-requests`` one at a time; ``ttft_p50_ms`` must not get worse;
3. the load: ``--num-prompts`` streams of ``--output-len`` tokens, ``--max-concurrency`` at once, closed loop.
``router_cpu_s``: user + system CPU over the load (``/proc``, else psutil, else null) of the serve process and its
descendants, less the workers (by PID) and Ray's processes and all below them (``ray::...`` or a file in a ``ray``
package folder); one started during the load counts from zero. N > 1 needs ``--router-processes`` (else
``status: "unsupported"``). Every wait is bounded, the stop too (SIGTERM, then the process group after 15 s).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.serve_process import ServeProcess

if TYPE_CHECKING:  # imported when the benchmark runs: ``--help`` loads neither protobuf nor the engine
    from benchmarks.otlp_receiver import OtlpReceiver

DETOKENIZE_METRIC = "pdserve_router_detokenize_seconds_total"
BLOCK_SIZE = 16  # transfer.block_size default
_RAY_CMDLINE = re.compile(r"^ray::|[/\\]ray[/\\]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router-processes", default="1,2", help="comma-separated list of router process counts")
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--low-load-requests", type=int, default=8, help="the TTFT run: requests, one at a time")
    parser.add_argument("--model", default=None, help="model folder (default: the tiny Llama, built once in the cache)")
    parser.add_argument("--start-timeout-s", type=float, default=180.0)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--load-timeout-s", type=float, default=900.0, help="bound on the load's duration")
    parser.add_argument(
        "--tracing",
        default="off",
        help="comma-separated: off, on (request traces over OTLP/HTTP to a receiver in this process, sampling 1.0). "
        "'off,on' runs each router-process count both ways, for tracing's overhead",
    )
    parser.add_argument("--quick", action="store_true", help="8 streams of 64 tokens, 4 low-load requests (tests)")
    parser.add_argument("--json", action="store_true")


# ---- the processes whose CPU is the router's ---------------------------------------------------------------------


def _proc_table() -> dict[int, tuple[int, float, str]] | None:
    """pid -> (parent pid, user + system CPU seconds, command line) for every process; None without /proc."""
    if not os.path.exists("/proc/self/stat"):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:  # exited meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ..., utime (14th), stime (15th)
        if not cmdline:  # kernel threads and zombies: the name in parentheses
            cmdline = stat[stat.find("(") + 1 : stat.rfind(")")]
        table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, cmdline)
    return table


def _psutil_table() -> dict[int, tuple[int, float, str]] | None:
    try:
        import psutil
    except ImportError:
        return None
    table = {}
    for p in psutil.process_iter(["ppid", "cpu_times", "cmdline", "name"]):
        times = p.info["cpu_times"]
        if times is None:
            continue
        cmdline = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "")
        table[p.pid] = (p.info["ppid"] or 0, times.user + times.system, cmdline)
    return table


def is_ray_process(cmdline: str) -> bool:
    return bool(_RAY_CMDLINE.search(cmdline)) or cmdline.split(" ", 1)[0].endswith(("raylet", "gcs_server"))


def router_cpu(serve_pid: int, exclude: set[int]) -> dict[int, float] | None:
    """CPU seconds so far of the router's processes (see the module docstring), by PID; None when unmeasurable."""
    table = _proc_table() or _psutil_table()
    if not table or serve_pid not in table:
        return None
    children = collections.defaultdict(list)
    for pid, (ppid, _, _) in table.items():
        children[ppid].append(pid)
    found, todo = {}, [serve_pid]
    while todo:
        pid = todo.pop()
        if pid in found or pid in exclude or (pid != serve_pid and is_ray_process(table[pid][2])):
            continue
        found[pid] = table[pid][1]
        todo.extend(children[pid])
    return found


def cpu_delta(before: dict[int, float] | None, after: dict[int, float] | None) -> float | None:
    if before is None or after is None:
        return None
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


# ---- config, model, load ----------------------------------------------------------------------------------------


def tiny_model_path() -> Path:
    """The tiny random-weight Llama, built once under ``$PDSERVE_CACHE`` (a temp dir if that is not writable)."""
    from engine.model_loader import cache_dir
    from engine.tiny_model import build_tiny_model

    for root in (cache_dir(), Path(tempfile.gettempdir()) / "pdserve-cache"):
        path = root / "bench" / "tiny-llama-seed0"
        if (path / "config.json").is_file():
            return path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix="tiny-llama-", dir=path.parent))
        except OSError:
            continue
        build_tiny_model(staging, arch="llama", seed=0)
        try:
            staging.rename(path)  # atomic: a concurrent run either sees the whole folder or builds its own
        except OSError:  # another run renamed its copy first: use that one
            if not (path / "config.json").is_file():
                return staging
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
        return path
    raise RuntimeError("no writable cache folder for the tiny model")


def cluster_config(model: str, args: argparse.Namespace) -> dict:
    total = args.input_len + args.output_len
    per_request = -(-(total + BLOCK_SIZE) // BLOCK_SIZE) + 1
    seqs = max(64, args.max_concurrency)
    pool = {"replicas": 1, "torch_threads": 1, "max_num_seqs": seqs}
    return {
        "model": {"name": model, "max_model_len": max(1100, total + 64)},
        "mode": "disaggregated",
        "pools": {
            "prefill": pool | {"kv_blocks": max(256, 2 * seqs * (-(-args.input_len // BLOCK_SIZE) + 2))},
            "decode": pool | {"kv_blocks": max(64 * 65, seqs * per_request) * 5 // 4},
        },
        "router": {"request_timeout_s": args.request_timeout_s, "queue_size": max(256, args.num_prompts)},
    }


def run_load(
    base_url: str,
    model: str,
    n: int,
    concurrency: int,
    input_len: int,
    output_len: int,
    args: argparse.Namespace,
    warmups: int = 0,
    before=None,
) -> dict:
    """One phase with the load tester (closed loop, ``ignore_eos``); ``before()`` runs once the prompts are built."""
    from bench.loadtest import cli as loadtest

    parser = argparse.ArgumentParser()
    loadtest.add_arguments(parser)
    with tempfile.TemporaryDirectory(prefix="frontend-bench-") as folder:
        opts = parser.parse_args(
            [
                "--base-url",
                base_url,
                "--model",
                model,
                "--max-concurrency",
                str(concurrency),
                "--num-prompts",
                str(n),
                "--random-input-len",
                str(input_len),
                "--random-output-len",
                str(output_len),
                "--ignore-eos",
                "--num-warmups",
                str(warmups),
                "--request-timeout-s",
                str(args.request_timeout_s),
                "--duration",
                str(args.load_timeout_s),
                "--result-dir",
                folder,
                "--disable-tqdm",
            ]
        )
        plan = loadtest.prepare(opts, model)
        marker = before() if before else None
        runs, _, _ = loadtest.execute(plan, base_url, model, Path(folder))
    return {"summary": runs[0], "before": marker}


def scrape_counter(base_url: str, name: str) -> float | None:
    """The sum over labels of counter sample ``name`` on ``/metrics``; None when absent or unreachable."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10.0, trust_env=False).text
    except httpx.HTTPError:
        return None
    values = [s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]
    return sum(values) if values else None


# ---- one configuration, the whole run -------------------------------------------------------------------------------

FIGURES = (
    "streamed_tokens",
    "expected_tokens",
    "failed_requests",
    "failures",
    "wall_s",
    "router_cpu_s",
    "router_process_count",
    "tokens_per_router_cpu_s",
    "tokens_per_wall_s",
    "ttft_p50_ms",
    "detokenize_share",
    "itl_ms_p50",
    "client_loop_lag_ms_p99",
    "serve_stop",
)


def _empty(n: int, status: str, reason: str | None = None) -> dict:
    return {"router_processes": n, "status": status, "reason": reason} | {k: None for k in FIGURES}


def run_configuration(n: int, model: str, args: argparse.Namespace, folder: Path, traces: OtlpReceiver | None) -> dict:
    """``traces``: where the cluster sends its request traces (None: tracing off)."""
    import yaml

    config = cluster_config(model, args)
    if traces is not None:
        config["observability"] = {"otlp_endpoint": traces.endpoint}
    tracing = "on" if traces is not None else "off"
    config_path = folder / f"frontend-{n}-{tracing}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    print(f"frontend bench: starting pdserve serve (router processes: {n}, tracing {tracing})", file=sys.stderr)
    spans_before = traces.span_count if traces is not None else 0
    serve = ServeProcess.start(config_path, n, args.start_timeout_s)
    result = _empty(n, "ok") | {"tracing": tracing}
    try:
        url, exclude = serve.url, set(serve.worker_pids)
        low = run_load(url, model, args.low_load_requests, 1, 32, 16, args, warmups=2)["summary"]
        result["ttft_p50_ms"] = _round(low["ttft_ms"]["p50"], 2)

        def snapshot() -> tuple:
            return router_cpu(serve.proc.pid, exclude), scrape_counter(url, DETOKENIZE_METRIC)

        print(
            f"frontend bench: {args.num_prompts} streams x {args.output_len} tokens, {args.max_concurrency} at once",
            file=sys.stderr,
        )
        phase = run_load(
            url, model, args.num_prompts, args.max_concurrency, args.input_len, args.output_len, args, before=snapshot
        )
        cpu_after, detok_after = snapshot()
        (cpu_before, detok_before), load = phase["before"], phase["summary"]
        cpu = cpu_delta(cpu_before, cpu_after)
        tokens = load["total_output_tokens"]
        result |= {
            "streamed_tokens": tokens,
            "expected_tokens": args.num_prompts * args.output_len,
            "failed_requests": load["failed"],
            "failures": load["failures"],
            "wall_s": _round(load["duration_s"], 3),
            "router_cpu_s": _round(cpu, 3),
            "router_process_count": len(cpu_after) if cpu_after is not None else None,
            "tokens_per_router_cpu_s": _round(tokens / cpu, 1) if cpu else None,
            "tokens_per_wall_s": _round(tokens / load["duration_s"], 1) if load["duration_s"] else None,
            "detokenize_share": (
                _round((detok_after - detok_before) / cpu, 4)
                if cpu and detok_before is not None and detok_after is not None
                else None
            ),
            "itl_ms_p50": _round(load["itl_ms"]["p50"], 2),
            "client_loop_lag_ms_p99": _round(load["client"]["loop_lag_ms_p99"], 1),
        }
    finally:
        result["serve_stop"] = serve.stop()
    if traces is not None:
        result["spans_received"] = traces.span_count - spans_before  # after the stop, which exports what was buffered
    return result


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def run(args: argparse.Namespace) -> dict:
    if args.quick:
        args.max_concurrency, args.num_prompts, args.output_len = 8, 8, 64
        args.low_load_requests = min(args.low_load_requests, 4)
    counts = [int(x) for x in str(args.router_processes).split(",") if x.strip()]
    if not counts or any(n < 1 for n in counts):
        raise ValueError("--router-processes: a comma-separated list of counts >= 1, e.g. 1,2")
    if min(args.max_concurrency, args.num_prompts, args.input_len, args.output_len, args.low_load_requests) < 1:
        raise ValueError(
            "--max-concurrency, --num-prompts, --input-len, --output-len and --low-load-requests must be at least 1"
        )
    from benchmarks.otlp_receiver import OtlpReceiver
    from engine.cpu_info import cpu_model

    modes = [x.strip() for x in str(args.tracing).split(",") if x.strip()]
    if not modes or set(modes) - {"off", "on"}:
        raise ValueError(f"--tracing: a comma-separated list of off and on, got {args.tracing!r}")
    model = str(Path(args.model).expanduser()) if args.model else str(tiny_model_path())
    configurations = []
    traces = OtlpReceiver(keep=False) if "on" in modes else None
    try:
        with tempfile.TemporaryDirectory(prefix="frontend-bench-config-") as folder:
            for n in counts:
                for mode in modes:
                    configurations.append(
                        run_configuration(n, model, args, Path(folder), traces if mode == "on" else None)
                    )
    finally:
        if traces is not None:
            traces.close()
    return {
        "benchmark": {
            "model": model,
            "max_concurrency": args.max_concurrency,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "low_load": {"requests": args.low_load_requests, "concurrency": 1, "input_len": 32, "output_len": 16},
            "cpu_count": os.cpu_count(),
            "cpu_model": cpu_model(),
            "router_cpu_rule": "serve process + its non-Ray descendants (not the workers), user+system",
        },
        "configurations": configurations,
        "tracing_overhead": _tracing_overhead(configurations),
    }


def _tracing_overhead(configurations: list[dict]) -> dict[str, float | None]:
    """Per router-process count run both ways: router CPU per streamed token with tracing on over off, less 1 (the
    mean rate of each mode's runs)."""
    rates: dict[tuple[int, str], list[float]] = {}  # repeated modes (--tracing off,on,off,on): their mean
    for c in configurations:
        if c.get("tokens_per_router_cpu_s"):
            rates.setdefault((c["router_processes"], c.get("tracing", "off")), []).append(c["tokens_per_router_cpu_s"])
    overhead: dict[str, float | None] = {}
    for (n, mode), off in rates.items():
        on = rates.get((n, "on"))
        if mode == "off" and on:
            overhead[f"router_processes_{n}"] = round((sum(off) / len(off)) / (sum(on) / len(on)) - 1, 4)
    return overhead


if __name__ == "__main__":
    from bench.loadtest.cli import run_main

    sys.exit(run_main("python -m benchmarks.frontend_bench", "Router CPU per streamed token", add_arguments, run))
