from __future__ import annotations

import pytest

from cli.main import build_parser

TINY = ["--prompts", "1", "--max-tokens", "4", "--batch", "2", "--repeats", "1"]


def _args(*argv: str):
    return build_parser().parse_args(["bench", "models", *argv])


def test_families_are_exact_and_timed_and_a_state_space_model_is_refused():
    from benchmarks.model_families_bench import run

    result = run(_args("--families", "llama,gemma2", "--model-types", "mamba", *TINY))
    rows = {row["name"]: row for row in result["families"]}
    assert list(rows) == ["llama", "gemma2", "mamba"]
    for name in ("llama", "gemma2"):
        row = rows[name]
        assert row["all_exact"] is True and row["exact"] == "1/1", row
        assert row["pdserve_decode_tokens_per_s"] > 0 and row["transformers_decode_tokens_per_s"] > 0
        assert row["kv_bytes_per_token"] == 2 * 3 * 2 * 16 * 4  # layers, KV heads, head dim, float32
    assert rows["gemma2"]["features"] == ["sliding windows", "logit soft-capping"]
    assert rows["mamba"]["refused"].startswith("model: model type 'mamba'")
    assert result["summary"] == {"exact": 2, "refused": 1, "inexact": 0, "failed": 0}


def _two_ranks(families: str) -> dict:
    from benchmarks.model_families_bench import run

    argv = ["--families", families, "--tensor-parallel-size", "2", "--expert-parallel-size", "2"]
    result = run(_args(*argv, *TINY))
    assert result["settings"]["tensor_parallel_size"] == result["settings"]["expert_parallel_size"] == 2
    return {row["name"]: row["tensor_parallel"] for row in result["families"]}


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): the (1, 2) and (2, 2) engines are test_expert_parallel.py's
def test_at_two_ranks_a_mixture_splits_its_experts_or_splits_them_alone_when_its_plan_is_refused():
    rows = _two_ranks("mixtral,gpt_oss")
    mixtral = rows["mixtral"]
    # the experts split over both ranks: o_proj's all-reduce per layer, and the experts' exchange measured
    assert (
        mixtral["exact"] is True
        and mixtral["expert_degree"] == 2
        and mixtral["all_reduce_bytes_per_token_per_rank"] == 768
    )
    experts = mixtral["experts"]
    assert (
        experts["bytes_sent_per_token"] > 0 and len(experts["pairs_per_rank"]) == 2 and experts["load_imbalance"] >= 1
    )
    # gpt-oss's plan cuts no head: refused at tensor degree 2 by name, so measured with its experts split alone
    gpt_oss = rows["gpt_oss"]
    assert "'embed_tokens': 'embedding_rowwise'" in gpt_oss["tensor_refused"]
    assert (gpt_oss["degree"], gpt_oss["expert_degree"], gpt_oss["ranks"]) == (1, 2, 2)
    assert gpt_oss["exact"] is True and gpt_oss["all_reduce_bytes_per_token_per_rank"] == 0
    assert gpt_oss["experts"]["bytes_sent_per_token"] > 0


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): the dense path is the engine's tests' too
def test_at_two_ranks_a_dense_family_is_cut_by_its_plan_alone():
    gemma2 = _two_ranks("gemma2")["gemma2"]
    assert gemma2["exact"] is True and gemma2["logprob_gap"] < 1e-4, gemma2  # float32 sums in another order
    assert set(gemma2["decode_step_ms"]) == {"1", "2"} and gemma2["all_reduce_bytes_per_token_per_rank"] == 1536
    assert gemma2["expert_degree"] == 1 and "experts" not in gemma2  # dense: at tensor degree 2 alone


def test_a_family_that_fails_to_build_is_a_row_with_its_error():
    from benchmarks.model_families_bench import measure

    def broken(out):
        raise RuntimeError("no weights today")

    row = measure("broken", "llama", broken, _args(*TINY))
    assert row == {"name": "broken", "model_type": "llama", "error": "build: RuntimeError: no weights today"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--families", "llama,nope"], "--families: unknown 'nope'"),
        (["--model-types", "nope"], "--model-types: unknown 'nope'"),
        (["--max-tokens", "1"], "--max-tokens must be at least 2"),
        (["--batch", "0"], "--batch must be a positive integer"),
    ],
)
def test_bad_options_are_errors_naming_the_flag(argv, message):
    from benchmarks.model_families_bench import run

    with pytest.raises(ValueError, match=message):
        run(_args(*argv))
