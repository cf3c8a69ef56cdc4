"""``pdserve bench tp-handoff --degrees``: the KV hand-off from a prefill engine of p ranks to a decode engine of d
ranks, end to end over a real backend, with every rank's engine left holding nothing (each side checks it before
reporting)."""

import argparse

import pytest

from benchmarks import tp_handoff_bench
from benchmarks.options import add_tp_handoff_bench_arguments


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_tp_handoff_bench_arguments(parser)
    return parser.parse_args(["--requests", "1", "--prompt-len", "32", "--reps", "1", *extra])


@pytest.mark.e2e
def test_a_hand_off_across_degrees_moves_every_heads_kv() -> None:
    out = tp_handoff_bench.run(_args("--degrees", "2:2"))  # rank 0 gathers, the other rank 0 broadcasts
    assert set(out["pairs"]) == {"2:2"} and out["backend"] == "zmq"
    per_token = 2 * 30 * 4 * 64 * 4  # every KV head of the bench model, float32, whatever the degrees
    for figures in out["pairs"].values():
        assert figures["kv_mib"] == round(32 * per_token / 2**20, 2)
        assert figures["handoff_ms"] > 0 and figures["handoff_gb_s"] > 0 and figures["prefill_step_ms"] > 0
        assert figures["send_only_ms"] > 0 and figures["send_only_gb_s"] > 0
    assert out["pairs"]["2:2"]["handoff_vs_2:2"] == 1.0


@pytest.mark.parametrize("bad", ["2", "1:0", "a:b"])
def test_bad_degree_pairs_are_refused_with_the_flag(bad: str) -> None:
    with pytest.raises(ValueError, match="--degrees"):
        tp_handoff_bench.parse_degrees(bad)
