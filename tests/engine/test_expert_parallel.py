"""Expert parallelism on the CPU over gloo: a mixture of experts' routed experts split over a tensor-parallel worker's
ranks, each rank reading only its experts from the checkpoint, tokens exchanged by all-to-all (eager) or the other
ranks' experts masked and summed (compiled).

Exactness: the experts' outputs are weighted and summed per token in another order than one rank's, and attention's
partial sums are added by an all-reduce, so outputs are compared token for token and the chosen tokens' logprobs
within 1e-4 (the largest gap is printed).
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.tiny_model import build_tiny_model
from engine.tp_shard import check_degree, checkpoint_layout
from planner.kv_sizing import load_shape
from tests.engine.test_tensor_parallel import PROMPTS, _compare, run_ranks


def _moe_config(arch: str, **fields):
    from transformers import AutoConfig

    from engine.tiny_model import TINY_ARCHITECTURES

    model_type, family = TINY_ARCHITECTURES[arch]
    shape = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3}
    return AutoConfig.for_model(model_type, **(family | shape | fields))


@pytest.mark.parametrize(
    ("arch", "expert_size"),
    [
        ("mixtral", 2),  # experts stored one by one (w1, w3 fused into gate_up_proj), block_sparse_moe renamed
        pytest.param("qwen3_moe", 2, marks=pytest.mark.e2e),  # `make test-e2e`: the same path, another family
        pytest.param("deepseek_v3", 2, marks=pytest.mark.e2e),  # shared experts cut by the tensor plan beside
        pytest.param("mixtral", 1, marks=pytest.mark.e2e),  # attention split, every expert on both ranks
    ],
)
def test_two_ranks_with_the_experts_split_generate_what_one_does(arch, expert_size, tmp_path):
    model = build_tiny_model(tmp_path, arch=arch)
    run = {"prompts": PROMPTS, "max_tokens": 12}
    one = run_ranks(1, model, **run)[0]
    two = run_ranks(2, model, **run, expert_parallel_size=expert_size)
    _compare(one, two[0])  # same tokens, logprobs within the tolerance; every rank checked its own leaks
    # the planner's count of one rank's weights (pdserve plan kv --tensor-parallel-size 2 --expert-parallel-size E)
    assert two[0]["parameters"] == load_shape(str(model)).rank_shape(2, expert_size).parameters
    traffic = two[0]["expert_traffic"]
    if expert_size == 1:
        assert traffic is None  # whole experts on every rank: nothing is dispatched
        return
    prompt_tokens = sum(len(p.encode()) + 1 for p in PROMPTS)  # the byte tokenizer's ids, and its BOS
    assert traffic["tokens"] >= prompt_tokens
    # top-2 of 4 experts in each mixture-of-experts layer (DeepSeek's first is dense): every pair counted once, on
    # the rank of its expert
    assert traffic["moe_layers"] == (2 if arch == "deepseek_v3" else 3)
    assert sum(traffic["pairs_per_rank"]) == 2 * traffic["moe_layers"] * traffic["tokens"]
    assert traffic["bytes_sent_per_token"] > 0 and traffic["load_imbalance"] >= 1.0
    print(f"{arch} at expert degree 2: {traffic}")


@pytest.mark.e2e  # long (the compiled step of two ranks): `make test-e2e`
def test_the_compiled_decode_step_masks_the_other_ranks_experts_and_stays_exact(tmp_path):
    model = build_tiny_model(tmp_path, arch="mixtral")
    run = {"prompts": PROMPTS, "max_tokens": 12}
    one = run_ranks(1, model, **run)[0]
    two = run_ranks(2, model, **run, expert_parallel_size=2, compile_decode_batches=[1, 2, 4])
    _compare(one, two[0])
    assert two[0]["static"] > 0  # decode steps ran on the compiled step, its experts masked and all-reduced


@pytest.mark.parametrize(
    "arch",
    [
        "mixtral",
        "gpt_oss",  # its plan cuts no attention head: its experts split alone (sinks, windows, biased experts)
        pytest.param("qwen3_moe", marks=pytest.mark.e2e),
        pytest.param("deepseek_v3", marks=pytest.mark.e2e),  # the latent row and the dense first layer whole
    ],
)
def test_the_experts_split_alone_over_ranks_that_hold_the_attention_whole(arch, tmp_path):
    """Expert degree 2 at tensor degree 1: two ranks, each with every attention head, every KV head and the dense
    layers whole, and half the routed experts; the same tokens as one rank."""
    model = build_tiny_model(tmp_path, arch=arch)
    run = {"prompts": PROMPTS, "max_tokens": 12}
    one = run_ranks(1, model, **run)[0]
    two = run_ranks(2, model, **run, tensor_parallel_size=1, expert_parallel_size=2)
    _compare(one, two[0])
    assert two[0]["parameters"] == load_shape(str(model)).rank_shape(1, 2).parameters < one["parameters"]
    assert two[1]["kv_heads"] == one["kv_heads"]  # every KV head on every rank
    traffic = two[0]["expert_traffic"]
    assert traffic["expert_parallel_size"] == 2 and sum(traffic["pairs_per_rank"]) > 0
    print(f"{arch} at (tensor 1, expert 2): {traffic}")


def test_an_expert_degree_the_model_cannot_take_names_the_field():
    from transformers import AutoConfig

    assert EngineConfig(model="m", expert_parallel_size=2).ranks == 2  # the experts alone over two ranks
    assert EngineConfig(model="m", tensor_parallel_size=2, expert_parallel_size=2).ranks == 2
    with pytest.raises(ValueError, match=r"expert_parallel_size 4: .* 1, tensor_parallel_size \(2\), or any with"):
        EngineConfig(model="m", tensor_parallel_size=2, expert_parallel_size=4)
    dense = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="expert_parallel_size 2: model type 'llama': the model has no routed experts"):
        check_degree(dense, 2, 2)
    six = _moe_config("mixtral", num_local_experts=6)
    with pytest.raises(ValueError, match="does not divide the model's 6 experts"):
        check_degree(six, 4, 4)
    check_degree(six, 2, 2)  # 3 experts a rank


def test_a_family_whose_attention_the_plan_does_not_cut_by_heads_splits_its_experts_alone():
    """gpt-oss's plan cuts only the embedding, by rows: refused at tensor degree 2 naming the entry, with the layout
    that serves it over several ranks, its experts split alone."""
    with pytest.raises(ValueError, match="'gpt_oss'.*embedding_rowwise.*split its experts alone"):
        check_degree(_moe_config("gpt_oss"), 2, 2)
    check_degree(_moe_config("gpt_oss"), 1, 2)


def test_experts_stored_one_by_one_map_to_the_fused_weight_and_their_part():
    mixtral = checkpoint_layout("mixtral")
    name = mixtral.rename("model.layers.3.block_sparse_moe.experts.5.w3.weight")
    assert name == "model.layers.3.mlp.experts.5.w3.weight"
    assert mixtral.fused(name) == ("model.layers.3.mlp.experts.gate_up_proj", 1, 5)  # w3 (up) after w1 (gate)
    assert mixtral.fused("model.layers.3.mlp.experts.5.w2.weight") == ("model.layers.3.mlp.experts.down_proj", 0, 5)
    assert mixtral.fused("model.layers.3.mlp.gate.weight") is None  # the router, stored as the model has it
    qwen = checkpoint_layout("qwen3_moe")
    assert qwen.fused("model.layers.0.mlp.experts.2.gate_proj.weight") == (
        "model.layers.0.mlp.experts.gate_up_proj",
        0,
        2,
    )


def test_a_checkpoint_conversion_of_another_kind_is_refused_by_name(monkeypatch):
    import transformers.conversion_mapping as mapping

    class Chunk:
        dim = 0

    class WeightConverter:
        source_patterns = ["mlp.gate_up_proj.weight"]
        target_patterns = ["mlp.gate_proj.weight", "mlp.up_proj.weight"]
        operations = [Chunk()]

    monkeypatch.setattr(mapping, "get_checkpoint_conversion_mapping", lambda model_type: [WeightConverter()])
    with pytest.raises(ValueError, match=r"model type 'x': transformers converts .*WeightConverter.*'Chunk', 0"):
        checkpoint_layout("x")
