"""``pdserve plan`` end to end on a small synthetic profile: table, recommendation, config YAML, JSON, plot."""

from __future__ import annotations

import json

import pytest

from cli.main import main
from cluster.config import load_config
from planner.profile_model import Fit, Profile
from planner.recommend import best, layouts, plan_config
from planner.simulator import Layout


@pytest.fixture
def profile_path(tmp_path):
    profile = Profile(
        model="tiny-test",
        dtype="float32",
        device="cpu",
        backend="zmq",
        date="2025-06-01T12:00:00",
        block_size=16,
        kv_bytes_per_token=4096,
        max_batch_tokens=2048,
        max_num_seqs=64,
        prefill_fit=Fit(["1", "tokens"], [0.002, 0.0002]),
        decode_fit=Fit(["1", "batch", "context_tokens"], [0.01, 0.0005, 1e-6]),
        transfer_fit=Fit(["1", "num_bytes"], [0.001, 1e-9]),
    )
    path = tmp_path / "profile.json"
    profile.save(path)
    return path


def test_plan_end_to_end(tmp_path, profile_path, capsys) -> None:
    out, plot = tmp_path / "plan.yaml", tmp_path / "plan.png"
    argv = ["plan", "--profile", str(profile_path), "--workload", "fixed:100:10", "--slo", "ttft:300", "tpot:40"]
    argv += ["--workers", "3", "--num-requests", "60", "--min-duration", "5", "--out", str(out), "--plot", str(plot)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "SIMULATED, not measured" in text and "tiny-test" in text and "2025-06-01" in text
    for label in ("colocated 3", "1P:2D", "2P:1D"):
        assert label in text
    recommended = [line for line in text.splitlines() if "<- recommended" in line]
    assert len(recommended) == 1
    config = load_config(out)  # what `pdserve serve --config` loads
    pools = config.pools
    if config.mode == "colocated":
        assert (pools.prefill.replicas, pools.decode.replicas) == (0, 3)
        assert recommended[0].startswith("colocated 3")
    else:
        assert pools.prefill.replicas + pools.decode.replicas == 3
        assert recommended[0].startswith(f"{pools.prefill.replicas}P:{pools.decode.replicas}D")
    assert out.read_text().startswith("# pdserve plan:") and "SIMULATED" in out.read_text()
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): the search's JSON is test_plan_degrees.py's
def test_plan_json_agrees_with_its_recommendation(profile_path, capsys) -> None:
    argv = ["plan", "--profile", str(profile_path), "--workload", "shared-prefix:2:64:32:8", "--workers", "2"]
    assert main([*argv, "--num-requests", "40", "--min-duration", "5", "--slo", "ttft:500", "tpot:50", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["simulated"] is True and data["profile"]["device"] == "cpu"
    assert [r["layout"] for r in data["results"]] == ["colocated 2", "1P:1D"]
    rates = {r["layout"]: r["goodput_rps"] for r in data["results"]}
    assert all(rate > 0 for rate in rates.values())
    top = max(rates.values())
    assert rates[data["recommended"]] >= top * (1 - 0.02)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--workload", "fixed:100:10", "--workers", "2"], "--profile"),
        (["--profile", "PROFILE", "--workload", "zipf:1:2", "--workers", "2"], "--workload"),
        (["--profile", "PROFILE", "--workload", "fixed:100:10", "--workers", "2", "--slo", "ttft=5"], "--slo"),
    ],
)
def test_user_errors_exit_2(profile_path, capsys, extra, message) -> None:
    argv = ["plan", *[str(profile_path) if a == "PROFILE" else a for a in extra]]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_ties_go_to_colocated_then_fewer_prefill() -> None:
    from planner.goodput import GoodputResult
    from planner.recommend import LayoutResult

    rates = {"colocated 4": 9.9, "1P:3D": 10.0, "2P:2D": 10.0, "3P:1D": 4.0}
    results = [LayoutResult(layout, GoodputResult(rates[layout.label], 1.0)) for layout in layouts(4)]
    assert best(results, rel_tol=0.02).layout == Layout("colocated", 0, 4)
    results[0] = LayoutResult(Layout("colocated", 0, 4), GoodputResult(5.0, 1.0))
    assert best(results, rel_tol=0.02).layout == Layout("disaggregated", 1, 3)


def test_plan_config_is_valid_for_every_layout() -> None:
    base = load_config("local")
    for layout in layouts(4):
        config = plan_config(base, layout)
        assert config.mode == layout.mode
        assert (config.pools.prefill.replicas, config.pools.decode.replicas) == (layout.prefill, layout.decode)
