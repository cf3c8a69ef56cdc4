"""Runs against the scripted streaming server: timing accuracy, usage, failures by reason, bounds."""

import argparse
import json
import time

import pytest

from bench.loadtest import cli
from tests.bench.loadtest.scripted_server import Script, ScriptedServer

TOLERANCE_S = 0.05  # a shared 2-core box under a parallel test load: scheduler noise, not client error
EARLY_S = 0.005  # a client cannot see a chunk before the server sends it: the lower bounds are tight


def assert_timed(values: list[float], expected_s: float) -> None:
    """Each measured span is at least what the server scripted (minus clock granularity), and their median is
    within TOLERANCE_S of it: one request delayed by the box (a GC, another test's process) cannot fail the test, a
    client that times the wrong chunk (too early, or the whole stream) does."""
    assert all(v >= expected_s - EARLY_S for v in values), (values, expected_s)
    assert sorted(values)[len(values) // 2] == pytest.approx(expected_s, abs=TOLERANCE_S), (values, expected_s)


def run_cli(server, tmp_path, tokenizer_dir, *extra):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "--base-url",
            server.base_url,
            "--tokenizer",
            str(tokenizer_dir),
            "--disable-tqdm",
            "--random-input-len",
            "32",
            "--random-output-len",
            "6",
            "--result-dir",
            str(tmp_path / "out"),
            *extra,
        ]
    )
    return cli.run(args)


def records(tmp_path):
    return [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]


def test_measured_ttft_and_gaps_match_the_server(tmp_path, byte_tokenizer_dir):
    with ScriptedServer(lambda body, n: Script(ttft_s=0.2, gap_s=0.05, extra={"prompt_tokens": 32})) as server:
        summary = run_cli(
            server,
            tmp_path,
            byte_tokenizer_dir,
            "--num-prompts",
            "4",
            "--request-rate",
            "inf",
            "--ignore-eos",
            "--goodput",
            "ttft:300",
            "tpot:70",
        )
    run = summary["runs"][0]
    assert run["completed"] == 4 and run["failed"] == 0
    rows = records(tmp_path)
    assert_timed([r["ttft_s"] for r in rows], 0.2)
    assert_timed([r["e2el_s"] for r in rows], 0.45)
    assert_timed([r["tpot_s"] for r in rows], 0.05)
    for r in rows:
        assert len(r["itl_s"]) == 5
        assert (r["input_tokens"], r["output_tokens"], r["output_tokens_source"]) == (32, 6, "usage")
    assert run["ttft_ms"]["median"] == pytest.approx(200, abs=1000 * TOLERANCE_S)
    assert run["itl_ms"]["median"] == pytest.approx(50, abs=1000 * TOLERANCE_S)
    assert run["total_output_tokens"] == 24 and run["input_tokens_mismatch"] == 0
    assert run["slo_attainment_pct"] == 100.0
    body = server.requests[0]
    assert body["_path"] == "/v1/completions" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 6
    out = tmp_path / "out"
    for name in ("summary.json", "summary.csv", "requests.jsonl", "ttft_cdf.png", "tpot_itl_cdf.png"):
        assert (out / name).stat().st_size > 0
    assert json.loads((out / "summary.json").read_text())["runs"][0]["completed"] == 4


def test_failures_are_counted_by_reason(tmp_path, byte_tokenizer_dir):
    scripts = {
        0: Script(status=500),
        1: Script(status=429),
        2: Script(cut_after_chunks=2),
        3: Script(error_after_chunks=1),
        4: Script(ttft_s=5.0),
        5: Script(tokens=0),
    }

    with ScriptedServer(lambda body, n: scripts.get(n, Script(ttft_s=0.02, gap_s=0.01))) as server:
        summary = run_cli(
            server,
            tmp_path,
            byte_tokenizer_dir,
            "--num-prompts",
            "8",
            "--max-concurrency",
            "1",
            "--request-timeout-s",
            "1.0",
            "--goodput",
            "ttft:1000",
        )
    run = summary["runs"][0]
    assert run["requests"] == 8 and run["completed"] == 2
    assert run["failures"] == {
        "http_429": 1,
        "http_500": 1,
        "no_content": 1,
        "stream_cut": 1,
        "stream_error": 1,
        "timeout": 1,
    }
    assert run["slo_attainment_pct"] == 25.0
    by_index = {r["index"]: r for r in records(tmp_path)}
    assert by_index[0]["http_status"] == 500 and "scripted failure" in by_index[0]["error_detail"]
    assert by_index[2]["ttft_s"] is not None  # the text before the cut was timed, yet the request failed


def test_duration_bound_ends_on_time_and_cancels_outstanding(tmp_path, byte_tokenizer_dir):
    with ScriptedServer(lambda body, n: Script(ttft_s=0.05, gap_s=0.1, tokens=50)) as server:
        started = time.perf_counter()
        summary = run_cli(
            server, tmp_path, byte_tokenizer_dir, "--num-prompts", "0", "--duration", "1.0", "--request-rate", "8"
        )
        elapsed = time.perf_counter() - started
    run = summary["runs"][0]
    assert run["duration_s"] == pytest.approx(1.0, abs=0.1)
    assert elapsed < 5.0  # prompt building and file writing included
    assert run["completed"] == 0 and run["failures"] == {"cancelled": run["requests"]}  # each needs ~5 s
    assert 3 <= run["requests"] <= 20


