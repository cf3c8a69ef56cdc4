"""``pdserve profile --roofline GPU``: a GPU-shaped profile from a model's shape and a datasheet, labelled an estimate.

The figures are the formulas of planner/roofline.py, so the tests check what a planner user relies on: the label,
that KV blocks are `plan kv`'s, that a decode step at batch 1 costs about one read of the weights, that splitting a
worker shortens its steps, and that layouts that cannot run are refused with the flag named.
"""

from __future__ import annotations

import pytest

from cli.main import main
from cli.plan_cmd import describe_profile
from planner.kv_sizing import load_shape, size_kv
from planner.profile_model import Profile, ProfileSet
from planner.roofline import GPUS, roofline_profile


def test_a_decode_step_at_batch_one_reads_the_weights_once() -> None:
    shape = load_shape("llama-3.1-8b")
    profile = roofline_profile(shape, "h100-sxm")
    weights = size_kv(shape, "bf16", 16).weight_bytes
    read_s = weights / (GPUS["h100-sxm"].hbm_tb_s * 1e12)
    step = profile.decode_step_s(1, 0)
    assert read_s < step < 2 * read_s  # the weights' read at peak bandwidth, with efficiency and fixed costs
    assert profile.decode_step_s(64, 64 * 2048) > step  # each request's KV is read too
    assert profile.prefill_s(4096) > 10 * profile.prefill_s(16)  # compute-bound: grows with the tokens
    assert "roofline estimate" in profile.device and profile.notes.startswith("NOT MEASURED")


def test_kv_blocks_are_plan_kvs_per_gpu_budget_at_each_degree() -> None:
    shape = load_shape("llama-3.1-70b")
    for degree in (2, 4, 8):
        profile = roofline_profile(shape, "h100-sxm", tensor_parallel_size=degree)
        sizing = size_kv(shape, "bf16", 16, 80, tensor_parallel_size=degree)
        assert profile.kv_blocks == sizing.kv_budget_blocks > 0
        assert profile.kv_bytes_per_token == size_kv(shape, "bf16", 16).kv_bytes_per_token  # every head crosses
    two, four = (roofline_profile(shape, "h100-sxm", tensor_parallel_size=d) for d in (2, 4))
    assert four.decode_step_s(8, 8 * 4096) < two.decode_step_s(8, 8 * 4096)


def test_what_cannot_run_is_refused_with_its_flag() -> None:
    shape = load_shape("llama-3.1-70b")
    with pytest.raises(ValueError, match="--tensor-parallel-size: llama-3.1-70b at degree 1 leaves no KV room"):
        roofline_profile(shape, "h100-sxm")
    with pytest.raises(ValueError, match="--roofline: one of h100-sxm"):
        roofline_profile(shape, "tpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="--dtype: a roofline profile is bf16 or fp16"):
        roofline_profile(shape, "h100-sxm", dtype="fp32", tensor_parallel_size=4)


def test_the_cli_writes_one_profile_per_degree_that_plan_reads(tmp_path, capsys) -> None:
    paths = []
    for degree in (1, 2):
        path = tmp_path / f"tp{degree}.json"
        args = ["profile", "--roofline", "h200", "--model", "llama-3.1-8b", "--tensor-parallel-size", str(degree)]
        assert main([*args, "--out", str(path)]) == 0
        paths.append(path)
    profiles = ProfileSet.of([Profile.load(p) for p in paths])
    assert profiles.degrees == [(1, 1), (2, 1)] and profiles.first.device == "H200 141GB (roofline estimate)"
    label = describe_profile(profiles)  # what every plan made from them prints above its table
    assert "on H200 141GB (roofline estimate), degrees tp1/tp2, estimated 20" in label
    assert "measured" not in label
    assert main(["profile", "--model", "llama-3.1-8b", "--out", str(tmp_path / "x.json")]) == 2
    assert "--model goes with --roofline" in capsys.readouterr().err


def test_a_mixture_of_experts_split_over_its_ranks_reads_its_share_of_the_experts() -> None:
    """Mixtral-8x7B on H200s at tensor degree 2: with every routed expert on both ranks (expert degree 1) a decode
    step reads 86 GiB per GPU; split two ways, half the routed experts' (and the captured step's masked exchange adds
    one all-reduce per layer). Qwen3-235B-A22B fits an 80 GB GPU only split eight ways."""
    shape = load_shape("mixtral-8x7b")
    whole = roofline_profile(shape, "h200", tensor_parallel_size=2)
    split = roofline_profile(shape, "h200", tensor_parallel_size=2, expert_parallel_size=2)
    assert (whole.expert_parallel_size, split.expert_parallel_size) == (1, 2)
    assert split.decode_step_s(1, 2048) < 0.6 * whole.decode_step_s(1, 2048)
    assert "expert_parallel_size 2" in split.notes and split.kv_blocks > whole.kv_blocks
    qwen = load_shape("qwen3-235b-a22b")
    with pytest.raises(ValueError, match="at degree 8 leaves no KV room on a H100 SXM 80GB: 427.1 GiB"):
        roofline_profile(qwen, "h100-sxm", tensor_parallel_size=8)
    assert roofline_profile(qwen, "h100-sxm", tensor_parallel_size=8, expert_parallel_size=8).kv_blocks > 0
