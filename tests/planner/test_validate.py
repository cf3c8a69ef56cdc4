"""``pdserve plan validate``: the comparison on hand-made records, and the command end to end on the tiny model."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import yaml

from bench.loadtest.options import add_workload_arguments
from cli.main import main
from cli.plan_validate_cmd import workload_argv
from engine.blocks import model_kv_bytes_per_token
from planner.profile_model import Fit, Profile
from planner.validate import (
    Comparison,
    LatencySummary,
    MeasuredRequest,
    compare,
    format_table,
    goal_summary,
    percentile,
    replay_from_records,
    summarize,
)

TINY_CLUSTER = {  # tests/helpers/cluster.py's tiny cluster, as a config file
    "mode": "disaggregated",
    "pools": {
        "prefill": {"replicas": 1, "torch_threads": 1, "kv_blocks": 96},
        "decode": {"replicas": 1, "torch_threads": 1, "kv_blocks": 160},
    },
    "router": {"port": 0},
    "transfer": {"deadline_s": 20, "lease_s": 20},
}


def record(index, sent_s, ttft_s, tpot_s, inputs=40, outputs=6, **extra) -> dict:
    """A load tester per-request record (``RequestResult.to_record()``), the keys the comparison reads."""
    return {
        "index": index,
        "warmup": False,
        "sent_s": sent_s,
        "success": True,
        "ttft_s": ttft_s,
        "tpot_s": tpot_s,
        "input_tokens": inputs,
        "expected_input_tokens": inputs,
        "output_tokens": outputs,
        "group": None,
    } | extra


def test_replay_keeps_what_was_actually_sent_in_send_order():
    records = [
        record(1, 0.9, 0.2, 0.05, inputs=50, outputs=8),
        record(0, 0.1, 0.3, 0.04, inputs=30, outputs=4),
        record(-1, 0.0, 0.5, 0.05, warmup=True),  # a warm-up: neither sent in the trace nor compared
        record(2, 1.4, None, None, success=False, error="timeout"),  # failed: counted, left out of both
        record(3, 2.0, 0.1, 0.03, inputs=None, expected_input_tokens=33, outputs=2),  # no usage: the expected count
    ]
    replay = replay_from_records(records)
    assert [(t.arrival_s, t.input_tokens, t.output_tokens) for t in replay.trace] == [
        (0.1, 30, 4),
        (0.9, 50, 8),
        (2.0, 33, 2),
    ]
    assert [m.ttft_s for m in replay.measured] == [0.3, 0.2, 0.1]
    assert replay.failed == 1
    assert all(t.prefix_id is None and t.prefix_tokens == 0 for t in replay.trace)


def test_replay_marks_shared_prefixes_by_group():
    records = [record(0, 0.0, 0.2, 0.05, inputs=100, group=0), record(1, 0.5, 0.2, 0.05, inputs=100, group=1)]
    replay = replay_from_records(records, prefix_tokens={0: 64, 1: 200})
    assert [(t.prefix_id, t.prefix_tokens) for t in replay.trace] == [(0, 64), (1, 100)]  # never past the prompt


def test_percentile_is_numpy_linear_interpolation():
    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 50):
        values = rng.exponential(size=n).tolist()
        for p in (0, 50, 90, 99, 100):
            assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))
    assert percentile([], 50) is None


def test_summary_in_ms_and_tpot_only_over_multi_token_answers():
    requests = [MeasuredRequest(i, 10, 5, ttft_s=(i + 1) / 10, tpot_s=0.02 * (i + 1)) for i in range(10)]
    requests.append(MeasuredRequest(10, 10, 1, ttft_s=0.05, tpot_s=0.0))  # one token: a TTFT, no TPOT
    s = summarize(requests)
    ttfts = sorted([(i + 1) * 100.0 for i in range(10)] + [50.0])
    tpots = [20.0 * (i + 1) for i in range(10)]
    assert s.requests == 11
    assert s.ttft_p50 == pytest.approx(float(np.percentile(ttfts, 50)))
    assert s.ttft_p90 == pytest.approx(float(np.percentile(ttfts, 90)))
    assert s.tpot_p50 == pytest.approx(float(np.percentile(tpots, 50)))
    assert s.tpot_p90 == pytest.approx(float(np.percentile(tpots, 90)))


def test_comparison_ratios_goal_and_table():
    measured = LatencySummary(20, ttft_p50=100.0, ttft_p90=200.0, tpot_p50=50.0, tpot_p90=None)
    simulated = LatencySummary(20, ttft_p50=110.0, ttft_p90=120.0, tpot_p50=50.0, tpot_p90=60.0)
    c = Comparison("disaggregated", 1.0, measured, simulated)
    assert c.ratios() == {"ttft_p50": pytest.approx(1.1), "ttft_p90": pytest.approx(0.6), "tpot_p50": 1.0,
                          "tpot_p90": None}  # fmt: skip
    assert c.within_goal() == {"ttft_p50": True, "ttft_p90": False, "tpot_p50": True, "tpot_p90": None}
    goal = goal_summary([c])
    assert (goal["within"], goal["figures"]) == (2, 3)
    assert goal["worst"]["metric"] == "ttft_p90" and goal["worst"]["ratio"] == pytest.approx(0.6)
    table = format_table([c]).splitlines()
    assert len(table) == 2 + 4  # header, rule, one row per figure
    assert table[3].split() == ["disaggregated", "1", "20", "TTFT", "p90", "200.0", "120.0", "0.60", "NO"]
    assert table[5].split()[-3:] == ["60.0", "-", "-"]  # TPOT p90: nothing measured, no ratio
    assert json.loads(json.dumps(c.to_json()))["ratios"]["tpot_p90"] is None


def test_compare_refuses_a_simulation_of_another_trace():
    replay = replay_from_records([record(0, 0.0, 0.2, 0.05), record(1, 0.5, 0.2, 0.05)])
    one = [MeasuredRequest(0.0, 40, 6, 0.2, 0.05)]
    with pytest.raises(ValueError, match="1 records for a trace of 2"):
        compare("colocated", 1.0, replay, one)
    same = compare("colocated", 1.0, replay, replay.measured)
    assert set(same.ratios().values()) == {1.0}


def test_a_simulated_request_without_a_first_token_counts_as_infinitely_late():
    replay = replay_from_records([record(i, i * 0.5, 0.2, 0.05) for i in range(4)])
    simulated = [MeasuredRequest(i * 0.5, 40, 6, 0.3, 0.05) for i in range(3)]
    simulated.append(MeasuredRequest(1.5, 40, 6, math.inf, None))  # rejected by the simulated router
    c = compare("disaggregated", 2.0, replay, simulated)
    assert c.simulated.unfinished == 1 and c.simulated.ttft_p50 == pytest.approx(300.0)
    assert c.simulated.ttft_p90 == math.inf and c.ratios()["ttft_p90"] == math.inf
    assert c.within_goal()["ttft_p90"] is False
    as_json = json.loads(json.dumps(c.to_json(), allow_nan=False))  # plain JSON: no Infinity
    assert as_json["simulated"]["ttft_p90"] is None and as_json["ratios"]["ttft_p90"] is None
    assert "1 simulated requests got no first token" in format_table([c])
    assert goal_summary([c])["worst"] == {"mode": "disaggregated", "rate": 2.0, "metric": "ttft_p90", "ratio": None}


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("fixed:128:32", {"dataset_name": "random", "random_input_len": 128, "random_output_len": 32,
                          "length_dist": "fixed"}),
        ("uniform:100:20:0.25", {"length_dist": "uniform", "random_range_ratio": 0.25}),
        ("lognormal:100:20", {"length_dist": "lognormal", "length_cv": 0.25}),
        ("normal:100:20:0.1", {"length_dist": "normal", "length_cv": 0.1}),
        ("shared-prefix:4:256:32:16", {"dataset_name": "shared-prefix", "shared_prefix_groups": 4,
                                       "shared_prefix_len": 256, "random_input_len": 32, "random_output_len": 16}),
    ],
)  # fmt: skip
def test_workload_words_become_load_tester_options(spec, expected):
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    args = vars(parser.parse_args(workload_argv(spec)))
    assert {k: args[k] for k in expected} == expected


@pytest.mark.parametrize("spec", ["poisson:1:2", "fixed:128", "fixed:0:5", "fixed:a:b", "uniform:10:10:1.5"])
def test_bad_workload_words_are_user_errors(spec):
    with pytest.raises(ValueError, match="--workload"):
        workload_argv(spec)


# ---- the command, end to end ----------------------------------------------------------------------------------


def tiny_profile(model_path) -> Profile:
    """A profile of plausible CPU step times for the tiny model. The end-to-end test checks the command's pipeline
    (both modes run, the simulator replays what was sent, the figures line up, nothing leaks), not the accuracy of
    these constants: docs/planner.md reports the accuracy measured with a real profile."""
    return Profile(
        model=str(model_path),
        dtype="float32",
        device="cpu",
        backend="zmq",
        date="2026-01-01T00:00:00+00:00",
        block_size=16,
        kv_bytes_per_token=model_kv_bytes_per_token(model_path, "float32"),
        max_batch_tokens=512,
        max_num_seqs=64,
        prefill_fit=Fit(["1", "tokens"], [0.003, 2e-5]),
        decode_fit=Fit(["1", "batch", "context_tokens"], [0.003, 2e-4, 1e-7]),
        transfer_fit=Fit(["1", "num_bytes"], [0.001, 1e-9]),
        notes="hand-made for tests",
    )


@pytest.mark.timeout(300)
def test_validate_runs_both_modes_and_replays_them_through_the_simulator(tiny_llama_path, tmp_path, capsys):
    config_path = tmp_path / "cluster.yaml"
    config_path.write_text(
        yaml.safe_dump(TINY_CLUSTER | {"model": {"name": str(tiny_llama_path), "max_model_len": 512}})
    )
    profile_path = tmp_path / "profile.json"
    tiny_profile(tiny_llama_path).save(profile_path)
    requests, warmups = 6, 1
    argv = ["plan", "validate", "--config", str(config_path), "--profile", str(profile_path)]
    argv += ["--workload", "fixed:40:6", "--rates", "4", "--num-requests", str(requests)]
    argv += ["--num-warmups", str(warmups), "--in-process", "--json", "--result-dir", str(tmp_path / "out")]

    assert main(argv) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])

    assert "TTFT p50" in captured.err and "sim/meas" in captured.err  # the table, on stderr with --json
    assert set(result["modes"]) == {"disaggregated", "colocated"}
    for mode, info in result["modes"].items():  # nothing held once the runs are over
        assert info["settled"] and info["held_kv_blocks"] == 0 and info["held_requests"] == 0, (mode, info)
    assert [(c["mode"], c["rate"]) for c in result["comparisons"]] == [("disaggregated", 4.0), ("colocated", 4.0)]
    for c in result["comparisons"]:
        assert c["failed"] == 0
        assert c["measured"]["requests"] == c["simulated"]["requests"] == requests
        for figure in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"):
            assert c["measured"][figure] > 0 and c["simulated"][figure] > 0
            assert c["ratios"][figure] == pytest.approx(c["simulated"][figure] / c["measured"][figure])
    assert result["goal"]["figures"] == 8
    sent = [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    assert len(sent) == 2 * (requests + warmups)
    assert all(r["success"] and r["output_tokens"] == 6 and r["input_tokens"] == 40 for r in sent)
    saved = json.loads((tmp_path / "out" / "validation.json").read_text())
    assert saved["comparisons"] == result["comparisons"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rates", "0,1"], "--rates"),
        (["--rates", "inf"], "--rates"),
        (["--modes", "colocated,split"], "--modes"),
        (["--num-requests", "0"], "--num-requests"),
        (["--workload", "trace.jsonl"], "--workload"),
        ([], "--profile 'missing.json': no such file"),
    ],
)
def test_bad_options_exit_2_before_anything_starts(extra, message, capsys):
    assert main(["plan", "validate", "--profile", "missing.json", *extra]) == 2
    assert message in capsys.readouterr().err
