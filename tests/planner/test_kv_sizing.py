"""KV sizing: the engine's formula against hand computation, the parameter counts that the weights are subtracted by
against published counts and against real models, the sizing arithmetic, and /status on a served tiny model."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from engine.blocks import DTYPE_BYTES, kv_bytes_per_token
from engine.kv_cache import KVSpec
from planner.kv_sizing import GIB, PRESETS, load_shape, normalize_dtype, size_kv
from tests.cluster.conftest import serve  # noqa: F401  (the in-process cluster fixture)
from tests.helpers.cluster import wait_all_kv_free

# Published total parameter counts (each model card / the safetensors index's total_size over 2 bytes in bf16)
PUBLISHED_PARAMETERS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-2-70b": 68_976_648_192,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b": 7_248_023_552,
    "smollm2-135m": 134_515_008,
    "mixtral-8x7b": 46_702_792_704,
}
# Published in billions, total and per token (model cards: DeepSeek-V3 "671B total, 37B activated"; Qwen3-235B-A22B
# "235B total, 22B activated"; Mixtral "46.7B total, 12.9B active")
PUBLISHED_MOE_BILLIONS = {"deepseek-v3": (671, 37), "qwen3-235b-a22b": (235, 22), "mixtral-8x7b": (46.7, 12.9)}


def test_formula_for_llama_3_1_8b_by_hand():
    # 32 layers, 8 KV heads, head dim 128, bf16: 2 x 32 x 8 x 128 x 2 bytes
    assert kv_bytes_per_token(32, 8, 128, 2) == 131072
    spec = KVSpec("llama", torch.bfloat16, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
    assert spec.bytes_per_token == 131072 and spec.bytes_per_block == 131072 * 16  # the engine uses the same one
    shape = load_shape("llama-3.1-8b")
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (32, 8, 128)  # head dim from 4096 / 32 heads
    assert size_kv(shape, "bf16", 16).kv_bytes_per_token == 131072


def test_dtype_bytes_match_torch():
    for name, size in DTYPE_BYTES.items():
        assert getattr(torch, name).itemsize == size


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_counts_equal_the_published_ones(name):
    assert set(PRESETS) == set(PUBLISHED_PARAMETERS) | set(PUBLISHED_MOE_BILLIONS)
    shape = load_shape(name)
    if name in PUBLISHED_PARAMETERS:
        assert shape.parameters == PUBLISHED_PARAMETERS[name]
    if name in PUBLISHED_MOE_BILLIONS:  # every expert held, the routed ones a token reads: as rounded in the cards
        total, active = PUBLISHED_MOE_BILLIONS[name]
        assert shape.parameters / 1e9 == pytest.approx(total, rel=0.005)
        assert shape.active_parameters / 1e9 == pytest.approx(active, rel=0.02)
    else:
        assert shape.active_parameters == shape.parameters


@pytest.mark.parametrize(
    "arch", ["mistral", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"]
)
def test_every_familys_parameter_count_from_config_json_equals_the_model(arch, tmp_path):
    """Experts (routed, shared, their routers and biases), latent attention's projections, Gemma's extra norms: the
    count from config.json alone is the built model's, for every family the engine serves."""
    from transformers import AutoModelForCausalLM

    from engine.tiny_model import build_tiny_model

    folder = build_tiny_model(tmp_path, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(folder)
    shape = load_shape(str(folder))
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert (shape.active_parameters < shape.parameters) == (shape.routed_experts > shape.experts_per_token > 0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_parameter_count_from_config_json_equals_the_real_model(arch, tiny_llama_path, tiny_qwen2_path):
    from transformers import AutoModelForCausalLM

    folder = tiny_llama_path if arch == "llama" else tiny_qwen2_path
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert load_shape(str(folder)).parameters == sum(p.numel() for p in model.parameters())


def test_sizing_on_an_80_gib_gpu_by_hand():
    s = size_kv(load_shape("llama-3.1-8b"), "bfloat16", 16, gpu_memory_gib=80, context_tokens=8192)
    usable = int(80 * GIB * 0.9)
    budget = usable - 8_030_261_248 * 2
    assert s.tokens_per_gib == GIB // 131072 == 8192
    assert s.weight_bytes == 8_030_261_248 * 2 and s.weights_fit
    assert (s.usable_bytes, s.kv_budget_bytes) == (usable, budget)
    assert s.kv_budget_tokens == budget // 131072 and s.kv_budget_blocks == budget // (131072 * 16)
    assert s.kv_bytes_per_request == 8192 * 131072 == GIB and s.blocks_per_request == 512
    assert s.requests_fit == budget // GIB and s.requests_fit_blocks == (budget // (131072 * 16)) // 512
    assert s.requests_fit_blocks == 57  # 57.04 GiB of KV, 1 GiB per 8k-token request


def test_a_partial_block_costs_a_whole_block():
    s = size_kv(load_shape("llama-3.1-8b"), "bf16", 16, gpu_memory_gib=40, context_tokens=17)
    assert s.blocks_per_request == 2
    assert s.requests_fit_blocks == s.kv_budget_blocks // 2 < s.requests_fit


def test_weights_larger_than_the_gpu_leave_no_kv():
    s = size_kv(load_shape("llama-3.1-70b"), "bf16", 16, gpu_memory_gib=80, context_tokens=4096)
    assert not s.weights_fit and s.kv_budget_bytes == 0 and s.requests_fit == 0 and s.requests_fit_blocks == 0


def test_bad_models_and_dtypes_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="neither a preset"):
        load_shape(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        load_shape(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        load_shape(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 12}))
    with pytest.raises(ValueError, match="model type 'gpt2': model config lacks a usable attention shape field"):
        load_shape(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "is_encoder_decoder": True}))
    with pytest.raises(ValueError, match="model type 't5' is an encoder-decoder model"):
        load_shape(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="attention shape"):
        load_shape(str(tmp_path))
    with pytest.raises(ValueError, match="dtype must be one of"):
        normalize_dtype("int4")


