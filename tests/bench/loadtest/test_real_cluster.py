"""A short real run of the load test against a real (in-process) pdserve cluster on the tiny model."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.loadtest import cli
from cluster.run.launch import start_serving
from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free

pytestmark = pytest.mark.timeout(180)


def test_load_test_against_the_real_cluster(tiny_llama_path, tmp_path):
    config = tiny_cluster_config(tiny_llama_path)
    handle = start_serving(config, in_process=True)
    try:
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        args = parser.parse_args(
            [
                "--base-url",
                handle.base_url,
                "--model",
                config.served_model_name,
                "--tokenizer",
                str(tiny_llama_path),
                "--num-prompts",
                "8",
                "--random-input-len",
                "40",
                "--random-output-len",
                "6",
                "--ignore-eos",
                "--request-rate",
                "inf",
                "--max-concurrency",
                "3",
                "--disable-tqdm",
                "--result-dir",
                str(tmp_path / "r"),
                "--goodput",
                "ttft:10000",
                "tpot:10000",
            ]
        )
        summary = cli.run(args)
        wait_all_kv_free(handle.base_url)
    finally:
        handle.stop()
    run = summary["runs"][0] if "runs" in summary else summary
    assert run["completed"] == 8 and run["failed"] == 0
    assert run["total_input_tokens"] == 8 * 40 and run["total_output_tokens"] == 8 * 6
    assert run["ttft_ms"]["median"] > 0 and run["tpot_ms"]["median"] > 0
    assert run["slo_attainment_pct"] == 100.0
    stages = run["server_timing_ms"]
    assert stages["prefill_compute"]["median"] > 0 and "kv_transfer" in stages
    lines = (tmp_path / "r" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 8 and all(json.loads(line)["output_tokens"] == 6 for line in lines)


def test_a_mooncake_replay_against_the_real_cluster(tiny_llama_path, tmp_path):
    """A window of the vendored Mooncake excerpt at 1/32 of its lengths (16-token hash blocks: the engines' block
    size): the context is the cluster's (512), the rows over it are counted and not sent, every row sent completes
    with the server counting its prompt as we do, the cluster reports cached tokens, and /status is sampled."""
    from pathlib import Path

    from bench.loadtest.traces import TraceFit, fit_trace, read_trace

    mooncake = Path(__file__).parent / "traces" / "mooncake_excerpt.jsonl"
    config = tiny_cluster_config(tiny_llama_path)
    handle = start_serving(config, in_process=True)
    try:
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        args = parser.parse_args(
            ["--base-url", handle.base_url, "--model", config.served_model_name, "--tokenizer", str(tiny_llama_path)]
            + ["--dataset-name", "mooncake", "--dataset-path", str(mooncake), "--trace-window", "5:10"]
            + ["--trace-token-scale", "0.03125", "--trace-speedup", "3", "--ignore-eos", "--disable-tqdm"]
            + ["--result-dir", str(tmp_path / "r"), "--goodput", "ttft:10000", "tpot:10000"]
        )
        wait_all_kv_free(handle.base_url)  # the workers' first heartbeats: the replay (under 2 s) samples /status once
        summary = cli.run(args)
        wait_all_kv_free(handle.base_url)
    finally:
        handle.stop()
    [run] = summary["runs"]
    fitted = fit_trace(read_trace("mooncake", mooncake), TraceFit(3.0, 1 / 32, (5.0, 10.0), None, 512))
    sent = len(fitted.rows)
    assert summary["benchmark"]["trace"]["context_tokens"] == 512
    assert run["rows"] == {
        "in_window": 12,
        "over_context": 12 - sent,
        "scheduled": sent,
        "sent": sent,
        "completed": sent,
        "failed": 0,
    }
    assert run["rows"]["over_context"] == 2 and run["input_tokens_mismatch"] == 0
    assert run["total_input_tokens"] == sum(r.input_tokens for r in fitted.rows)  # completions: exact lengths
    assert run["schedule_lag_ms"]["count"] == sent and run["slo_attainment_pct"] == 100.0
    hit = run["prefix_hit_rate"]
    assert hit["ideal"] == pytest.approx(16 * (sent - 1) / run["total_input_tokens"])  # every row starts with id 0
    assert hit["measured"] is not None and 0.0 < hit["measured"] <= 1.0  # the later rows hit block 0
    assert run["cached_tokens"]["requests_reporting"] == sent
    series = run["series"]
    assert sum(series["arrivals"]) == sent and set(series["kv_used"]) == {"prefill", "decode"}
    assert "trace_series.png" in summary["plots"]
