"""``pdserve bench migrate``: the figures from sample token times (ITL windows, stalls, goodput), the token check
(lost, duplicated, a run that went another way), the options and sizing it refuses,
the runs' configs; and end to end on the tiny model (workers in-process), the JSON's shape and a drain that moved
every stream with no token lost or duplicated."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import migration_bench
from benchmarks.migration_bench import (
    base_config,
    check_options,
    checks_against,
    compare_drains,
    compare_rebalance,
    drain_config,
    drain_figures,
    drain_sizing,
    gaps_in,
    itl_figures,
    load_figures,
    migration_counts,
    rebalance_config,
    rebalance_sizing,
    token_check,
)
from benchmarks.stream_client import Stream
from tests.helpers.cluster import tiny_cluster_config


def options(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    migration_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def stream(index: int, arrivals: list[float], tokens: list[str] | None = None, **fields) -> Stream:
    tokens = tokens if tokens is not None else [f"t{i}" for i in range(len(arrivals))]
    out = Stream(index, "prompt", len(tokens), sent_s=0.0, arrivals=arrivals, tokens=tokens, chunks=len(tokens))
    out.completion_tokens, out.finish_reason = len(tokens), "length"
    for name, value in fields.items():
        setattr(out, name, value)
    return out


# ---- ITL windows -----------------------------------------------------------------------------------------------


def test_a_gap_belongs_to_the_window_its_token_arrived_in():
    arrivals = [0.0, 1.0, 1.5, 4.0, 4.25]
    assert gaps_in(arrivals, 1.0, 4.0) == [1.0, 0.5]  # the tokens at 1.0 and 1.5
    assert gaps_in(arrivals, 2.0, 5.0) == [2.5, 0.25]  # the stall before 4.0 counts where it ended
    assert gaps_in(arrivals, 5.0, 6.0) == []
    assert gaps_in([0.0, 1.0, 1.0, 1.0], 0.0, 2.0) == [1.0, 0.0, 0.0]  # one chunk of three tokens


def test_the_itl_figures_pool_every_streams_gaps():
    streams = [[0.0, 0.1, 0.2, 0.3], [0.05, 0.15, 0.25, 1.25]]  # the second stalls a second at its end
    figures = itl_figures(streams, 0.0, 2.0)
    assert figures["gaps"] == 6 and figures["window_s"] == 2.0
    assert figures["p50_ms"] == 100.0 and figures["max_ms"] == 1000.0
    assert 100.0 < figures["p99_ms"] <= 1000.0
    assert itl_figures(streams, 5.0, 6.0) == {
        "window_s": 1.0,
        "gaps": 0,
        "p50_ms": None,
        "p99_ms": None,
        "max_ms": None,
    }


def _steady(start: float, step: float, n: int, stall_at: float | None = None, stall: float = 0.0) -> list[float]:
    """``n`` tokens ``step`` apart from ``start``; from ``stall_at`` on, each ``stall`` later."""
    out = [round(start + i * step, 6) for i in range(n)]
    return [a + stall if stall_at is not None and a >= stall_at else a for a in out]


def test_a_drain_runs_figures_compare_the_moved_streams_own_itl_around_the_move_with_before_it():
    # two streams at 10 tokens/s moved at t=5 (a 0.2 s stall), one that finished before the drain
    moved = [
        stream(i, _steady(0.0, 0.1, 100, stall_at=5.0, stall=0.2), timing={"migrations": 1, "migration_s": 0.19})
        for i in range(2)
    ]
    done = stream(2, _steady(0.0, 0.1, 20))
    references = [stream(i, [0.0] * len(s.tokens), tokens=s.tokens) for i, s in enumerate(moved + [done])]
    figures = drain_figures(moved + [done], references, drain_s=5.0, drained_s=5.15, window_s=2.0)
    assert figures["drain_time_s"] == 0.15 and figures["moved_streams"] == 2
    assert figures["itl_of"] == "moved streams"
    assert figures["tokens_at_drain"] == {"min": 20, "max": 50}
    assert figures["itl_before"]["p99_ms"] == pytest.approx(100.0) and figures["itl_before"]["gaps"] == 40
    assert figures["itl_during"]["window_s"] == 2.15 and figures["itl_during"]["max_ms"] == pytest.approx(300.0)
    assert figures["itl_p99_ratio"] == pytest.approx(figures["itl_during"]["p99_ms"] / 100.0, abs=1e-3)
    assert figures["stall_ms"]["client_max"] == pytest.approx(300.0) and figures["stall_ms"]["server_max"] == 190.0
    assert figures["tokens"]["identical"] == 3 and figures["tokens"]["tokens_lost"] == 0
    assert figures["coalesced_tokens"] == 0 and figures["errors"] == {}


def test_a_run_where_nothing_moved_measures_every_stream():
    streams = [stream(i, _steady(0.0, 0.1, 100)) for i in range(2)]
    figures = drain_figures(streams, streams, drain_s=5.0, drained_s=10.0, window_s=1.0)
    assert figures["moved_streams"] == 0 and figures["itl_of"] == "all streams (none moved)"
    assert figures["itl_during"]["gaps"] == 2 * 50 and figures["stall_ms"]["client_max"] is None


def test_the_drain_goals():
    def run(drain_s, ratio, moved=16, lost=0, duplicated=0, errors=None):
        tokens = {"tokens_lost": lost, "tokens_duplicated": duplicated}
        return {
            "drain_time_s": drain_s,
            "itl_p99_ratio": ratio,
            "moved_streams": moved,
            "tokens": tokens,
            "errors": errors or {},
        }

    met = compare_drains(run(1.0, 2.9), run(20.0, None, moved=0), 16)
    assert met["drain_time_ratio"] == 0.05 and met["itl_p99_ratio"] == 2.9
    assert all(met["goals"][k] for k in ("drain_time_ratio_met", "itl_p99_ratio_met", "all_streams_moved"))
    assert met["goals"]["tokens_lost_0_duplicated_0"] and met["goals"]["all_met"]
    assert not compare_drains(run(1.0, 2.9, moved=15), run(20.0, None, moved=0), 16)["goals"]["all_met"]
    missed = compare_drains(run(3.0, 3.5, moved=15, duplicated=1), run(20.0, None, moved=0), 16)
    assert not any(
        missed["goals"][k]
        for k in ("drain_time_ratio_met", "itl_p99_ratio_met", "all_streams_moved", "tokens_lost_0_duplicated_0")
    )
    failed_wait = compare_drains(run(1.0, 2.0), run(20.0, None, moved=0, errors={3: "http 500"}), 16)
    assert not failed_wait["goals"]["tokens_lost_0_duplicated_0"]


# ---- tokens lost, duplicated, different ------------------------------------------------------------------------

REFERENCE = ["a", "b", "c", "d", "e", "f"]


@pytest.mark.parametrize(
    ("received", "lost", "duplicated", "different", "first"),
    [
        (REFERENCE, 0, 0, 0, None),
        (["a", "b", "d", "e", "f"], 1, 0, 0, None),  # c never came
        (["a", "b", "c", "c", "d", "e", "f"], 0, 1, 0, None),  # c twice
        (["a", "b", "c", "d"], 2, 0, 0, None),  # cut short
        (["a", "b", "x", "y", "z", "w"], 0, 0, 4, 2),  # went another way at token 2
        (["a", "a", "b", "c", "x", "y", "z"], 0, 1, 3, 4),  # a duplicate, then another way
    ],
    ids=["same", "lost", "duplicated", "cut", "diverged", "duplicated-then-diverged"],
)
def test_a_streams_tokens_are_aligned_with_its_reference(received, lost, duplicated, different, first):
    check = token_check(REFERENCE, received)
    assert (check["lost"], check["duplicated"], check["different"]) == (lost, duplicated, different)
    assert check["first_difference"] == first and check["identical"] == (received == REFERENCE)


def test_the_checks_sum_over_streams_and_compare_the_clients_count_with_the_servers():
    references = [stream(0, [0.0] * 6, REFERENCE), stream(1, [0.0] * 6, REFERENCE)]
    got = [stream(0, [0.0] * 5, ["a", "b", "d", "e", "f"]), stream(1, [0.0] * 6, ["a", "b", "x", "y", "z", "w"])]
    checks = checks_against(references, got)
    assert checks["identical"] == 0 and checks["tokens_lost"] == 1 and checks["tokens_different"] == 4
    assert checks["first_differences"] == {1: 2} and checks["counts_agree"]
    got[0].completion_tokens = 6  # the server says it sent one the client never read
    assert not checks_against(references, got)["counts_agree"]


# ---- the rebalance figures -------------------------------------------------------------------------------------


def test_goodput_counts_the_requests_within_both_slo_bounds_per_second_of_the_run():
    fast = stream(0, [0.5, 0.6, 0.7, 0.8, 0.9])  # TTFT 0.5 s, TPOT 0.1 s
    slow = stream(1, [0.5, 1.0, 1.5, 2.0, 2.5])  # TPOT 0.5 s: preempted
    late = stream(2, [3.0, 3.1, 3.2, 3.3, 4.0])  # TTFT 3 s
    failed = stream(3, [0.5, 0.6], error="http 500")
    figures = load_figures([fast, slow, late, failed], [True, True, False, False], slo_ttft_s=2.0, slo_tpot_s=0.2)
    assert figures["requests"] == 4 and figures["completed"] == 3 and figures["within_slo"] == 1
    assert figures["wall_s"] == 4.0 and figures["goodput_rps"] == 0.25
    # the TTFT bound holds at every TPOT bound: the late one never counts, the slow one from 2x on
    assert figures["goodput_rps_by_tpot_slo_ms"] == {"200": 0.25, "250": 0.25, "300": 0.25, "400": 0.25}
    assert figures["long_tpot_ms"]["p50"] == pytest.approx(300.0) and figures["tpot_ms"]["p50"] == pytest.approx(250.0)
    assert figures["longest_gap_ms"]["max"] == pytest.approx(700.0) and figures["errors"] == {3: "http 500"}
    rows = figures["per_request"]
    assert [r["within_slo"] for r in rows] == [True, False, False, False] and rows[3]["tpot_ms"] is None
    assert rows[1] == {
        "long": True,
        "ttft_ms": 500.0,
        "tpot_ms": 500.0,
        "longest_gap_ms": 500.0,
        "migrations": 0,
        "within_slo": False,
    }


def test_the_rebalance_comparison_and_the_migration_counts():
    def run(goodput, p99, long_p99, gap, preemptions, moved):
        return {
            "goodput_rps": goodput,
            "tpot_ms": {"p99": p99},
            "long_tpot_ms": {"p99": long_p99},
            "longest_gap_ms": {"max": gap},
            "preemptions": preemptions,
            "migrations": moved,
        }

    out = compare_rebalance(run(0.5, 400.0, 300.0, 20000.0, 6, {}), run(0.6, 200.0, 240.0, 900.0, 0, {"moved": 3}))
    assert out == {
        "goodput_ratio": 1.2,
        "tpot_p99_ratio": 0.5,
        "long_tpot_p99_ratio": 0.8,
        "longest_gap_ms": {"off": 20000.0, "on": 900.0},
        "preemptions": {"off": 6, "on": 0},
        "moves": {"off": 0, "on": 3},
    }
    key = "pdserve_migrations_total"
    before = {(key, (("reason", "drain"), ("result", "moved"))): 1.0}
    after = before | {
        (key, (("reason", "drain"), ("result", "moved"))): 5.0,
        (key, (("reason", "drain"), ("result", "refused"))): 1.0,
        (key, (("reason", "admin"), ("result", "moved"))): 2.0,
    }
    assert migration_counts(before, after, "drain") == {"moved": 4, "refused": 1}


# ---- options, sizing, configs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--streams", "0"], "--streams"),
        (["--max-tokens", "8", "--tokens-before-move", "8"], "--tokens-before-move"),
        (["--window-s", "0"], "--window-s"),
        (["--kv-blocks", "0"], "--kv-blocks"),
        (["--send-gap-s", "-1"], "--send-gap-s"),
        (["--slo-tpot-ms", "0"], "--slo-tpot-ms"),
        (["--long-tokens", "16", "--short-tokens", "16"], "--long-tokens"),
        (["--max-moves-per-worker", "0"], "--max-moves-per-worker"),
    ],
)
def test_bad_options_are_refused_by_name(argv, message):
    with pytest.raises(ValueError, match=message):
        check_options(options(*argv))


def test_the_command_is_registered_with_its_defaults_and_says_where_they_differ_from_the_issue():
    from cli.main import build_parser

    args = build_parser().parse_args(["bench", "migrate"])
    assert (args.streams, args.max_tokens, args.parts, args.in_process) == (16, 256, "both", False)
    check_options(args)
    assert migration_bench.ISSUE_SETTINGS == {"streams": 16, "max_tokens": 1000}


def test_the_drain_kv_holds_every_stream_to_its_end_and_a_context_past_the_model_is_refused():
    size = drain_sizing(options(), block_size=16, max_model_len=4096)
    assert size["blocks_the_streams_reach"] == 16 * 20  # (64 + 256) / 16 each
    assert size["decode_kv_blocks"] == 352
    assert drain_sizing(options("--kv-blocks", "500"), 16, None)["decode_kv_blocks"] == 500
    with pytest.raises(ValueError, match="max_model_len"):
        drain_sizing(options("--max-tokens", "1000"), 16, max_model_len=512)


def test_the_rebalance_kv_holds_the_long_prompts_on_one_worker_but_not_their_ends():
    size = rebalance_sizing(options(), block_size=16)
    assert (size["long_prompt_blocks"], size["long_end_blocks"]) == (2, 17)  # 17 and 272 tokens
    assert size["long_ends_over_one_worker"] == 1.42 and size["long_ends_fit_two_workers"]
    with pytest.raises(ValueError, match="cannot hold 8 prompts"):
        rebalance_sizing(options("--rebalance-kv-blocks", "15"), 16)
    with pytest.raises(ValueError, match="one long generation"):
        rebalance_sizing(options("--long-requests", "1", "--rebalance-kv-blocks", "10"), 16)


def test_the_runs_configs():
    args = options("--max-moves-per-worker", "2")
    args.cluster_config = tiny_cluster_config("tiny-model-folder")
    base = base_config(args)
    assert base.mode == "disaggregated" and base.router.port == 0 and not base.router.rebalance.enabled
    migrate, wait = drain_config(base, True, 300), drain_config(base, False, 300)
    assert (migrate.pools.decode.replicas, migrate.pools.decode.kv_blocks) == (1, 300)
    assert migrate.router.migrate_on_drain and not wait.router.migrate_on_drain
    off, on = rebalance_config(base, args, False), rebalance_config(base, args, True)
    assert (on.pools.decode.replicas, on.pools.decode.kv_blocks, on.router.decode_policy) == (2, 96, "round_robin")
    assert on.router.rebalance.enabled and on.router.rebalance.max_moves_per_worker == 2
    assert not off.router.rebalance.enabled
    assert base.pools.decode.replicas == 1 and base.router.migrate_on_drain  # the base is left as it was


# ---- end to end ------------------------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_the_bench_runs_on_the_tiny_model_and_the_drain_moves_every_stream_exactly(tiny_llama_path):
    args = options(
        "--in-process",
        "--streams",
        "4",
        "--max-tokens",
        "400",
        "--prompt-len",
        "24",
        "--window-s",
        "0.5",
        "--long-requests",
        "4",
        "--long-tokens",
        "200",
        "--short-tokens",
        "8",
        "--rebalance-prompt-len",
        "16",
        "--rebalance-kv-blocks",
        "28",
        "--send-gap-s",
        "0.05",
    )
    args.cluster_config = tiny_cluster_config(tiny_llama_path)
    out = migration_bench.run(args)

    assert set(out) == {"configuration", "drain", "rebalance", "wall_s"} and out["configuration"]["in_process"]
    drain = out["drain"]
    assert set(drain) == {"workload", "sizing", "runs", "comparison"} and not drain["workload"]["at_issue_settings"]
    migrate, wait = drain["runs"]["migrate"], drain["runs"]["wait"]
    for run in (migrate, wait):
        assert run["streams_on_source"] == run["streams_running_at_drain"] == 4
        assert run["errors"] == {} and run["held_after"]["settled"]
        assert run["tokens"]["tokens_lost"] == run["tokens"]["tokens_duplicated"] == 0, run["tokens"]
        assert run["tokens"]["counts_agree"]
        assert run["itl_before"]["gaps"] > 0 and run["itl_during"]["gaps"] > 0
    assert migrate["moved_streams"] == 4 and migrate["migrations"] == {"moved": 4}
    assert migrate["workers"]["migrations_out"] == migrate["workers"]["migrations_in"] == 4
    assert migrate["workers"]["migration_bytes"] > 0 and migrate["stall_ms"]["server_max"] > 0
    assert wait["moved_streams"] == 0 and wait["migrations"] == {}
    assert 0 < migrate["drain_time_s"] < wait["drain_time_s"]
    comparison = drain["comparison"]
    assert comparison["goals"]["all_streams_moved"] and comparison["goals"]["tokens_lost_0_duplicated_0"]
    assert isinstance(comparison["goals"]["itl_p99_ratio_met"], bool) and comparison["drain_time_ratio"] < 1

    rebalance = out["rebalance"]
    off, on = rebalance["runs"]["off"], rebalance["runs"]["on"]
    for run in (off, on):
        assert run["requests"] == run["completed"] == 8 and run["errors"] == {}
        assert len(run["long_requests_placed_on"]) == 1  # the skew: every long one on one worker
        assert run["goodput_rps"] > 0 and run["tpot_ms"]["p99"] > 0 and run["held_after"]["settled"]
    assert off["migrations"] == {} and off["preemptions"] > 0  # no room for the long ones' ends
    assert on["same_tokens_as_off_run"] == 8
    assert set(rebalance["comparison"]) == {
        "goodput_ratio",
        "tpot_p99_ratio",
        "long_tpot_p99_ratio",
        "longest_gap_ms",
        "preemptions",
        "moves",
    }
