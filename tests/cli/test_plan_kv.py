"""``pdserve plan kv`` as a user runs it: JSON for a preset and for a model folder, the table, and bad flags."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli.main import main
from tests.cli.test_startup import BELOW_CLI, HEAVY, run_cli, top_level
from tests.helpers.imports import ROOT

GIB = 1 << 30


def _json(capsys, *argv: str) -> dict:
    assert main(["plan", "kv", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_preset_json_by_hand(capsys):
    out = _json(capsys, "--model", "llama-3.1-8b", "--dtype", "bf16", "--gpu-memory-gb", "80", "--context", "8192")
    per_token = 2 * 32 * 8 * 128 * 2  # layers x KV heads x head dim x bf16, K and V
    budget = int(80 * GIB * 0.9) - 8_030_261_248 * 2  # 90% of 80 GiB less the bf16 weights
    assert out["kv_bytes_per_token"] == per_token == 131072 and out["tokens_per_gib"] == 8192
    assert out["dtype"] == "bfloat16" and out["block_size"] == 16 and out["kv_bytes_per_block"] == per_token * 16
    assert out["kv_budget_bytes"] == budget and out["kv_budget_tokens"] == budget // per_token
    assert out["blocks_per_request"] == 8192 // 16
    assert out["requests_fit_blocks"] == (budget // (per_token * 16)) // 512 == 57
    assert out["requests_fit"] == budget // (8192 * per_token)
    assert "meta-llama/Llama-3.1-8B config.json" in out["source"]


def test_a_latent_attention_model_caches_its_latent(capsys, tmp_path):
    """DeepSeek-V3's config.json: (512 latent + 64 rotary key) x 61 layers x 2 bytes per token in bf16, beside the
    per-head K and V its 128 heads would take without the latent."""
    config = {
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "hidden_size": 7168, "intermediate_size": 18432, "vocab_size": 129280,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = _json(capsys, "--model", str(tmp_path), "--dtype", "bf16")
    assert out["kv_bytes_per_token"] == (512 + 64) * 61 * 2 == 70_272
    assert out["per_head_equivalent_bytes_per_token"] == 61 * 128 * (128 + 64 + 128) * 2 == 4_997_120
    assert (out["num_kv_heads"], out["head_dim"]) == (1, 288)


def test_model_folder_json_reads_its_config(capsys, tiny_llama_path):
    out = _json(capsys, "--model", str(tiny_llama_path), "--dtype", "float32", "--block-size", "32")
    config = json.loads((tiny_llama_path / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    assert out["kv_bytes_per_token"] == per_token == 2 * 3 * 2 * 16 * 4
    assert out["tokens_per_gib"] == GIB // per_token and out["kv_bytes_per_block"] == per_token * 32
    assert out["source"] == str(tiny_llama_path / "config.json")
    assert out["kv_budget_bytes"] is None and out["requests_fit"] is None  # no GPU asked
    utilization = _json(
        capsys, "--model", str(tiny_llama_path), "--dtype", "fp16", "--gpu-memory-gb", "1",
        "--gpu-memory-utilization", "0.5", "--context", "100",
    )  # fmt: skip
    budget = GIB // 2 - utilization["parameters"] * 2
    assert utilization["kv_bytes_per_token"] == per_token // 2 and utilization["kv_budget_bytes"] == budget
    assert utilization["requests_fit_blocks"] == budget // (per_token // 2 * 16) // 7  # 100 tokens: 7 blocks


def test_table_for_humans(capsys):
    assert main(["plan", "kv", "--model", "llama-3.1-70b", "--dtype", "bfloat16", "--gpu-memory-gb", "80",
                 "--context", "4096"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "327,680 B" in out and "= 2 x 80 x 8 x 128 x 2" in out  # 70B: 80 layers
    assert "requests that fit  0" in out and "weights alone exceed" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtype", "bf16"], "--model is required"),
        (["--model", "llama-3.1-8b"], "--dtype is required"),
        (["--model", "llama-3.1-8b", "--dtype", "int3"], "--dtype: dtype must be one of"),
        (["--model", "/nonexistent/model", "--dtype", "bf16"], "--model: '/nonexistent/model' is neither a preset"),
        (["--model", "llama-3.1-8b", "--dtype", "bf16", "--gpu-memory-gb", "0"], "--gpu-memory-gb must be positive"),
        (["--model", "llama-3.1-8b", "--dtype", "bf16", "--context", "-5"], "--context must be a positive"),
        (["--model", "llama-3.1-8b", "--dtype", "bf16", "--block-size", "0"], "--block-size must be a positive"),
        (
            ["--model", "llama-3.1-8b", "--dtype", "bf16", "--gpu-memory-gb", "80", "--gpu-memory-utilization", "1.5"],
            "--gpu-memory-utilization must be in (0, 1]",
        ),
        (["--model", "llama-3.1-8b", "--dtype", "bf16", "--gpu-memory-utilization", "0.8"], "needs --gpu-memory-gb"),
    ],
)
def test_bad_flags_name_the_flag(capsys, argv, message):
    assert main(["plan", "kv", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_folder_without_config_names_the_flag(capsys, tmp_path):
    assert main(["plan", "kv", "--model", str(tmp_path), "--dtype", "bf16"]) == 2
    assert "--model:" in capsys.readouterr().err


def test_as_a_user_runs_it_and_help_is_light(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "plan", "kv", "--model", "qwen2.5-7b", "--dtype", "bf16", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["kv_bytes_per_token"] == 2 * 28 * 4 * 128 * 2  # 3584 / 28 heads = 128 head dim
    help_proc, modules = run_cli(tmp_path, "plan", "kv", "--help")
    assert help_proc.returncode == 0 and "--gpu-memory-utilization" in help_proc.stdout
    assert not top_level(modules) & (HEAVY | BELOW_CLI)


def test_a_tensor_parallel_worker_is_sized_per_gpu(capsys):
    """Llama-3.1-70B in bf16 on 80 GB GPUs: no KV fits one GPU; at degree 4 each rank holds 2 of the 8 KV heads, a
    quarter of every layer's attention and MLP, and the whole embedding and LM head (replicated)."""
    args = ["--model", "llama-3.1-70b", "--dtype", "bf16", "--gpu-memory-gb", "80", "--context", "8192"]
    one = _json(capsys, *args)
    four = _json(capsys, *args, "--tensor-parallel-size", "4")
    assert one["requests_fit_blocks"] == 0 and four["tensor_parallel_size"] == 4
    assert four["num_kv_heads"] == 2 and four["kv_bytes_per_token"] == one["kv_bytes_per_token"] // 4
    embeddings = 2 * 128256 * 8192  # vocabulary x hidden, the embedding and the untied LM head
    assert four["parameters"] - embeddings == pytest.approx((one["parameters"] - embeddings) / 4, rel=1e-4)
    budget = int(80 * GIB * 0.9) - four["parameters"] * 2
    assert four["kv_budget_bytes"] == budget and four["requests_fit_blocks"] == budget // (81920 * 16) // 512 == 57


