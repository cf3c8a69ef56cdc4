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