def test_closed_loop_keeps_concurrency_and_warmups_are_left_out(tmp_path, byte_tokenizer_dir):
    with ScriptedServer(lambda body, n: Script(ttft_s=0.03, gap_s=0.01, tokens=3)) as server:
        summary = run_cli(
            server, tmp_path, byte_tokenizer_dir, "--num-prompts", "12", "--max-concurrency", "3", "--num-warmups", "2"
        )
        assert len(server.requests) == 14
        assert server.max_active == 3
    run = summary["runs"][0]
    assert run["closed_loop"] and run["requests"] == 12 and run["completed"] == 12
    assert run["warmups"] == {"requests": 2, "failed": 0}
    rows = records(tmp_path)
    assert sum(r["warmup"] for r in rows) == 2
    # 3 senders, each request ~0.05 s: 12 requests take about 4 rounds
    assert run["duration_s"] == pytest.approx(0.2, abs=0.1)


def test_chat_multi_token_chunks_timing_and_no_usage(tmp_path, byte_tokenizer_dir):
    timing = {
        "router_queue_s": 0.001,
        "prefill_queue_s": 0.002,
        "prefill_compute_s": 0.02,
        "first_token_delivery_s": 0.001,
        "kv_transfer_s": 0.004,
        "decode_queue_s": 0.001,
        "ttft_s": 0.03,
    }
    with ScriptedServer(
        lambda body, n: Script(ttft_s=0.05, gap_s=0.02, tokens_per_chunk=2, usage=False, timing=timing)
    ) as server:
        summary = run_cli(
            server,
            tmp_path,
            byte_tokenizer_dir,
            "--endpoint-type",
            "chat",
            "--num-prompts",
            "3",
            "--request-rate",
            "50",
        )
        assert server.requests[0]["_path"] == "/v1/chat/completions"
        assert server.requests[0]["messages"][-1]["role"] == "user"
    run = summary["runs"][0]
    assert run["completed"] == 3
    # the scripted server sends " tok" per token: the byte tokenizer counts 4 tokens each, 24 for 6 tokens
    assert run["output_tokens_from_tokenizer"] == 3 and run["total_output_tokens"] == 3 * 24
    assert run["multi_token_chunk_requests"] == 3
    rows = records(tmp_path)
    for r in rows:
        assert r["content_chunks"] == 3 and len(r["itl_s"]) == 2  # the role-only chunk is not a token
    assert_timed([r["ttft_s"] for r in rows], 0.05)
    stages = run["server_timing_ms"]
    assert stages["prefill_compute"]["mean"] == pytest.approx(20.0)
    assert stages["client_minus_server_ttft"]["median"] == pytest.approx(20.0, abs=1000 * TOLERANCE_S)
    assert "ttft_breakdown.png" in summary["plots"]


def test_sweep_reports_max_rate_per_worker(tmp_path, byte_tokenizer_dir):
    # The server gets slower with each request: later (higher-rate) runs miss the TTFT SLO.
    with ScriptedServer(lambda body, n: Script(ttft_s=0.02 if n < 6 else 0.2, gap_s=0.01, tokens=3)) as server:
        summary = run_cli(
            server,
            tmp_path,
            byte_tokenizer_dir,
            "--num-prompts",
            "6",
            "--rates",
            "20,40",
            "--goodput",
            "ttft:100",
            "--num-workers",
            "2",
        )
    assert [r["rate"] for r in summary["runs"]] == [20.0, 40.0]
    assert [r["slo_attainment_pct"] for r in summary["runs"]] == [100.0, 0.0]
    assert summary["sweep"]["max_rate_meeting_slo"] == 20.0 and summary["sweep"]["max_rate_per_worker"] == 10.0
    assert "latency_vs_rate.png" in summary["plots"]
    csv_rows = (tmp_path / "out" / "summary.csv").read_text().splitlines()
    assert len(csv_rows) == 3


def test_each_rate_of_a_sweep_sends_its_own_prompts(tmp_path, byte_tokenizer_dir):
    """A later rate on the same server must not be measured on the earlier rate's prompts (prefix-cache hits)."""
    prompts: list[str] = []

    def script(body, n):
        prompts.append(body["prompt"])
        return Script(ttft_s=0.01, gap_s=0.01, tokens=2)

    with ScriptedServer(script) as server:
        summary = run_cli(server, tmp_path, byte_tokenizer_dir, "--num-prompts", "4", "--rates", "20,40")
    assert [r["completed"] for r in summary["runs"]] == [4, 4]
    assert len(prompts) == 8
    assert not set(prompts[:4]) & set(prompts[4:])


def test_unreachable_server_fails_cleanly(tmp_path, byte_tokenizer_dir):
    class Gone:
        base_url = "http://127.0.0.1:9"  # discard port: nothing listens

    summary = run_cli(Gone, tmp_path, byte_tokenizer_dir, "--num-prompts", "2", "--request-timeout-s", "2")
    assert summary["runs"][0]["failures"] == {"connect_error": 2}


def test_a_non_streamed_answer_is_timed_as_a_whole(tmp_path, byte_tokenizer_dir):
    with ScriptedServer(lambda body, n: Script(stream=False, ttft_s=0.1, tokens=5, timing={"ttft_s": 0.09})) as server:
        summary = run_cli(server, tmp_path, byte_tokenizer_dir, "--endpoint-type", "chat", "--num-prompts", "2")
    run = summary["runs"][0]
    assert run["completed"] == 2 and run["total_output_tokens"] == 10
    rows = records(tmp_path)
    assert_timed([r["ttft_s"] for r in rows], 0.1)
    for r in rows:
        assert r["ttft_s"] == r["e2el_s"]
        assert r["tpot_s"] == 0.0 and r["server_timing"] == {"ttft_s": 0.09}
