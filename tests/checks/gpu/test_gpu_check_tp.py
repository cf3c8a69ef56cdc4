"""gpu-check's tensor-parallel section (checks/gpu/gpu_check_tp.py) on the CPU: the same code a two-GPU machine runs,
with both ranks on the CPU and gloo where NCCL would be.

It checks that degree 2 decodes what degree 1 does and reports its figures and its all-reduce backend, that a
hand-off from one rank into two is token-exact on each KV-plane backend and names the path each took, that a spent
deadline is an error per piece (never raised, no process started), and that a machine with one device (or none)
says so in the JSON instead of running anything.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checks.gpu import gpu_check, gpu_check_models
from checks.gpu import gpu_check_tp as tp
from checks.gpu.gpu_check_time import Deadline

pytestmark = pytest.mark.timeout(120)
SHAPE = gpu_check_models.SHAPES["tiny"]
SCRIPT = str(Path(__file__).resolve().parents[3] / "checks" / "gpu" / "gpu_check.py")
ENV = {**os.environ, "PYTHONPATH": ""}  # the script makes the repository importable itself, as on a GPU box


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gpu-check-tp") / SHAPE.name
    hf, tokenizer = gpu_check_models.build_model(SHAPE, "cpu", torch.bfloat16)
    gpu_check_models.save_folder(hf, tokenizer, path)
    return path


def _params(folder: Path, pairs: list, **more) -> dict:
    sizes = gpu_check.TINY_SIZES["tp"] | {"handoff_reps": 1}  # a warm-up round and one timed: the test's minute
    params = tp.section_params(folder, SHAPE.vocab_size, SHAPE.kv_bytes_per_token(4), "cpu", sizes, pairs)
    return params | more


def _no_rank_left() -> None:
    assert multiprocessing.active_children() == []


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): a whole run of the two-GPU check on the CPU
def test_degree_two_on_the_cpu_decodes_as_degree_one_and_reports_its_figures(folder):
    t0 = time.monotonic()
    out = tp.tensor_parallel_2(_params(folder, []), Deadline.after(100, "tensor_parallel_2"))
    print(f"degrees 1 and 2: {time.monotonic() - t0:.1f} s")
    assert out["devices"] == ["cpu", "cpu"] and out["backends"] == ["zmq", "nccl"]
    one, two = out["degree_1"], out["degree_2"]
    assert "error" not in one and "error" not in two, (one, two)
    assert one["devices"] == ["cpu"] and two["devices"] == ["cpu", "cpu"]
    for figures in (one, two):
        assert set(figures["tokens_per_s"]) == {"1", "8"} and all(v > 0 for v in figures["tokens_per_s"].values())
    greedy = out["greedy"]
    assert greedy["exact"] is True and greedy["exact_rows"] == greedy["rows"] == 2 and greedy["first_flip"] is None
    assert greedy["max_logprob_gap"] < 1e-4
    assert set(out["decode_degree_2_vs_1"]) == {"1", "8"}
    # the layers' all-reduces on gloo for host tensors (NCCL on cuda:0/cuda:1); no graphs on the CPU, said as None
    assert two["device_group"] == "gloo" and two["all_reduce_backend"] == "gloo"
    assert two["cuda_graphs"] is True and two["graphs"] is None and out["graphs_captured_at_degree_2"] is None
    assert out["handoffs"] == [] and out["handoffs_exact"] is None
    _no_rank_left()


def _degree_1_alone(folder: Path, sizes: dict) -> list[list[int]]:
    """The reference the section's degree_1 piece computes, here in this process (one rank's thread, as a rank's)."""
    from checks.gpu import gpu_check_engine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", kv_blocks=64))
        prompts = tp.exactness_prompts(sizes, SHAPE.vocab_size)
        return gpu_check_engine.engine_greedy(engine, prompts, sizes["exact_tokens"])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): tests/worker/test_rank_kv.py's hand-offs stay
def test_a_handoff_from_one_rank_into_two_is_token_exact_on_each_backend(folder):
    """Both backends in one pair of workers, as on two GPUs (each backend's endpoints made anew on every rank); without
    a degree_1 piece the rows keep the decode worker's tokens, compared here with one engine alone."""
    t0 = time.monotonic()
    params = _params(folder, [(1, 2)], degrees=())
    out = tp.tensor_parallel_2(params, Deadline.after(100, "tensor_parallel_2"))
    print(f"the (1, 2) hand-off on two backends: {time.monotonic() - t0:.1f} s")
    rows = out["handoffs"]
    assert [(r["prefill_degree"], r["decode_degree"], r["backend"]) for r in rows] == [(1, 2, "zmq"), (1, 2, "nccl")]
    alone = _degree_1_alone(folder, params["sizes"])
    for row in rows:
        assert row["exact"]["error"].startswith("no degree-1 reference"), row
        assert row["exact"]["tokens"] == alone
        assert row["handoff_gb_s"] > 0 and row["prefill_step_ms"] > 0 and row["rounds"] == 1
        assert row["kv_bytes"] == 2 * 64 * SHAPE.kv_bytes_per_token(4)  # every head of every prompt token, once
        assert row["prefill_devices"] == ["cpu"] and row["decode_devices"] == ["cpu", "cpu"]
    # the path the prefill rank took to each decode rank: frames on zmq, a pair group (gloo here) on nccl
    assert [r["prefill_paths"] for r in rows] == [{"rank0": ["inline"]}, {"rank0": ["pair"]}]
    assert out["handoffs_exact"] is None  # not compared in the section: no reference there
    assert "degree_1" not in out and "greedy" not in out
    _no_rank_left()


