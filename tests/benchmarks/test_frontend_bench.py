"""`pdserve bench frontend --quick` as a user runs it: a real `pdserve serve` subprocess, a real load, JSON figures,
and no serve process or worker left behind. Plus the rule that decides whose CPU is the router's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import frontend_bench
from benchmarks.serve_process import process_running

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.e2e
def test_quick_bench_prints_sane_figures_and_stops_its_server(tiny_llama_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "bench",
            "frontend",
            "--quick",
            "--router-processes",
            "1",
            "--json",
            "--model",
            str(tiny_llama_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    bench = result["benchmark"]
    assert (bench["max_concurrency"], bench["num_prompts"], bench["output_len"]) == (8, 8, 64)
    [config] = result["configurations"]
    assert config["router_processes"] == 1 and config["status"] == "ok"
    assert config["failed_requests"] == 0
    assert config["streamed_tokens"] == config["expected_tokens"] == 8 * 64
    assert config["wall_s"] > 0 and config["router_cpu_s"] > 0
    assert config["router_process_count"] >= 1
    assert config["tokens_per_router_cpu_s"] == pytest.approx(512 / config["router_cpu_s"], rel=0.05)
    assert config["tokens_per_wall_s"] == pytest.approx(512 / config["wall_s"], rel=0.05)
    assert config["tokens_per_router_cpu_s"] > 0 and config["ttft_p50_ms"] > 0
    share = config["detokenize_share"]  # null until the router exports its detokenize counter
    assert share is None or 0.0 <= share <= 1.0
    stop = config["serve_stop"]  # SIGTERM stopped it cleanly, and it took its workers with it
    assert stop["exit_code"] == 0 and not stop["forced"] and stop["workers_left_running"] == 0
    assert len(stop["worker_pids"]) == 2
    assert [pid for pid in [stop["pid"], *stop["worker_pids"]] if process_running(pid)] == []


def test_router_cpu_counts_the_serve_process_and_its_non_ray_children(tmp_path):
    """A stand-in serve process with a busy plain child (a future router process) and a child that looks like Ray:
    the plain child's CPU is counted, the Ray one's is not, and excluded PIDs (the workers) are skipped."""
    busy = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(30)\n"
    ray_dir = tmp_path / "ray" / "_private"
    ray_dir.mkdir(parents=True)
    (ray_dir / "log_monitor.py").write_text(busy)
    (tmp_path / "router_child.py").write_text(busy)
    parent_code = (
        "import subprocess, sys, time\n"
        f"a = subprocess.Popen([sys.executable, {str(tmp_path / 'router_child.py')!r}])\n"
        f"b = subprocess.Popen([sys.executable, {str(ray_dir / 'log_monitor.py')!r}])\n"
        "print(a.pid, b.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    child_pids: list[int] = []
    try:
        child_pids = [int(p) for p in parent.stdout.readline().split()]
        router_child, ray_child = child_pids
        start = frontend_bench.router_cpu(parent.pid, exclude=set())
        assert start is not None and router_child in start and ray_child not in start
        for _ in range(200):  # both children burn 0.6 s of CPU, then sleep
            now = frontend_bench.router_cpu(parent.pid, exclude=set())
            if now[router_child] >= 0.55:
                break
            time.sleep(0.1)
        assert now[router_child] >= 0.55 and ray_child not in now
        assert frontend_bench.cpu_delta({}, now) >= 0.55
        assert frontend_bench.cpu_delta(now, now) == 0
        excluded = frontend_bench.router_cpu(parent.pid, exclude={router_child})
        assert set(excluded) == {parent.pid}
        assert frontend_bench.is_ray_process("ray::WorkerActor")
        assert frontend_bench.is_ray_process("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x")
        assert not frontend_bench.is_ray_process("/venv/bin/python -m cli.main serve --config x.yaml")
    finally:
        for pid in child_pids:  # the processes this test started, by PID
            if process_running(pid):
                os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait(timeout=10)


def test_router_cpu_of_a_missing_process_is_null():
    pid = 2**22 + 7  # above the default pid_max: never a live process
    assert frontend_bench.router_cpu(pid, exclude=set()) is None
    assert frontend_bench.cpu_delta(None, {1: 1.0}) is None


def test_config_holds_every_stream_at_full_length():
    args = frontend_bench.argparse.Namespace(
        input_len=32, output_len=1000, max_concurrency=64, num_prompts=128, request_timeout_s=300.0
    )
    config = frontend_bench.cluster_config("/models/tiny", args)
    decode = config["pools"]["decode"]
    assert decode["kv_blocks"] * frontend_bench.BLOCK_SIZE >= 64 * 1032
    assert decode["max_num_seqs"] >= 64 and config["model"]["max_model_len"] >= 1100
    assert config["mode"] == "disaggregated"
    assert config["pools"]["prefill"]["replicas"] == config["pools"]["decode"]["replicas"] == 1
    from cluster.config import parse_config

    parse_config(config)  # a valid config file


def test_tracing_overhead_is_cpu_per_token_on_over_off_from_each_modes_mean():
    from benchmarks.frontend_bench import _tracing_overhead

    runs = [
        {"router_processes": 1, "tracing": "off", "tokens_per_router_cpu_s": 1000.0},
        {"router_processes": 1, "tracing": "on", "tokens_per_router_cpu_s": 900.0},
        {"router_processes": 1, "tracing": "off", "tokens_per_router_cpu_s": 1200.0},
        {"router_processes": 1, "tracing": "on", "tokens_per_router_cpu_s": 1100.0},
        {"router_processes": 2, "tracing": "off", "tokens_per_router_cpu_s": 800.0},  # never run with tracing
        {"router_processes": 2, "tracing": "on", "tokens_per_router_cpu_s": None},  # its load failed
    ]
    assert _tracing_overhead(runs) == {"router_processes_1": round(1100 / 1000 - 1, 4)}


def test_tracing_modes_are_checked_before_anything_starts():
    import argparse

    from benchmarks.frontend_bench import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="--tracing"):
        run(parser.parse_args(["--tracing", "off,maybe"]))
