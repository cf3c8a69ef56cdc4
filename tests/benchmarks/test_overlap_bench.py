"""The overlap bench end to end on the tiny model: both modes measured, the JSON has every figure, values sane."""

from __future__ import annotations

import argparse

import pytest

from tests.helpers.cluster import tiny_cluster_config


def test_the_int8_prompt_count_declared_in_the_product_is_the_experiments():
    """bench/options.py declares --int8-prompts (for bench overlap and bench transfer --overlap) without importing
    benchmarks/: its bound is a plain number, kept equal to the chat prompts here."""
    from bench.options import INT8_CHECK_PROMPTS
    from benchmarks import overlap_bench

    assert len(overlap_bench.CHAT_PROMPTS) == INT8_CHECK_PROMPTS


@pytest.mark.e2e
def test_overlap_bench_tiny(ray_local, tiny_llama_path):
    from benchmarks import overlap_bench

    parser = argparse.ArgumentParser()
    overlap_bench.add_arguments(parser)
    args = parser.parse_args(
        ["--prompt-tokens", "200", "--reps", "2", "--int8-check", "--int8-prompts", "2", "--int8-tokens", "8"]
    )
    args.cluster_config = tiny_cluster_config(tiny_llama_path)
    out = overlap_bench.run(args)

    assert out["configuration"]["prompt_tokens"] == 200
    assert out["kv_bytes_per_request"] == 200 * out["kv_bytes_per_token"] > 0
    for mode in ("streamed", "unstreamed"):
        figures = out[mode]
        for key in ("kv_after_prefill_s", "prefill_compute_s", "kv_transfer_s", "kv_minus_prefill_s"):
            assert len(figures["samples"][key]) == 2, (mode, key, figures)
        for key in ("prefill_compute_s", "kv_transfer_s"):
            assert all(v >= 0 for v in figures["samples"][key]), (mode, key, figures)
        # streamed KV may be complete before the prefill step ends (the last layer's KV leaves before that layer's
        # attention and MLP): negative, but never by more than the prefill took; unstreamed KV leaves after it
        floor = 0.0 if mode == "unstreamed" else -max(figures["samples"]["prefill_compute_s"])
        assert all(v >= floor for v in figures["samples"]["kv_after_prefill_s"]), (mode, figures)
        # the KV moved to the decode worker is at least the prompt's KV (whole blocks, first token's slot aside)
        assert figures["decode_transfer_bytes_per_request"] >= out["kv_bytes_per_request"]
    assert out["hidden_fraction"] is not None and out["hidden_fraction"] <= 1
    assert set(out["kv_minus_prefill_ms"]) == {"streamed", "unstreamed"}
    assert out["unstreamed_transfer_gbps"] > 0
    int8 = out["int8"]
    assert int8["prompts"] == 2 and 0 <= int8["changed"] <= 2
    assert int8["raw_wire_bytes"] > 0 and 0 < int8["wire_bytes_ratio"] < 1
