"""``pdserve bench tp`` on the tiny model: every degree's figures, and the same greedy tokens as degree 1."""

import argparse

import pytest

from benchmarks import tp_bench


@pytest.mark.e2e  # every degree on the tiny model: `make test-e2e`
def test_tp_bench_reports_each_degree_with_the_same_tokens(tiny_llama_path):
    parser = argparse.ArgumentParser()
    tp_bench.add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(tiny_llama_path), "--degrees", "1,2", "--batch", "2", "--input-len", "12", "--output-len", "4"]
    )
    out = tp_bench.run(args)
    assert set(out["degrees"]) == {"1", "2"}
    two = out["degrees"]["2"]
    assert two["same_tokens_as_degree_1"] is True and two["threads_per_rank"] == 1
    assert two["prefill_step_ms"] > 0 and two["decode_step_ms"] > 0
    assert out["degrees"]["1"]["decode_vs_degree_1"] == 1.0