def test_status_reports_the_served_models_kv(serve, tiny_llama_path):  # noqa: F811
    """The prefill pool sizes by an explicit block count, the decode pool by kv_memory_mb over 2 tensor-parallel
    ranks (each holds 1 of the 2 KV heads, so the budget holds twice the blocks): /status's figures equal the formula
    over the tiny model's config.json, and the workers' own block counts (the engine's allocation)."""
    config = json.loads((tiny_llama_path / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4  # float32
    assert per_token == 2 * 3 * 2 * 16 * 4
    decode = {"replicas": 1, "torch_threads": 1, "kv_memory_mb": 1, "tensor_parallel_size": 2}
    handle = serve(pools={"decode": decode})
    reply = httpx.post(
        f"{handle.base_url}/v1/completions",
        json={"model": handle.config.served_model_name, "prompt": "hello there", "max_tokens": 4},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    status = wait_all_kv_free(handle.base_url)
    kv = httpx.get(f"{handle.base_url}/status", timeout=5).json()["kv"]
    assert kv["dtype"] == "float32" and kv["block_size"] == 16
    assert kv["bytes_per_token"] == per_token and kv["tokens_per_gib"] == GIB // per_token
    decode_blocks = (1 << 20) // (per_token // 2 * 16)
    assert kv["pools"]["prefill"] == {
        "role": "prefill",
        "replicas": 1,
        "tensor_parallel_size": 1,
        "expert_parallel_size": 1,
        "kv_memory_mb": handle.config.pools.prefill.kv_memory_mb,
        "kv_blocks": 96,
        "blocks": 96,
        "tokens": 96 * 16,
        "kv_bytes": 96 * 16 * per_token,
    }
    assert kv["pools"]["decode"] == {
        "role": "decode",
        "replicas": 1,
        "tensor_parallel_size": 2,
        "expert_parallel_size": 1,
        "kv_memory_mb": 1,
        "kv_blocks": None,
        "blocks": decode_blocks,
        "tokens": decode_blocks * 16,
        "kv_bytes": decode_blocks * 16 * per_token,
    }
    workers = {w["role"]: w["total_blocks"] for w in status["workers"]}
    assert workers == {"prefill": 96, "decode": decode_blocks}  # what the engines really allocated


def test_default_model_reads_its_converted_folder_else_the_same_shapes_preset(monkeypatch, tmp_path, tiny_llama_path):
    from engine.model_loader import DEFAULT_MODEL

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    before = load_shape(DEFAULT_MODEL)  # not converted yet: nothing is downloaded or converted to size it
    assert "not converted yet" in before.source and not (tmp_path / "models").exists()
    assert before.parameters == load_shape("smollm2-135m").parameters
    folder = tmp_path / "models" / DEFAULT_MODEL
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((tiny_llama_path / "config.json").read_text())
    after = load_shape(DEFAULT_MODEL)
    assert after.source == str(folder / "config.json") and after.num_layers == 3
