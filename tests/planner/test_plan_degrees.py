"""``pdserve plan`` over tensor-parallel degrees: one profile per degree, a device budget, each pool's degree chosen.

The profiles are built by hand so the answer is known: at degree 2 a worker's steps take half as long and it holds
twice the KV blocks (its ranks' KV heads), so under a tight TPOT only degree-2 decode workers meet the SLO.
"""

from __future__ import annotations

import json

import pytest

from cli.main import main
from cluster.config import load_config, parse_config
from planner.goodput import SLO
from planner.profile_model import Degree, Fit, Profile, ProfileSet
from planner.recommend import best, evaluate, layout_settings, layouts
from planner.simulator import Layout, simulate
from planner.trace import TraceRequest, poisson_workload


def degree_profile(degree: int, model: str = "tiny-test", kv_bytes: int = 4096) -> Profile:
    speed = degree  # ideal scaling: a hand-made profile, not a claim about any hardware
    return Profile(
        model=model,
        dtype="float32",
        device="cpu",
        backend="zmq",
        date="2025-06-01T12:00:00",
        block_size=16,
        kv_bytes_per_token=kv_bytes,
        max_batch_tokens=2048,
        max_num_seqs=64,
        prefill_fit=Fit(["1", "tokens"], [0.002 / speed, 0.0002 / speed]),
        decode_fit=Fit(["1", "batch", "context_tokens"], [0.03 / speed, 0.0005 / speed, 1e-6 / speed]),
        transfer_fit=Fit(["1", "num_bytes"], [0.001, 1e-9]) if degree == 1 else None,
        tensor_parallel_size=degree,
        num_kv_heads=4,
    )


def base_config(**decode):
    pool = {"kv_memory_mb": 4}  # a CPU pool: no GPUs per replica
    return parse_config(
        {"model": {"name": "tiny-test"}, "pools": {"prefill": pool, "decode": {**pool, **decode}}}, "<test>"
    )


def test_layouts_spend_the_device_budget_at_each_degree() -> None:
    found = {layout.label: layout for layout in layouts(4, degrees=[Degree(1), Degree(2)])}
    assert {"colocated 4", "colocated 2(tp2)", "2P(tp1):1D(tp2)", "1P(tp2):2D(tp1)", "1P(tp2):1D(tp2)"} <= set(found)
    assert all(layout.devices <= 4 for layout in found.values())
    assert "3P:1D" in found and "2P(tp2):1D(tp2)" not in found  # 6 devices
    assert [layout.label for layout in layouts(3)] == ["colocated 3", "1P:2D", "2P:1D"]  # degree 1: as before


def test_a_pools_degree_sets_its_step_time_and_its_kv_blocks() -> None:
    profiles = ProfileSet.of([degree_profile(1), degree_profile(2)])
    base = base_config()
    one, two = (layout_settings(base, Layout("colocated", 0, 1, decode_tp=d), profiles) for d in (1, 2))
    assert two.decode_kv_blocks == 2 * one.decode_kv_blocks  # each rank's budget holds half the heads
    trace = [TraceRequest(0.0, 64, 20)]
    (slow,) = simulate(profiles, trace, Layout("colocated", 0, 1, decode_tp=1), one)
    (fast,) = simulate(profiles, trace, Layout("colocated", 0, 1, decode_tp=2), two)
    assert fast.tpot_s == pytest.approx(slow.tpot_s / 2, rel=0.05)
    with pytest.raises(ValueError, match=r"no profile of tp4 \(profiled: tp1, tp2\)"):
        simulate(profiles, trace, Layout("colocated", 0, 1, decode_tp=4), one)


def test_the_search_picks_the_degree_that_meets_the_slo() -> None:
    profiles = ProfileSet.of([degree_profile(1), degree_profile(2)])
    workload = poisson_workload("fixed:64:16", [TraceRequest(0.0, 64, 16) for _ in range(30)], seed=0)
    slo = SLO(ttft_s=1.0, tpot_s=0.025)  # degree 1's decode step alone is 30 ms
    results = evaluate(profiles, workload, 4, base_config(), slo)
    by_label = {r.layout.label: r.goodput.rate for r in results}
    assert by_label["colocated 4"] == 0 and by_label["1P(tp2):2D(tp1)"] == 0
    assert by_label["colocated 2(tp2)"] > 0
    chosen = best(results)
    assert chosen.layout.decode_tp == 2 and chosen.goodput.rate > 0


