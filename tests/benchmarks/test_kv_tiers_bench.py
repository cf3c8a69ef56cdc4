"""``pdserve bench kv-tiers``: the sizing and its refusals, the figures from sample counters and summaries, the runs'
configs; and end to end on the tiny model (workers in-process), the JSON's shape and tier hits in the ``with`` run."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from benchmarks import kv_tiers_bench
from benchmarks.kv_tiers_bench import (
    TIER_KEYS,
    base_config,
    check_options,
    compare_restart,
    compare_runs,
    phase_figures,
    sizing,
    tier_figures,
    tiered_config,
)
from tests.helpers.cluster import tiny_cluster_config

SMOLLM2_BYTES_PER_TOKEN = 46_080  # float32: 2 (K, V) x 30 layers x 3 KV heads x 64 x 4 bytes
MIB = 1024 * 1024


def options(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    kv_tiers_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


# ---- sizing and options ----------------------------------------------------------------------------------------


def test_the_default_sizing_puts_4x_a_workers_kv_in_the_prefixes_and_the_host_tier_holds_them_all():
    args = options()
    size = sizing(args, 16, SMOLLM2_BYTES_PER_TOKEN, prefix_tokens=512, request_blocks=35)
    assert size["prefix_blocks"] == 32 and size["device_kv_tokens"] == 1024
    assert size["all_prefixes_blocks"] == 8 * 32
    assert size["prefixes_over_device_kv"] == 4.0 and size["at_least_4x"]
    assert size["device_lru_always_misses"]
    # 2 prefixes fit the device, one more may be on its way down: 5 tenants surely left it
    assert size["restart_tenants_off_device"] == 5
    block_mb = 16 * SMOLLM2_BYTES_PER_TOKEN / MIB
    held = (8 * 32 + (8 + 24) * 3) * block_mb  # every prefix, and each request's own 3 blocks
    assert size["host_memory_mb"] == size["disk_mb"] == math.ceil(1.25 * held)
    assert size["host_memory_mb"] * MIB >= 8 * 512 * SMOLLM2_BYTES_PER_TOKEN


def test_explicit_tier_sizes_win_and_fewer_tenants_are_flagged_under_4x():
    args = options("--tenants", "4", "--host-memory-mb", "100", "--disk-mb", "50", "--restart-requests", "1")
    size = sizing(args, 16, SMOLLM2_BYTES_PER_TOKEN, prefix_tokens=512, request_blocks=35)
    assert size["prefixes_over_device_kv"] == 2.0 and not size["at_least_4x"]
    assert (size["host_memory_mb"], size["disk_mb"]) == (100, 50)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv-blocks", "32"], "cannot hold 1 requests of 35 blocks"),
        (["--max-concurrency", "2"], "cannot hold 2 requests"),
        (["--restart-requests", "6"], "only 5 tenants"),
    ],
)
def test_sizing_refuses_a_device_that_cannot_hold_the_load_or_a_restart_on_prefixes_still_there(argv, message):
    with pytest.raises(ValueError, match=message):
        sizing(options(*argv), 16, SMOLLM2_BYTES_PER_TOKEN, prefix_tokens=512, request_blocks=35)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tenants", "0"], "--tenants must be at least 1"),
        (["--kv-blocks", "0"], "--kv-blocks must be at least 1"),
        (["--host-memory-mb", "0"], "--host-memory-mb must be at least 1"),
        (["--restart-requests", "-1"], "cannot be negative"),
        (["--num-prompts", "2", "--restart-requests", "3"], "cannot exceed --num-prompts"),
    ],
)
def test_bad_options_are_refused_by_name(argv, message):
    with pytest.raises(ValueError, match=message):
        check_options(options(*argv))


def test_the_command_is_registered_with_its_defaults():
    from cli.main import build_parser

    args = build_parser().parse_args(["bench", "kv-tiers"])
    assert (args.tenants, args.prefix_len, args.kv_blocks, args.mode) == (8, 512, 64, "disaggregated")
    assert args.tenants * args.prefix_len == 4 * args.kv_blocks * 16


# ---- configs ---------------------------------------------------------------------------------------------------


def test_the_runs_configs_differ_in_their_tiers_only_and_share_no_host_pool(tmp_path):
    args = options("--kv-blocks", "24")
    args.cluster_config = tiny_cluster_config("tiny-model-folder")
    base = base_config(args)
    assert (base.pools.prefill.replicas, base.pools.decode.replicas) == (1, 1)
    assert base.pools.prefill.kv_blocks == base.pools.decode.kv_blocks == 24
    assert base.router.local_prefill_max_tokens == 0 and base.pools.prefill.kv_offload is None
    with_ = tiered_config(base, "with", tmp_path, 300, 200)
    again = tiered_config(base, "with", tmp_path, 300, 200)
    prefill, decode = with_.pools.prefill.kv_offload, with_.pools.decode.kv_offload
    assert prefill.host_memory_mb == 300 and prefill.disk_mb == 200
    assert prefill.host_pool == decode.host_pool != again.pools.prefill.kv_offload.host_pool
    assert (prefill.disk_dir, decode.disk_dir) == (str(tmp_path / "prefill"), str(tmp_path / "decode"))
    disk_only = tiered_config(base, "restart", tmp_path, 0, 200).pools.prefill.kv_offload
    assert disk_only.host_memory_mb == 0 and disk_only.disk_mb == 200
    no_disk = tiered_config(base, "with", None, 300, 200).pools.prefill.kv_offload
    assert no_disk.disk_dir is None and no_disk.disk_mb == 0
    assert base.pools.prefill.kv_offload is None  # the base is left as it was


def test_colocated_mode_is_one_worker():
    args = options("--mode", "colocated")
    args.cluster_config = tiny_cluster_config("tiny-model-folder")
    base = base_config(args)
    assert (base.mode, base.pools.prefill.replicas, base.pools.decode.replicas) == ("colocated", 1, 0)
    assert kv_tiers_bench.compute_role(base) == "colocated"


# ---- figures from sample results -------------------------------------------------------------------------------


def _worker(role: str, **counters: float) -> dict:
    return {"name": f"{role}-0", "role": role, "alive": True, "total_blocks": 64, "free_blocks": 64} | counters


def _status(*workers: dict) -> dict:
    return {"workers": list(workers), "inflight": 0, "settled": True}


def _summary(ttft_p50: float, ttft_p90: float, cached: int | None, prompt: int = 1000) -> dict:
    return {
        "requests": 4,
        "completed": 4,
        "failed": 0,
        "failures": {},
        "duration_s": 2.0,
        "total_input_tokens": prompt,
        "ttft_ms": {"p50": ttft_p50, "p90": ttft_p90},
        "tpot_ms": {"p50": 10.0},
        "cached_tokens": None if cached is None else {"total": cached, "fraction": cached / prompt},
        "server_timing_ms": {"router_queue": {"median": 5.04}, "prefill_compute": {"median": 80.0}},
    }


def test_tier_figures_are_the_counters_change_per_role():
    before = _status(_worker("prefill", tier_loads=2, tier_load_seconds=0.5, host_hit_tokens=64))
    after = _status(
        _worker("prefill", tier_loads=6, tier_load_seconds=0.9, host_hit_tokens=576, disk_saved_bytes=1024),
        _worker("decode", tier_loads=0),
    )
    tiers = tier_figures(before, after, ["prefill", "decode"])
    assert tiers["prefill"]["host_hit_tokens"] == 512 and tiers["prefill"]["disk_saved_bytes"] == 1024
    assert tiers["prefill"]["tier_loads"] == 4 and tiers["prefill"]["tier_load_seconds"] == 0.4
    assert tiers["prefill"]["load_ms_mean"] == 100.0
    assert set(TIER_KEYS) <= set(tiers["decode"]) and tiers["decode"]["load_ms_mean"] is None


def test_a_runs_hit_rate_comes_from_usage_and_from_the_workers_device_and_tier_hits():
    config = base_config(_tiny_args())
    before = ({}, _status(_worker("prefill", prefix_hit_tokens=100), _worker("decode")))
    after = (
        {},
        _status(
            _worker("prefill", prefix_hit_tokens=132, host_hit_tokens=600, disk_hit_tokens=200),
            _worker("decode", prefix_hit_tokens=999),  # the decode worker's hits are not prompt computation
        ),
    )
    figures = phase_figures(_summary(100.0, 150.0, cached=840), before, after, config)
    assert figures["hit_rate"] == {"usage": 0.84, "workers": 0.832}
    assert figures["hit_tokens"] == {"role": "prefill", "device": 32, "host": 600, "disk": 200}
    assert figures["prompt_tokens"] == 1000 and figures["cached_prompt_tokens"] == 840
    assert set(figures["tiers"]) == {"prefill", "decode"}
    assert figures["ttft_ms"] == {"p50": 100.0, "p90": 150.0}
    assert figures["ttft_parts_ms_p50"] == {"router_queue": 5.0, "prefill_compute": 80.0}
    unreported = phase_figures(_summary(100.0, 150.0, cached=None), before, after, config)
    assert unreported["hit_rate"]["usage"] is None and unreported["cached_prompt_tokens"] is None


def _tiny_args() -> argparse.Namespace:
    args = options()
    args.cluster_config = tiny_cluster_config("tiny-model-folder")
    return args


def _run(p50: float, p90: float, usage: float | None, workers: float | None) -> dict:
    return {"ttft_ms": {"p50": p50, "p90": p90}, "hit_rate": {"usage": usage, "workers": workers}}


def test_the_goals_are_met_at_a_third_of_the_ttft_and_a_hit_rate_of_0_8():
    met = compare_runs({"without": _run(900.0, 1000.0, 0.0, 0.0), "with": _run(270.0, 400.0, 0.85, 0.8)})
    assert met["ttft_p50_ratio"] == 0.3 and met["ttft_p90_ratio"] == 0.4
    assert met["hit_rate"] == {"without": 0.0, "with": 0.85}
    assert met["goals"]["ttft_p50_ratio_met"] and met["goals"]["hit_rate_met"] and met["goals"]["all_met"]
    one_missed = compare_runs({"without": _run(900.0, 1000.0, 0.0, 0.0), "with": _run(270.0, 400.0, 0.5, 0.5)})
    assert one_missed["goals"]["ttft_p50_ratio_met"] and not one_missed["goals"]["all_met"]
    missed = compare_runs({"without": _run(900.0, 1000.0, 0.0, 0.0), "with": _run(310.0, 400.0, None, 0.7)})
    assert missed["hit_rate"]["with"] == 0.7  # the workers' rate where usage reports none
    assert not missed["goals"]["ttft_p50_ratio_met"] and not missed["goals"]["hit_rate_met"]
    assert missed["goals"]["ttft_p50_ratio_at_most"] == 0.33 and missed["goals"]["hit_rate_at_least"] == 0.8


def test_the_restart_goal_is_half_the_cold_ttft():
    assert compare_restart({"ttft_ms": {"p50": 800.0, "p90": 900.0}}, {"ttft_ms": {"p50": 400.0, "p90": 450.0}}) == {
        "ttft_p50_ratio": 0.5,
        "ttft_p90_ratio": 0.5,
        "goal": {"ttft_p50_ratio_at_most": 0.5, "met": True},
    }
    assert not compare_restart({"ttft_ms": {"p50": 800.0, "p90": 900.0}}, {"ttft_ms": {"p50": 401.0, "p90": None}})[
        "goal"
    ]["met"]


# ---- end to end ------------------------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "ray"])
def test_the_bench_runs_on_the_tiny_model_and_the_with_run_hits_its_tiers(in_process, tiny_llama_path, tmp_path):
    """With Ray the restart is a SIGKILLed worker process that Ray starts again; in-process, a restarted cluster."""
    if not in_process:
        import ray

        if ray.is_initialized():  # another module's Ray: the bench starts a local one of its own
            ray.shutdown()
    args = options(
        "--tenants",
        "8",
        "--prefix-len",
        "128",
        "--question-len",
        "8",
        "--output-len",
        "2",
        "--num-prompts",
        "8",
        "--kv-blocks",
        "16",
        "--restart-requests",
        "2",
        "--result-dir",
        str(tmp_path / "results"),
        *(["--in-process"] if in_process else []),
    )
    args.cluster_config = tiny_cluster_config(tiny_llama_path)
    out = kv_tiers_bench.run(args)

    assert set(out) >= {"configuration", "workload", "sizing", "runs", "comparison", "restart", "wall_s"}
    assert out["sizing"]["at_least_4x"] and out["sizing"]["device_lru_always_misses"]
    for name in ("without", "with"):
        run = out["runs"][name]
        assert run["requests"] == run["completed"] == 8 and run["failed"] == 0, (name, run["failures"])
        assert run["held_after"]["settled"] and run["held_after"]["kv_blocks"] == 0, (name, run["held_after"])
        assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p90"]
        assert set(run["tiers"]) == {"prefill", "decode"} and set(TIER_KEYS) <= set(run["tiers"]["prefill"])
        assert run["ttft_parts_ms_p50"]["prefill_compute"] > 0
    without, with_ = out["runs"]["without"], out["runs"]["with"]
    assert without["kv_offload"] is None and with_["kv_offload"]["host_memory_mb"] > 0
    # an LRU device cache alone misses every prefix; the tiers give them back
    assert without["hit_tokens"]["host"] == without["hit_tokens"]["disk"] == 0
    assert with_["hit_tokens"]["host"] + with_["hit_tokens"]["disk"] > 0
    assert with_["tiers"]["prefill"]["tier_loads"] > 0 and with_["tiers"]["prefill"]["host_loaded_bytes"] > 0
    assert with_["hit_rate"]["usage"] > without["hit_rate"]["usage"]
    comparison = out["comparison"]
    assert comparison["ttft_p50_ratio"] > 0 and isinstance(comparison["goals"]["ttft_p50_ratio_met"], bool)
    assert isinstance(comparison["goals"]["hit_rate_met"], bool)

    restart = out["restart"]
    if in_process:
        assert "started again" in restart["method"]  # nothing restarts a thread
    else:
        assert "restarted by Ray" in restart["method"]
        assert restart["kill"]["new_pid"] not in (None, restart["kill"]["pid"])
    assert restart["kv_offload"]["host_memory_mb"] == 0 and restart["kv_offload"]["disk_dir"]
    assert restart["cold"]["completed"] == 8 and restart["restarted"]["completed"] == 2
    assert restart["cold"]["hit_tokens"]["disk"] == 0
    assert restart["restarted"]["hit_tokens"]["disk"] > 0  # the pages outlived the workers
    assert restart["tenants"]["restarted"] == [0, 1]
    assert isinstance(restart["goal"]["met"], bool) and restart["ttft_p50_ratio"] > 0
    assert out["tier_folders_removed"] and not any(Path(args.result_dir).glob("**/*.kv"))
