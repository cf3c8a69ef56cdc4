"""``pdserve bench role-switch`` on a tiny in-process cluster: every move, by switch and by replacement, ends with the
worker serving in its new pool, a request is served after each, no KV is held at the end, and the figures are there
(the goal's ratio is a measurement, not asserted: this box's wall times are noisy)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import role_switch_bench
from tests.helpers.cluster import tiny_cluster_config

pytestmark = pytest.mark.timeout(240)


def test_switching_and_replacing_are_both_measured(tiny_llama_path) -> None:
    parser = argparse.ArgumentParser()
    role_switch_bench.add_arguments(parser)
    args = parser.parse_args(["--in-process", "--repeats", "1"])
    args.cluster_config = tiny_cluster_config(tiny_llama_path)
    out = role_switch_bench.run(args)

    assert [s["to"] for s in out["switch"]["samples"]] == ["prefill", "decode"]
    assert [s["to"] for s in out["replace"]["samples"]] == ["prefill", "decode"]
    assert all(s["rebuild_s"] > 0 and s["drain_s"] >= 0 for s in out["switch"]["samples"])
    assert all(s["start_s"] > 0 for s in out["replace"]["samples"])
    assert out["switch_over_replace"] > 0
    assert out["served_after_every_move"] and out["kv_free_after"]
    assert "cores" in out["cpu"] and "all_met" in out["goals"]
