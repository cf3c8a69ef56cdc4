"""``pdserve bench routing`` end to end on the tiny model, workers in-process: both workloads, both runs complete
every request, the JSON carries every figure, nothing is left held, and the new behaviour ships fewer KV bytes per
multi-turn request and reuses more of the prompt than the old one."""

from __future__ import annotations

import argparse

import pytest

from tests.helpers.cluster import tiny_cluster_config

pytestmark = pytest.mark.timeout(300)

RUN_KEYS = {
    "requests",
    "completed",
    "failed",
    "failures",
    "duration_s",
    "ttft_ms",
    "tpot_ms",
    "kv_bytes",
    "prefix_hit_rate",
    "router",
    "engine_prefix_hit_tokens",
    "held_after",
}


@pytest.fixture(scope="module")
def bench_out(tiny_llama_path, tmp_path_factory) -> dict:
    from benchmarks import routing_bench

    parser = argparse.ArgumentParser()
    routing_bench.add_arguments(parser)
    args = parser.parse_args(
        [
            "--in-process",
            "--max-concurrency",
            "2",
            "--prefix-groups",
            "4",
            "--prefix-len",
            "96",
            "--question-len",
            "8",
            "--num-prompts",
            "12",
            "--output-len",
            "4",
            "--num-conversations",
            "3",
            "--num-turns",
            "3",
            "--system-len",
            "40",
            "--user-len",
            "24",
            "--turn-output-len",
            "8",
            "--think-time-s",
            "0.05",
            "--result-dir",
            str(tmp_path_factory.mktemp("routing")),
        ]
    )
    args.cluster_config = tiny_cluster_config(tiny_llama_path)
    return routing_bench.run(args)


def test_every_run_completes_every_request_and_holds_nothing_after(bench_out):
    assert set(bench_out["workloads"]) == {"shared-prefix", "multi-turn"}
    expected = {"shared-prefix": 12, "multi-turn": 3 * 3}
    for workload, entry in bench_out["workloads"].items():
        for run in ("baseline", "kv_aware"):
            figures = entry[run]
            assert RUN_KEYS <= set(figures), (workload, run, set(figures))
            assert figures["requests"] == figures["completed"] == expected[workload], (workload, run, figures)
            assert figures["failed"] == 0 and figures["failures"] == {}
            assert figures["held_after"] == {"settled": True, "kv_blocks": 0, "requests": 0}, (workload, run)
            assert figures["ttft_ms"]["p50"] > 0 and figures["ttft_ms"]["p90"] >= figures["ttft_ms"]["p50"]
            assert figures["tpot_ms"]["p50"] is not None
            # every prompt was prefilled once: on a prefill worker (routed there), or on its decode worker
            path = figures["router"]["prefill_path"]
            assert path["remote"] + path["local"] == expected[workload], (workload, run, path)
            if path["remote"]:
                assert figures["router"]["prefill_routed_prompt_tokens"] > 0
                assert figures["kv_bytes"]["received_by_decode"] > 0
        # the old behaviour and shared-prefix's kv_aware (default 0) never prefill locally; multi-turn's kv_aware does
        # (default 128 tokens: each turn's part the decode worker lacks is shorter than that on the tiny model)
        assert entry["baseline"]["router"]["prefill_path"]["local"] == 0
        assert (entry["kv_aware"]["router"]["prefill_path"]["local"] > 0) == (workload == "multi-turn")
        assert entry["runs_compared"]["kv_aware"]["local_prefill_max_tokens"] == (
            128 if workload == "multi-turn" else 0
        )
        if workload == "multi-turn":
            assert set(entry["kv_aware"]["turns"]["ttft_ms_p50_by_turn"]) == {"1", "2", "3"}
        assert set(entry["ratios"]) >= {"ttft_p50", "ttft_p90", "kv_bytes_per_request"}
        ratios = entry["ratios"]
        assert all(value is not None and value >= 0 for value in ratios.values()), ratios
        assert ratios["ttft_p50"] > 0 and ratios["ttft_p90"] > 0, ratios  # (bytes: 0 when every prefill was local)
        assert entry["goal"]["met"] == (entry["ratios"]["ttft_p50"] <= 0.5)


def test_the_shared_prefix_workload_is_sized_so_half_the_prefixes_fit_a_prefill_worker(bench_out):
    entry = bench_out["workloads"]["shared-prefix"]
    sizing = entry["prefill_kv"]
    assert sizing["half_the_prefixes_fit_one_worker"] and not sizing["all_prefixes_fit_one_worker"], sizing
    assert sizing["prefixes_one_worker_holds"] == 2, sizing
    for run in ("baseline", "kv_aware"):  # one decision per request, by what decided it
        assert sum(entry[run]["router"]["prefill_decisions"].values()) == entry[run]["requests"]
    assert entry["baseline"]["router"]["prefill_decisions"]["prefix"] == 0  # least_loaded never weighs prefixes
    # the new decode worker keeps the prefixes it received: later requests of a group reserve and receive less
    assert entry["baseline"]["prefix_hit_rate"]["decode"] == 0 < entry["kv_aware"]["prefix_hit_rate"]["decode"]
    assert entry["kv_aware"]["kv_bytes"]["per_request"] < entry["baseline"]["kv_bytes"]["per_request"]


def test_the_new_behaviour_ships_fewer_bytes_per_multi_turn_request_and_reuses_more(bench_out):
    entry = bench_out["workloads"]["multi-turn"]
    base, new = entry["baseline"], entry["kv_aware"]
    assert new["kv_bytes"]["per_request"] < base["kv_bytes"]["per_request"], (new["kv_bytes"], base["kv_bytes"])
    assert entry["ratios"]["kv_bytes_per_request"] < 1
    # the old decode worker reuses nothing; the new one holds every later turn's history
    assert base["prefix_hit_rate"]["decode"] == 0
    assert new["prefix_hit_rate"]["decode"] > base["prefix_hit_rate"]["decode"]
    assert new["router"]["decode_cached_prompt_tokens"] > 0
    assert entry["workload"]["system_len"] == 40
