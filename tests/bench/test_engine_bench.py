from __future__ import annotations

import json

import pytest

from cli.main import main


def test_engine_bench_prints_the_figures(tiny_llama_path, capsys):
    args = [
        "bench",
        "engine",
        "--json",
        "--model",
        str(tiny_llama_path),
        "--batch-sizes",
        "1,4",
        "--output-len",
        "4",
        "--input-len",
        "16",
        "--prefill-prompts",
        "2",
        "--prefill-len",
        "32",
        "--repeats",
        "1",
        "--no-compiled",  # the compiled step's cold and warm starts: its own tests (tests/engine/test_compile_cache.py)
    ]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["kv_bytes_per_token"] == 2 * 3 * 2 * 16 * 4  # layers 3, kv heads 2, head dim 16, float32
    for size in ("1", "4"):
        figures = result["decode"][size]
        assert figures["pdserve_decode_tokens_per_s"] > 0 and figures["transformers_decode_tokens_per_s"] > 0
        assert figures["pdserve_linear_decode_tokens_per_s"] > 0 and figures["ratio_vs_torch_linear"] > 0
    assert "ratio_vs_pdserve_batch_1" in result["decode"]["4"]
    # llama.cpp runs only the built-in model (rewritten in F32): a folder model says why it is not there
    assert "ratio_vs_llama_cpp" not in result["decode"]["1"] and isinstance(result["llama_cpp"], str)
    assert result["prefill"]["pdserve_tokens_per_s"] > 0
    assert result["torch_threads"] >= 1


@pytest.mark.e2e  # compiles the decode step twice (cold, then a warm start in another process): `make test-e2e`
def test_engine_bench_prints_the_compiled_steps_cold_and_warm_starts(tiny_llama_path, capsys):
    args = ["bench", "engine", "--json", "--model", str(tiny_llama_path), "--batch-sizes", "1", "--output-len", "4"]
    args += ["--input-len", "16", "--prefill-prompts", "1", "--prefill-len", "16", "--repeats", "1"]
    assert main(args) == 0
    compiled = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["compiled_decode"]
    assert compiled["cold_start_step_s"] > 0 and compiled["warm_start_loaded_all"] is True, compiled