def test_a_transfer_takes_the_decode_degrees_fit_where_one_was_measured() -> None:
    two = degree_profile(2)
    two.transfer_fit = Fit(["1", "num_bytes"], [0.003, 2e-9])  # rank 0 hands every piece on: slower than degree 1
    profiles = ProfileSet.of([degree_profile(1), two, degree_profile(4)])
    assert profiles.transfer_s(10**6, decode_degree=1) == pytest.approx(0.001 + 1e-3)
    assert profiles.transfer_s(10**6, decode_degree=2) == pytest.approx(0.003 + 2e-3)
    assert profiles.transfer_s(10**6, decode_degree=4) == pytest.approx(0.001 + 1e-3)  # none at 4: the lowest's
    assert ProfileSet.of([degree_profile(2)]).transfer_s(10**6, decode_degree=2) == 0.0  # colocated: no KV moves


def test_profiles_of_different_models_are_refused() -> None:
    with pytest.raises(ValueError, match="differ in model"):
        ProfileSet.of([degree_profile(1), degree_profile(2, model="other")])
    with pytest.raises(ValueError, match="two profiles of tensor_parallel_size 1"):
        ProfileSet.of([degree_profile(1), degree_profile(1)])


def test_plan_cli_writes_the_chosen_degrees(tmp_path, capsys) -> None:
    paths = []
    for degree in (1, 2):
        paths.append(tmp_path / f"profile-tp{degree}.json")
        degree_profile(degree).save(paths[-1])
    base = tmp_path / "base.yaml"
    base.write_text(json.dumps(base_config().model_dump(mode="json")))
    out = tmp_path / "plan.yaml"
    argv = ["plan", "--profile", *map(str, paths), "--workload", "fixed:64:16", "--gpus", "2", "--config", str(base)]
    argv += ["--slo", "ttft:1000", "tpot:25", "--num-requests", "20", "--min-duration", "0", "--out", str(out)]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["profile"]["tensor_parallel_sizes"] == [1, 2] and data["workers"] == 2
    assert data["recommended"] == "colocated 1(tp2)"
    config = load_config(out)
    assert config.mode == "colocated"
    assert (config.pools.decode.replicas, config.pools.decode.tensor_parallel_size) == (1, 2)
    assert main([*argv[:-2], "--workers", "3"]) == 2  # two budgets that differ
    assert "give one budget" in capsys.readouterr().err


def test_the_search_takes_each_pools_expert_degree_from_its_profiles() -> None:
    """A profile is one (tensor, expert) degree's: two of one tensor degree with different expert degrees are two
    candidates, each layout takes its pools' own, and the written config carries both degrees of both pools."""
    split = degree_profile(2)
    split.expert_parallel_size = 2
    profiles = ProfileSet.of([degree_profile(2), split])
    assert profiles.degrees == [Degree(2, 1), Degree(2, 2)] and profiles.at(Degree(2, 2)) is split
    found = {layout.label: layout for layout in layouts(4, degrees=profiles.degrees)}
    assert {"colocated 2(tp2)", "colocated 2(tp2 ep2)", "1P(tp2 ep2):1D(tp2)", "1P(tp2):1D(tp2 ep2)"} <= set(found)
    with pytest.raises(ValueError, match="a layout's degrees: expert_parallel_size 4: .* or any with"):
        Layout("colocated", 0, 1, decode_tp=2, decode_ep=4)
    # the experts split alone: a worker of tensor degree 1 takes a device per expert rank
    alone = Layout("disaggregated", 1, 1, prefill_tp=1, decode_tp=1, decode_ep=2)
    assert alone.devices == 3 and alone.label == "1P(tp1):1D(tp1 ep2)"
    assert [lay.label for lay in layouts(4, degrees=[Degree(1, 2)])] == [
        "colocated 2(tp1 ep2)",
        "1P(tp1 ep2):1D(tp1 ep2)",
    ]
    from planner.recommend import plan_config

    config = plan_config(base_config(), found["1P(tp2 ep2):1D(tp2)"])
    assert (config.pools.prefill.tensor_parallel_size, config.pools.prefill.expert_parallel_size) == (2, 2)
    assert (config.pools.decode.tensor_parallel_size, config.pools.decode.expert_parallel_size) == (2, 1)
    colocated = plan_config(base_config(), found["colocated 2(tp2 ep2)"])  # its empty prefill pool: the same degrees
    assert colocated.pools.prefill.replicas == 0 and colocated.pools.prefill.expert_parallel_size == 2
