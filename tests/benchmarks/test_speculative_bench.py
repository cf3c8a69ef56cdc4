"""``pdserve bench speculative`` (benchmarks/speculative_bench.py) end to end on the tiny model: every method's
figures, greedy answers identical with and without speculation."""

from __future__ import annotations

import json

from cli.main import main


def test_speculative_bench_prints_the_figures(tiny_llama_path, capsys):
    args = ["bench", "speculative", "--json", "--model", str(tiny_llama_path), "--method", "ngram"]
    args += [
        "--batch-sizes",
        "1,2",
        "--output-len",
        "6",
        "--input-len",
        "12",
        "--repeats",
        "1",
        "--batch1-prompts",
        "2",
    ]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["speculative"] == {"method": "ngram", "num_tokens": 4, "ngram_max": 3}
    for prompt_set in ("grounded", "random", "random_sampled"):
        for size in ("1", "2"):
            figures = result[prompt_set][size]
            for name in ("pdserve_speculative", "pdserve", "transformers_prompt_lookup", "transformers"):
                assert figures[f"{name}_decode_tokens_per_s"] > 0
            assert figures["speculative_answers_identical"] is True  # speculation never changes a greedy answer
            assert 0.0 <= figures["acceptance_rate"] <= 1.0 and figures["answer_tokens"] > 0
