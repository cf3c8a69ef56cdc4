"""The planner on a production trace: hash ids become shared prompt blocks the simulated prefix caches and the router's
kv_aware placement see, arrival times keep their pattern at every rate, and ``pdserve plan --workload trace:...``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main
from planner.profile_model import Fit, Profile
from planner.simulator import Layout, SimSettings, simulate, synthetic_prompt
from planner.trace import TraceRequest, trace_workload
from planner.validate import prefix_hit_rate

TRACES = Path(__file__).parents[1] / "bench" / "loadtest" / "traces"
MOONCAKE = TRACES / "mooncake_excerpt.jsonl"
AZURE = TRACES / "azure_code_excerpt.csv"


def profile() -> Profile:
    return Profile(
        model="tiny-test", dtype="float32", device="cpu", backend="zmq", date="2025-06-01T12:00:00", block_size=16,
        kv_bytes_per_token=4096, max_batch_tokens=2048, max_num_seqs=64,
        prefill_fit=Fit(["1", "tokens"], [0.002, 0.0002]), decode_fit=Fit(["1", "batch"], [0.01, 0.0005]),
        transfer_fit=Fit(["1", "num_bytes"], [0.001, 1e-9]),
    )  # fmt: skip


def conversations(unique: bool = False) -> list[TraceRequest]:
    """Four conversations of five turns, a turn every 0.5 s: each turn's prompt is its conversation's earlier blocks
    plus one new one (Mooncake's shape); ``unique``: the same lengths and times, no id ever repeated."""
    requests, fresh = [], 1000
    for turn in range(5):
        for conv in range(4):
            ids = tuple(conv * 100 + k for k in range(turn + 2))
            if unique:
                ids, fresh = tuple(range(fresh, fresh + len(ids))), fresh + len(ids)
            requests.append(
                TraceRequest(turn * 2.0 + conv * 0.5, 32 * len(ids) - 5, 4, hash_ids=ids, hash_block_tokens=32)
            )
    return requests


def test_a_hash_id_is_the_same_block_of_tokens_in_every_request() -> None:
    a = TraceRequest(0.0, 70, 1, hash_ids=(7, 8, 9), hash_block_tokens=32)
    b = TraceRequest(0.0, 40, 1, hash_ids=(7, 3), hash_block_tokens=32)
    pa, pb = synthetic_prompt(0, a), synthetic_prompt(1, b)
    assert len(pa) == 70 and len(pb) == 40  # the last block cut by the prompt's end
    assert pa[:32] == pb[:32] and pa[32:40] != pb[32:40]
    assert len(set(pa) | set(pb)) == 70 + 40 - 32
    plain = synthetic_prompt(2, TraceRequest(0.0, 40, 1))
    assert not set(plain) & (set(pa) | set(pb))


@pytest.mark.parametrize("layout", [Layout("colocated", 0, 2), Layout("disaggregated", 1, 2)])
def test_shared_hash_ids_reach_the_simulated_prefix_caches(layout: Layout) -> None:
    settings = SimSettings(prefill_policy="kv_aware", decode_policy="kv_aware", hop_s=0.0)
    shared = simulate(profile(), conversations(), layout, settings)
    unique = simulate(profile(), conversations(unique=True), layout, settings)
    shared_hits, unique_hits = prefix_hit_rate(shared), prefix_hit_rate(unique)
    assert unique_hits == 0.0
    # every turn after the first finds its conversation's earlier blocks: whole 16-token engine blocks of them
    assert shared_hits is not None and shared_hits > 0.5
    assert all(r.cached_tokens is not None and r.cached_tokens % 16 == 0 for r in shared)
    assert sum(r.ttft_s for r in shared) < sum(r.ttft_s for r in unique)  # fewer tokens prefilled


def test_a_trace_keeps_its_arrival_pattern_at_every_rate() -> None:
    times = [10.0, 10.0, 10.0, 11.0, 15.0, 15.5, 30.0]  # a burst, a lull, a straggler
    requests = [TraceRequest(t, 16, 2, hash_ids=(5 * i, 999), hash_block_tokens=8) for i, t in enumerate(times)]
    workload = trace_workload("t", list(reversed(requests)))
    assert workload.native_rate == pytest.approx(6 / 20)
    for rate in (0.3, 1.0, 7.0):
        arrivals = [r.arrival_s for r in workload.at_rate(rate)]
        assert arrivals == pytest.approx([(t - 10.0) * (workload.native_rate / rate) for t in times])
    # ids renumbered densely in order of first use, equal ids kept equal
    assert [r.hash_ids for r in workload.shapes] == [(0, 1)] + [(i, 1) for i in range(2, 8)]
    records = simulate(profile(), workload.at_rate(2.0), Layout("colocated", 0, 1), SimSettings(hop_s=0.0))
    assert [r.arrival_s for r in records] == pytest.approx([r.arrival_s for r in workload.at_rate(2.0)])


def test_a_repeat_of_the_trace_shares_no_block_with_the_copies_before() -> None:
    workload = trace_workload(
        "t", [TraceRequest(float(t), 16, 2, hash_ids=(0, t), hash_block_tokens=8) for t in range(3)]
    )
    copies = workload.at_rate(1.0, min_duration_s=9.0)
    assert len(copies) == 9
    first, second = {h for r in copies[:3] for h in r.hash_ids}, {h for r in copies[3:6] for h in r.hash_ids}
    assert not first & second
    assert [r.hash_ids[0] for r in copies[3:6]] == [copies[3].hash_ids[0]] * 3  # still shared within the copy


def test_trace_request_checks_its_hash_blocks() -> None:
    with pytest.raises(ValueError, match="hash_block_tokens"):
        TraceRequest(0.0, 16, 2, hash_ids=(1,))
    with pytest.raises(ValueError, match="no prefix_id"):
        TraceRequest(0.0, 16, 2, prefix_id=1, prefix_tokens=8, hash_ids=(1,), hash_block_tokens=8)


# ---- pdserve plan --workload trace:... -------------------------------------------------------------------------


@pytest.fixture
def profile_path(tmp_path) -> Path:
    path = tmp_path / "profile.json"
    profile().save(path)
    return path


def plan(profile_path: Path, *extra: str) -> list[str]:
    return ["plan", "--profile", str(profile_path), "--workers", "2", "--min-duration", "2", "--tolerance", "0.1",
            "--slo", "ttft:20000", "tpot:200", *extra]  # fmt: skip


def test_plan_on_a_mooncake_trace(profile_path, capsys) -> None:
    argv = plan(profile_path, "--workload", f"trace:mooncake:{MOONCAKE}", "--trace-token-scale", "0.0625")
    assert main([*argv, "--max-rows", "30", "--trace-window", "0:600", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    trace = data["trace"]
    assert trace["format"] == "mooncake" and trace["hash_block_tokens"] == 32
    assert trace["rows"]["used"] + trace["rows"]["over_context"] == trace["rows"]["in_window"] == 30
    assert 0 < trace["ideal_prefix_hit_rate"] < 1
    for result in data["results"]:
        assert result["goodput_rps"] > 0
        assert result["trace_speed"] == pytest.approx(result["goodput_rps"] / trace["native_rate_rps"])
        # the simulated caches find at most what an unbounded cache would, in whole 16-token blocks
        assert 0 < result["prefix_hit_rate"] <= trace["ideal_prefix_hit_rate"] + 1e-9


def test_plan_guesses_the_format_and_prints_the_trace(profile_path, capsys) -> None:
    assert main([*plan(profile_path, "--workload", f"trace:{AZURE}", "--max-rows", "20")]) == 0
    out = capsys.readouterr().out
    assert f"trace azure:{AZURE}: 14 rows of 20 in the window, 6 over the context left out" in out  # local: 4096
    assert "no hash ids" in out
    assert "x trace" in out.splitlines()[3] and "prefix hits" not in out  # no sharing: no hit-rate column


def test_a_bare_jsonl_path_is_pdserves_trace_format(profile_path, tmp_path, capsys) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [{"arrival_s": 0.3 * i, "input_tokens": 40 + i, "output_tokens": 5} for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([*plan(profile_path, "--workload", str(path), "--json", "--tolerance", "0.5")]) == 0  # the format only
    data = json.loads(capsys.readouterr().out)
    assert data["trace"]["format"] == "trace-jsonl" and data["trace"]["rows"]["used"] == 12
    assert data["trace"]["native_rate_rps"] == pytest.approx(11 / 3.3)


@pytest.mark.parametrize(
    "workload, extra, message",
    [
        ("fixed:100:10", ["--trace-speedup", "2"], "--trace-speedup: only for a trace workload"),
        ("fixed:100:10", ["--max-rows", "5", "--trace-window", "0:1"], "--trace-window, --max-rows: only for a trace"),
        (f"trace:mooncake:{MOONCAKE}", ["--trace-format", "azure"], "contradicts"),
        (f"trace:{MOONCAKE}", ["--trace-format", "sharegpt"], "--trace-format: one of"),
        ("trace:missing.jsonl", [], "is not a file"),
        (f"trace:{MOONCAKE}", ["--trace-speedup", "0"], "--trace-speedup must be a positive number"),
        (f"trace:{MOONCAKE}", ["--trace-window", "5"], "--trace-window must be START:END"),
        (f"trace:{MOONCAKE}", ["--trace-window", "0:0.001"], "a trace needs at least two"),
        (f"trace:{AZURE}", ["--trace-format", "mooncake"], f"{AZURE}:1: not a JSON object"),
    ],
)
def test_trace_option_errors_exit_2(profile_path, capsys, workload, extra, message) -> None:
    assert main([*plan(profile_path, "--workload", workload), *extra]) == 2
    assert message in capsys.readouterr().err


def test_an_unknown_file_format_asks_for_one(profile_path, tmp_path, capsys) -> None:
    path = tmp_path / "rows.csv"
    path.write_text("when,prompt,answer\n1,2,3\n")
    assert main([*plan(profile_path, "--workload", f"trace:{path}")]) == 2
    assert "write trace:FORMAT:FILE or give --trace-format" in capsys.readouterr().err
