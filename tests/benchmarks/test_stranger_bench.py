"""``pdserve bench stranger`` on a tiny in-process cluster: raw ZMTP attacks from a process without the cluster's keys
move the cluster's memory by less than the goal's 50 MB while the same attacks make a plain ZeroMQ process hold
hundreds of MB; every socket counted refused handshakes, and a request is served afterwards with nothing held."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import stranger_bench
from tests.helpers.cluster import tiny_cluster_config

pytestmark = pytest.mark.timeout(240)


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): a whole benchmark run
def test_a_stranger_moves_no_memory_of_the_cluster(tiny_llama_path) -> None:
    parser = argparse.ArgumentParser()
    stranger_bench.add_arguments(parser)
    args = parser.parse_args(["--in-process", "--seconds", "1.5", "--attacks", "flood,routing_ids,wrong_keys"])
    args.cluster_config = tiny_cluster_config(tiny_llama_path)
    out = stranger_bench.run(args)

    assert set(out["attacks"]) == {"flood", "routing_ids", "wrong_keys"}
    assert {s["plane"] for s in out["sockets"]} == {"control", "kv"}
    for kind in ("flood", "routing_ids"):
        peaks = out["attacks"][kind]["peak_over_baseline_mb"]
        assert peaks[stranger_bench.UNGUARDED] > 100, peaks  # the attack is real: plain sockets hold it
        assert out["attacks"][kind]["max_mb"] <= stranger_bench.GOAL_MB, peaks
    assert all(count > 0 for count in out["handshakes_refused"].values()), out["handshakes_refused"]
    assert out["served_after"] and out["kv_free_after"]
    assert out["goals"]["all_met"] and "cores" in out["cpu"]
