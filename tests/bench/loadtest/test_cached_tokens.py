"""`pdserve bench serve` reports the server's cached prompt tokens (``usage.prompt_tokens_details.cached_tokens``).

Against the scripted server, streamed (usage in the last chunk, as ``stream_options.include_usage`` asks) and as one
JSON body: every request's figure lands in ``requests.jsonl`` and the run's ``cached_tokens`` section (total, mean,
fraction of the prompt tokens) equals what the script reported; a server that reports none gives ``null``, not 0.
Then a real in-process pdserve cluster serving a shared-prefix workload one request at a time: apart from the first
request each prompt-computing worker gets, every request finds the shared prefix's full blocks in the prefix cache,
and the server says so.
"""

from __future__ import annotations

import csv
import json

import pytest

from bench.loadtest.client import RequestResult
from bench.loadtest.metrics import cached_tokens_summary
from tests.bench.loadtest.scripted_server import Script, ScriptedServer
from tests.bench.loadtest.test_client import records, run_cli

PROMPT_TOKENS = 32


def _cached_for(n: int) -> int:
    return 8 * (n % 3)  # 0, 8, 16, 0, 8, ... cached of PROMPT_TOKENS


def _done(cached: int | None, prompt: int = PROMPT_TOKENS) -> RequestResult:
    return RequestResult(index=0, success=True, input_tokens=prompt, cached_tokens=cached)


def test_the_summary_counts_only_requests_that_report_cached_tokens():
    results = [_done(0), _done(16), _done(24, prompt=64), _done(None), _done(None, prompt=1000)]
    summary = cached_tokens_summary(results)
    assert summary == {
        "requests_reporting": 3,
        "total": 40,
        "mean": pytest.approx(40 / 3),
        "prompt_tokens": 2 * PROMPT_TOKENS + 64,
        "fraction": pytest.approx(40 / 128),  # the 1000 prompt tokens without a figure are not a 0 % hit
    }
    assert cached_tokens_summary([_done(None), _done(None)]) is None
    assert cached_tokens_summary([]) is None


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "json-body"])
def test_cached_tokens_reported_by_the_server_reach_the_summary(tmp_path, byte_tokenizer_dir, stream):
    def script(body, n):
        return Script(
            ttft_s=0.01, gap_s=0.0, stream=stream, cached_tokens=_cached_for(n), extra={"prompt_tokens": PROMPT_TOKENS}
        )

    with ScriptedServer(script) as server:
        summary = run_cli(
            server,
            tmp_path,
            byte_tokenizer_dir,
            "--num-prompts",
            "6",
            "--request-rate",
            "inf",
            "--max-concurrency",
            "1",
        )
    assert all(body["stream_options"] == {"include_usage": True} for body in server.requests)
    run = summary["runs"][0]
    assert run["completed"] == 6
    expected = [_cached_for(n) for n in range(6)]  # one request at a time: the n-th request sent is the n-th served
    rows = records(tmp_path)
    assert sorted(r["cached_tokens"] for r in rows) == sorted(expected)
    cached = run["cached_tokens"]
    assert cached["requests_reporting"] == 6 and cached["total"] == sum(expected)
    assert cached["mean"] == pytest.approx(sum(expected) / 6)
    assert cached["prompt_tokens"] == 6 * PROMPT_TOKENS
    assert cached["fraction"] == pytest.approx(sum(expected) / (6 * PROMPT_TOKENS))
    on_disk = json.loads((tmp_path / "out" / "summary.json").read_text())["runs"][0]["cached_tokens"]
    assert on_disk["total"] == sum(expected)
    (row,) = csv.DictReader((tmp_path / "out" / "summary.csv").open())
    assert float(row["cached_tokens_fraction"]) == pytest.approx(cached["fraction"])


def test_a_server_without_cached_tokens_gets_null_not_zero(tmp_path, byte_tokenizer_dir):
    with ScriptedServer(lambda body, n: Script(ttft_s=0.01, gap_s=0.0)) as server:
        summary = run_cli(server, tmp_path, byte_tokenizer_dir, "--num-prompts", "3", "--request-rate", "inf")
    run = summary["runs"][0]
    assert run["completed"] == 3 and run["cached_tokens"] is None
    assert all(r["cached_tokens"] is None for r in records(tmp_path))
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["runs"][0]["cached_tokens"] is None
    (row,) = csv.DictReader((tmp_path / "out" / "summary.csv").open())
    assert row["cached_tokens_total"] == "" and row["cached_tokens_fraction"] == ""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_pdserve_reports_its_prefix_cache_hits_to_the_load_test(tiny_llama_path, tmp_path, mode):
    from cluster.run.launch import start_serving
    from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free

    prefix_len, block = 64, tiny_cluster_config(tiny_llama_path).transfer.block_size
    config = tiny_cluster_config(tiny_llama_path, mode=mode)
    handle = start_serving(config, in_process=True)
    computing = sum(w.role in ("prefill", "colocated") for w in handle.workers)
    try:
        summary = run_cli(
            handle,
            tmp_path,
            tiny_llama_path,
            "--model",
            config.served_model_name,
            "--dataset-name",
            "shared-prefix",
            "--shared-prefix-groups",
            "1",
            "--shared-prefix-len",
            str(prefix_len),
            "--num-prompts",
            "6",
            "--random-input-len",
            "24",
            "--random-output-len",
            "3",
            "--ignore-eos",
            "--request-rate",
            "inf",
            "--max-concurrency",
            "1",
        )
        wait_all_kv_free(handle.base_url)
    finally:
        handle.stop()
    run = summary["runs"][0]
    assert run["completed"] == 6 and run["failed"] == 0
    rows = records(tmp_path)
    cached = [r["cached_tokens"] for r in rows]
    assert all(isinstance(c, int) for c in cached), cached  # the server reports it on every answer
    assert all(0 <= c <= r["input_tokens"] for c, r in zip(cached, rows)), cached
    # one request at a time: each worker that computes prompts (the prefill worker; both colocated workers) computes
    # the shared prefix once, and every other request finds its full blocks in that worker's prefix cache
    misses = [c for c in cached if c < (prefix_len // block) * block]
    assert len(misses) <= computing, cached
    section = run["cached_tokens"]
    assert section["requests_reporting"] == 6 and section["total"] == sum(cached)
    assert section["fraction"] == pytest.approx(sum(cached) / sum(r["input_tokens"] for r in rows))
