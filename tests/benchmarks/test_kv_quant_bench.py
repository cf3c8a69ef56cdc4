"""``pdserve bench kv-cache`` on the tiny model: every figure present and consistent with the cache's layout."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import kv_quant_bench


def _args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    kv_quant_bench.add_arguments(parser)
    args = parser.parse_args([])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def test_the_bench_reports_capacity_agreement_and_speed(tiny_llama_path):
    args = _args(model=str(tiny_llama_path), prompts=3, max_tokens=4, batch=2, repeats=1, dtypes="int8")
    result = kv_quant_bench.run(args)
    auto, int8 = result["kv_cache_dtype"]["auto"], result["kv_cache_dtype"]["int8"]
    assert (auto["kv_bytes_per_token"], int8["kv_bytes_per_token"]) == (768, 240)
    assert int8["tokens_per_gib_vs_auto"] == 3.2
    assert int8["prompts_identical"].endswith("/3") and 0 <= int8["tokens_before_first_difference"] <= 1
    assert int8["mean_abs_logprob_gap"] >= 0 and auto["decode_tokens_per_s"] > 0 and int8["decode_tokens_per_s"] > 0


def test_an_unknown_cache_dtype_is_refused_naming_the_flag(tiny_llama_path):
    with pytest.raises(ValueError, match="--dtypes"):
        kv_quant_bench.run(_args(model=str(tiny_llama_path), dtypes="int4"))