def test_handoff_rows_are_compared_with_degree_1_with_their_logprob_gap():
    reference = {"tokens": [[4, 5, 6]], "logprobs": [[(-0.3, -2.0), (-0.2, -1.0), (-0.1, -3.0)]]}
    same = tp._handoff_exact(reference, {"tokens": [[4, 5, 6]], "logprobs": [[-0.2 + 3e-6, -0.1]]})
    assert same["exact"] is True and same["max_logprob_gap"] == pytest.approx(3e-6, rel=0.01)
    flipped = tp._handoff_exact(reference, {"tokens": [[4, 7, 6]], "logprobs": [[-0.9, -0.1]]})
    assert flipped["exact"] is False and flipped["first_diff"] == [1]
    assert tp._all_exact([{"exact": same}, {"exact": same}]) is True
    assert tp._all_exact([{"exact": same}, {"exact": flipped}]) is False
    assert tp._all_exact([{"exact": same}, {"backend": "nccl", "error": "boom"}]) is False
    assert tp._all_exact([{"exact": {"error": "no degree-1 reference", "tokens": [[4]]}}]) is None
    assert tp._all_exact([]) is None


def test_a_spent_deadline_is_each_pieces_error_and_starts_no_rank(folder):
    out = tp.tensor_parallel_2(_params(folder, [(1, 2), (2, 2)]), Deadline(time.monotonic() - 1, "tensor_parallel_2"))
    assert out["degree_1"]["error"].startswith("OutOfTime") and out["degree_2"]["error"].startswith("OutOfTime")
    assert "greedy" not in out and len(out["handoffs"]) == 4
    assert all(r["error"].startswith("OutOfTime") for r in out["handoffs"]) and out["handoffs_exact"] is False
    _no_rank_left()


def test_greedy_against_names_the_first_flip_with_both_logprobs_and_the_margin():
    one = {"tokens": [[5, 6, 7], [1, 2, 3]], "logprobs": [[(-0.1, -3.0), (-0.5, -0.6), (-0.2, -2.0)]] * 2}
    two = {"tokens": [[5, 6, 7], [1, 9, 3]], "logprobs": [[(-0.1, -3.0), (-0.5, -0.6), (-0.2, -2.0)],
                                                          [(-0.1 + 2e-6, -3.0), (-0.55, -0.56), (-0.2, -2.0)]]}  # fmt: skip
    got = tp.greedy_against(one, two)
    assert got["exact"] is False and got["exact_rows"] == 1 and got["first_diff"] == [None, 1]
    assert got["first_flip"] == {
        "row": 1,
        "position": 1,
        "degree_1": {"token": 2, "logprob": -0.5},
        "degree_2": {"token": 9, "logprob": -0.55},
        "degree_1_margin": pytest.approx(0.1),
    }
    assert got["max_logprob_gap"] == pytest.approx(2e-6, rel=0.01)  # over the tokens both degrees chose


@pytest.mark.parametrize(("count", "reason"), [(0, "no CUDA device"), (1, "one device"), (2, None), (8, None)])
def test_the_section_runs_only_where_two_devices_are_visible(monkeypatch, count, reason):
    monkeypatch.setattr(tp.torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(tp.torch.cuda, "device_count", lambda: count)
    assert tp.skip_reason("cuda") == reason
    assert tp.skip_reason("cpu") == "no CUDA device"  # the CPU run of the script (CI) never runs it


def test_one_visible_device_says_skipped_in_the_json_whatever_the_budget(monkeypatch, tmp_path):
    monkeypatch.setattr(tp.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tp.torch.cuda, "device_count", lambda: 1)
    out = tmp_path / "gpu-check.json"
    run = gpu_check.Run(out, {"check": "gpu-check"}, Deadline(time.monotonic() - 1, "the run"), gpu_check.TINY_SIZES)

    def never(*args, **kwargs):
        raise AssertionError("nothing is built or run on one device")

    monkeypatch.setattr(gpu_check.models, "build_model", never)
    monkeypatch.setattr(tp, "tensor_parallel_2", never)
    assert gpu_check.tensor_parallel(run, SHAPE, "cuda", True, tmp_path) == {"skipped": "one device"}
    written = json.loads(out.read_text())
    assert written["tensor_parallel_2"] == {"skipped": "one device"}
    assert written["exact"]["tensor_parallel_2_float32_vs_degree_1"] is None


def test_the_script_on_a_machine_without_two_gpus_writes_only_why(tmp_path):
    """`--tensor-parallel-only` (make gpu-check-tp) on the CPU: the JSON holds the section's reason and nothing ran."""
    out = tmp_path / "gpu-check-tp.json"
    command = [sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--tensor-parallel-only", "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=100, env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["tensor_parallel_2"] == {"skipped": "no CUDA device"}
    assert "primary" not in data and "llama_3_8b" not in data
    assert data["budget_s"] == gpu_check.CAPS["tensor_parallel_2"]
    assert data["exact"]["tensor_parallel_2_handoffs_float32_vs_degree_1"] is None