def test_a_degree_that_does_not_split_the_model_names_the_flag(capsys):
    argv = ["plan", "kv", "--model", "llama-3.1-70b", "--dtype", "bf16", "--tensor-parallel-size", "3"]
    assert main(argv) == 2
    assert "--tensor-parallel-size: tensor_parallel_size 3 does not divide the model's 64 attention heads" in (
        capsys.readouterr().err
    )


def test_a_latent_mixture_of_experts_per_gpu_holds_the_whole_latent_and_its_share_of_the_experts(capsys):
    """DeepSeek-V3 at tensor degree 8: each GPU caches the whole latent row (the same KV bytes per token as one
    GPU), and holds every routed expert unless they are split 8 ways (expert degree 8)."""
    args = ["--model", "deepseek-v3", "--dtype", "bf16", "--tensor-parallel-size", "8"]
    one = _json(capsys, "--model", "deepseek-v3", "--dtype", "bf16")
    whole = _json(capsys, *args)
    split = _json(capsys, *args, "--expert-parallel-size", "8")
    assert one["kv_bytes_per_token"] == whole["kv_bytes_per_token"] == split["kv_bytes_per_token"] == 70_272
    routed = 58 * 256 * 3 * 7168 * 2048  # MoE layers x routed experts x (gate, up, down) x hidden x expert width
    assert whole["parameters"] - split["parameters"] == routed * 7 // 8
    assert split["expert_parallel_size"] == 8 and split["parameters"] < one["parameters"] / 7


def test_an_expert_degree_the_model_cannot_take_names_the_flag(capsys):
    argv = ["plan", "kv", "--model", "llama-3.1-70b", "--dtype", "bf16", "--tensor-parallel-size", "2"]
    assert main([*argv, "--expert-parallel-size", "2"]) == 2
    assert "--expert-parallel-size: expert_parallel_size 2: the model has no routed experts to split" in (
        capsys.readouterr().err
    )
