"""``pdserve plan validate --workload trace:...``: the rows as sent replayed through the simulator with their hash ids,
and the command end to end on an in-process tiny cluster (the load tester's trace replay against it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.loadtest.options import DATASETS
from bench.loadtest.traces import TraceFit, fit_trace, read_trace
from cli.main import main
from cli.plan_validate_cmd import _hash_blocks
from planner.simulator import Layout, SimSettings, simulate
from planner.validate import compare, replay_from_records
from tests.planner.test_trace_workload import profile
from tests.planner.test_validate import TINY_CLUSTER, record, tiny_profile

MOONCAKE = Path(__file__).parents[1] / "bench" / "loadtest" / "traces" / "mooncake_excerpt.jsonl"


def sent_trace():
    return fit_trace(read_trace("mooncake", MOONCAKE), TraceFit(token_scale=1 / 32, max_rows=12))


def test_measured_rows_keep_their_hash_ids_in_the_replay() -> None:
    sent = sent_trace()
    records = [record(i, row.arrival_s, 0.2, 0.05, inputs=row.input_tokens, outputs=row.output_tokens,
                      requested_output_tokens=row.output_tokens, cached_tokens=16 * (i > 0))
               for i, row in enumerate(sent.rows)]  # fmt: skip
    records.insert(0, record(-1, 0.0, 0.1, 0.05, warmup=True))  # a warm-up is no row
    hashes = _hash_blocks(sent, records)
    replay = replay_from_records(records, None, hashes)
    assert [t.hash_ids for t in replay.trace] == [row.hash_ids for row in sent.rows]
    assert {t.hash_block_tokens for t in replay.trace} == {16}
    assert replay.measured[1].cached_tokens == 16
    simulated = simulate(profile(), replay.trace, Layout("colocated", 0, 1), SimSettings(hop_s=0.0))
    c = compare("colocated", 1.0, replay, simulated)
    # every row shares hash id 0 (the excerpt's system prompt): 16 tokens each after the first one computed it
    assert c.simulated.prefix_hit_rate is not None and c.simulated.prefix_hit_rate > 0
    assert c.measured.prefix_hit_rate == pytest.approx(16 * 11 / sum(row.input_tokens for row in sent.rows))
    figures = c.simulated.figures()
    assert set(figures) == {"ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "prefix_hit_rate"}


def test_a_request_that_is_not_its_row_is_refused() -> None:
    sent = sent_trace()
    records = [record(0, 0.0, 0.2, 0.05, requested_output_tokens=sent.rows[0].output_tokens + 1)]
    with pytest.raises(ValueError, match="request 0 is not row 0"):
        _hash_blocks(sent, records)
    with pytest.raises(ValueError, match="request 99 is not row 99"):
        _hash_blocks(sent, [record(99, 0.0, 0.2, 0.05)])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--workload", f"trace:{MOONCAKE}", "--rates", "1"], "--rates: a trace runs on its own schedule"),
        (["--workload", "fixed:40:6", "--trace-speedup", "2"], "--trace-speedup: only for a trace workload"),
        (["--workload", "trace:nowhere.jsonl"], "is not a file"),
    ],
)
def test_trace_options_are_checked_before_anything_starts(extra, message, capsys) -> None:
    assert main(["plan", "validate", "--profile", "missing.json", *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_validate_replays_a_trace_on_both_sides(tiny_llama_path, tmp_path, capsys) -> None:
    if "mooncake" not in DATASETS:
        pytest.skip("the load tester cannot replay a trace yet (bench/loadtest: --dataset-name mooncake)")
    config_path = tmp_path / "cluster.yaml"
    config_path.write_text(
        yaml.safe_dump(TINY_CLUSTER | {"model": {"name": str(tiny_llama_path), "max_model_len": 512}})
    )
    profile_path = tmp_path / "profile.json"
    tiny_profile(tiny_llama_path).save(profile_path)
    argv = [
        "plan",
        "validate",
        "--config",
        str(config_path),
        "--profile",
        str(profile_path),
        "--modes",
        "disaggregated",
    ]
    argv += ["--workload", f"trace:mooncake:{MOONCAKE}", "--trace-token-scale", "0.03125", "--trace-window", "5:13"]
    argv += ["--max-rows", "8", "--trace-speedup", "4", "--num-warmups", "1", "--in-process", "--json"]
    argv += ["--result-dir", str(tmp_path / "out")]

    assert main(argv) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])

    assert "prefix hit rate measured" in captured.err  # the table's line, on stderr with --json
    mode = result["modes"]["disaggregated"]
    assert mode["settled"] and mode["held_kv_blocks"] == 0 and mode["held_requests"] == 0
    for side in ("simulated", "measured"):
        figures = mode[side]
        assert figures["ttft_p50_ms"] > 0 and figures["tpot_p50_ms"] > 0
        assert 0 < figures["prefix_hit_rate"] < 1  # the rows share the excerpt's first block
    trace = result["trace"]
    assert trace["format"] == "mooncake" and trace["rows"]["used"] == 8 and trace["hash_block_tokens"] == 16
    (comparison,) = result["comparisons"]
    assert comparison["failed"] == 0 and comparison["measured"]["requests"] == 8
    assert comparison["rate"] == pytest.approx(trace["native_rate_rps"], rel=1e-3)
